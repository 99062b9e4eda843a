"""Emulated two-node cluster: the tuner's pick against an exhaustive grid, over a rate-limited link.

Two network namespaces on this machine are the two "nodes", joined by a veth pair whose egress is
rate-limited on both ends with ``tc qdisc ... tbf`` (root only; everything is set up and torn down
by this script, also on SIGINT/SIGTERM). Ranks are placed on the nodes by their node identity
(``OVERLAP_NODE_ID=a|b``, docs/design.md): ranks of one node talk over gloo inside their namespace (the
veth end's address is local, so their traffic takes the loopback path, unlimited) and share
``/dev/shm`` and a hostname; ranks of different nodes talk over the veth pair at the emulated rate,
so `overlap.world` gives them the link class ``network``. The rendezvous is a file store under
``/tmp`` (the namespaces share the file system); gloo binds to the veth end of its namespace
(``GLOO_SOCKET_IFNAME``). Every wait is bounded: ``OVERLAP_TIMEOUT_S`` and the process group's timeout
(``--timeout``) on the ranks, ``--deadline`` per rate in the parent, which kills every rank on any failure.

The parts: `emulated_cluster_link` (the namespaces, the veth pair, tbf), `emulated_cluster_config` (what a
run does), `emulated_cluster_ranks` (on the ranks, per rate: a probe or a recorded profile, a node check,
then per problem and repeat the tuner, the exhaustive grid and a duel of their picks),
`emulated_cluster_report` (the summary and the table: regret, tuning time against the grid's, chunks per
link class, the model's error), `emulated_cluster_figures` (``--figures``: the TP ops' ``hierarchical``
figures) and `emulated_cluster_moe` (``--moe-figures``: the MoE layer on a balanced and a skewed routing, with
expert migration). This script is the parent: it sets the link up per rate, starts the ranks
in the namespaces, watches them and tears everything down; every name the tests use is reachable from it.

usage:
  sudo .venv/bin/python bench/emulated_cluster.py                       # 100mbit and 2gbit, 2 ranks per node
  sudo .venv/bin/python bench/emulated_cluster.py --rate 100mbit --repeats 5 --json out.json
  sudo .venv/bin/python bench/emulated_cluster.py --quick --ranks-per-node 1
  sudo .venv/bin/python bench/emulated_cluster.py --figures           # hierarchical's figures (docs/results/)
  sudo .venv/bin/python bench/emulated_cluster.py --moe-figures       # the MoE layer's figures, with migration

A default run takes about 2 minutes on 2 cores (4 ranks; more where other jobs share the cores: the
report prints the machine's load). Exit code 0; 1 when a run fails (the failing rank's log on
stderr); 2 on bad arguments or where the emulation cannot run here (not root, no ``ip``/``tc``,
namespaces or tbf refused); 130 on SIGINT/SIGTERM. The table goes to stdout, progress to stderr.
Traffic goes only to the addresses of the veth pair this script creates (10.77.X.1 and 10.77.X.2)
and to loopback inside the namespaces.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# The sibling modules, also where this file is loaded by its path (the tests) rather than run as a script.
sys.path.insert(0, str(Path(__file__).resolve().parent))
from emulated_cluster_config import DEFAULT_PROBLEMS, QUICK_PROBLEMS, Config  # noqa: E402
from emulated_cluster_figures import FIGURE_RATES, figure_problems, format_figures, summarize_figures  # noqa: E402
from emulated_cluster_link import (  # noqa: E402
    EmulationUnavailable,
    Link,
    parse_rate,
    probe_emulation,
    remove_stale,
    unavailable_reason,
)
from emulated_cluster_moe import MOE_RATES, format_moe_figures, moe_problems, summarize_moe  # noqa: E402
from emulated_cluster_ranks import rank_entry  # noqa: E402
from emulated_cluster_report import format_table, summarize  # noqa: E402

__all__ = [
    "DEFAULT_PROBLEMS", "QUICK_PROBLEMS", "Config", "EmulationUnavailable", "Link", "format_table", "main",
    "parse_rate", "probe_emulation", "rank_entry", "remove_stale", "run", "run_rate", "summarize",
    "unavailable_reason",
]

ROOT = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------------------------
# The ranks: started inside the namespaces, watched, killed on any failure
# ----------------------------------------------------------------------------------------------


def _tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def run_rate(cfg: Config, rate: str, tag: str = "0") -> dict[str, Any]:
    """The whole comparison at one `rate`: set up the link, run the ranks, tear down; rank 0's raw results.

    Raises RuntimeError (with the failing rank's log) where a rank fails or the run outlives
    ``cfg.deadline_s``; every rank is killed and the link torn down first."""
    work = Path(tempfile.mkdtemp(prefix="overlap-emu-"))
    procs: list[subprocess.Popen] = []
    try:
        with Link(rate, tag) as link:
            try:
                return _run_ranks(cfg, rate, link, work, procs)
            finally:
                _kill(procs)  # before the namespaces go: a namespace outlives its name while a process is in it
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _run_ranks(cfg: Config, rate: str, link: Link, work: Path, procs: list[subprocess.Popen]) -> dict[str, Any]:
    """Start every rank in its node's namespace (appending to `procs`), wait for them, return rank 0's results."""
    world_size = 2 * cfg.ranks_per_node
    logs = [work / f"rank{r}.log" for r in range(world_size)]
    spec = {"rate": rate, "world_size": world_size, "ranks_per_node": cfg.ranks_per_node,
            "init_file": str(work / "store"), "out": str(work / "result.json"), "config": dataclasses.asdict(cfg),
            "link": {"ns": link.ns, "dev": link.dev, "addr": link.addr, "burst_bytes": link.burst_bytes()}}
    (work / "spec.json").write_text(json.dumps(spec))
    pythonpath = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    for r in range(world_size):
        node = 0 if r < cfg.ranks_per_node else 1
        env = {**os.environ, "RANK": str(r), "WORLD_SIZE": str(world_size),
               "LOCAL_RANK": str(r % cfg.ranks_per_node), "OVERLAP_NODE_ID": "ab"[node],
               "GLOO_SOCKET_IFNAME": link.dev[node], "OVERLAP_TIMEOUT_S": str(cfg.timeout_s),
               "OVERLAP_CACHE_DIR": str(work / "cache"), "PYTHONPATH": pythonpath,
               "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        for name in ("OVERLAP_PLAN", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK", "LOCAL_WORLD_SIZE"):
            env.pop(name, None)  # nothing from the caller's own launch may leak into the ranks
        with open(logs[r], "wb") as log:
            procs.append(subprocess.Popen(
                ["ip", "netns", "exec", link.ns[node], sys.executable, str(Path(__file__).resolve()),
                 "--rank-entry", str(work / "spec.json")],
                env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True))  # its own process group, killed as a whole by `_kill`
    load = os.getloadavg()[0]
    _watch(procs, logs, cfg, rate)
    raw = json.loads((work / "result.json").read_text())
    raw["load"] = [load, os.getloadavg()[0]]  # the 1-minute load around the run: other jobs show up as noise
    return raw


def _watch(procs: list[subprocess.Popen], logs: list[Path], cfg: Config, rate: str) -> None:
    """Wait for every rank (at most ``cfg.deadline_s``), echoing rank 0's progress; raise on a failure."""
    deadline = time.monotonic() + cfg.deadline_s
    echoed = 0
    while True:
        if cfg.verbose:
            try:
                text = logs[0].read_text(errors="replace")
            except OSError:
                text = ""
            done = text[:text.rfind("\n") + 1]
            for line in done[echoed:].splitlines():
                print(f"[{rate}] {line}", file=sys.stderr, flush=True)
            echoed = len(done)
        codes = [p.poll() for p in procs]
        failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            r = failed[0]
            raise RuntimeError(f"[{rate}] rank {r} exited with code {codes[r]}; its log ends:\n{_tail(logs[r])}")
        if all(c == 0 for c in codes):
            return
        if time.monotonic() > deadline:
            logs_text = "\n".join(f"--- rank {r} ---\n{_tail(log, 15)}" for r, log in enumerate(logs))
            raise RuntimeError(f"[{rate}] the ranks did not finish within {cfg.deadline_s:.0f} s (killed):\n"
                               f"{logs_text}")
        time.sleep(0.2)


def _kill(procs: list[subprocess.Popen]) -> None:
    """SIGTERM, then SIGKILL, each rank's own process group (only processes this script started)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        live = [p for p in procs if p.poll() is None]
        for p in live:
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                pass
        for p in live:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass



# ----------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------


def run(cfg: Config) -> list[dict[str, Any]]:
    """Every rate of `cfg` in turn: ``[{"raw": rank 0's results, "summary": summarize(raw)}, ...]``.

    Raises EmulationUnavailable where this machine cannot emulate the cluster, RuntimeError where a
    run fails. SIGINT/SIGTERM tear the link down and stop the ranks before the process exits."""
    reason = unavailable_reason()
    if reason is None:
        remove_stale()
        reason = probe_emulation()
    if reason is not None:
        raise EmulationUnavailable(reason)

    stopping: list[int] = []

    def stop(signum: int, _frame: object) -> None:
        if stopping:  # a second signal: let the teardown that the first one started finish
            return
        stopping.append(signum)
        raise KeyboardInterrupt(f"signal {signum}")

    previous = {}
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            previous[sig] = signal.signal(sig, stop)
        except ValueError:  # not the main thread: the caller handles signals
            pass
    try:
        out = []
        for i, rate in enumerate(cfg.rates):
            raw = run_rate(cfg, rate, tag=str(i))
            summary = (summarize_figures(raw) if cfg.figures else summarize_moe(raw) if cfg.moe_figures
                       else summarize(raw))
            out.append({"raw": raw, "summary": summary})
        return out
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _parse(argv: list[str] | None) -> tuple[Config, str | None, str | None, str | None]:
    """``(config, --json path, --rank-entry spec, --plans folder)``; exits 2 on bad arguments."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate", action="append", help="link rate in tc's syntax (repeatable; default 100mbit and 2gbit)")
    ap.add_argument("--ranks-per-node", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3, help="interleaved tuner/grid comparisons per problem")
    ap.add_argument("--measure", type=int, default=3, help="plans the tuner measures besides reference")
    ap.add_argument("--tune-repeats", type=int, default=5, help="timed calls per plan (tuner and grid)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--probe", choices=("quick", "full"), default="quick",
                    help="probe depth (full takes ~2 min at 100mbit: 16 MiB messages)")
    ap.add_argument("--quick", action="store_true", help="one problem, 2 repeats (a smoke run)")
    ap.add_argument("--timeout", type=float, default=0.0,
                    help="OVERLAP_TIMEOUT_S and the process group timeout (default 60 s, 300 s with --probe full)")
    ap.add_argument("--deadline", type=float, default=900.0, help="seconds per rate before the ranks are killed")
    ap.add_argument("--profiles", help="a JSON file {rate: profile} (as --json records them under raw.profile): "
                                       "those rates use it instead of probing")
    ap.add_argument("--figures", action="store_true",
                    help="the hierarchical strategy's figures instead of the tuner/grid comparison: 2 nodes x 2 ranks "
                         f"at {', '.join(FIGURE_RATES)} (unless --rate), every TP op with a hierarchical strategy, "
                         "fwd and fwd+bwd: reference, pipelined, hierarchical, the tuner's pick; bytes per call")
    ap.add_argument("--moe-figures", action="store_true",
                    help="the MoE layer's figures instead of the tuner/grid comparison: 2 nodes x 2 ranks at "
                         f"{', '.join(MOE_RATES)} (unless --rate), a balanced and a skewed routing, fwd and fwd+bwd: "
                         "reference, pipelined, hierarchical, hierarchical with the hot experts migrated, the "
                         "model's migration, the tuner's pick; bytes per call")
    ap.add_argument("--plans", help="with --figures or --moe-figures: a folder where each rate's plan file (the "
                                    "tuner's picks, as `overlap tune` writes them) is saved as plans-<rate>.json")
    ap.add_argument("--json", help="write the raw results and summaries here")
    ap.add_argument("--quiet", action="store_true", help="no progress lines")
    ap.add_argument("--rank-entry", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.rank_entry:
        return Config(), None, args.rank_entry, None
    if args.plans and not (args.figures or args.moe_figures):
        ap.error("--plans goes with --figures or --moe-figures")
    try:
        profiles = json.loads(Path(args.profiles).read_text()) if args.profiles else {}
        problems = (tuple(figure_problems()) if args.figures else tuple(moe_problems()) if args.moe_figures
                    else QUICK_PROBLEMS if args.quick else DEFAULT_PROBLEMS)
        rates = tuple(args.rate or (FIGURE_RATES if args.figures else MOE_RATES if args.moe_figures else Config.rates))
        cfg = Config(rates=rates, profiles=profiles, ranks_per_node=args.ranks_per_node,
                     repeats=2 if args.quick and args.repeats == 3 else args.repeats, measure=args.measure,
                     tune_repeats=args.tune_repeats, warmup=args.warmup, probe=args.probe,
                     problems=problems, timeout_s=args.timeout, figures=args.figures, moe_figures=args.moe_figures,
                     deadline_s=args.deadline, verbose=not args.quiet)
    except (ValueError, OSError) as exc:  # json.JSONDecodeError is a ValueError
        ap.error(str(exc))
    return cfg, args.json, None, args.plans


def main(argv: list[str] | None = None) -> int:
    cfg, json_path, rank_spec, plans_dir = _parse(argv)
    if rank_spec is not None:
        rank_entry(rank_spec)
        return 0
    start = time.monotonic()
    try:
        results = run(cfg)
    except EmulationUnavailable as exc:
        print(f"emulated_cluster: {exc}", file=sys.stderr)
        return 2
    except RuntimeError as exc:
        print(f"emulated_cluster: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as exc:
        print(f"emulated_cluster: interrupted ({exc or 'SIGINT'}); ranks stopped, link torn down", file=sys.stderr)
        return 130
    raws = [r["raw"] for r in results]
    print(format_figures(raws) if cfg.figures else format_moe_figures(raws) if cfg.moe_figures
          else format_table([r["summary"] for r in results]))
    print(f"total {time.monotonic() - start:.0f} s")
    if json_path:
        Path(json_path).write_text(json.dumps(results, indent=1) + "\n")
    for r in results if plans_dir else ():
        Path(plans_dir).mkdir(parents=True, exist_ok=True)
        Path(plans_dir, f"plans-{r['raw']['rate']}.json").write_text(json.dumps(r["raw"]["plan_file"], indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
