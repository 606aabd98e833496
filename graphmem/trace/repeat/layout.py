"""Repeated blocks, the cut recording taken apart (graphmem.trace.repeat.place places it).

Input: the ``Trace`` of a model whose stack was cut to KEEP blocks, and where the stack is.
Output: a ``Layout``: each op's block (or none, or "shared" for the optimizer's multi-tensor
ops), each block's runs of consecutive ops, each storage's owning block and its id within the
block, by which the same storage is found in another block.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field
from typing import Any

from graphmem.records import Phase, Trace

__all__ = ["KEEP", "Layout", "Stacked", "Unrepeatable", "layout"]

KEEP = 4  # blocks recorded: the first, two between (the template and its check), the last
_SHARED = ("aten._foreach_", "aten._fused_")


class Unrepeatable(Exception):
    """The cut recording does not repeat by offset; record the whole model."""


@dataclass(frozen=True, slots=True)
class Layout:
    """The cut trace taken apart: per op ``kind`` (None outside the stack, "shared", or
    (block, run, position)); per block its ``runs`` (start, stop) of consecutive ops; per
    run whether its blocks run in ``ascending`` order; each block storage's ``owner``
    (block, id within the block) and per block ``local`` id -> sid."""

    where: Stacked
    kind: tuple[Any, ...]
    runs: tuple[tuple[tuple[int, int], ...], ...]
    ascending: tuple[bool, ...]
    owner: dict[int, tuple[int, Hashable]]
    local: tuple[dict[Hashable, int], ...]
    ends: frozenset[int]  # the last op of each phase of each iteration


@dataclass(frozen=True, slots=True)
class Stacked:
    """Where the blocks are: the stack's module path, and how many of its children make one
    block (2 when every second child differs, as with checkpointing every second one).
    ``program``: the trace is a whole program's (graphmem run), see ``layout``."""

    prefix: str
    period: int = 1
    program: bool = False
    # graphmem run: storage -> block for the blocks' tensors the program holds now, -1 for the
    # model's other ones (a recording that stops before they are named: the parameters before
    # the first forward)
    named: Mapping[int, int] = field(default_factory=dict, compare=False)

    def index(self, path: str) -> int | None:
        """The child of the stack a module path (or tensor name) lies in: 2 for ``prefix.2.mlp``."""
        return _index(self.prefix, path)

    def block_of(self, path: str) -> int | None:
        index = self.index(path)
        return None if index is None else index // self.period

    def renamed(self, path: str, source: int, target: int) -> str:
        """``path`` in block ``source`` renamed into block ``target``."""
        index = self.index(path)
        assert index is not None and index // self.period == source, "renamed: a path outside the block"
        head = f"{self.prefix}.{index}" if self.prefix else str(index)
        moved = str(target * self.period + index % self.period)
        return (f"{self.prefix}.{moved}" if self.prefix else moved) + path[len(head):]


@functools.lru_cache(maxsize=65536)  # the same few hundred paths, once per placed block
def _index(prefix: str, path: str) -> int | None:
    if prefix and not path.startswith(prefix + "."):
        return None
    head = (path[len(prefix) + 1:] if prefix else path).split(".", 1)[0]
    return int(head) if head.isdigit() else None


def _kinds(trace: Trace, where: Stacked) -> list[Any]:
    """Each op's block by its module (None outside the stack), "shared" for multi-tensor
    optimizer ops.  Ops outside the stack between two ops of one block, in one phase, are that
    block's, and between two blocks the next one's: LayerDrop's draw before each block, FSDP2's
    gradient detaches in a hook autograd runs for no module, Mamba's activation module that is
    not in the model's tree."""
    kinds: list[Any] = []
    for op in trace.ops:
        if op.phase == Phase.OPTIMIZER and op.op.startswith(_SHARED):
            kinds.append("shared")
        else:
            kinds.append(where.block_of(op.module))
    return _fill(kinds, trace)


def _fill(kinds: list[Any], trace: Trace) -> list[Any]:
    """Ops outside the stack between two ops of one block, in one phase, are that block's,
    and between two blocks the next one's (see ``_kinds``)."""
    kinds = list(kinds)
    i = 0
    while i < len(kinds):
        stop = i
        while stop < len(kinds) and kinds[stop] is None:
            stop += 1
        if stop > i and 0 < i and stop < len(kinds) and isinstance(kinds[i - 1], int) and \
                isinstance(kinds[stop], int) and min(kinds[i - 1], kinds[stop]) >= 0 and \
                abs(kinds[i - 1] - kinds[stop]) <= 1 and \
                len({(o.phase, o.iteration) for o in trace.ops[i - 1:stop + 1]}) == 1:
            kinds[i:stop] = [kinds[stop]] * (stop - i)
        i = stop + 1 if stop > i else i + 1
    return kinds


def _runs(kinds: list[Any], phases: list[tuple[Phase, int]]) -> tuple[list[Any], tuple[tuple[tuple[int, int], ...],
                                                                                       ...], tuple[bool, ...]]:
    """Each block op's (block, run, position), each block's runs (of consecutive ops of one
    phase and iteration), each run's order."""
    runs: list[list[tuple[int, int]]] = [[] for _ in range(KEEP)]
    placed = list(kinds)
    i = 0
    while i < len(kinds):
        b = kinds[i]
        if not isinstance(b, int):
            i += 1
            continue
        if not 0 <= b < KEEP:
            raise Unrepeatable(f"an op in block {b} of a stack cut to {KEEP}")
        stop = i
        while stop < len(kinds) and kinds[stop] == b and phases[stop] == phases[i]:
            placed[stop] = (b, len(runs[b]), stop - i)
            stop += 1
        runs[b].append((i, stop))
        i = stop
    if not runs[1]:
        raise Unrepeatable("no op ran in the blocks")
    count = len(runs[0])  # the first and last block may differ from the others (no gradient for the
    # first block's input when the embeddings are frozen), not the two between
    if any(len(r) != count for r in runs) or any(
            runs[1][r][1] - runs[1][r][0] != runs[2][r][1] - runs[2][r][0] for r in range(count)):
        raise Unrepeatable("the blocks' runs of ops differ")
    ascending = []
    for r in range(count):
        if runs[2][r][0] == runs[1][r][1]:
            ascending.append(True)
        elif runs[1][r][0] == runs[2][r][1]:
            ascending.append(False)
        else:
            raise Unrepeatable("ops outside the stack between two of its blocks")
    return placed, tuple(tuple(r) for r in runs), tuple(ascending)


def _owners(trace: Trace, where: Stacked, kind: list[Any]) -> dict[int, tuple[int, Hashable]]:
    """Block storage -> (block, id within the block): the tensors named after the block's
    parameters, what a block op made (by its place in the op), and what a shared op made for
    a block's tensor."""
    owner: dict[int, tuple[int, Hashable]] = {}
    marked: dict[tuple[int, int], int] = defaultdict(int)
    named: dict[tuple[int, str], int] = defaultdict(int)
    for s in trace.storages:
        if s.label or s.created < 0:  # a tensor named after a parameter is its block's, whoever made it
            b = where.block_of(s.label)
            if b is not None:
                name = where.renamed(s.label, b, 0)
                owner[s.sid] = (b, ("n", name, named[(b, name)]))
                named[(b, name)] += 1
            continue
        op, k = trace.ops[s.created], kind[s.created]
        if k == "shared":
            if s.sid in op.outputs:
                pos = op.outputs.index(s.sid)
                # graphmem run: the tensor it comes from, counted per tensor (op.listed)
                sources = op.listed if where.program and op.listed else op.inputs
                source = sources[pos] if pos < len(sources) else -1
                if source in owner:
                    b, lo = owner[source]
                    if where.program:  # several outputs from one storage: told apart by their place
                        owner[s.sid] = (b, ("s", s.created, lo, sources[:pos].count(source)))
                    else:
                        owner[s.sid] = (b, ("s", s.created, lo))
        elif k is not None:
            b, r, p = k
            if s.sid in op.outputs:
                owner[s.sid] = (b, ("o", r, p, op.outputs.index(s.sid)))
            elif s.sid in op.inputs:
                owner[s.sid] = (b, ("i", r, p, op.inputs.index(s.sid)))
            else:  # given a role between two ops
                owner[s.sid] = (b, ("m", r, p, marked[(b, s.created)]))
                marked[(b, s.created)] += 1
    return owner


def _by_storages(trace: Trace, kinds: list[Any], owner: dict[int, tuple[int, Hashable]],
                 program: bool = False) -> list[Any]:
    """An optimizer op that reads one block's tensors alone (or, reading none, makes them) is
    that block's (one that reads tensors outside the stack alone is outside it), whatever it is
    named after (an op on a tensor with no parameter yet, such as a new step counter, is
    named after the op before it: the previous parameter's).  ``program``: so is an op that
    runs in no module (the program's code), in any phase."""
    kinds = list(kinds)
    for i, op in enumerate(trace.ops):
        outside = op.phase == Phase.OPTIMIZER or (program and not op.module and not isinstance(kinds[i], int))
        if kinds[i] != "shared" and outside and (op.inputs or op.outputs):
            blocks = {owner[sid][0] if sid in owner else None for sid in op.inputs or op.outputs}
            if len(blocks) == 1:
                kinds[i] = blocks.pop()
    return kinds


# ops that gather a list of tensors into one (torch.stack of each parameter's gradient norm in
# clip_grad_norm_): with one list entry per block tensor, their output grows with the stack
LISTED = frozenset({"aten.stack.default", "aten.cat.default"})


_OUT = -1  # graphmem run: a storage named after a tensor outside the stack, or an op firmly outside


def _named(trace: Trace, where: Stacked) -> dict[int, int]:
    """Storage -> block: those named after a block's tensors, and ``where.named``'s; those
    named after the model's other tensors -> _OUT (the embedding, the output layer)."""
    named = dict(where.named)
    for s in trace.storages:
        if s.label:
            b = where.block_of(s.label)
            named.setdefault(s.sid, _OUT if b is None else b)
    return named


def _by_named(trace: Trace, where: Stacked, kinds: list[Any]) -> list[Any]:
    """graphmem run: an op that runs in no module (the program's own code: building,
    initialising and sharding the model; FSDP2's hooks at the edges of a forward) is the block
    whose tensors it reads or makes, the tensors named after a block's parameters and buffers
    (an op reading several blocks' is none of them); a multi-tensor op (``_foreach_*``,
    ``_fused_*``) or a gather of a list (``LISTED``) that reads several blocks' is "shared", in
    any phase (clip_grad_norm_'s, between the backward and the optimizer)."""
    named = _named(trace, where)
    kinds = list(kinds)
    for i, op in enumerate(trace.ops):
        if kinds[i] is not None or op.module:
            continue
        blocks = {named[sid] for sid in (*op.inputs, *op.outputs) if sid in named}
        inside = blocks - {_OUT}
        if len(inside) == 1:
            kinds[i] = inside.pop()
        elif len(inside) > 1 and (op.op.startswith(_SHARED) or op.op in LISTED):
            kinds[i] = "shared"
        elif blocks == {_OUT} and op.phase == Phase.PROGRAM:
            kinds[i] = _OUT  # the program's code on the model's other tensors: no block's, even between two
    return kinds


def _by_dataflow(trace: Trace, where: Stacked, kinds: list[Any]) -> list[Any]:
    """graphmem run: the ops of the program's own code that still are no block's, taken
    together with the tensors they pass each other (the model's parameters sharded on the
    meta device before ``to_empty`` gave them storage, so named after nothing yet), are the
    block whose named tensors or whose ops of the program's code they meet, when that is one
    block."""
    named = _named(trace, where)
    parent: dict[Any, Any] = {}

    def find(x: Any) -> Any:
        while parent.get(x, x) != x:
            parent[x] = parent.get(parent[x], parent[x])
            x = parent[x]
        return x

    loose = [i for i, op in enumerate(trace.ops) if kinds[i] is None and not op.module]
    touched: set[int] = set()
    for i in loose:
        for sid in (*trace.ops[i].inputs, *trace.ops[i].outputs):
            touched.add(sid)
            a, b = find(("op", i)), find(("s", sid))
            if a != b:
                parent[a] = b
    meets: dict[Any, set[int]] = {}
    for i, op in enumerate(trace.ops):
        k = kinds[i]
        # only the program's own code meets them (a forward or backward op of a block also
        # reads the next FSDP group's parameters, prefetched)
        if isinstance(k, int) and op.phase == Phase.PROGRAM:
            for sid in (*op.inputs, *op.outputs):
                if sid in touched:
                    meets.setdefault(find(("s", sid)), set()).add(k)
    for sid, b in named.items():
        meets.setdefault(find(("s", sid)), set()).add(b)
    kinds = list(kinds)
    for i in loose:
        blocks = meets.get(find(("op", i)), set())
        if len(blocks) == 1:  # one block, or only the model's other tensors (_OUT)
            kinds[i] = next(iter(blocks))
    return kinds


def _listed_by_owner(trace: Trace, kinds: list[Any], owner: dict[int, tuple[int, Hashable]]) -> list[Any]:
    """graphmem run: a multi-tensor op or a gather of a list outside the stack that reads the
    tensors of several blocks (per-parameter norms a multi-tensor op made) is "shared"."""
    kinds = list(kinds)
    for i, op in enumerate(trace.ops):
        if kinds[i] is None and not op.module and (op.op.startswith(_SHARED) or op.op in LISTED) \
                and len({owner[sid][0] for sid in op.inputs if sid in owner}) > 1:
            kinds[i] = "shared"
    return kinds


def layout(trace: Trace, where: Stacked) -> Layout:
    kinds, phases = _kinds(trace, where), [(op.phase, op.iteration) for op in trace.ops]
    if where.program:  # what is firmly outside stays so (no filling across it), then is outside
        kinds = [None if k == _OUT else k for k in _fill(_by_dataflow(trace, where, _by_named(trace, where, kinds)),
                                                          trace)]
    for _ in range(4):  # what an op made is its block's; an optimizer op is the block of what it reads
        placed, runs, ascending = _runs(kinds, phases)
        owner = _owners(trace, where, placed)
        kinds, before = _by_storages(trace, kinds, owner, where.program), kinds
        if where.program:
            kinds = _listed_by_owner(trace, kinds, owner)
        if kinds == before:
            break
    else:
        raise Unrepeatable("the optimizer's ops do not settle into blocks")
    local: tuple[dict[Hashable, int], ...] = tuple({} for _ in range(KEEP))
    for sid, (b, lo) in owner.items():
        if lo in local[b]:
            raise Unrepeatable("two storages of a block in the same place")
        local[b][lo] = sid
    ends = frozenset(i for i in range(len(phases)) if i + 1 == len(phases) or phases[i + 1] != phases[i])
    return Layout(where=where, kind=tuple(placed), runs=runs, ascending=ascending, owner=owner, local=local,
                   ends=ends)
