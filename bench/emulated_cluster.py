"""Emulated two-node cluster: the tuner's pick against an exhaustive grid, over a rate-limited link.

Two network namespaces on this machine are the two "nodes", joined by a veth pair whose egress is
rate-limited on both ends with ``tc qdisc ... tbf`` (root only; everything is set up and torn down
by this script, also on SIGINT/SIGTERM). Ranks are placed on the nodes by their node identity
(``OVERLAP_NODE_ID=a|b``, DESIGN.md): ranks of one node talk over gloo inside their namespace (the
veth end's address is local, so their traffic takes the loopback path, unlimited) and share
``/dev/shm`` and a hostname; ranks of different nodes talk over the veth pair at the emulated rate,
so `overlap.world` gives them the link class ``network``. The rendezvous is a file store under
``/tmp`` (the namespaces share the file system); gloo binds to the veth end of its namespace
(``GLOO_SOCKET_IFNAME``). The link: tbf on both veth ends (each direction has the rate), a bucket of
16 KiB or 0.25 ms at the rate (`Link.burst_bytes`), a 200 ms queue (no drops, which would cost TCP
retransmission timeouts), and TCP's slow start after idle switched off in the two namespaces (gloo's
traffic comes in bursts; a restarted window would time a 1 MiB message at a fraction of the rate).
Every wait is bounded: ``OVERLAP_TIMEOUT_S`` and the process group's timeout (``--timeout``) on the
ranks, ``--deadline`` per rate in the parent, which kills every rank on any failure.

On the ranks, per rate: a probe (`overlap.tune.probe_cached`, quick unless ``--probe full``, cached
in a fresh temporary ``OVERLAP_CACHE_DIR`` so no rate reuses another's; ``--profiles FILE`` gives a
recorded profile per rate instead, and the model's ranking is then fixed by the inputs), a check that the node-local
subgroups see ``shm`` links and that a ``symm`` call over shared memory matches ``reference``, then
per problem and repeat, interleaved: (1) the tuner, `overlap.tune.search.tune` with the probed
profile (the model's ``--measure`` best plans and ``reference`` measured); (2) the exhaustive grid,
`overlap.tune.search.measure` over every plan `overlap.plan.candidates` lists. Both measure with the
same ``--tune-repeats`` and ``--warmup`` and time themselves by wall clock on rank 0. (3) A duel: the
tuner's pick and the grid's best timed again side by side (with ``reference``), interleaved, twice as
many calls each, so neither is judged on the times it was selected by.

Report, per rate and problem (medians over the repeats, spreads ``[min..max]``):

* ``pick``: the tuner's choice (the most frequent one; every pick is in the JSON); ``net``/``shm``:
  its chunk counts per link class (``-`` where the plan does not chunk that class);
* ``best``: the grid's fastest plan (grid times pooled over the repeats: the median per plan);
* ``regret``: the pick's time / the grid best's time - 1 in that repeat's duel (0 where they are the
  same plan; negative where the pick won the duel); target <= 5%. ``grid``: the pick's grid time / the
  best grid time - 1, judged on the grid that chose the best (biased up: the best of ~17 noisy times
  is biased low); ``pooled``: the same on the grid pooled over repeats. ``noise``: the grid regret of
  exhaustive search itself, its pick of one repeat judged on another repeat's grid (the floor that
  timing noise sets on the grid columns);
* ``tune/grid``: the tuner's wall time / the grid's (target <= 25%). The probe, paid once per machine
  and shared by every problem, is reported on its own line;
* ``ref/best``: reference's pooled grid time / the best's (> 1.1: overlap pays);
* ``err pick``, ``err grid``: the model's error, median ``|predicted / measured - 1|`` of the pick (as
  the tuner measured it) and over every grid plan.

usage:
  sudo .venv/bin/python bench/emulated_cluster.py                       # 100mbit and 2gbit, 2 ranks per node
  sudo .venv/bin/python bench/emulated_cluster.py --rate 100mbit --repeats 5 --json out.json
  sudo .venv/bin/python bench/emulated_cluster.py --quick --ranks-per-node 1

A default run takes about 2 minutes on 2 cores (4 ranks; more where other jobs share the cores: the
report prints the machine's load). Exit code 0; 1 when a run fails (the failing rank's log on
stderr); 2 on bad arguments or where the emulation cannot run here (not root, no ``ip``/``tc``,
namespaces or tbf refused); 130 on SIGINT/SIGTERM. The table goes to stdout, progress to stderr.
Traffic goes only to the addresses of the veth pair this script creates (10.77.X.1 and 10.77.X.2)
and to loopback inside the namespaces.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import math
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

#: problems as `overlap.plan.Problem` fields, for 2 ranks per node on 2 CPU cores: a call takes ~10-30 ms
#: and its GEMMs and transfers are comparable somewhere between 100 Mbit/s and 2 Gbit/s. At 100 Mbit/s
#: (~12 MB/s per direction, shared by the 4 rank pairs that cross it) the gather of ``all_gather_matmul``
#: (48 KiB per block, 4 blocks per direction) takes about as long as its GEMMs (~0.14 GFLOP per block);
#: ``matmul_reduce_scatter`` (64 KiB partials) and ``moe`` (dispatch and combine, 32 KiB per peer each)
#: are bound by the link there and balanced nearer 2 Gbit/s.
DEFAULT_PROBLEMS: tuple[dict[str, Any], ...] = (
    {"op": "all_gather_matmul", "m": 64, "k": 192, "n": 5632},
    {"op": "matmul_reduce_scatter", "m": 16, "k": 1024, "n": 1024},
    {"op": "moe", "m": 128, "k": 128, "n": 1024, "experts": 8, "top_k": 2},
)
QUICK_PROBLEMS: tuple[dict[str, Any], ...] = DEFAULT_PROBLEMS[:1]

#: tc's rate units (SI for *bit, bytes for *bps; the IEC ones are powers of 1024), in bits per second
_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12,
          "kibit": 2**10, "mibit": 2**20, "gibit": 2**30, "tibit": 2**40,
          "bps": 8, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9, "tbps": 8e12}
_RATE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-z]+)\s*$", re.IGNORECASE)


def parse_rate(text: str) -> float:
    """Bits per second of a tc rate (``100mbit``, ``2gbit``, ``500kbit``, ``10mbps`` = bytes).

    Raises ValueError for anything else, or a rate outside 1 Mbit/s ... 100 Gbit/s."""
    match = _RATE.match(text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS:
        raise ValueError(f"rate must be a number and one of tc's units {sorted(_UNITS)}, e.g. 100mbit; got {text!r}")
    bps = float(match.group(1)) * _UNITS[unit]
    if not 1e6 <= bps <= 1e11:
        raise ValueError(f"rate must be between 1mbit and 100gbit, got {text!r} ({bps:.3g} bit/s)")
    return bps


@dataclasses.dataclass
class Config:
    """One run: every rate in `rates`, the whole comparison each."""

    rates: tuple[str, ...] = ("100mbit", "2gbit")
    ranks_per_node: int = 2
    repeats: int = 3  # interleaved tuner/grid comparisons per problem
    measure: int = 3  # plans the tuner measures besides reference (`tune(measure=...)`)
    tune_repeats: int = 5  # timed calls per plan, tuner and grid alike
    warmup: int = 1
    probe: str = "quick"  # "quick" or "full" (`overlap.tune.probe(quick=...)`)
    problems: tuple[dict[str, Any], ...] = DEFAULT_PROBLEMS
    timeout_s: float = 0.0  # OVERLAP_TIMEOUT_S and the process group's timeout (0: 60 s, 300 s for a full probe)
    deadline_s: float = 900.0  # per rate: the ranks are killed past it
    symm_check: bool = True
    verbose: bool = True  # rank 0's progress lines on stderr
    #: rate -> a recorded `overlap.plan.Profile` (its JSON): that rate's ranks take it instead of probing, so
    #: the model's ranking, and so the plans the tuner measures, are a function of the inputs alone
    profiles: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        self.rates = tuple(self.rates)
        for rate in self.rates:
            parse_rate(rate)
        if not self.rates:
            raise ValueError("at least one rate is needed")
        for name in ("ranks_per_node", "repeats", "measure", "tune_repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {self.warmup}")
        if self.probe not in ("quick", "full"):
            raise ValueError(f"probe must be 'quick' or 'full', got {self.probe!r}")
        self.problems = tuple(dict(p) for p in self.problems)
        world_size = 2 * self.ranks_per_node
        for p in self.problems:
            if p.get("op") == "moe" and p.get("experts", 0) % world_size:
                raise ValueError(f"problem {p}: {p.get('experts')} experts do not divide over {world_size} ranks")
        if not self.timeout_s:
            # A full probe ping-pongs 16 MiB messages: at 100 Mbit/s the other ranks wait ~90 s for a pair.
            self.timeout_s = 300.0 if self.probe == "full" else 60.0
        self.profiles = {rate: dict(profile) for rate, profile in self.profiles.items()}
        if set(self.profiles) - set(self.rates):
            raise ValueError(f"profiles for rates {sorted(set(self.profiles) - set(self.rates))} that are not run")
        if self.timeout_s < 0 or self.deadline_s <= 0:
            raise ValueError(f"timeout_s and deadline_s must be > 0, got {self.timeout_s}, {self.deadline_s}")


# ----------------------------------------------------------------------------------------------
# The emulated link: two namespaces, a veth pair, tbf on both ends
# ----------------------------------------------------------------------------------------------


class EmulationUnavailable(RuntimeError):
    """This machine cannot emulate the cluster (not root, no ip/tc, namespaces refused)."""


def _cmd(*args: str, timeout: float = 20.0, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        why = proc.stderr.strip() or proc.stdout.strip()
        raise RuntimeError(f"`{' '.join(args)}` failed ({proc.returncode}): {why}")
    return proc


def unavailable_reason() -> str | None:
    """Why the emulation cannot run here (None where it can): checks root and ``ip``/``tc`` only."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, veth pairs and tc qdiscs): run it with sudo"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"needs {' and '.join(missing)} (iproute2) on PATH"
    return None


def probe_emulation() -> str | None:
    """Like `unavailable_reason`, and also creates and deletes a namespace, a veth pair and a tbf qdisc
    (what the emulation needs), so a refusal is found in a second: None where everything works."""
    reason = unavailable_reason()
    if reason is not None:
        return reason
    try:
        with Link("1gbit", tag="chk"):
            pass
    except (RuntimeError, subprocess.TimeoutExpired, OSError) as exc:
        return f"cannot set up the emulated link here: {exc}"
    return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def remove_stale() -> list[str]:
    """Delete namespaces of this script (``ovl-PID-...``) whose process has exited (a run killed by
    SIGKILL cannot tear down); returns their names."""
    listing = _cmd("ip", "netns", "list", check=False).stdout
    stale = []
    for line in listing.splitlines():
        name = line.split()[0] if line.split() else ""
        match = re.fullmatch(r"ovl-(\d+)-\w+-[ab]", name)
        if match and int(match.group(1)) != os.getpid() and not _alive(int(match.group(1))):
            _cmd("ip", "netns", "del", name, check=False)
            stale.append(name)
    return stale


class Link:
    """Namespaces ``ovl-PID-TAG-a``/``-b`` joined by veth ``ovPIDTAGa``/``b`` (10.77.X.1 and .2/24),
    egress limited to `rate` on both ends. A context manager: `close` (also on errors) deletes both
    namespaces, which removes the veth pair and its qdiscs with them."""

    def __init__(self, rate: str, tag: str = "0"):
        parse_rate(rate)
        self.rate, pid = rate, os.getpid()
        self.ns = (f"ovl-{pid}-{tag}-a", f"ovl-{pid}-{tag}-b")
        self.dev = (f"ov{pid}{tag}a"[:15], f"ov{pid}{tag}b"[:15])
        subnet = 1 + pid % 250  # any /24 works (each pair is alone in its namespaces); varied for reading logs
        self.addr = (f"10.77.{subnet}.1", f"10.77.{subnet}.2")
        self._made: list[str] = []

    def burst_bytes(self) -> int:
        """The token bucket: 16 KiB or 0.25 ms at the rate, whichever is more (16 KiB at 100 Mbit/s, 61 KiB
        at 2 Gbit/s). Smaller buckets cost tbf throughput (a timer wake-up every few packets: at 2 Gbit/s a
        16 KiB bucket halves it); larger ones let the first bytes of every message after a pause through
        at the veth's speed (a 64 KiB bucket at 100 Mbit/s: a 64 KiB message in half its time), which the
        probe's small messages would take for the link's latency and bandwidth."""
        return max(16 * 1024, int(parse_rate(self.rate) / 8 * 250e-6))

    def open(self) -> Link:
        try:
            for ns in self.ns:
                _cmd("ip", "netns", "add", ns)
                self._made.append(ns)
            _cmd("ip", "link", "add", self.dev[0], "type", "veth", "peer", "name", self.dev[1])
            self._made.append("veth")
            for ns, dev, addr in zip(self.ns, self.dev, self.addr, strict=True):
                _cmd("ip", "link", "set", dev, "netns", ns)
                _cmd("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
                _cmd("ip", "-n", ns, "link", "set", dev, "up")
                _cmd("ip", "-n", ns, "link", "set", "lo", "up")
                # Linux restarts a TCP connection's window after an idle spell; gloo's messages come in
                # bursts, so a 1 MiB message would be timed at half the rate or less. Data-centre
                # networks (and RDMA) do not do that: switch it off in these namespaces only.
                _cmd("ip", "netns", "exec", ns, "sh", "-c", "echo 0 > /proc/sys/net/ipv4/tcp_slow_start_after_idle")
                # latency: how long a packet may queue before it is dropped; generous, since a drop
                # costs TCP a retransmission timeout (>= 200 ms), which would swamp the timings.
                _cmd("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", self.rate,
                     "burst", str(self.burst_bytes()), "latency", "200ms")
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        for ns in self.ns:
            if ns in self._made:
                _cmd("ip", "netns", "del", ns, check=False)
        if "veth" in self._made:  # only where it never left the root namespace
            for dev in self.dev:
                if _cmd("ip", "link", "show", dev, check=False).returncode == 0:
                    _cmd("ip", "link", "del", dev, check=False)
        self._made.clear()

    def __enter__(self) -> Link:
        return self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()


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
# On the ranks
# ----------------------------------------------------------------------------------------------


def _rank_entry(spec_path: str) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    spec = json.loads(Path(spec_path).read_text())
    cfg = Config(**spec["config"])
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{spec['init_file']}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=cfg.timeout_s))
    try:
        result = _compare(cfg, spec, rank, world_size)
        if rank == 0:
            tmp = Path(spec["out"] + ".tmp")
            tmp.write_text(json.dumps(result))
            os.replace(tmp, spec["out"])
        dist.barrier()  # every rank is done before any tears its connections down
    finally:
        dist.destroy_process_group()


def _say(rank: int, text: str) -> None:
    if rank == 0:
        print(f"{time.strftime('%H:%M:%S')} {text}", flush=True)


def _node_check(cfg: Config, info: Any, rank: int) -> dict[str, Any]:
    """Every rank's node is the one the launcher gave it; within each node's subgroup the link class is
    ``shm`` and a ``symm`` call (POSIX shared memory between the namespaces' processes) matches
    ``reference``. Raises RuntimeError otherwise (and AssertionError where the results differ)."""
    import torch
    import torch.distributed as dist

    import overlap
    from overlap import world

    rpn = cfg.ranks_per_node
    want = tuple("ab"[r // rpn] for r in range(info.world_size))
    if info.nodes != want:
        raise RuntimeError(f"rank {rank}: overlap sees the nodes {info.nodes}, the ranks were launched on {want}")
    classes = info.link_classes()
    if any(c != ("network" if want[p] != want[rank] else "shm") for p, c in classes.items()):
        raise RuntimeError(f"rank {rank}: link classes {classes} for nodes {want}")
    out = {"nodes": list(info.nodes), "link_classes": {str(p): c for p, c in classes.items()}, "symm": "skipped"}
    subgroups = [dist.new_group([n * rpn + i for i in range(rpn)]) for n in range(2)]  # collective: every rank
    if not cfg.symm_check or rpn < 2:
        return out
    pg = subgroups[rank // rpn]
    sub = world.group_info(pg)
    if not sub.single_node or set(sub.link_classes().values()) != {"shm"}:
        raise RuntimeError(f"rank {rank}: node {want[rank]}'s subgroup is not one node of shm links: {sub}")
    gen = torch.Generator().manual_seed(17 + rank)
    a, b = torch.randn(16, 32, generator=gen), torch.randn(32, 24, generator=torch.Generator().manual_seed(5))
    got = overlap.all_gather_matmul(a, b, group=pg, strategy="symm")
    want_y = overlap.all_gather_matmul(a, b, group=pg, strategy="reference")
    torch.testing.assert_close(got, want_y, rtol=1e-5, atol=1e-5)
    overlap.release(pg)
    out["symm"] = "matches reference"
    return out


def _compare(cfg: Config, spec: dict, rank: int, world_size: int) -> dict[str, Any]:
    import torch.distributed as dist

    from overlap import world
    from overlap.plan import Plan, Problem, Profile, candidates, predict, rank_candidates, topology_of
    from overlap.tune import probe_cached
    from overlap.tune.search import measure, tune

    info = world.group_info()
    topology = topology_of(info)
    _say(rank, f"{world_size} ranks up, nodes {''.join(info.nodes)}, topology {topology.signature}")
    node = _node_check(cfg, info, rank)
    _say(rank, f"node check: {node['symm']} within each node")
    t0 = time.perf_counter()
    if spec["rate"] in cfg.profiles:
        profile = Profile.from_json(cfg.profiles[spec["rate"]])
        _say(rank, "probe: none, the profile was given")
    else:
        profile = probe_cached(refresh=True, quick=cfg.probe == "quick",
                               progress=(lambda text: _say(rank, f"probe: {text}")))
    probe_s = time.perf_counter() - t0
    net = profile.links.get("network", {}).get("p2p")
    _say(rank, f"probe: {probe_s:.1f} s; network {net.bandwidth_Bps / 1e6:.1f} MB/s, "
               f"{net.latency_s * 1e6:.0f} us" if net else f"probe: {probe_s:.1f} s")

    problems = [Problem(**p) for p in cfg.problems]
    for p in problems:  # first calls (imports, allocator, gloo pairs) stay out of both timings
        measure(p, [Plan("reference"), Plan("pipelined")], repeats=1, warmup=1)

    def timed(fn) -> tuple[Any, float]:
        dist.barrier()
        start = time.perf_counter()
        out = fn()
        return out, time.perf_counter() - start

    def plan_dict(plan: Plan) -> dict[str, Any]:
        return {"text": plan.describe(), "strategy": plan.strategy, "chunks": dict(plan.num_chunks)}

    results = []
    for p in problems:
        grid_plans = candidates(p, topology)
        model = rank_candidates(p, topology, profile)
        predicted = {plan.describe(): predict(p, plan, topology, profile).total_s for plan in grid_plans}
        results.append({"problem": dataclasses.asdict(p), "key": p.key, "grid_size": len(grid_plans),
                        "model_pick": plan_dict(model[0][0]), "predicted": predicted, "repeats": []})
    for rep in range(cfg.repeats):
        for p, res in zip(problems, results, strict=True):
            _say(rank, f"repeat {rep + 1}/{cfg.repeats}, {p.key}: tuner")
            (_, outcomes), tune_s = timed(lambda p=p: tune([p], profile=profile, measure=cfg.measure,
                                                           repeats=cfg.tune_repeats, warmup=cfg.warmup))
            o = outcomes[0]
            _say(rank, f"  picked {o.chosen.plan.describe()} in {tune_s:.2f} s; grid of {res['grid_size']}")
            grid, grid_s = timed(lambda p=p: measure(p, candidates(p, topology), repeats=cfg.tune_repeats,
                                                     warmup=cfg.warmup))
            best = min((t for t in grid if not t.error), key=lambda t: t.measured_s)
            _say(rank, f"  grid best {best.plan.describe()} in {grid_s:.2f} s")
            duel = {}
            if best.plan.describe() != o.chosen.plan.describe():  # reference first: the others are checked on it
                contenders = [Plan("reference")] + [t.plan for t in (o.chosen, best) if t.plan.strategy != "reference"]
                duel = {t.plan.describe(): t.measured_s for t in measure(p, contenders, repeats=2 * cfg.tune_repeats,
                                                                         warmup=cfg.warmup) if not t.error}
                _say(rank, "  duel " + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in duel.items()))
            res["repeats"].append({
                "tune_s": tune_s, "grid_s": grid_s,
                "pick": plan_dict(o.chosen.plan), "pick_measured_s": o.chosen.measured_s,
                "best": best.plan.describe(), "duel": duel,
                "pick_predicted_s": o.chosen.predicted_s, "reference_measured_s": o.reference.measured_s,
                "tuner_trials": [{"plan": t.plan.describe(), "predicted_s": t.predicted_s, "measured_s": t.measured_s,
                                  "error": t.error} for t in o.trials],
                "grid": {t.plan.describe(): {"measured_s": t.measured_s, "spread_s": t.spread_s, "error": t.error}
                         for t in grid},
            })
    return {"rate": spec["rate"], "link": spec["link"], "topology": topology.signature, "world_size": world_size,
            "ranks_per_node": cfg.ranks_per_node, "node_check": node, "probe": cfg.probe, "probe_s": probe_s,
            "profile": profile.to_json(), "problems": results}


# ----------------------------------------------------------------------------------------------
# Summary (pure Python: the parent and the tests use it)
# ----------------------------------------------------------------------------------------------


def _spread(values: list[float]) -> dict[str, float]:
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return {"median": math.nan, "min": math.nan, "max": math.nan}
    return {"median": statistics.median(finite), "min": min(finite), "max": max(finite)}


def _duel_regret(rep: dict[str, Any]) -> float:
    """The pick's duel time / the grid best's - 1; 0 where the tuner picked the grid's best."""
    pick, best, duel = rep["pick"]["text"], rep.get("best"), rep.get("duel", {})
    if best is None:  # results written before duels were run
        return math.nan
    if pick == best:
        return 0.0
    return duel.get(pick, math.nan) / duel.get(best, math.nan) - 1


def summarize(raw: dict[str, Any]) -> dict[str, Any]:
    """Per problem of one rate's raw results: regret, tuning time share, chunks, model error (see the
    module docstring); medians and ``[min, max]`` over the repeats."""
    problems = []
    for res in raw["problems"]:
        reps = res["repeats"]
        regrets, grid_regrets, shares, err_pick, err_grid = [], [], [], [], []
        pooled_times: dict[str, list[float]] = collections.defaultdict(list)
        grids = [{k: v["measured_s"] for k, v in rep["grid"].items() if not v["error"]} for rep in reps]
        # The noise floor: exhaustive search's own pick of one repeat judged on another repeat's grid.
        floor = [gj.get(min(gi, key=gi.get), math.nan) / min(gj.values()) - 1
                 for i, gi in enumerate(grids) for j, gj in enumerate(grids) if i != j]
        for rep, grid in zip(reps, grids, strict=True):
            best = min(grid.values())
            grid_regrets.append(grid.get(rep["pick"]["text"], math.nan) / best - 1)
            regrets.append(_duel_regret(rep))
            shares.append(rep["tune_s"] / rep["grid_s"])
            err_pick.append(abs(rep["pick_predicted_s"] / rep["pick_measured_s"] - 1))
            err_grid += [abs(res["predicted"][k] / t - 1) for k, t in grid.items()
                         if math.isfinite(res["predicted"][k])]
            for k, t in grid.items():
                pooled_times[k].append(t)
        pooled = {k: statistics.median(v) for k, v in pooled_times.items()}
        best_plan = min(pooled, key=pooled.get)
        picks = collections.Counter(rep["pick"]["text"] for rep in reps)
        pick = picks.most_common(1)[0][0]
        pick_chunks = next(rep["pick"] for rep in reps if rep["pick"]["text"] == pick)
        ref = pooled.get("reference[]", math.nan)
        best_overlap = min((t for k, t in pooled.items() if not k.startswith("reference")), default=math.nan)
        problems.append({
            "key": res["key"], "grid_size": res["grid_size"], "pick": pick, "picks": dict(picks),
            "pick_strategy": pick_chunks["strategy"], "pick_chunks": pick_chunks["chunks"],
            "model_pick": res["model_pick"]["text"], "model_chunks": res["model_pick"]["chunks"],
            "best": best_plan, "best_s": pooled[best_plan], "reference_s": ref,
            "reference_over_best": ref / pooled[best_plan], "reference_over_best_overlap": ref / best_overlap,
            "regret": _spread(regrets), "regret_grid": _spread(grid_regrets),
            "regret_pooled": pooled.get(pick, math.nan) / pooled[best_plan] - 1,
            "regret_noise": _spread(floor),
            "tune_share": _spread(shares), "tune_s": _spread([r["tune_s"] for r in reps]),
            "grid_s": _spread([r["grid_s"] for r in reps]),
            "model_error_pick": _spread(err_pick),
            "model_error_grid": statistics.median(err_grid) if err_grid else math.nan,
        })
    net = raw["profile"]["links"].get("network", {}).get("p2p", {})
    return {"rate": raw["rate"], "topology": raw["topology"], "probe": raw["probe"], "probe_s": raw["probe_s"],
            "network_MBps": net.get("bandwidth_Bps", math.nan) / 1e6,
            "network_latency_us": net.get("latency_s", math.nan) * 1e6,
            "node_check": raw["node_check"]["symm"], "load": raw.get("load", [math.nan, math.nan]),
            "problems": problems}


def _pct(s: dict[str, float]) -> str:
    return f"{s['median'] * 100:4.1f}% [{s['min'] * 100:.0f}..{s['max'] * 100:.0f}]"


def _chunks(chunks: dict[str, int], link: str) -> str:
    return str(chunks[link]) if link in chunks else "-"


def format_table(summaries: list[dict[str, Any]]) -> str:
    """The report: a line per rate (link, probe, load), a line per problem (columns: the module docstring)."""
    kw = max([44] + [len(p["key"]) for s in summaries for p in s["problems"]])  # the problem column's width
    head = (f"{'rate':>8}  {'problem':<{kw}} {'pick':<28} {'net':>3} {'shm':>3}  {'grid best':<28} {'regret':<20} "
            f"{'grid':>6} {'pooled':>6} {'noise':>6}  {'tune/grid':<20} {'ref/best':>8} {'err pick':>8} "
            f"{'err grid':>8}")
    lines = [head, "-" * len(head)]
    worst_regret, worst_share = [], []
    for s in summaries:
        lines.append(f"{s['rate']:>8}  {s['topology']}; probe ({s['probe']}) {s['probe_s']:.1f} s: network "
                     f"{s['network_MBps']:.1f} MB/s + {s['network_latency_us']:.0f} us; node-local symm "
                     f"{s['node_check']}; load {s['load'][0]:.1f} -> {s['load'][1]:.1f} on {os.cpu_count()} cores")
        for p in s["problems"]:
            lines.append(
                f"{s['rate']:>8}  {p['key']:<{kw}} {p['pick']:<28} {_chunks(p['pick_chunks'], 'network'):>3} "
                f"{_chunks(p['pick_chunks'], 'shm'):>3}  {p['best']:<28} {_pct(p['regret']):<20} "
                f"{p['regret_grid']['median'] * 100:5.1f}% {p['regret_pooled'] * 100:5.1f}% "
                f"{p['regret_noise']['median'] * 100:5.1f}%  "
                f"{_pct(p['tune_share']):<20} {p['reference_over_best']:8.2f} "
                f"{p['model_error_pick']['median'] * 100:7.0f}% {p['model_error_grid'] * 100:7.0f}%")
            worst_regret.append(p["regret"]["median"])
            worst_share.append(p["tune_share"]["median"])
    if worst_regret:
        lines.append(f"targets: regret <= 5% (median duel per problem; worst {max(worst_regret) * 100:.1f}%), "
                     f"tuning time <= 25% of the grid's (worst {max(worst_share) * 100:.1f}%)")
    return "\n".join(lines)


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
            out.append({"raw": raw, "summary": summarize(raw)})
        return out
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _parse(argv: list[str] | None) -> tuple[Config, str | None, str | None]:
    """``(config, --json path, --rank-entry spec)``; exits 2 on bad arguments."""
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
    ap.add_argument("--json", help="write the raw results and summaries here")
    ap.add_argument("--quiet", action="store_true", help="no progress lines")
    ap.add_argument("--rank-entry", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.rank_entry:
        return Config(), None, args.rank_entry
    try:
        profiles = json.loads(Path(args.profiles).read_text()) if args.profiles else {}
        cfg = Config(rates=tuple(args.rate or Config.rates), profiles=profiles, ranks_per_node=args.ranks_per_node,
                     repeats=2 if args.quick and args.repeats == 3 else args.repeats, measure=args.measure,
                     tune_repeats=args.tune_repeats, warmup=args.warmup, probe=args.probe,
                     problems=QUICK_PROBLEMS if args.quick else DEFAULT_PROBLEMS, timeout_s=args.timeout,
                     deadline_s=args.deadline, verbose=not args.quiet)
    except (ValueError, OSError) as exc:  # json.JSONDecodeError is a ValueError
        ap.error(str(exc))
    return cfg, args.json, None


def main(argv: list[str] | None = None) -> int:
    cfg, json_path, rank_spec = _parse(argv)
    if rank_spec is not None:
        _rank_entry(rank_spec)
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
    print(format_table([r["summary"] for r in results]))
    print(f"total {time.monotonic() - start:.0f} s")
    if json_path:
        Path(json_path).write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
