"""The fx graph of a trace whose blocks were placed by offset (graphmem.trace.repeat.place).

Input: the cut recording's graph and where each of its ops went.  Output: the whole step's
graph, each op's node copied once per block it was placed for, its arguments the nodes of
the same block's (or the block before's, or after's) ops and parameters, as the recording of
the whole model would give them.
"""

from __future__ import annotations

import operator
from collections.abc import Hashable, Sequence
from functools import partial
from typing import Any

import torch

from graphmem.records import Trace

__all__ = ["placed_graph"]

Key = tuple[int, Hashable]


def _parts(graph: torch.fx.Graph) -> tuple[dict[int, torch.fx.Node], dict[torch.fx.Node, list[torch.fx.Node]],
                                           dict[torch.fx.Node, int]]:
    """Op index -> its node; op node -> its getitem nodes; any node made by an op -> that op."""
    op_node: dict[int, torch.fx.Node] = {}
    items: dict[torch.fx.Node, list[torch.fx.Node]] = {}
    made_by: dict[torch.fx.Node, int] = {}
    for node in graph.nodes:
        if node.op == "call_function" and "graphmem" in node.meta:
            index = node.meta["graphmem"]["op_index"]
            op_node[index], items[node], made_by[node] = node, [], index
        elif node.op == "call_function" and node.target is operator.getitem and node.args[0] in items:
            items[node.args[0]].append(node)
            made_by[node] = made_by[node.args[0]]
    return op_node, items, made_by


class _Copier:
    """Copies the cut graph's nodes into the whole step's graph, block by block."""

    def __init__(self, trace: Trace, placer: Any) -> None:
        self.op_node, self.items, self.made_by = _parts(trace.graph)
        self.by_name = {s.label.replace(".", "_"): s.sid for s in trace.storages if s.created < 0 and s.label}
        self.placer, self.trace = placer, trace
        self.shared_items: dict[tuple[int, Key], torch.fx.Node] = {}  # (op, its output's storage) -> getitem
        self.key, self.op_at = placer.key, placer.at
        self.graph = torch.fx.Graph()
        self.inputs: dict[Key, torch.fx.Node] = {}
        self.made: dict[tuple[int, int], torch.fx.Node] = {}  # (whole-trace op, output or -1) -> node
        self.constants: dict[tuple[torch.fx.Node, int], torch.fx.Node] = {}
        self.lifted_by = {n: min(self.made_by[u] for u in n.users if u in self.made_by)
                          for n in trace.graph.nodes if n.op == "get_attr" and any(u in self.made_by for u in n.users)}

    def arg(self, node: torch.fx.Node, t: int, s: int) -> torch.fx.Node:
        """The whole graph's node for cut ``node`` read by an op of block ``t`` placed from ``s``."""
        if node.op == "placeholder":
            return self.inputs[self.key(self.by_name[str(node.target)], t, s)]
        if node.op == "get_attr":  # a constant the op lifted: each block lifts its own
            at = (node, t if self.owner(node) >= 0 else -1)
            if at not in self.constants:
                self.constants[at] = self.graph.get_attr(f"_tensor_constant{len(self.constants) + 1}")
            return self.constants[at]
        j = self.made_by[node]
        if node is self.op_node[j]:
            return self.made[(self.op_at(j, t, s), -1)]
        position = self.items[self.op_node[j]].index(node)
        if self.placer.shared(j):  # a multi-tensor op's outputs grew with the stack: found by storage
            return self.shared_items[(self.op_at(j, t, s), self.key(self.trace.ops[j].outputs[position], t, s))]
        return self.made[(self.op_at(j, t, s), position)]

    def owner(self, node: torch.fx.Node) -> int:
        """The recorded block a cut node belongs to (-1: none)."""
        if node.op == "placeholder":
            return int(self.placer.owner_block(self.by_name[str(node.target)]))
        if node.op == "get_attr":
            return int(self.placer.block(self.lifted_by[node])) if node in self.lifted_by else -1
        j = self.made_by.get(node)
        if j is not None and self.placer.shared(j) and node is not self.op_node[j]:  # by its storage
            return int(self.placer.owner_block(self.trace.ops[j].outputs[self.items[self.op_node[j]].index(node)]))
        return int(self.placer.block(self.made_by[node])) if node in self.made_by else -1

    def expanded(self, items: Sequence[Any], owners: Sequence[int]) -> list[Any]:
        """A multi-tensor op's list (of nodes, or of one number per tensor, with the owners of
        the op's first list of nodes): block 1's items followed by block 2's become every
        middle block's (as its storages were, graphmem.trace.repeat.place)."""
        out: list[Any] = []
        n = 0
        while n < len(items):
            stop = n
            while stop < len(items) and owners[stop] == 1:
                stop += 1
            if stop > n:
                out.extend(self.arg(x, t, 1) if isinstance(x, torch.fx.Node) else x
                           for t in range(1, self.placer.length - 1) for x in items[n:stop])
                n = stop + (stop - n)  # block 2's run follows, as the storages' expansion checked
                continue
            out.append(self.arg(items[n], -1, -1) if isinstance(items[n], torch.fx.Node) else items[n])
            n += 1
        return out

    def shared_args(self, source: torch.fx.Node) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """A multi-tensor op's arguments, every per-tensor list grown with the stack."""
        lists = [a for a in (*source.args, *source.kwargs.values()) if isinstance(a, (list, tuple))
                 and a and all(isinstance(x, torch.fx.Node) for x in a)]
        first = [self.owner(x) for x in lists[0]] if lists else []

        def one(a: Any) -> Any:
            if isinstance(a, torch.fx.Node):
                return self.arg(a, -1, -1)
            if not isinstance(a, (list, tuple)):
                return a
            owners = [self.owner(x) for x in a] if a and isinstance(a[0], torch.fx.Node) else first
            return self.expanded(a, owners) if len(owners) == len(a) else list(a)
        return tuple(one(a) for a in source.args), {k: one(a) for k, a in source.kwargs.items()}


def placed_graph(trace: Trace, placeholders: Sequence[tuple[Key, int, str]], placer: Any) -> torch.fx.Graph:
    """The whole step's graph.

    Args:
        trace: the cut recording.
        placeholders: (key, cut sid, label) of each storage that exists before the first op,
            in the whole trace's order.
        placer: graphmem.trace.repeat.place's placer (``order``, ``key``, ``at``, ``block``,
            ``owner_block``, ``shared``, ``length``).
    """
    copier = _Copier(trace, placer)
    with_nodes = {copier.by_name[str(n.target)] for n in trace.graph.nodes
                  if n.op == "placeholder" and str(n.target) in copier.by_name}
    for k, sid, label in placeholders:
        if sid in with_nodes:
            copier.inputs[k] = copier.graph.placeholder(label.replace(".", "_"))
    for n, (t, i) in enumerate(placer.order):
        s, source = placer.block(i), copier.op_node[i]
        target: Any = source.target
        if placer.shared(i):
            copy = copier.graph.call_function(target, *copier.shared_args(source))
        else:  # named by fx from the op, as the recorder's nodes are
            mapped: Any = torch.fx.node.map_arg((source.args, source.kwargs), partial(copier.arg, t=t, s=s))
            copy = copier.graph.call_function(target, *mapped)
        copy.meta["graphmem"] = {"op_index": n}
        copier.made[(n, -1)] = copy
        if placer.shared(i) and copier.items[source]:
            for position, k in enumerate(placer.expand(trace.ops[i].outputs)):
                copier.shared_items[(n, k)] = copier.graph.call_function(operator.getitem, (copy, position))
            continue
        for position, item in enumerate(copier.items[source]):
            copier.made[(n, position)] = copier.graph.call_function(operator.getitem, (copy, item.args[1]))
    return copier.graph
