"""The parent of the emulated cluster (`bench.emulated_cluster`): per rate, the link set up (`link`), every rank
started in its node's namespace (``python -m bench.emulated_cluster --rank-entry SPEC``), watched (rank 0's progress
echoed, every rank killed on any failure or past ``--deadline``) and everything torn down, also on SIGINT/SIGTERM.
"""

from __future__ import annotations

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

from bench.emulated_cluster.config import Config
from bench.emulated_cluster.figures import summarize_figures
from bench.emulated_cluster.link import EmulationUnavailable, Link, probe_emulation, remove_stale, unavailable_reason
from bench.emulated_cluster.moe import summarize_moe
from bench.emulated_cluster.report import summarize

ROOT = Path(__file__).resolve().parents[2]


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
                ["ip", "netns", "exec", link.ns[node], sys.executable, "-m", "bench.emulated_cluster",
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
