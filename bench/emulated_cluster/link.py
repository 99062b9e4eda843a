"""The emulated link of `bench.emulated_cluster`: two network namespaces joined by a veth pair whose egress is
rate-limited on both ends with ``tc qdisc ... tbf`` (root only), its setup and teardown (`Link`), the check
that this machine can make one (`probe_emulation`), the cleanup of namespaces left by a killed run
(`remove_stale`) and tc's rate syntax (`parse_rate`).

The link: tbf on both veth ends (each direction has the rate), a bucket of 16 KiB or 0.25 ms at the rate
(`Link.burst_bytes`), a 200 ms queue (no drops, which would cost TCP retransmission timeouts), and TCP's
slow start after idle switched off in the two namespaces (gloo's traffic comes in bursts; a restarted window
would time a 1 MiB message at a fraction of the rate).

Pure Python and iproute2: no torch, no overlap.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess

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
