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

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import replace
from functools import partial
from typing import Any

from graphmem.records import OpRecord, StorageRecord, SymbolicSizes, Trace
from graphmem.trace.repeat.graph import placed_graph
from graphmem.trace.repeat.layout import KEEP, LISTED, Layout, Stacked, Unrepeatable, layout

__all__ = ["KEEP", "Stacked", "Unrepeatable", "placed_calls", "repeat_blocks", "repeat_program", "same_trace"]

Key = tuple[int, Hashable]  # a storage of the whole trace: (block, its id within the block) or (-1, sid)


class _Placer:
    """Places the cut trace's blocks for a stack of ``length`` blocks (see the module docstring)."""

    def __init__(self, layout: Layout, length: int, trace: Trace) -> None:
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
        if b == s == 1:  # a middle block's own storage (most references): the copy's own
            return (t, lo)
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


def _placed_op(placer: _Placer, trace: Trace, t: int, i: int) -> tuple[OpRecord, str, list[Key], list[Key]]:
    """Cut op ``i`` placed for block ``t`` (-1: outside the stack): the cut op, its module
    there, its storages as keys."""
    op, lay = trace.ops[i], placer.layout
    if t >= 0:
        s = lay.kind[i][0]
        return (op, placer.moved(op.module, t, s),
                [placer.key(sid, t, s) for sid in op.inputs], [placer.key(sid, t, s) for sid in op.outputs])
    b = lay.where.block_of(op.module)  # an op outside may be named after the op before it
    if b in (1, 2):
        raise Unrepeatable("an op outside the blocks named after a block between the ends")
    module = lay.where.renamed(op.module, b, placer.length - 1) if b == KEEP - 1 else op.module
    if lay.kind[i] != "shared":
        return op, module, [placer.key(sid) for sid in op.inputs], [placer.key(sid) for sid in op.outputs]
    if op.scratch_bytes or op.flops:
        raise Unrepeatable("a multi-tensor op with scratch bytes or FLOPs (they grow with the stack)")
    return op, module, placer.expand(op.inputs), placer.expand(op.outputs)


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
    return sid, StorageRecord(sid=-1, nbytes=rec.nbytes, created=created, released=released, roles=rec.roles,
                              label=label, shape=rec.shape, dtype=rec.dtype)


def _keys(placer: _Placer, trace: Trace) -> list[Key]:
    """Every storage of the whole trace: outside ones, the first and last block's, and the
    template's for each block between."""
    lay, last = placer.layout, placer.length - 1
    keys: list[Key] = [(-1, s.sid) for s in trace.storages if s.sid not in lay.owner]
    keys += [(0, lo) for lo in lay.local[0]] + [(last, lo) for lo in lay.local[KEEP - 1]]
    keys += [(t, lo) for t in range(1, last) for lo in lay.local[1]]
    return keys


def repeat_blocks(trace: Trace, prefix: str, length: int, *, period: int = 1, graph: bool = True,
                  program: bool = False) -> Trace:
    """The trace of the whole model with a stack of ``length`` children at ``prefix``, from
    ``trace``, its recording cut to KEEP blocks of ``period`` children each (see the module
    docstring).  ``graph``:
    False keeps the cut trace's fx graph (for the check, which compares no graph).
    ``program``: the trace of a whole program (graphmem run; graphmem.trace.repeat.layout).

    Raises:
        Unrepeatable: the cut recording does not repeat by offset.
    """
    if length % period:
        raise Unrepeatable(f"a stack of {length} does not split into blocks of {period}")
    return _repeat(trace, Stacked(prefix, period, program), length // period, graph)[0]


def repeat_program(trace: Trace, prefix: str, length: int, *, named: Mapping[int, int],
                   since: int) -> tuple[Trace, int]:
    """graphmem run: the trace of the whole program from ``trace``, its recording with the stack
    at ``prefix`` cut to KEEP of its ``length`` blocks (``named``: storage -> block for the
    blocks' tensors the program holds now), checked first as ``record_step`` checks a step:
    blocks 0, 1 and 3 placed for KEEP blocks must give ``trace`` back.  Also where op ``since``
    of ``trace`` (an op outside the blocks, or its end) is in the whole trace.

    Raises:
        Unrepeatable: the recording does not repeat by offset, or ``since`` is a block's op.
    """
    where = Stacked(prefix, 1, True, named)
    if not same_trace(_repeat(trace, where, KEEP, False)[0], trace):
        raise Unrepeatable("the cut recording does not repeat by offset")
    whole, placer = _repeat(trace, where, length, False)
    if since >= len(trace.ops):
        return whole, len(whole.ops)
    if (-1, since) not in placer.index:
        raise Unrepeatable("counters asked for from an op inside the blocks")
    return whole, placer.index[(-1, since)]


def _repeat(trace: Trace, where: Stacked, length: int, graph: bool) -> tuple[Trace, _Placer]:
    program = where.program
    placer = _Placer(layout(trace, where), length, trace)
    placed = [_placed_op(placer, trace, t, i) for t, i in placer.order]
    records = {key: _storage_of(placer, trace, key) for key in _keys(placer, trace)}
    if program:
        _grown_lists(placer, trace, placed, records)
    first = placer.expand([s.sid for s in trace.storages if s.created < 0])

    def slot(key: Key) -> tuple[int, int, int, int]:  # the recorder numbers storages as it first meets them
        sid, rec = records[key]
        _, _, ins, outs = placed[rec.created]
        if key in ins:
            return (rec.created, 0, ins.index(key), sid)
        return (rec.created, 1, outs.index(key), sid) if key in outs else (rec.created, 2, 0, sid)
    rest = sorted((key for key in records if records[key][1].created >= 0), key=slot)
    sid_of = {key: n for n, key in enumerate([*first, *rest])}
    if len(sid_of) != len(records):
        raise Unrepeatable("storages placed twice or not at all")
    ops = tuple(OpRecord(index=n, op=op.op, phase=op.phase, iteration=op.iteration, module=module,
                         inputs=tuple([sid_of[k] for k in ins]), outputs=tuple([sid_of[k] for k in outs]),
                         scratch_bytes=op.scratch_bytes, flops=op.flops, recompute=op.recompute, line=op.line)
                for n, (op, module, ins, outs) in enumerate(placed))
    fx: Any = trace.fx
    if graph:  # built when first asked for
        fx = partial(placed_graph, trace, [(key, records[key][0], records[key][1].label) for key in first], placer)
    storages = tuple(StorageRecord(sid=n, nbytes=r.nbytes, created=r.created, released=r.released, roles=r.roles,
                                   label=r.label, shape=r.shape, dtype=r.dtype)
                     for n, r in enumerate(records[key][1] for key in [*first, *rest]))
    return replace(trace, fx=fx, ops=ops, storages=storages,
                   sizes=_sizes(trace.sizes, placer, {n: records[key][0] for key, n in sid_of.items()})), placer


def _grown_lists(placer: _Placer, trace: Trace, placed: list[tuple[OpRecord, str, list[Key], list[Key]]],
                 records: dict[Key, tuple[int, StorageRecord]]) -> None:
    """A gather of a list that takes a tensor of every block (``LISTED``: torch.stack of the
    parameters' gradient norms) makes, for the whole stack, a tensor as many times longer as
    its list is: its first dimension is the list's length.  Whatever reads it may do no work
    that grows with it (FLOPs, scratch bytes)."""
    grown: set[int] = set()
    for op, _, ins, outs in placed:
        if op.op not in LISTED or len(ins) == len(op.inputs):
            if grown & set(op.inputs) and (op.flops or op.scratch_bytes):
                raise Unrepeatable("an op reads a list grown with the stack and does work that grows with it")
            continue
        for key in outs:
            sid, rec = records[key]
            before, after = len(op.inputs), len(ins)
            if key[0] >= 0 or not rec.shape or rec.shape[0] != before or rec.nbytes % before:
                raise Unrepeatable(f"{op.op} over the blocks makes a tensor that does not grow with its list")
            records[key] = (sid, replace(rec, shape=(after, *rec.shape[1:]), nbytes=rec.nbytes // before * after))
            grown.add(sid)


def _sizes(sizes: SymbolicSizes | None, placer: _Placer, source: dict[int, int]) -> SymbolicSizes | None:
    """The size expressions of the whole trace: each storage's and op's from its source."""
    if sizes is None:
        return None
    return replace(sizes, storages={n: sizes.storages[sid] for n, sid in source.items() if sid in sizes.storages},
                   ops={n: sizes.ops[i] for n, (_, i) in enumerate(placer.order) if i in sizes.ops})


def same_trace(a: Trace, b: Trace) -> bool:
    """Whether two traces record the same step: ops, storages, sizes (not the fx graph)."""
    return a.ops == b.ops and a.storages == b.storages and a.sizes == b.sizes


def placed_calls(trace: Trace, prefix: str, length: int, positions: Sequence[int], period: int = 1,
                 named: Mapping[int, int] | None = None) -> list[int]:
    """How many times the whole model makes each call the cut recording made before the op at
    each of ``positions`` (a kernel choice): once outside the stack and in the first and last
    block, ``length - 2`` times in block 1, never in block 2 (block 1's copies stand for it).
    ``named``: a program's recording (graphmem run; ``repeat_program``'s)."""
    where = Stacked(prefix, period) if named is None else Stacked(prefix, period, True, named)
    kind = layout(trace, where).kind  # which block each op is in: no placing needed
    times = {0: 1, 1: length // period - 2, 2: 0, KEEP - 1: 1}
    return [times[kind[p][0]] if 0 <= p < len(kind) and isinstance(kind[p], tuple) else 1 for p in positions]
