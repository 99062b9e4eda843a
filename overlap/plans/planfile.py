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

Every problem with a file (unreadable, not JSON, another version, a missing or malformed field, a number out of
range, another topology) raises ValueError with the path and what to do, so one ``except ValueError`` covers them.
Every number of a loaded file is checked (`Entry.from_json`, `Profile.from_json`): ints where counts are, at least
1, and under the bounds below; seconds finite and >= 0.

Files are written atomically (`write_atomic`) with the mode ``open()`` gives (``0o666`` less the umask), never
world-writable. ``overlap tune --out`` merges into an existing file (`merge_into`).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
from collections.abc import Mapping
from typing import Any

from .costmodel import Problem, Profile, Topology
from .plan import Plan

PLAN_FILE_VERSION = 1

# Bounds of a loaded plan file's numbers (`Entry.from_json`, `PlanFile.load`):
#: chunks per link class of a plan (the runtime clamps a count to the rows and flags a call has; more than 2^20
#: is no plan the tuner writes)
MAX_PLAN_CHUNKS = 1 << 20
#: a fused kernel's tile side: a power of two from 16 to 1024, so that a tile (block_m x block_n, ...) stays
#: within Triton's 2^20 elements per tensor (``TRITON_MAX_TENSOR_NUMEL``)
MAX_PLAN_BLOCK = 1024
#: a problem's m, k, n, experts and top_k
MAX_PLAN_DIM = (1 << 31) - 1
#: a plan file's world size
MAX_PLAN_WORLD_SIZE = 1 << 20
#: seconds measured or predicted for one call (a year; longer is written as null)
MAX_PLAN_SECONDS = 365 * 86400.0

_SECONDS = ("measured_s", "reference_s", "predicted_s")


def _seconds_or_none(value: float | None) -> float | None:
    """`value` where it is a time a plan file holds (finite, 0 to `MAX_PLAN_SECONDS`), else None (null)."""
    return float(value) if value is not None and math.isfinite(value) and 0 <= value <= MAX_PLAN_SECONDS else None


def _check_int(value: Any, field: str, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{field} must be an int from {low} to {high}, got {value!r}")


@dataclasses.dataclass
class Entry:
    """One tuned problem: its plan and the seconds measured for it, for ``reference``, and predicted."""

    problem: Problem
    plan: Plan
    measured_s: float | None = None
    reference_s: float | None = None
    predicted_s: float | None = None

    def to_json(self) -> dict[str, Any]:
        """The entry as a plan file holds it (a time that is not finite or is out of range written as null)."""
        plan = dataclasses.asdict(self.plan)
        plan["num_chunks"] = dict(self.plan.num_chunks)
        return {"problem": dataclasses.asdict(self.problem), "plan": plan,
                **{f: _seconds_or_none(getattr(self, f)) for f in _SECONDS}}

    @classmethod
    def from_json(cls, data: Any, world_size: int | None = None) -> Entry:
        """The entry `to_json` wrote, every number checked: the problem's sizes ints from 1 to `MAX_PLAN_DIM`, the
        plan's chunk counts ints from 1 to `MAX_PLAN_CHUNKS`, its tile sides 0 or powers of two from 16 to
        `MAX_PLAN_BLOCK`, one_shot a bool, its migration pairs an expert of the problem and a node below
        `world_size` (where given), the seconds null or finite from 0 to `MAX_PLAN_SECONDS`. Raises KeyError,
        TypeError or ValueError (naming the field) on a malformed entry (`PlanFile.load` names the file and entry)."""
        if not isinstance(data, Mapping):
            raise ValueError(f"an entry must be a JSON object, got {data!r}")
        seconds = {f: data.get(f) for f in _SECONDS}
        for name, v in seconds.items():
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)
                                  or not 0 <= v <= MAX_PLAN_SECONDS):
                raise ValueError(f"{name} must be null or a finite number of seconds from 0 to {MAX_PLAN_SECONDS:g}, "
                                 f"got {v!r}")
        problem, plan = Problem(**data["problem"]), Plan(**data["plan"])
        for name in ("m", "k", "n", "experts", "top_k"):
            value = getattr(problem, name)
            if value or name in ("m", "k", "n"):  # (experts and top_k are 0 but for MoE problems)
                _check_int(value, f"problem.{name}", 1, MAX_PLAN_DIM)
        for link, n in plan.num_chunks:
            _check_int(n, f"plan.num_chunks.{link}", 1, MAX_PLAN_CHUNKS)
        for name in ("block_m", "block_n", "block_k"):
            if getattr(plan, name) > MAX_PLAN_BLOCK:
                raise ValueError(f"plan.{name} must be 0 (the kernel's default) or a power of two from 16 to "
                                 f"{MAX_PLAN_BLOCK}, got {getattr(plan, name)!r}")
        if not isinstance(plan.one_shot, bool):
            raise ValueError(f"plan.one_shot must be true or false, got {plan.one_shot!r}")
        for expert, node in plan.migrate:
            if expert >= problem.experts or (world_size is not None and node >= world_size):
                raise ValueError(f"plan.migrate: pair ({expert}, {node}) names no expert of the problem's "
                                 f"{problem.experts} or no node of {world_size} ranks")
        return cls(problem, plan, **{f: None if v is None else float(v) for f, v in seconds.items()})


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
            raise ValueError(f"plan file {path} cannot be read: {exc.strerror or exc}") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"plan file {path} is not valid JSON ({exc}): re-run overlap tune") from None
        if not isinstance(data, Mapping):
            raise ValueError(f"plan file {path} holds a JSON {type(data).__name__}, not an object: re-run overlap tune")
        if data.get("version") != PLAN_FILE_VERSION:
            raise ValueError(f"plan file {path} has version {data.get('version')!r}; this overlap reads version "
                             f"{PLAN_FILE_VERSION}: re-run overlap tune")
        missing = [f for f in ("topology", "world_size", "entries", "created") if f not in data]
        if missing:
            raise ValueError(f"plan file {path} lacks the fields {missing}: re-run overlap tune")
        world_size = data["world_size"]
        if not isinstance(data["topology"], str) or isinstance(world_size, bool) or not isinstance(world_size, int) \
                or not 1 <= world_size <= MAX_PLAN_WORLD_SIZE or not isinstance(data["entries"], Mapping):
            raise ValueError(f"plan file {path}: topology must be a string, world_size an int from 1 to "
                             f"{MAX_PLAN_WORLD_SIZE} (got {world_size!r}) and entries an object: re-run overlap tune")
        try:
            profile = Profile.from_json(data["profile"], where=f"plan file {path}: profile") \
                if data.get("profile") is not None else None
        except ValueError as exc:  # (names the file and the field)
            raise ValueError(f"{exc}: re-run overlap tune") from None
        planfile = cls(topology=data["topology"], world_size=world_size, profile=profile,
                       created=str(data["created"]), path=path)
        for key, raw in data["entries"].items():
            try:
                planfile.add(Entry.from_json(raw, world_size))
            except (KeyError, TypeError, ValueError, AttributeError) as exc:
                what = (f"missing field {exc}" if isinstance(exc, KeyError) else str(exc) if isinstance(exc, ValueError)
                        else f"{type(exc).__name__}: {exc}")
                raise ValueError(f"plan file {path}: entry {key!r} is malformed ({what}): re-run overlap tune") \
                    from None
        return planfile


_CACHE: dict[str, tuple[int, PlanFile]] = {}


def write_atomic(path: str | os.PathLike, text: str) -> None:
    """Write `text` to a temporary file beside `path`, flush it to disk, then rename it over `path`.

    The file gets the mode ``open()`` would give it, ``0o666`` less the umask (a private temporary file, as
    ``tempfile.mkstemp`` makes, would leave it 0600 whatever the umask), but never write access for others: with
    a umask that allows it (0), ``0o664``."""
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    for _ in range(100):
        tmp = os.path.join(folder, f".{os.path.basename(path)}.{os.urandom(6).hex()}.tmp")
        try:  # O_EXCL: a new file, never one (or a link) someone put there; the kernel applies the umask
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o664)
            break
        except FileExistsError:
            continue
    else:
        raise FileExistsError(f"write_atomic: no free temporary name beside {path}")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
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


def merge_into(path: str | os.PathLike, planfile: PlanFile) -> PlanFile:
    """`planfile` merged into the plan file at `path` where one exists (what ``overlap tune --out`` writes): that
    file's entries of other problems kept, those of `planfile`'s problems replaced by `planfile`'s; the profile
    (where `planfile` has one) and the creation time `planfile`'s. Where no file exists, `planfile` itself.

    Raises ValueError naming `path` where the file there cannot be read or is no valid plan file (`PlanFile.load`),
    or was tuned on another topology than `planfile` (a plan file holds one): it is never overwritten then."""
    path = os.fspath(path)
    if not os.path.lexists(path):
        return planfile
    existing = PlanFile.load(path)
    if existing.topology != planfile.topology:
        raise ValueError(f"plan file {path} holds plans of topology {existing.topology!r}, not of these ranks' "
                         f"{planfile.topology!r}: a plan file holds one topology; write another file (--out) or "
                         "remove this one")
    merged = dataclasses.replace(existing, profile=planfile.profile or existing.profile, created=planfile.created,
                                 entries=dict(existing.entries))
    for entry in planfile.entries.values():
        merged.add(entry)
    return merged


def load_cached(path: str | os.PathLike) -> PlanFile:
    """`PlanFile.load`, cached per process by (path, modification time): a rewritten file is read again.
    The returned object is shared: do not modify it."""
    path = os.path.abspath(os.fspath(path))
    try:
        mtime = os.stat(path).st_mtime_ns
    except OSError as exc:
        raise ValueError(f"plan file {path} cannot be read: {exc.strerror or exc}") from None
    cached = _CACHE.get(path)
    if cached is not None and cached[0] == mtime:
        return cached[1]
    planfile = PlanFile.load(path)
    _CACHE[path] = (mtime, planfile)
    return planfile
