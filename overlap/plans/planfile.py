"""Plan files: the plans `overlap tune` chose for one topology, which ``auto`` looks calls up in.

A plan file is versioned JSON (`PLAN_FILE_VERSION`), one per topology (`overlap.plans.Topology.signature`):

.. code-block:: json

    {"version": 1, "topology": "cpu:nodes=1:ranks=2:links=shm*1", "world_size": 2,
     "created": "2026-11-05T10:00:00+00:00", "profile": {... `overlap.plans.Profile.to_json` ...} or null,
     "entries": {"<Problem.key>": {"problem": {"op": ..., "m": ..., ...},
                                   "plan": {"strategy": "symm", "num_chunks": {"shm": 2}, "block_m": 0, ...},
                                   "measured_s": 0.0031, "reference_s": 0.0042, "predicted_s": 0.0029}}}

``measured_s`` and ``reference_s`` are the tuned plan and ``reference`` timed side by side (None where
only predicted). `PlanFile.lookup` never returns a plan measured slower than ``reference``.

Every problem with a file (unreadable, not JSON, another version, a missing or malformed field, another
topology) raises ValueError with the path and what to do, so one ``except ValueError`` covers them.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import tempfile
from collections.abc import Mapping
from typing import Any

from .costmodel import Problem, Profile, Topology
from .plan import Plan

PLAN_FILE_VERSION = 1


@dataclasses.dataclass
class Entry:
    """One tuned problem: its plan and the seconds measured for it, for ``reference``, and predicted."""

    problem: Problem
    plan: Plan
    measured_s: float | None = None
    reference_s: float | None = None
    predicted_s: float | None = None

    def to_json(self) -> dict[str, Any]:
        plan = dataclasses.asdict(self.plan)
        plan["num_chunks"] = dict(self.plan.num_chunks)
        return {"problem": dataclasses.asdict(self.problem), "plan": plan, "measured_s": self.measured_s,
                "reference_s": self.reference_s, "predicted_s": self.predicted_s}

    @classmethod
    def from_json(cls, data: Any) -> Entry:
        """Raises KeyError, TypeError or ValueError on a malformed entry (`PlanFile.load` names it)."""
        seconds = {f: data.get(f) for f in ("measured_s", "reference_s", "predicted_s")}
        for name, v in seconds.items():
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
                raise ValueError(f"{name} must be a number or null, got {v!r}")
        return cls(Problem(**data["problem"]), Plan(**data["plan"]),
                   **{f: None if v is None else float(v) for f, v in seconds.items()})


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


@dataclasses.dataclass(kw_only=True)
class PlanFile:
    """The plans tuned on one topology (see the module docstring); `path`: where it was loaded from."""

    version: int = PLAN_FILE_VERSION
    topology: str
    world_size: int
    profile: Profile | None = None
    entries: dict[str, Entry] = dataclasses.field(default_factory=dict)
    created: str = dataclasses.field(default_factory=_now)
    path: str = dataclasses.field(default="", compare=False)

    @classmethod
    def new(cls, topology: Topology, world_size: int | None = None, profile: Profile | None = None) -> PlanFile:
        """An empty plan file for `topology` (`world_size`, if given, must be the topology's)."""
        if world_size is not None and world_size != topology.world_size:
            raise ValueError(f"PlanFile.new: world_size {world_size} is not the topology's {topology.world_size}")
        return cls(topology=topology.signature, world_size=topology.world_size, profile=profile)

    def add(self, entry: Entry) -> None:
        """Add or replace the entry of ``entry.problem``."""
        self.entries[entry.problem.key] = entry

    def lookup(self, problem: Problem) -> Plan | None:
        """The plan tuned for `problem`, ``Plan("reference")`` where it was measured slower than reference,
        or None where the file has no entry for it."""
        entry = self.entries.get(problem.key)
        if entry is None:
            return None
        if entry.measured_s is not None and entry.reference_s is not None and entry.measured_s > entry.reference_s:
            return Plan("reference")
        return entry.plan

    def check_topology(self, topology: Topology) -> None:
        """Raise ValueError unless this file was tuned on `topology` (by signature)."""
        if topology.signature != self.topology:
            where = f"plan file {self.path}" if self.path else "plan file"
            raise ValueError(f"{where} was tuned on topology {self.topology!r}, but this group is "
                             f"{topology.signature!r}: re-tune on this topology (overlap tune)")

    def to_json(self) -> dict[str, Any]:
        return {"version": self.version, "topology": self.topology, "world_size": self.world_size,
                "created": self.created, "profile": self.profile.to_json() if self.profile else None,
                "entries": {key: e.to_json() for key, e in sorted(self.entries.items())}}

    def save(self, path: str | os.PathLike) -> None:
        """Write atomically (`write_atomic`): readers see the old file or the new one, never half."""
        path = os.fspath(path)
        write_atomic(path, json.dumps(self.to_json(), indent=1) + "\n")
        self.path = path

    @classmethod
    def load(cls, path: str | os.PathLike) -> PlanFile:
        """Read a plan file; raises ValueError (with the path) for anything but a valid version-1 file."""
        path = os.fspath(path)
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except OSError as exc:
            raise ValueError(f"plan file {path} cannot be read: {exc}") from exc
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"plan file {path} is not valid JSON ({exc}): re-run overlap tune") from exc
        if not isinstance(data, Mapping):
            raise ValueError(f"plan file {path} holds a JSON {type(data).__name__}, not an object: re-run overlap tune")
        if data.get("version") != PLAN_FILE_VERSION:
            raise ValueError(f"plan file {path} has version {data.get('version')!r}; this overlap reads version "
                             f"{PLAN_FILE_VERSION}: re-run overlap tune")
        missing = [f for f in ("topology", "world_size", "entries", "created") if f not in data]
        if missing:
            raise ValueError(f"plan file {path} lacks the fields {missing}: re-run overlap tune")
        if not isinstance(data["topology"], str) or isinstance(data["world_size"], bool) \
                or not isinstance(data["world_size"], int) or not isinstance(data["entries"], Mapping):
            raise ValueError(f"plan file {path}: topology must be a string, world_size an int and entries an "
                             "object: re-run overlap tune")
        try:
            profile = Profile.from_json(data["profile"]) if data.get("profile") is not None else None
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ValueError(f"plan file {path}: bad machine profile ({type(exc).__name__}: {exc}): "
                             "re-run overlap tune") from exc
        planfile = cls(topology=data["topology"], world_size=data["world_size"], profile=profile,
                       created=str(data["created"]), path=path)
        for key, raw in data["entries"].items():
            try:
                planfile.add(Entry.from_json(raw))
            except (KeyError, TypeError, ValueError, AttributeError) as exc:
                what = f"missing field {exc}" if isinstance(exc, KeyError) else f"{type(exc).__name__}: {exc}"
                raise ValueError(f"plan file {path}: entry {key!r} is malformed ({what}): re-run overlap tune") \
                    from exc
        return planfile


_CACHE: dict[str, tuple[int, PlanFile]] = {}


def write_atomic(path: str | os.PathLike, text: str) -> None:
    """Write `text` to a temporary file beside `path`, flush it to disk, then rename it over `path`."""
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)  # readers see the old file or the whole new one, never a part
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def load_cached(path: str | os.PathLike) -> PlanFile:
    """`PlanFile.load`, cached per process by (path, modification time): a rewritten file is read again.
    The returned object is shared: do not modify it."""
    path = os.path.abspath(os.fspath(path))
    try:
        mtime = os.stat(path).st_mtime_ns
    except OSError as exc:
        raise ValueError(f"plan file {path} cannot be read: {exc}") from exc
    cached = _CACHE.get(path)
    if cached is not None and cached[0] == mtime:
        return cached[1]
    planfile = PlanFile.load(path)
    _CACHE[path] = (mtime, planfile)
    return planfile
