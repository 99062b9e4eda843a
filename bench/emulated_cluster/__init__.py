"""Emulated two-node cluster: the tuner's pick against an exhaustive grid, over a rate-limited link.

Two network namespaces on this machine are the two "nodes", joined by a veth pair whose egress is
rate-limited on both ends with ``tc qdisc ... tbf`` (root only; everything is set up and torn down
by this command, also on SIGINT/SIGTERM). Ranks are placed on the nodes by their node identity
(``OVERLAP_NODE_ID=a|b``, docs/toolchain.md): ranks of one node talk over gloo inside their namespace (the
veth end's address is local, so their traffic takes the loopback path, unlimited) and share
``/dev/shm`` and a hostname; ranks of different nodes talk over the veth pair at the emulated rate,
so `overlap.world` gives them the link class ``network``. The rendezvous is a file store under
``/tmp`` (the namespaces share the file system); gloo binds to the veth end of its namespace
(``GLOO_SOCKET_IFNAME``). Every wait is bounded: ``OVERLAP_TIMEOUT_S`` and the process group's timeout
(``--timeout``) on the ranks, ``--deadline`` per rate in the parent, which kills every rank on any failure.

The modules: `link` (the namespaces, the veth pair, tbf), `config` (what a run does), `ranks` (on the ranks, per
rate: a probe or a recorded profile, a node check, then per problem and repeat the tuner, the exhaustive grid and a
duel of their picks), `report` (the summary and the table: regret, tuning time against the grid's, chunks per link
class, the model's error), `figures` (``--figures``: the TP ops' ``hierarchical`` figures), `moe`
(``--moe-figures``: the MoE layer on a balanced and a skewed routing, with expert migration), `run` (the parent: it
sets the link up per rate, starts the ranks in the namespaces, watches them and tears everything down) and
``__main__`` (the command line, ``python -m bench.emulated_cluster``); every name the tests use is reachable from
this package.

usage:
  sudo .venv/bin/python -m bench.emulated_cluster                       # 100mbit and 2gbit, 2 ranks per node
  sudo .venv/bin/python -m bench.emulated_cluster --rate 100mbit --repeats 5 --json out.json
  sudo .venv/bin/python -m bench.emulated_cluster --quick --ranks-per-node 1
  sudo .venv/bin/python -m bench.emulated_cluster --figures           # hierarchical's figures (docs/results/)
  sudo .venv/bin/python -m bench.emulated_cluster --moe-figures       # the MoE layer's figures, with migration

A default run takes about 2 minutes on 2 cores (4 ranks; more where other jobs share the cores: the
report prints the machine's load). Exit code 0; 1 when a run fails (the failing rank's log on
stderr); 2 on bad arguments or where the emulation cannot run here (not root, no ``ip``/``tc``,
namespaces or tbf refused); 130 on SIGINT/SIGTERM. The table goes to stdout, progress to stderr.
Traffic goes only to the addresses of the veth pair this command creates (10.77.X.1 and 10.77.X.2)
and to loopback inside the namespaces.

"""

from bench.emulated_cluster.config import DEFAULT_PROBLEMS, QUICK_PROBLEMS, Config
from bench.emulated_cluster.link import (
    EmulationUnavailable,
    Link,
    parse_rate,
    probe_emulation,
    remove_stale,
    unavailable_reason,
)
from bench.emulated_cluster.ranks import rank_entry
from bench.emulated_cluster.report import format_table, summarize
from bench.emulated_cluster.run import run, run_rate

__all__ = [
    "DEFAULT_PROBLEMS", "QUICK_PROBLEMS", "Config", "EmulationUnavailable", "Link", "format_table", "parse_rate",
    "probe_emulation", "rank_entry", "remove_stale", "run", "run_rate", "summarize", "unavailable_reason",
]
