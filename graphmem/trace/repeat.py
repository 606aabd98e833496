"""Repeated blocks recorded once: a step of a model with a stack of alike blocks, from a
recording of the model cut to its first four blocks.

Input: the ``Trace`` of the cut model (blocks 0-3 of the stack at ``prefix``) and the
stack's real length L.  Output: the ``Trace`` the whole model records, op for op and storage
for storage: blocks 0 and 3 stand for the first and the last block, and block 1 is the
template of every block between them.  Each op of a block, and each storage a block owns,
is placed for the other blocks by offset: a block-1 op that reads block 0's output reads the
previous block's, one that reads a gradient block 2 made reads the next block's.  The
optimizer's multi-tensor ops (``_foreach_*``, ``_fused_*``) take every block's tensors in
order; their lists grow by the copies.

The recording checks itself: the cut trace, rebuilt from blocks 0, 1 and 3 alone (block 2 a
copy of block 1), must equal the cut trace as recorded; anything else (a block that differs
from the one before it, an op outside the blocks that reads a block between the first and
the last, a block that reads two blocks away) raises ``Unrepeatable`` and the caller records
the whole model.  Knows nothing of reports or the command line.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

from graphmem.trace.records import OpRecord, Phase, StorageRecord, SymbolicSizes, Trace
from graphmem.trace.repeat_graph import placed_graph

__all__ = ["KEEP", "Stacked", "Unrepeatable", "placed_calls", "repeat_blocks", "same_trace"]

KEEP = 4  # blocks recorded: the first, two between (the template and its check), the last
_SHARED = ("aten._foreach_", "aten._fused_")
Key = tuple[int, Hashable]  # a storage of the whole trace: (block, its id within the block) or (-1, sid)


class Unrepeatable(Exception):
    """The cut recording does not repeat by offset; record the whole model."""


@dataclass(frozen=True, slots=True)
class _Layout:
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
    block (2 when every second child differs, as with checkpointing every second one)."""

    prefix: str
    period: int = 1

    def index(self, path: str) -> int | None:
        """The child of the stack a module path (or tensor name) lies in: 2 for ``prefix.2.mlp``."""
        if self.prefix and not path.startswith(self.prefix + "."):
            return None
        head = (path[len(self.prefix) + 1:] if self.prefix else path).split(".", 1)[0]
        return int(head) if head.isdigit() else None

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
    i = 0
    while i < len(kinds):
        stop = i
        while stop < len(kinds) and kinds[stop] is None:
            stop += 1
        if stop > i and 0 < i and stop < len(kinds) and isinstance(kinds[i - 1], int) and \
                isinstance(kinds[stop], int) and abs(kinds[i - 1] - kinds[stop]) <= 1 and \
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
                source = op.inputs[pos] if pos < len(op.inputs) else -1
                if source in owner:
                    b, lo = owner[source]
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


def _by_storages(trace: Trace, kinds: list[Any], owner: dict[int, tuple[int, Hashable]]) -> list[Any]:
    """An optimizer op that reads one block's tensors alone (or, reading none, makes them) is
    that block's (one that reads tensors outside the stack alone is outside it), whatever it is
    named after (an op on a tensor with no parameter yet, such as a new step counter, is
    named after the op before it: the previous parameter's)."""
    kinds = list(kinds)
    for i, op in enumerate(trace.ops):
        if kinds[i] != "shared" and op.phase == Phase.OPTIMIZER and (op.inputs or op.outputs):
            blocks = {owner[sid][0] if sid in owner else None for sid in op.inputs or op.outputs}
            if len(blocks) == 1:
                kinds[i] = blocks.pop()
    return kinds


def _layout(trace: Trace, where: Stacked) -> _Layout:
    kinds, phases = _kinds(trace, where), [(op.phase, op.iteration) for op in trace.ops]
    for _ in range(4):  # what an op made is its block's; an optimizer op is the block of what it reads
        placed, runs, ascending = _runs(kinds, phases)
        owner = _owners(trace, where, placed)
        kinds, before = _by_storages(trace, kinds, owner), kinds
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
    return _Layout(where=where, kind=tuple(placed), runs=runs, ascending=ascending, owner=owner, local=local,
                   ends=ends)


class _Placer:
    """Places the cut trace's blocks for a stack of ``length`` blocks (see the module docstring)."""

    def __init__(self, layout: _Layout, length: int, trace: Trace) -> None:
        if length < KEEP:
            raise Unrepeatable(f"a stack of {length} blocks is shorter than the {KEEP} recorded")
        self._trace_ops = trace.ops
        self._made = {s.sid: (s.created if s.created >= 0 else None) for s in trace.storages}
        self._freed = {s.sid: s.released for s in trace.storages}
        self.layout, self.length = layout, length
        self.order = self._order()
        self.index = {at: n for n, at in enumerate(self.order)}
        # the first and last block may differ from the others: block 0's storages and ops as
        # block 1's (what block 2 reads where block 1 reads block 0's), block 2's as block 3's
        self.same: dict[tuple[int, int], dict[Hashable, Hashable]] = {(0, 1): {}, (2, KEEP - 1): {}}
        self.same_op: dict[tuple[int, int], dict[tuple[int, int], tuple[int, int]]] = {(0, 1): {}, (2, KEEP - 1): {}}
        self._match_ends()

    def block(self, i: int) -> int:
        """The recorded block cut op ``i`` is in (-1: outside the stack)."""
        k = self.layout.kind[i]
        return int(k[0]) if isinstance(k, tuple) else -1

    def shared(self, i: int) -> bool:
        return bool(self.layout.kind[i] == "shared")

    def owner_block(self, sid: int) -> int:
        owned = self.layout.owner.get(sid)
        return owned[0] if owned else -1

    def _match_ends(self) -> None:
        """Fill ``same`` and ``same_op`` from block 1's and block 2's ops, side by side."""
        lay, ops = self.layout, self._trace_ops
        for (start1, stop1), (start2, _) in zip(lay.runs[1], lay.runs[2], strict=True):
            for i, j in zip(range(start1, stop1), range(start2, start2 + stop1 - start1), strict=True):
                if len(ops[i].inputs) != len(ops[j].inputs) or len(ops[i].outputs) != len(ops[j].outputs):
                    raise Unrepeatable("block 1 and block 2 run different ops")
                for a, b in zip((*ops[i].inputs, *ops[i].outputs), (*ops[j].inputs, *ops[j].outputs), strict=True):
                    self._match(a, b)
        for lo, sid in lay.local[1].items():  # where block 1's storages are made and freed
            other = lay.local[2].get(lo)
            if other is not None:
                for c1, c2 in ((self._made[sid], self._made[other]), (self._freed[sid], self._freed[other])):
                    self._match_op(c1, c2)

    def _match(self, a: int, b: int) -> None:
        oa, ob = self.layout.owner.get(a), self.layout.owner.get(b)
        if oa is None or ob is None or (oa[0], ob[0]) not in self.same:
            return
        if self.same[(oa[0], ob[0])].setdefault(oa[1], ob[1]) != ob[1]:
            raise Unrepeatable("a storage of the first or last block stands for two")
        self._match_op(self._made[a], self._made[b])

    def _match_op(self, c1: int | None, c2: int | None) -> None:
        if c1 is None or c2 is None:
            return
        k1, k2 = self.layout.kind[c1], self.layout.kind[c2]
        if isinstance(k1, tuple) and isinstance(k2, tuple) and (k1[0], k2[0]) in self.same_op:
            if self.same_op[(k1[0], k2[0])].setdefault(k1[1:], k2[1:]) != k2[1:]:
                raise Unrepeatable("an op of the first or last block stands for two")

    def _as_in(self, b: int, source: int, position: Any, table: str) -> Any:
        """Block ``b``'s storage id (or op position) as the recorded block ``source`` has it."""
        if b == source or {b, source} <= {1, 2}:
            return position
        found = getattr(self, table).get((b, source), {}).get(position)
        if found is None:
            raise Unrepeatable("a block's storage or op has no counterpart in another block")
        return found

    def source(self, t: int) -> int:
        """The recorded block that block ``t`` of the whole stack is placed from."""
        return 0 if t == 0 else KEEP - 1 if t == self.length - 1 else 1

    def _order(self) -> list[tuple[int, int]]:
        """(block of the whole stack or -1, op of the cut trace) in the whole trace's op order."""
        lay, last = self.layout, self.length - 1
        order: list[tuple[int, int]] = []
        for i, k in enumerate(lay.kind):
            if not isinstance(k, tuple):
                order.append((-1, i))
                continue
            b, r, p = k
            if p:
                continue  # a run is placed whole at its first op
            if b in (0, KEEP - 1):
                targets: Sequence[int] = [0 if b == 0 else last]
            elif (b == 1) == lay.ascending[r]:
                targets = range(1, last) if lay.ascending[r] else range(last - 1, 0, -1)
            else:
                continue
            for t in targets:
                start, stop = lay.runs[self.source(t)][r]
                order.extend((t, j) for j in range(start, stop))
        return order

    def target(self, t: int, b: int, s: int) -> int:
        """The block a reference from block ``t`` (placed from ``s``) to recorded block ``b`` means."""
        if abs(b - s) > 1:  # the first and the last block may name each other (the first optimizer
            # update is named after the op before it, the last block's)
            if {b, s} != {0, KEEP - 1}:
                raise Unrepeatable("a block reads a block two away")
            return 0 if b == 0 else self.length - 1
        target = t + b - s
        if not 0 <= target <= self.length - 1:
            raise Unrepeatable("a reference past the ends of the stack")
        return target

    def moved(self, path: str, t: int, s: int) -> str:
        """A module path or tensor name seen from block ``t`` placed from ``s``: a path in
        recorded block b is in the block ``target`` gives; other paths stay."""
        b = self.layout.where.block_of(path)
        return path if b is None else self.layout.where.renamed(path, b, self.target(t, b, s))

    def key(self, sid: int, t: int = -1, s: int = -1) -> Key:
        """The whole trace's storage for ``sid`` read by an op of block ``t`` placed from ``s``
        (-1: an op outside the stack)."""
        owned = self.layout.owner.get(sid)
        if owned is None:
            return (-1, sid)
        b, lo = owned
        if t < 0:
            if b not in (0, KEEP - 1):
                raise Unrepeatable("an op outside the stack reads a block between the first and the last")
            return (0 if b == 0 else self.length - 1, lo)
        target = self.target(t, b, s)
        lo = self._as_in(b, self.source(target), lo, "same")
        if lo not in self.layout.local[self.source(target)]:
            raise Unrepeatable("a block's storage has no counterpart in another block")
        return (target, lo)

    def expand(self, sids: Sequence[int]) -> list[Key]:
        """A shared op's (or the placeholders') storages: block 1's run of them followed by
        block 2's becomes the run of every block between the first and the last."""
        out: list[Key] = []
        groups: list[tuple[int, list[int]]] = []
        for sid in sids:
            b = self.layout.owner[sid][0] if sid in self.layout.owner else -1
            if groups and groups[-1][0] == b:
                groups[-1][1].append(sid)
            else:
                groups.append((b, [sid]))
        n = 0
        while n < len(groups):
            b, members = groups[n]
            if b in (1, 2):
                ids = [self.layout.owner[sid][1] for sid in members]
                after = groups[n + 1] if n + 1 < len(groups) else (-1, [])
                if b != 1 or after[0] != 2 or [self.layout.owner[sid][1] for sid in after[1]] != ids:
                    raise Unrepeatable("a multi-tensor op does not take the blocks in order")
                out.extend((t, lo) for t in range(1, self.length - 1) for lo in ids)
                n += 2
                continue
            out.extend(self.key(sid) for sid in members)
            n += 1
        return out

    def at(self, c: int, t: int, s: int) -> int:
        """The whole trace's op for an event at cut op ``c`` of a storage of block ``t``
        placed from ``s`` (-1, -1: a storage outside the stack)."""
        k = self.layout.kind[c]
        if not isinstance(k, tuple):
            return self.index[(-1, c)]
        b, r, p = k
        if t >= 0 and abs(b - s) > 1 and c in self.layout.ends and b in (0, KEEP - 1):
            t = s = -1  # freed when a phase ends (zero_grad after the last update): at the same end
        target = self.target(t, b, s) if t >= 0 else (0 if b == 0 else self.length - 1 if b == KEEP - 1 else -1)
        if target < 0:
            raise Unrepeatable("a storage outside the stack is made or freed in a block between the ends")
        r, p = self._as_in(b, self.source(target), (r, p), "same_op")
        start, stop = self.layout.runs[self.source(target)][r]
        if p >= stop - start:
            raise Unrepeatable("a block's op has no counterpart in the first or the last block")
        return self.index[(target, start + p)]


def _placed_op(placer: _Placer, trace: Trace, t: int, i: int) -> tuple[OpRecord, list[Key], list[Key]]:
    """Cut op ``i`` placed for block ``t`` (-1: outside the stack), its storages as keys."""
    op, lay = trace.ops[i], placer.layout
    if t >= 0:
        s = lay.kind[i][0]
        return (replace(op, module=placer.moved(op.module, t, s)),
                [placer.key(sid, t, s) for sid in op.inputs], [placer.key(sid, t, s) for sid in op.outputs])
    b = lay.where.block_of(op.module)  # an op outside may be named after the op before it
    if b in (1, 2):
        raise Unrepeatable("an op outside the blocks named after a block between the ends")
    op = replace(op, module=lay.where.renamed(op.module, b, placer.length - 1)) if b == KEEP - 1 else op
    if lay.kind[i] != "shared":
        return op, [placer.key(sid) for sid in op.inputs], [placer.key(sid) for sid in op.outputs]
    if op.scratch_bytes or op.flops:
        raise Unrepeatable("a multi-tensor op with scratch bytes or FLOPs (they grow with the stack)")
    return op, placer.expand(op.inputs), placer.expand(op.outputs)


def _storage_of(placer: _Placer, trace: Trace, key: Key) -> tuple[int, StorageRecord]:
    """(cut sid, the whole trace's record with its final sid still to set) for ``key``."""
    t, lo = key
    if t < 0:
        assert isinstance(lo, int)
        sid, s = lo, -1
    else:
        s = placer.source(t)
        sid = placer.layout.local[s][lo]
    rec = trace.storages[sid]
    created = -1 if rec.created < 0 else placer.at(rec.created, t, s)
    released = None if rec.released is None else placer.at(rec.released, t, s)
    label = rec.label if t < 0 else placer.moved(rec.label, t, s)
    return sid, replace(rec, created=created, released=released, label=label)


def _keys(placer: _Placer, trace: Trace) -> list[Key]:
    """Every storage of the whole trace: outside ones, the first and last block's, and the
    template's for each block between."""
    lay, last = placer.layout, placer.length - 1
    keys: list[Key] = [(-1, s.sid) for s in trace.storages if s.sid not in lay.owner]
    keys += [(0, lo) for lo in lay.local[0]] + [(last, lo) for lo in lay.local[KEEP - 1]]
    keys += [(t, lo) for t in range(1, last) for lo in lay.local[1]]
    return keys


def repeat_blocks(trace: Trace, prefix: str, length: int, *, period: int = 1, graph: bool = True) -> Trace:
    """The trace of the whole model with a stack of ``length`` children at ``prefix``, from
    ``trace``, its recording cut to KEEP blocks of ``period`` children each (see the module
    docstring).  ``graph``:
    False keeps the cut trace's fx graph (for the check, which compares no graph).

    Raises:
        Unrepeatable: the cut recording does not repeat by offset.
    """
    if length % period:
        raise Unrepeatable(f"a stack of {length} does not split into blocks of {period}")
    placer = _Placer(_layout(trace, Stacked(prefix, period)), length // period, trace)
    placed = [_placed_op(placer, trace, t, i) for t, i in placer.order]
    records = {key: _storage_of(placer, trace, key) for key in _keys(placer, trace)}
    first = placer.expand([s.sid for s in trace.storages if s.created < 0])

    def slot(key: Key) -> tuple[int, int, int, int]:  # the recorder numbers storages as it first meets them
        sid, rec = records[key]
        _, ins, outs = placed[rec.created]
        if key in ins:
            return (rec.created, 0, ins.index(key), sid)
        return (rec.created, 1, outs.index(key), sid) if key in outs else (rec.created, 2, 0, sid)
    rest = sorted((key for key in records if records[key][1].created >= 0), key=slot)
    sid_of = {key: n for n, key in enumerate([*first, *rest])}
    if len(sid_of) != len(records):
        raise Unrepeatable("storages placed twice or not at all")
    ops = tuple(replace(op, index=n, inputs=tuple(sid_of[k] for k in ins),
                        outputs=tuple(sid_of[k] for k in outs)) for n, (op, ins, outs) in enumerate(placed))
    fx: Any = trace.fx
    if graph:  # built when first asked for
        fx = partial(placed_graph, trace, [(key, records[key][0], records[key][1].label) for key in first], placer)
    storages = tuple(replace(records[key][1], sid=n) for n, key in enumerate([*first, *rest]))
    return replace(trace, fx=fx, ops=ops, storages=storages,
                   sizes=_sizes(trace.sizes, placer, {n: records[key][0] for key, n in sid_of.items()}))


def _sizes(sizes: SymbolicSizes | None, placer: _Placer, source: dict[int, int]) -> SymbolicSizes | None:
    """The size expressions of the whole trace: each storage's and op's from its source."""
    if sizes is None:
        return None
    return replace(sizes, storages={n: sizes.storages[sid] for n, sid in source.items() if sid in sizes.storages},
                   ops={n: sizes.ops[i] for n, (_, i) in enumerate(placer.order) if i in sizes.ops})


def same_trace(a: Trace, b: Trace) -> bool:
    """Whether two traces record the same step: ops, storages, sizes (not the fx graph)."""
    return a.ops == b.ops and a.storages == b.storages and a.sizes == b.sizes


def placed_calls(trace: Trace, prefix: str, length: int, positions: Sequence[int], period: int = 1) -> list[int]:
    """How many times the whole model makes each call the cut recording made before the op at
    each of ``positions`` (a kernel choice): once outside the stack and in the first and last
    block, ``length - 2`` times in block 1, never in block 2 (block 1's copies stand for it)."""
    placer = _Placer(_layout(trace, Stacked(prefix, period)), length // period, trace)
    times = {0: 1, 1: length // period - 2, 2: 0, KEEP - 1: 1}
    return [times[placer.block(p)] if 0 <= p < len(trace.ops) and placer.block(p) >= 0 else 1 for p in positions]
