"""One recording for every value of a size: the trace with a size kept as a symbol.

An input dimension marked with a letter (``B`` in ``Bx1000``) is recorded as a symbol of
FakeTensor's ShapeEnv, with a value (its hint) that decides what the step does.  Every
storage's size, every op's scratch bytes and FLOPs are then expressions of the symbol (a
polynomial for most models: ``4096*B``), and every decision the step took on a size (a
branch, a kernel that switches at a length, a view that needs one value) is kept as a
guard.  Where the guards hold, the step does the same ops with the same storages alive, so
its trace at another value is the same trace with the expressions evaluated there
(``trace_at``): the same bytes, to the byte, as recording at that value.  Outside the
guards, record again.

Values the model reads (answered from assumed inputs) and value-dependent sizes are taken
at the hint, not as expressions: such a recording keeps no formula (``Trace.sizes`` is
None) and holds at its hint only.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from graphmem.records import OpRecord, StorageRecord, SymbolicSizes, Trace

__all__ = ["SymbolicSizes", "trace_at"]  # SymbolicSizes lives with the other records


def trace_at(trace: Trace, value: int) -> Trace:
    """``trace`` with its sizes evaluated at ``value`` of its symbol.

    Raises:
        ValueError: the trace keeps no formula, or its guards do not hold at ``value``.
    """
    sizes = trace.sizes
    if sizes is None:
        raise ValueError("trace_at: the trace keeps no size formula")
    if value == sizes.hint:
        return trace
    if not sizes.holds(value):
        raise ValueError(f"trace_at: {sizes.name}={value} is outside the recording's guards")
    cache: dict[Any, int] = {}
    point = {sizes.symbol: value}

    def at(expr: Any) -> int:
        if isinstance(expr, int):
            return expr
        if expr not in cache:
            cache[expr] = int(expr.xreplace(point))
        return cache[expr]

    storages = tuple(_storage_at(s, sizes.storages[s.sid], at) if s.sid in sizes.storages else s
                     for s in trace.storages)
    ops = tuple(_op_at(op, sizes.ops[op.index], at) if op.index in sizes.ops else op for op in trace.ops)
    return replace(trace, storages=storages, ops=ops, sizes=replace(sizes, hint=value))


def _storage_at(record: StorageRecord, exprs: tuple[Any, tuple[Any, ...]], at: Any) -> StorageRecord:
    nbytes, shape = exprs
    return replace(record, nbytes=at(nbytes), shape=tuple(at(d) for d in shape))


def _op_at(record: OpRecord, exprs: tuple[Any, Any], at: Any) -> OpRecord:
    scratch, flops = exprs
    return replace(record, scratch_bytes=at(scratch), flops=at(flops))
