"""The runner of the one-GPU check (bench/gpu_check.py): every group of sections (`gpu_check_groups.GROUPS`) in a
process of its own, the correctness groups first, within the run's deadline, with a record that is complete
whatever happens to a process.

For each group it starts ``gpu_check.py --group NAME`` and copies that process's output, line by line, to stdout
and to the log (``--out``/gpu_check.log). The process records each section in the run's JSON as it starts and
ends (`gpu_check_report.report_sink`). When it ends:

* exit 0: the group is done;
* EXIT_RESTART (a sticky CUDA error, a stuck queue): the rest of the group runs in a fresh process;
* EXIT_DEADLINE: it stopped itself at the deadline, its running section recorded as a FAIL; nothing more starts;
* anything else (a crash: an exit code or a signal): the section it was running is recorded as a FAIL that says
  so, and the rest of the group runs in a fresh process (as long as each process gets at least one section
  done); later groups run either way.

A process still alive at the deadline (less a margin) is killed with its whole process group; its running
section is recorded as a FAIL. Sections that never ran are recorded as SKIPs with the reason. A group whose
sections all have a static skip (GPU-only sections in ``--cpu-smoke``) is recorded from its listing, without a
process.

Imports overlap only through gpu_check_groups' listing (after the self-install).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from gpu_check_common import EXIT_DEADLINE, deadline_margin, log
from gpu_check_groups import Group, list_sections, ordered_groups, resolve_only
from gpu_check_report import DOC_NAME, load_doc, save_doc

SCRIPT = Path(__file__).resolve().parent / "gpu_check.py"
MAX_PROCESSES_PER_GROUP = 12  # each after the first needs the one before to have finished a section


def kill_margin(time_limit: float) -> float:
    """Seconds before --time-limit at which the runner kills a process that did not stop itself: three quarters
    of the margin after the process's own deadline, time for a process on a busy machine to write its record."""
    return deadline_margin(time_limit) / 4


def run_teed(cmd: list[str], env: dict[str, str], until: float, log_file: Any, cwd: str | None = None) -> int | None:
    """Run `cmd` in a new session, its stdout and stderr copied line by line to ours and to `log_file`; kill its
    whole process group at wall time `until`. Returns its exit status (negative: the signal), None if killed."""
    proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True, text=True, errors="replace", bufsize=1)

    def copy() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            sys.stdout.write(line)
            sys.stdout.flush()
            if log_file is not None:
                log_file.write(line)
                log_file.flush()

    copier = threading.Thread(target=copy, daemon=True)
    copier.start()
    try:
        code: int | None = proc.wait(timeout=max(0.0, until - time.time()))
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
        code = None
    copier.join(timeout=5.0)
    return code


def describe_exit(code: int | None) -> str:
    if code is None:
        return "killed by the runner at --time-limit (it did not stop itself)"
    if code < 0:
        try:
            return f"died of signal {signal.Signals(-code).name}"
        except ValueError:
            return f"died of signal {-code}"
    return f"exited with code {code}"


class Runner:
    """The one-GPU run: the record, the listing, the group processes."""

    def __init__(self, args: argparse.Namespace, doc: dict[str, Any], log_file: Any):
        self.args, self.doc, self.log_file = args, doc, log_file
        self.out = args.out
        self.paths = [os.path.join(self.out, DOC_NAME)] + ([args.json] if args.json else [])
        self.deadline = doc["started"] + args.time_limit
        self.cuda = not args.cpu_smoke

    def log(self, msg: str) -> None:
        log(msg, self.doc["started"])

    def save(self) -> None:
        save_doc(self.doc, self.paths)

    def reload(self) -> None:
        """The record as the group's process left it (it writes the same file)."""
        fresh = load_doc(self.paths[0])
        for key in ("results", "sections", "running", "gpu", "sm_count"):
            self.doc[key] = fresh.get(key, self.doc.get(key))

    def add(self, name: str, status: str, value: str, group: str, section: str | None = None) -> None:
        self.doc["results"].append({"name": name, "status": status, "value": value, "tflops": None, "ratio": None,
                                    "data": {}, "section": section or name})
        if section is None or section == name:
            self.doc["sections"].append({"name": name, "group": group, "status": status, "seconds": 0.0})
        log(f"{status} {name}: {value}", self.doc["started"])

    def listing(self) -> dict[str, list[tuple[str, str | None]]]:
        listing = {}
        for g in ordered_groups():
            try:
                listing[g.name] = list_sections(g, self.cuda, self.args)
            except Exception as exc:  # noqa: BLE001 - a group that cannot even list its sections fails alone
                self.add(f"group {g.name}", "FAIL", f"listing its sections failed: {type(exc).__name__}: {exc}"[:300],
                         g.name)
        return listing

    def run(self) -> int:
        """Every selected section; the record saved after each process. Returns the exit status of the run."""
        listing = self.listing()
        try:
            self.doc["selected"] = resolve_only(self.args.only, listing)
        except ValueError as exc:
            self.log(str(exc))
            self.doc["results"].append({"name": "--only", "status": "FAIL", "value": str(exc), "tflops": None,
                                        "ratio": None, "data": {}, "section": None})
            self.save()
            return 2
        chosen = set(self.doc["selected"]) if self.doc["selected"] is not None else None
        self.save()
        for g in ordered_groups():
            sections = [(n, s) for n, s in listing.get(g.name, []) if chosen is None or n in chosen]
            if not sections:
                continue
            if all(skip for _, skip in sections):  # e.g. GPU-only sections on the CPU: no process needed
                for name, skip in sections:
                    self.add(name, "SKIP", skip, g.name)
                self.save()
                continue
            if not self.run_group(g, sections):
                break
        self.account(listing, chosen)
        self.save()
        return 1 if not self.doc["ok"] else 3 if not self.doc["complete"] else 0

    def run_group(self, g: Group, sections: list[tuple[str, str | None]]) -> bool:
        """Processes for `g` until its sections are done; False when the deadline stops the run."""
        for _ in range(MAX_PROCESSES_PER_GROUP):
            done = {s["name"] for s in self.doc["sections"]}
            if all(name in done for name, _ in sections):
                return True
            if time.time() > self.deadline - deadline_margin(self.args.time_limit):
                return False
            self.doc["running"] = None
            self.save()
            before = len(done)
            started = time.time()
            code = run_teed(self.command(g), self.env(g), self.deadline - kill_margin(self.args.time_limit),
                            self.log_file, cwd=os.getcwd())
            self.reload()
            self.doc["processes"].append({"group": g.name, "exit": code, "seconds": round(time.time() - started, 1)})
            running = self.doc["running"]
            if running is not None:  # it died inside a section: that section is a FAIL
                self.add(running, "FAIL", f"the group's process {describe_exit(code)} during this section "
                                          "(the log has its last output)", g.name)
                self.doc["running"] = None
            self.save()
            if code == 0:
                return True
            if code is None or code == EXIT_DEADLINE:
                return False
            done = {s["name"] for s in self.doc["sections"]}
            if len(done) == before:
                self.add(f"group {g.name}", "FAIL", f"its process {describe_exit(code)} before finishing a section; "
                                                    "the rest of the group is not run", g.name)
                return True
            if any(name not in done for name, _ in sections):
                self.log(f"group {g.name}: its process {describe_exit(code)}; the rest of the group runs in a "
                         "fresh process")
        return True

    def command(self, g: Group) -> list[str]:
        a = self.args
        cmd = [sys.executable, str(SCRIPT), "--group", g.name, "--no-install", "--out", self.out,
               "--time-limit", str(a.time_limit), "--started-at", repr(self.doc["started"]), "--seed", str(a.seed)]
        return cmd + (["--cpu-smoke"] if a.cpu_smoke else [])

    def env(self, g: Group) -> dict[str, str]:
        env = dict(os.environ)
        env["PYTHONUNBUFFERED"] = "1"
        env.update(dict(g.env))
        return env

    def account(self, listing: dict[str, list[tuple[str, str | None]]], chosen: set[str] | None) -> None:
        """A SKIP, with the reason, for every selected section that has no record; ``complete`` set."""
        done = {s["name"] for s in self.doc["sections"]}
        late = time.time() > self.deadline - deadline_margin(self.args.time_limit)
        missing = 0
        for g in ordered_groups():
            for name, _ in listing.get(g.name, []):
                if (chosen is None or name in chosen) and name not in done:
                    why = f"over --time-limit {self.args.time_limit:.0f} s (not started)" if late else \
                        f"not run: group {g.name}'s processes failed (see 'group {g.name}')"
                    self.add(name, "SKIP", why, g.name)
                    missing += 1
        self.doc["complete"] = missing == 0 and not any(
            "time-limit" in r["value"] or r["name"].startswith("group ")
            for r in self.doc["results"] if r["status"] != "PASS")
