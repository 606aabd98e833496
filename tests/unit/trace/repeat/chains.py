"""Hand-built recordings of a stack of alike blocks, as the recorder would record them whole.

A model of ``n`` blocks at ``layers``, block b one matrix product ``h_b = h_{b-1} @ w_b``
(``h_{-1}`` is the input ``x``), H features, every tensor float32.  What it records, written
out from that description alone (no graphmem code builds any of it):

inference (ops 0..n-1)
    op b: ``aten.mm`` in module ``layers.b``, reads (h_{b-1}, w_b), makes h_b.
    storages, numbered as first met: x = 0, w_b = 1 + b, h_b = 1 + n + b; h_b is freed after
    op b + 1 reads it, the last one lives on (the output).

training (``train=True``), after the forward above
    op n: the loss, ``aten.sum`` outside the stack, reads h_{n-1}, makes ``loss`` (sid 1 + 2n);
    op 2n - b (b = n-1 down to 0): block b's backward, reads (h_{b-1}, w_b, the gradient from
    above: ``loss`` for the last block, else what block b + 1's backward made), makes the
    gradient of its input d_b and of its weight g_b.  The j-th backward op (j = n-1-b) makes
    d_b = 2 + 2n + 2j and g_b = 3 + 2n + 2j.
    h_b is freed after the backward of block b + 1 reads it (op 2n - b - 1), the last h after
    the loss; ``loss`` after the last block's backward (op n + 1); d_b after block b - 1's
    backward (op 2n - b + 1), d_0 (nothing reads it) at once (op 2n); gradients live on.
    ``optimizer=True`` adds op 2n + 1: one ``aten._foreach_add_.List`` outside the stack that
    reads every weight, then every weight's gradient, in block order, and makes nothing.

``sizes=True`` records the batch as the symbol ``B`` (hint 2): x, every h and every d is
``4*B*H`` bytes of shape (B, H), every mm and backward op ``2*B*H*H`` FLOPs.
"""

from __future__ import annotations

import operator
from typing import Any

import sympy
import torch

from graphmem.records import OpRecord, Phase, Role, StorageRecord, SymbolicSizes, Trace

H = 8  # features
WEIGHT = 4 * H * H  # 256 bytes: H x H float32
ACTIVATION = 4 * 2 * H  # 64 bytes: 2 x H float32 (the batch is 2)
B = sympy.Symbol("B", positive=True, integer=True)
aten = torch.ops.aten


def _op(index: int, op: str, phase: Phase, module: str, inputs: tuple[int, ...], outputs: tuple[int, ...],
        flops: int = 0) -> OpRecord:
    return OpRecord(index=index, op=op, phase=phase, iteration=0, module=module, inputs=inputs, outputs=outputs,
                    scratch_bytes=0, flops=flops)


def _storage(sid: int, nbytes: int, created: int, released: int | None, label: str = "",
             *roles: Role, shape: tuple[int, ...] = (2, H)) -> StorageRecord:
    return StorageRecord(sid=sid, nbytes=nbytes, created=created, released=released, roles=frozenset(roles),
                         label=label, shape=shape, dtype="float32")


def chain(n: int, *, train: bool = False, optimizer: bool = False, sizes: bool = False) -> Trace:
    """The whole recording of ``n`` blocks (see the module docstring)."""
    x, w, h = 0, [1 + b for b in range(n)], [1 + n + b for b in range(n)]
    loss = 1 + 2 * n
    d = {b: 2 + 2 * n + 2 * (n - 1 - b) for b in range(n)}
    g = {b: 3 + 2 * n + 2 * (n - 1 - b) for b in range(n)}
    mm_flops = 2 * 2 * H * H  # 2 x H times H x H: 2*B*H*H at B = 2
    ops = [_op(b, "aten.mm.default", Phase.FORWARD, f"layers.{b}", (h[b - 1] if b else x, w[b]), (h[b],), mm_flops)
           for b in range(n)]
    storages = [_storage(x, ACTIVATION, -1, None, "x", Role.INPUT)]
    storages += [_storage(w[b], WEIGHT, -1, None, f"layers.{b}.weight", Role.PARAMETER, shape=(H, H))
                 for b in range(n)]
    if not train:
        storages += [_storage(h[b], ACTIVATION, b, b + 1) for b in range(n - 1)]
        storages.append(_storage(h[n - 1], ACTIVATION, n - 1, None, "", Role.OUTPUT))
    else:
        storages += [_storage(h[b], ACTIVATION, b, 2 * n - b - 1, "", Role.SAVED) for b in range(n - 1)]
        storages.append(_storage(h[n - 1], ACTIVATION, n - 1, n))
        ops.append(_op(n, "aten.sum.default", Phase.LOSS, "", (h[n - 1],), (loss,)))
        storages.append(_storage(loss, 4, n, n + 1, "", Role.OUTPUT, shape=()))
        for b in reversed(range(n)):
            above = loss if b == n - 1 else d[b + 1]
            ops.append(_op(2 * n - b, "aten.linear_backward.default", Phase.BACKWARD, f"layers.{b}",
                           (h[b - 1] if b else x, w[b], above), (d[b], g[b]), mm_flops))
            storages.append(_storage(d[b], ACTIVATION, 2 * n - b, 2 * n - b + 1 if b else 2 * n))
            storages.append(_storage(g[b], WEIGHT, 2 * n - b, None, "", Role.GRADIENT, shape=(H, H)))
        if optimizer:
            ops.append(_op(2 * n + 1, "aten._foreach_add_.List", Phase.OPTIMIZER, "",
                           tuple(w) + tuple(g[b] for b in range(n)), ()))
    storages.sort(key=lambda s: s.sid)
    symbolic = None
    if sizes:
        activations = [x, *h, *(d.values() if train else ())]
        symbolic = SymbolicSizes(name="B", symbol=B, hint=2, storages={sid: (4 * B * H, (B, H)) for sid in activations},
                                 ops={op.index: (0, 2 * B * H * H) for op in ops if op.flops}, guards=())
    return Trace(mode="train" if train else "inference", fx=_graph(n, ops), ops=tuple(ops), storages=tuple(storages),
                 optimizer="sgd" if optimizer else None, sizes=symbolic)


def _graph(n: int, ops: list[OpRecord]) -> torch.fx.Graph:
    """The recording's fx graph: a placeholder per input and weight, a node per op (tagged with
    its index), a ``getitem`` per output of an op that makes two."""
    graph = torch.fx.Graph()
    made: dict[int, torch.fx.Node] = {0: graph.placeholder("x")}
    for b in range(n):
        made[1 + b] = graph.placeholder(f"layers_{b}_weight")
    for op in ops:
        target = {"aten.mm.default": aten.mm.default, "aten.sum.default": aten.sum.default,
                  "aten.linear_backward.default": aten.linear_backward.default,
                  "aten._foreach_add_.List": aten._foreach_add_.List}[op.op]
        if op.phase == Phase.OPTIMIZER:
            args: tuple[Any, ...] = ([made[s] for s in op.inputs[:n]], [made[s] for s in op.inputs[n:]])
        else:
            args = tuple(made[s] for s in op.inputs)
        node = graph.call_function(target, args)
        node.meta["graphmem"] = {"op_index": op.index}
        if len(op.outputs) == 1:
            made[op.outputs[0]] = node
        for position, sid in enumerate(op.outputs if len(op.outputs) > 1 else ()):
            made[sid] = graph.call_function(operator.getitem, (node, position))
    return graph
