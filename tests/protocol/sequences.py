"""The synchronization operations the code actually performs, in order, read from what the compilers emit or from
the sources, in the terms of `tests.protocol.spec` (``(sem, scope)`` pairs), to be compared with the protocol's roles.

* `ptx_sequence`: a PTX kernel's memory operations that order anything (atomics, ``ld``/``st`` with a semantics
  qualifier, volatile loads) and its CTA barriers, in the order of the text, each as a `Step`;
* `cpp_sequence`: the ordering calls of a C++/CUDA function body (``__atomic_*`` with their ``__ATOMIC_*`` order,
  the inline-PTX ``ld.acquire``/``st.release``, ``__threadfence_system``, ``__syncthreads``, and the project's
  wrappers: ``flag_store_release``, ``atomic_add_acq_rel_sys``), plus plain stores to the words named
  (``counters[...] = ...``).

Semantics compare as the protocol sees them: ``plain``, ``relaxed`` and ``volatile`` all order nothing
(`UNORDERED`).
"""

from __future__ import annotations

import dataclasses
import re

from tests.protocol.spec import ACQ_REL, ACQUIRE, GPU, PLAIN, RELAXED, RELEASE, SYS, Op
from tests.support.ptx_flow import parse

UNORDERED = "unordered"
_SEMS = {"relaxed": RELAXED, "acquire": ACQUIRE, "release": RELEASE, "acq_rel": ACQ_REL, "volatile": RELAXED}
_SCOPES = {"sys": SYS, "gpu": GPU, "cta": "cta"}


@dataclasses.dataclass(frozen=True)
class Step:
    kind: str  # rmw, load, store, barrier, fence
    sem: str  # one of spec's semantics, or UNORDERED
    scope: str
    text: str  # the instruction or the call, for messages
    line: int = 0

    def matches(self, op: Op) -> bool:
        """Whether this step does at least what `op` asks: a read-modify-write where the role has one, a store (or
        an exchange) where it stores; an ordering at least as strong (acq_rel covers release and acquire, anything
        covers unordered) at a scope at least as wide (``sys`` covers ``gpu``) where it orders."""
        if op.kind == "barrier":
            return self.kind == "barrier"
        kind_ok = self.kind == op.kind or (op.kind == "store" and self.kind == "rmw")
        sem = UNORDERED if op.sem in (PLAIN, RELAXED) else op.sem
        if sem == UNORDERED:
            return kind_ok
        strong = self.sem == sem or self.sem == ACQ_REL
        return kind_ok and strong and (self.scope == op.scope or self.scope == SYS)


def ordering(op: str) -> tuple[str, str] | None:
    """(sem, scope) of a PTX memory instruction (``atom.global.acq_rel.sys.add.u32``), or None where it orders
    nothing and is no atomic (a plain ``ld``/``st``)."""
    parts = op.split(".")
    sems = [_SEMS[p] for p in parts if p in _SEMS]
    scope = next((_SCOPES[p] for p in parts if p in _SCOPES), GPU if parts[0] == "atom" else "")
    if parts[0] in ("atom", "red"):  # an atomic without a semantics qualifier is relaxed
        sem = sems[0] if sems else RELAXED
        return (UNORDERED if sem == RELAXED else sem, scope)
    if sems:
        return (UNORDERED if sems[0] == RELAXED else sems[0], scope)
    return None


def ptx_sequence(ptx: str) -> list[Step]:
    """The ordering operations and barriers of a PTX kernel, in text order."""
    instrs, _ = parse(ptx)
    steps = []
    for i in instrs:
        head = i.op.split(".")[0]
        if i.op.startswith(("bar.sync", "barrier.sync", "bar.red", "barrier.red")):
            steps.append(Step("barrier", "", "cta", i.op, i.line))
        elif head in ("fence", "membar") and not i.op.startswith("fence.proxy"):  # (a proxy fence: shared memory)
            steps.append(Step("fence", ACQ_REL, SYS if ".sys" in i.op else GPU, i.op, i.line))
        elif head in ("atom", "red", "ld", "st") and ".global" in i.op or head in ("atom", "red"):
            got = ordering(i.op)
            if got is None:
                continue
            kind = {"atom": "rmw", "red": "rmw", "ld": "load", "st": "store"}[head]
            steps.append(Step(kind, got[0], got[1], i.op, i.line))
    return steps


def plain_global_stores_after(ptx: str, line: int) -> list[str]:
    """The plain global stores that come after PTX line `line` (a data store after the flag's release)."""
    instrs, _ = parse(ptx)
    return [i.op for i in instrs if i.line > line and i.op.startswith("st.global") and ordering(i.op) is None]


_CPP = [
    (re.compile(r"__atomic_store_n\([^;]*__ATOMIC_(\w+)\)"), "store"),
    (re.compile(r"__atomic_load_n\([^;]*__ATOMIC_(\w+)\)"), "load"),
    (re.compile(r"__atomic_fetch_add\([^;]*__ATOMIC_(\w+)\)"), "rmw"),
    (re.compile(r"__atomic_compare_exchange_n\([^;]*?__ATOMIC_(\w+)"), "rmw"),
]
_CPP_ORDER = {"RELAXED": UNORDERED, "ACQUIRE": ACQUIRE, "RELEASE": RELEASE, "ACQ_REL": ACQ_REL, "SEQ_CST": ACQ_REL}
_WRAPPERS = {  # the project's own primitives, as their definitions order (checked by the tests too)
    "flag_store_release": Step("store", RELEASE, SYS, "flag_store_release"),
    "flag_load_acquire": Step("load", ACQUIRE, SYS, "flag_load_acquire"),
    "atomic_add_acq_rel_sys": Step("rmw", ACQ_REL, SYS, "atomic_add_acq_rel_sys"),
    "__threadfence_system": Step("fence", ACQ_REL, SYS, "__threadfence_system"),
    "__syncthreads": Step("barrier", "", "cta", "__syncthreads"),
}


def function_body(source: str, signature: str) -> str:
    """The text of the C++ function whose definition contains `signature`, up to its closing brace."""
    at = source.index(signature)
    start = source.index("{", at)
    depth = 0
    for i in range(start, len(source)):
        depth += {"{": 1, "}": -1}.get(source[i], 0)
        if depth == 0:
            return source[start : i + 1]
    raise ValueError(f"{signature}: no closing brace")


def cpp_sequence(body: str, plain_words: tuple[str, ...] = ()) -> list[Step]:
    """The ordering operations of a C++/CUDA function body in source order, and plain stores to `plain_words`
    (``counters[block] = 0`` -> an unordered store)."""
    found: list[tuple[int, Step]] = []
    for pattern, kind in _CPP:
        for m in pattern.finditer(body):
            found.append((m.start(), Step(kind, _CPP_ORDER[m.group(1)], SYS, m.group(0))))
    for m in re.finditer(r'asm volatile\("(ld|st)\.(acquire|release|relaxed)\.(sys|gpu)', body):
        found.append((m.start(), Step("load" if m.group(1) == "ld" else "store", _SEMS[m.group(2)],
                                      _SCOPES[m.group(3)], m.group(0))))
    for name, step in _WRAPPERS.items():
        for m in re.finditer(rf"\b{name}\s*\(", body):
            found.append((m.start(), step))
    for word in plain_words:
        for m in re.finditer(rf"\b{re.escape(word)}\[[^\]]*\]\s*=[^=]", body):
            found.append((m.start(), Step("store", UNORDERED, GPU, m.group(0).strip())))
    return [step for _, step in sorted(found, key=lambda x: x[0])]
