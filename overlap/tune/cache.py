"""The machine-profile cache: one JSON file per machine configuration (`cache_path`) under
``OVERLAP_CACHE_DIR``, else ``$XDG_CACHE_HOME/overlap``, else ``~/.cache/overlap``; reading it (`load_cached`) and
writing it on rank 0, atomically (`save_cached`). Local: no communication beyond `world.group_info`
(`overlap.tune.probing.probe_cached` is the collective that hands rank 0's file to every rank).
"""

from __future__ import annotations

import json
import logging
import re
import socket
from pathlib import Path

import torch
import torch.distributed as dist

from .. import envs, world
from ..plans import Profile
from ..plans.planfile import write_atomic
from ..world import LINK_CLASSES, GroupInfo

log = logging.getLogger("overlap")


def device_name(device: torch.device) -> str:
    """The name a profile (and its cache file) gives the device: the GPU's, or ``cpu``."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def cache_dir() -> Path:
    """``OVERLAP_CACHE_DIR`` if set, else ``$XDG_CACHE_HOME/overlap`` (an absolute XDG_CACHE_HOME), else
    ``~/.cache/overlap`` (`overlap.envs.cache_dir`)."""
    return Path(envs.cache_dir())


def check_cache_dir() -> Path:
    """`cache_dir`, where a profile can be saved (a folder this user can write, or create); raises OSError naming
    OVERLAP_CACHE_DIR otherwise (`envs.checked_cache_dir`). `overlap.tune.probing.probe_cached` calls it before it
    probes, and the command line before any rank starts: not after a probe of seconds."""
    return Path(envs.checked_cache_dir(writable=True))


def may_probe(refresh: bool) -> bool:
    """Whether a command that takes the cached profile (`probe_cached`) may have to probe and save one, as far as
    can be told before its ranks start: with `refresh`, or where the cache holds no profile of this host (which
    profile the ranks need depends on their links). The command line then checks `check_cache_dir` up front."""
    if refresh:
        return True
    prefix = re.sub(r"[^A-Za-z0-9._+-]+", "_", f"profile-{socket.gethostname()}-")
    try:
        return not any(p.name.startswith(prefix) for p in cache_dir().iterdir())
    except OSError:
        return True


def _info(group: GroupInfo | dist.ProcessGroup | None, timeout: float | None = None) -> GroupInfo:
    return group if isinstance(group, GroupInfo) else world.group_info(group, timeout)


def cache_path(info: GroupInfo | dist.ProcessGroup | None = None, *, quick: bool = False) -> Path:
    """The profile file of this machine for a group: `cache_dir` / ``profile-HOST-DEVICE-wW-LINKS.json``.

    HOST is this machine's hostname, DEVICE ``cpu-tN`` (N torch threads per rank: GEMM rates depend
    on it) or the GPU's name, W the group's world size, LINKS the link classes this rank sees to its
    peers (``none`` for one rank); quick probes go to their own ``-quick`` file. `info` is the
    group's `GroupInfo`, or a group (then `world.group_info`, a collective on a group's first use).
    """
    info = _info(info)
    device = device_name(info.device) if info.device.type == "cuda" else f"cpu-t{torch.get_num_threads()}"
    present = set(info.link_classes().values())
    return profile_path(device, info.world_size, tuple(c for c in LINK_CLASSES if c in present), quick=quick)


def profile_path(device: str, world_size: int = 1, links: tuple[str, ...] = (), *, quick: bool = False) -> Path:
    """`cache_path`'s file for `device` (a GPU's name, or ``cpu-tN``), `world_size` ranks seeing `links`: also
    where a measurement without a group (the GPU check's, on one GPU) writes its profile."""
    name = f"profile-{socket.gethostname()}-{device}-w{world_size}-{'+'.join(links) or 'none'}"
    return cache_dir() / (re.sub(r"[^A-Za-z0-9._+-]+", "_", name + ("-quick" if quick else "")) + ".json")


def save_profile(profile: Profile, path: Path) -> Path:
    """Write `profile` to `path` atomically (`save_cached` on a group's rank 0; the GPU check without one)."""
    _write_atomic(path, json.dumps(profile.to_json(), indent=2, sort_keys=True) + "\n")
    return path


def _read(path: Path) -> Profile | None:
    """The profile in `path`; None where there is none, or (with a warning naming the file and what is wrong: a
    field out of range, another version, not JSON) where it cannot serve, so that it is probed again."""
    try:
        return Profile.from_json(json.loads(path.read_text()), where=f"profile {path}")
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        log.warning("overlap: ignoring the machine profile %s (%s); it will be probed again", path, exc)
        return None


def _write_atomic(path: Path, text: str) -> None:
    write_atomic(path, text)


def load_cached(group: GroupInfo | dist.ProcessGroup | None = None, *, quick: bool = False) -> Profile | None:
    """This machine's cached profile for `group` (`cache_path`), or None where there is none or it is
    unreadable, of another version or holds a number out of range (logged, naming the file and the field).
    Local: no communication beyond `world.group_info`; ranks on other nodes than rank 0 look on their own
    machine (use `probe_cached` for one answer)."""
    return _read(cache_path(_info(group), quick=quick))


def save_cached(profile: Profile, group: GroupInfo | dist.ProcessGroup | None = None, *,
                quick: bool = False) -> Path:
    """Write `profile` to `cache_path` on group rank 0 (atomically: a temporary file, then a rename);
    other ranks write nothing. Returns the path on every rank."""
    info = _info(group)
    path = cache_path(info, quick=quick)
    if info.rank == 0:
        save_profile(profile, path)
    return path
