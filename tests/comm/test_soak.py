"""Soak (bench/soak.py) at CI size: many calls of every op and strategy leak nothing.

Two ranks run every op under reference, pipelined and symm (and the one-shot variants of
matmul_all_reduce) 50 times each, forward and backward, on a process group of their own, then release
it. After each case's warm-up, shared-memory entries, mappings of overlap segments, file descriptors and
the heap must not grow, RSS stays within 5% + 8 MiB, and after `overlap.release` the group's segments are
neither in the shm directory nor mapped. The soak's own leak detector is checked on made-up samples.
"""

from __future__ import annotations

import os

from bench import soak

CASE_LABELS = ("reference", "pipelined", "symm", "pipelined+one_shot", "symm+one_shot")


def soak_task(rank, world_size, iters):
    """The soak on a fresh group of the pool's ranks (so heaps made by other tests do not count)."""
    import torch.distributed as dist

    group = dist.new_group(backend="gloo")
    try:
        cfg = soak.SoakConfig(
            iters=iters, warmup=8, shape=(16, 64, 48), strategies=CASE_LABELS, timeout=30.0, verbose=False
        )
        return soak.soak_rank(cfg, group)
    finally:
        dist.destroy_process_group(group)


def test_soak_nothing_grows_and_release_cleans_up(pools):
    pool = pools(2)
    records = pool.run(soak_task, 50, timeout=150)
    cases = [(c["op"], c["strategy"]) for c in records[0]["cases"]]
    assert len(cases) == 4 * 3 + 2, cases  # four TP ops x three strategies, and the two one-shot variants
    found = soak.problems(records)
    assert not found, "soak found growth or leftovers:\n" + "\n".join(found) + "\n" + soak.table(records)
    for rec in records:
        assert all(c["iters"] == 50 for c in rec["cases"]), rec["cases"]
        # The group's heap existed (symm ran) and is gone after the release.
        assert max(s["heap"] for c in rec["cases"] for _, _, s in c["samples"]) > 0
        assert rec["released"]["heap"] == 0 and rec["released"]["maps"] == rec["before"]["maps"], rec["released"]
    # Nothing of the pool's ranks is in the directory (segments are unlinked as soon as mapped).
    assert soak.shm_entries(tuple(pool.pids)) == []


# ----------------------------------------------------------------------------------------------
# The detector itself, on made-up samples
# ----------------------------------------------------------------------------------------------


def _sample(shm=0, maps=4, fds=15, rss_mib=300, heap=4096):
    return {"shm": shm, "maps": maps, "fds": fds, "rss_kib": rss_mib * 1024, "threads": 6, "heap": heap}


def _record(end, released=None, mismatch=()):
    case = {
        "op": "matmul_all_reduce",
        "strategy": "symm",
        "iters": 100,
        "ms_median": 1.0,
        "mismatch": list(mismatch),
        "samples": [
            ("start", 0, _sample(maps=0, heap=0)),
            ("warm", 0, _sample()),
            ("iter", 50, _sample()),
            ("end", 100, end),
        ],
    }
    return {
        "rank": 0,
        "pids": [1],
        "before": _sample(maps=0, heap=0),
        "cases": [case],
        "released": released or _sample(maps=0, heap=0),
    }


def test_detector_flags_each_kind_of_growth():
    assert soak.problems([_record(_sample())]) == []
    assert soak.problems([_record(_sample(rss_mib=300 + 15 + 8 - 1))]) == []  # within 5% + 8 MiB
    for end, what in [
        (_sample(fds=16), "file descriptors"),
        (_sample(shm=1), "entries"),
        (_sample(maps=5), "mappings"),
        (_sample(heap=8192), "heap"),
        (_sample(rss_mib=300 + 15 + 8 + 1), "RSS"),
    ]:
        found = soak.problems([_record(end)])
        assert len(found) == 1 and what in found[0], (end, found)
    assert "after overlap.release" in soak.problems([_record(_sample(), released=_sample(maps=2, heap=0))])[0]
    assert "differ from reference" in soak.problems([_record(_sample(), mismatch=["out"])])[0]
    assert "left after" in soak.problems([_record(_sample())], after_exit=["overlap-x-1-g1-r0"])[0]


def test_shm_entries_counts_only_this_runs_segments(tmp_path, monkeypatch):
    from overlap import shm

    monkeypatch.setenv("OVERLAP_SHM_DIR", str(tmp_path))
    pid, run, ns = os.getpid(), shm.new_run_id(), shm.pid_namespace()
    mine, other = shm.segment_name(run, ns, pid, "g1", 0), shm.segment_name(run, ns, pid + 1, "ctrl", 1)
    folder = shm.private_dir()
    for name in (mine, other, "other-file", "overlap-x"):
        open(os.path.join(folder, name), "wb").close()
    (tmp_path / f"overlap-ab12-{pid}-g1-r0").write_bytes(b"")  # (outside the folder: not a segment)
    assert soak.shm_entries((pid,)) == [mine]
    assert len(soak.shm_entries()) == 2
