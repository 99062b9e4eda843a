"""The GPU tests' fixtures and their record (docs/gpu-check.md).

``dev``: where the virtual ranks run: the GPU where one is visible, else the CPU with the Triton interpreter (the CPU
mode runs in CI with the rest of the suite; tests that need CUDA skip there, saying so). Before anything touches
CUDA this sets ``CUDA_DEVICE_MAX_CONNECTIONS=32`` unless the caller set it (streams then get hardware queues of their
own; the GPU check runs the tests marked ``one_queue`` once more under 1).

A test whose failure leaves the process unusable (a sticky CUDA error, a device that did not drain: `DeviceStuck`)
ends its process once its reports are out: under pytest-xdist (``-n 1 --max-worker-restart N``, as the GPU check
runs it) the worker is replaced by a fresh one for the tests after it; without xdist the later tests skip, saying
why.

The modules run in the GPU check's order (`tests.gpu.plan.MODULE_ORDER`: the kernel tests first, the ops on one
device last), whatever pytest collected first. Where a GPU is present the tests marked ``cpu_only`` (they exist for
the CPU mode: interpreted subprocesses) are deselected. ``OVERLAP_GPU_MODULE_BUDGETS`` (set by the GPU check: JSON,
module -> seconds, in run order) and ``OVERLAP_GPU_MODULE_ANCHOR`` (a file: the wall time the pass's first test
started, written by the first test of the pass, read by a worker that replaces a crashed one): each module's slot
ends at that time plus the budgets up to it (`tests.gpu.plan.module_ends`); a module's later tests skip once its
slot has ended, saying so; its first test always runs (`tests.gpu.plan.should_skip`).

``OVERLAP_GPU_RECORD=PATH``: a JSON record of the run, rewritten as each test starts and ends (on the controller
under xdist): every report (node id, phase, outcome, seconds, the failure's text, what the test noted through
`tolerance.note`), and the test running now, so that a run stopped from outside still leaves what it had.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")  # read when CUDA creates its context: before any test

import torch  # noqa: E402

from tests.gpu import plan, tolerance  # noqa: E402
from tests.gpu.virtual import Device, DeviceStuck  # noqa: E402

# The texts of errors after which a CUDA context is unusable (every later call fails the same way).
STICKY_ERRORS = ("illegal memory access", "illegal instruction", "misaligned address", "unspecified launch failure",
                 "device-side assert", "CUDA error: an illegal", "cudaErrorIllegalAddress", "cudaErrorLaunchFailure",
                 "context is destroyed", "uncorrectable ECC")
EXIT_UNUSABLE = 75  # a worker's exit status after a test left its process unusable
_unusable: str | None = None  # why this process can run no more tests
_modules_started: set[str] = set()  # the modules of which a test has started in this process
_module_ends: dict[str, float] | None = None  # when each module's slot ends (None: not read yet)


def module_ends() -> dict[str, float]:
    """The modules' slot ends of this pass, from its first test's start (the anchor file; written here if this is
    the pass's first test), or nothing where the GPU check set no budgets."""
    global _module_ends
    if _module_ends is None:
        budgets = json.loads(os.environ.get("OVERLAP_GPU_MODULE_BUDGETS") or "{}")
        anchor = os.environ.get("OVERLAP_GPU_MODULE_ANCHOR")
        start = time.time()
        if budgets and anchor:
            try:
                with open(anchor, "x", encoding="utf-8") as f:
                    f.write(repr(start))
            except FileExistsError:
                try:
                    start = float(Path(anchor).read_text())
                except ValueError:
                    pass
        _module_ends = plan.module_ends(start, budgets) if budgets and anchor else {}
    return _module_ends


def pytest_configure(config: pytest.Config) -> None:
    if os.environ.get("OVERLAP_GPU_RECORD") and not os.environ.get("PYTEST_XDIST_WORKER"):
        config.pluginmanager.register(Record(Path(os.environ["OVERLAP_GPU_RECORD"])), "overlap-gpu-record")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    places = [i for i, item in enumerate(items) if item.path.parent == here]  # tests/gpu's (not tests/gpu/cpu's)
    ordered = sorted((items[i] for i in places), key=lambda item: plan.rank(item.path.name))  # stable
    for i, item in zip(places, ordered):
        items[i] = item
    if torch.cuda.is_available():
        cpu_only = [item for item in items if item.path.parent == here and item.get_closest_marker("cpu_only")]
        if cpu_only:
            config.hook.pytest_deselected(items=cpu_only)
            items[:] = [item for item in items if item not in cpu_only]
        return
    for item in items:
        if item.get_closest_marker("cuda") is not None and item.path.parent == here:
            item.add_marker(pytest.mark.skip(reason="needs a GPU: no CUDA device here"))


@pytest.fixture(scope="session")
def dev() -> Device:
    """The virtual ranks' device: this process's GPU, else the CPU (interpreted kernels, tiny sizes)."""
    if torch.cuda.is_available():
        return Device(torch.device("cuda", torch.cuda.current_device()))
    return Device(torch.device("cpu"))


@pytest.fixture(autouse=True)
def _test_hook(request):
    """What tests/gpu/cpu/test_gpu_check.py makes a test do, to prove the run's handling of it (unset in real runs):
    ``OVERLAP_GPU_TEST_HOOK="ACTION:SUBSTRING[;...]"``, applied to the tests whose node id holds SUBSTRING:
    ``fault`` (a sticky CUDA error: the process is unusable after it), ``raise`` (a plain failure), ``sleep=S``
    (a test that takes S seconds)."""
    for spec in filter(None, os.environ.get("OVERLAP_GPU_TEST_HOOK", "").split(";")):
        action, _, where = spec.partition(":")
        if where not in request.node.nodeid:
            continue
        if action == "fault":
            raise RuntimeError("CUDA error: an illegal memory access was encountered (test hook)")
        if action == "raise":
            raise AssertionError("test hook: this test fails")
        if action.startswith("sleep="):
            time.sleep(float(action.removeprefix("sleep=")))
        else:
            raise ValueError(f"OVERLAP_GPU_TEST_HOOK: unknown action in {spec!r}")
    yield


# ==============================================================================================
# A process a test left unusable
# ==============================================================================================


def unusable_after(excinfo: pytest.ExceptionInfo | None) -> str | None:
    """Why a test's exception leaves the process unusable, or None."""
    if excinfo is None:
        return None
    text = f"{excinfo.typename}: {excinfo.value}"
    if isinstance(excinfo.value, DeviceStuck) or any(s in text for s in STICKY_ERRORS):
        return text.replace("\n", " ")[:300]
    return None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    global _unusable
    report = yield
    if call.when == "call":  # what the test noted (`tolerance.note`): its report's properties (the records, junit)
        report.user_properties.extend(tolerance.take_notes())
    why = unusable_after(call.excinfo)
    if why is not None and _unusable is None:
        _unusable = f"{item.nodeid}: {why}"
    return report


def pytest_runtest_setup(item: pytest.Item) -> None:
    tolerance.take_notes()  # nothing an earlier test left
    if _unusable is not None:
        pytest.skip(f"this process is unusable since {_unusable} (run under pytest-xdist to go on in a fresh one)")
    module = item.path.name
    if item.path.parent == Path(__file__).parent and module in (ends := module_ends()):
        first = module not in _modules_started
        _modules_started.add(module)
        if plan.should_skip(module, time.time(), ends, first):
            budgets = json.loads(os.environ.get("OVERLAP_GPU_MODULE_BUDGETS") or "{}")
            pytest.skip(plan.SKIP_REASON.format(module=module, seconds=budgets.get(module, 0.0)))


def pytest_runtest_logfinish(nodeid: str, location) -> None:
    """Under xdist, once the test that left the process unusable has its reports out, end the worker."""
    if _unusable is not None and os.environ.get("PYTEST_XDIST_WORKER"):
        print(f"[gpu tests] ending worker {os.environ['PYTEST_XDIST_WORKER']}: {_unusable}", flush=True)
        os._exit(EXIT_UNUSABLE)


# ==============================================================================================
# The JSON record
# ==============================================================================================


class Record:
    """Every report and the running test, rewritten to `path` (atomically) as they come."""

    def __init__(self, path: Path):
        self.path = path
        self.doc = {"started": time.time(), "torch": torch.__version__,
                    "cuda_device_max_connections": os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS"),
                    "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
                    "running": None, "finished": False, "exit_status": None, "tests": []}
        self.save()

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(self.doc, indent=1, default=str))
        os.replace(tmp, self.path)

    def pytest_runtest_logstart(self, nodeid: str, location) -> None:
        self.doc["running"] = {"test": nodeid, "since": time.time()}
        self.save()

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.when != "call" and report.outcome == "passed":
            return  # a passing set-up or teardown says nothing
        message = None
        if report.longrepr is not None:
            message = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)[-4000:]
        self.doc["tests"].append({"test": report.nodeid, "phase": report.when, "outcome": report.outcome,
                                  "seconds": round(report.duration, 3), "message": message,
                                  "properties": dict(report.user_properties)})
        if report.when == "teardown" or report.outcome == "failed":
            self.doc["running"] = None
        self.save()

    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        self.doc.update(running=None, finished=True, exit_status=int(exitstatus))
        self.save()
