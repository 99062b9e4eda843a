"""Which branches of a PTX kernel can take different warps past different barriers.

Every warp of a CTA must reach each CTA barrier (``bar.sync``, ``bar.red``, ...) equally often: a warp that
leaves a loop holding barriers early, or branches around one, leaves the others waiting at it for ever, or
reuses shared memory they still read. So a conditional branch with a barrier between it and the point where
its two paths meet again needs a predicate with the same value in every thread. `divergent_barriers` finds
the branches whose predicate may differ between threads (a loop's exit among them), by a flow-insensitive
taint analysis of the registers:

* per-thread sources: the special registers that differ between threads or reads (``%tid``, ``%laneid``,
  ``%warpid``, ``%globaltimer``, ``%clock``, ...), loads that may see a concurrent write (``.volatile``,
  ``.acquire``, ``.relaxed``, ``.mmio``) and atomics (each thread gets its own old value);
* everything computed from a per-thread value is per-thread, and so is a value defined under a per-thread
  guard (``@%p mov ...``); a weak load from a uniform address is uniform (reading a word that another
  thread writes meanwhile would be a data race: a weak load only reads data nobody writes concurrently);
* a barrier reduction (``bar.red``) gives every thread the same value, whatever its inputs.

The paths between a branch and its merge point come from the control-flow graph of the basic blocks and its
post-dominators. It reads the text only (no GPU, no CUDA tools): used by tests/gpu/cpu/test_kernels_aot.py on
Triton's PTX and by tests/gpu/cpu/test_wait_uniform.py on nvcc's. A value that differs between threads only through
control dependence (set on one side of a per-thread branch) is not modelled.
"""

from __future__ import annotations

import dataclasses
import re

# Special registers whose value differs between the threads of a CTA, or between two reads.
PER_THREAD_SPECIALS = ("%tid", "%laneid", "%warpid", "%globaltimer", "%clock", "%lanemask", "%smid", "%nwarpid")
BARRIERS = ("bar.sync", "bar.red", "bar.arrive", "barrier.sync", "barrier.red", "barrier.arrive", "bar.cta",
            "barrier.cta")
# Instructions without a register destination (their first operand is an address, a label or nothing).
NO_DEST = ("st", "red", "bra", "ret", "exit", "bar", "barrier", "cp", "fence", "membar", "prefetch", "trap",
           "wgmma.fence", "wgmma.commit_group", "wgmma.wait_group", "griddepcontrol", "nanosleep", "call",
           "stmatrix", "tensormap", "elect")
UNORDERED_LOADS = ("volatile", "acquire", "relaxed", "mmio")
_REG = re.compile(r"(?<![\w.$%])(%[A-Za-z_]\w*(?:\.[xyz])?|\$?[A-Za-z_][\w$]*)")
_LABEL = re.compile(r"^\s*(\$?[A-Za-z_][\w$]*):")


@dataclasses.dataclass
class Instr:
    line: int  # 1-based line in the PTX text
    guard: str | None  # predicate register of an ``@%p`` / ``@!%p`` guard
    op: str  # opcode with its qualifiers (``ld.global.sys.acquire.b32``)
    dests: list[str]
    srcs: list[str]
    text: str


@dataclasses.dataclass
class Divergence:
    """A conditional branch with a barrier before its paths meet, whose predicate may differ between threads."""

    line: int
    branch: str
    predicate: str
    sources: list[str]  # the per-thread sources it depends on (``%globaltimer``, ``ld.volatile.global``, ...)


def _split_operands(text: str) -> list[str]:
    out, depth, cur = [], 0, ""
    for ch in text:
        if ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    if cur.strip():
        out.append(cur.strip())
    return out


def _names(text: str) -> list[str]:
    """Register (and symbol) names in an operand; numbers and PTX keywords are never registers."""
    return [m for m in _REG.findall(text) if not re.fullmatch(r"0[xX][0-9a-fA-F]+|\d\w*", m)]


def _statements(ptx: str):
    """(line, statement) for every label and instruction, in order: comments, directives without a
    semicolon (``.loc``, ``.file``) and the braces of inline-assembly scopes removed."""
    chunks: list[tuple[int, str]] = []
    for number, raw in enumerate(ptx.splitlines(), 1):
        text = raw.split("//", 1)[0].strip()
        if text.startswith(".") and not text.endswith(";"):
            continue
        chunks.append((number, text))
    pending, start = "", 0
    for number, text in chunks:
        while text:
            if not pending.strip():
                start = number
            stmt, sep, text = text.partition(";")
            pending += " " + stmt
            if not sep:
                break
            yield from _labels_then(start, pending)
            pending = ""
    if pending.strip():
        yield from _labels_then(start, pending)


def _labels_then(line: int, stmt: str):
    stmt = stmt.strip().lstrip("{}() \t")
    while True:
        label = _LABEL.match(stmt)
        if not label:
            break
        yield line, label.group(1) + ":"
        stmt = stmt[label.end():].strip().lstrip("{}() \t")
    stmt = stmt.strip().rstrip("} \t")
    if stmt and not stmt.startswith("."):
        yield line, stmt


def parse(ptx: str) -> tuple[list[Instr], dict[str, int]]:
    """The instructions of the PTX (every function, in order) and the index of each label."""
    instrs: list[Instr] = []
    labels: dict[str, int] = {}
    for number, stmt in _statements(ptx):
        if stmt.endswith(":"):
            labels[stmt[:-1]] = len(instrs)
            continue
        guard = None
        if stmt.startswith("@"):
            g, _, stmt = stmt.partition(" ")
            guard = g.lstrip("@!")
            stmt = stmt.strip()
        op, _, rest = stmt.partition(" ")
        if not op or not re.match(r"[a-z]", op):
            continue
        operands = _split_operands(rest.strip())
        base = op.split(".")[0]
        if base in NO_DEST or op.startswith(NO_DEST) or not operands:
            dests, srcs = [], operands
        else:
            dests, srcs = [operands[0]], operands[1:]
        if op.startswith("wgmma.mma_async") or op.startswith("mma"):
            srcs = operands  # the accumulator is read too
        instrs.append(Instr(number, guard, op, [n for d in dests for n in _names(d)],
                            [n for s in srcs for n in _names(s)], stmt))
    return instrs, labels


def _source_kind(ins: Instr) -> str | None:
    """The per-thread source this instruction is, if it is one."""
    parts = ins.op.split(".")
    if parts[0] in ("ld", "ldu") and any(q in parts for q in UNORDERED_LOADS):
        return ".".join(p for p in parts if not re.fullmatch(r"[bsuf]\d+|v\d", p))
    if parts[0] in ("atom", "atomicrmw"):
        return "atom." + ".".join(p for p in parts[1:] if p in ("global", "shared", "sys", "gpu", "cta"))
    for special in PER_THREAD_SPECIALS:
        if any(s.startswith(special) for s in ins.srcs):
            return special
    return None


def taint(instrs: list[Instr]) -> dict[str, frozenset[str]]:
    """Per-thread sources reaching each register (registers absent: uniform)."""
    tainted: dict[str, frozenset[str]] = {}
    changed = True
    while changed:
        changed = False
        for ins in instrs:
            if not ins.dests or ins.op.startswith(("bar.red", "barrier.red", "barrier.cta.red")):
                continue
            kinds: set[str] = set()
            kind = _source_kind(ins)
            if kind:
                kinds.add(kind)
            for reg in ins.srcs + ([ins.guard] if ins.guard else []):
                kinds |= tainted.get(reg, frozenset())
            if not kinds:
                continue
            for d in ins.dests:
                merged = tainted.get(d, frozenset()) | kinds
                if merged != tainted.get(d):
                    tainted[d] = frozenset(merged)
                    changed = True
    return tainted


def _blocks(instrs: list[Instr], labels: dict[str, int]) -> tuple[list[range], dict[int, list[int]]]:
    """Basic blocks (instruction index ranges) and their successors."""
    starts = sorted({0, *labels.values()} | {i + 1 for i, ins in enumerate(instrs)
                                               if ins.op.split(".")[0] in ("bra", "ret", "exit")})
    starts = [s for s in starts if s < len(instrs)]
    blocks = [range(s, e) for s, e in zip(starts, [*starts[1:], len(instrs)], strict=True)]
    block_of = {s: b for b, s in enumerate(starts)}
    succ: dict[int, list[int]] = {}
    for b, r in enumerate(blocks):
        last = instrs[r[-1]] if len(r) else None
        out = []
        base = last.op.split(".")[0] if last else ""
        if base == "bra":
            target = last.srcs[0] if last.srcs else None
            if target in labels and labels[target] in block_of:
                out.append(block_of[labels[target]])
        if (base not in ("bra", "ret", "exit") or last.guard) and b + 1 < len(blocks):
            out.append(b + 1)
        succ[b] = out
    return blocks, succ


def _post_dominators(n: int, succ: dict[int, list[int]]) -> list[int]:
    """Post-dominator sets (bitmasks) of the blocks; block ``n`` is a virtual exit after every block without
    a successor. A block that never reaches the exit keeps every block in its set."""
    everything = (1 << (n + 1)) - 1
    pdom = [everything] * n + [1 << n]
    changed = True
    while changed:
        changed = False
        for b in reversed(range(n)):
            meet = everything
            for s in succ[b] or [n]:
                meet &= pdom[s]
            new = meet | (1 << b)
            if new != pdom[b]:
                pdom[b], changed = new, True
    return pdom


def _immediate_post_dominator(b: int, pdom: list[int]) -> int | None:
    """The strict post-dominator of `b` that every other one post-dominates (None: `b` never reaches the exit)."""
    strict = [d for d in range(len(pdom)) if pdom[b] >> d & 1 and d != b]
    for d in strict:
        if all(pdom[d] >> e & 1 for e in strict):
            return d
    return None


def divergent_barriers(ptx: str) -> list[Divergence]:
    """Conditional branches (and returns) whose predicate may differ between the threads of a CTA while a
    barrier lies between the branch and the point where both of its paths meet again: some warps would reach
    that barrier and others not (or a different number of times, for a loop's exit). Empty for a kernel
    whose barriers every warp reaches equally often."""
    instrs, labels = parse(ptx)
    tainted = taint(instrs)
    blocks, succ = _blocks(instrs, labels)
    pdom = _post_dominators(len(blocks), succ)
    has_barrier = [any(instrs[i].op.startswith(BARRIERS) for i in r) for r in blocks]
    found = []
    for b, r in enumerate(blocks):
        if not len(r):
            continue
        ins = instrs[r[-1]]
        if not (ins.guard and ins.op.split(".")[0] in ("bra", "ret", "exit") and ins.guard in tainted):
            continue
        merge = _immediate_post_dominator(b, pdom)
        seen, todo, barrier = {b}, list(succ[b]), False
        while todo and not barrier:
            x = todo.pop()
            if x in seen or x == merge or x >= len(blocks):
                continue
            seen.add(x)
            barrier = has_barrier[x]
            todo.extend(succ[x])
        if barrier:
            found.append(Divergence(ins.line, ins.text, ins.guard, sorted(tainted[ins.guard])))
    return found
