"""The recorder's fx graph: one node per recorded op, its arguments the nodes of the tensors it read.

Input: the placeholders (parameters, buffers, inputs) and each op with its arguments and
outputs.  Output: a ``torch.fx.Graph`` in execution order; each op node carries its index in
the trace under ``node.meta["graphmem"]``.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

from graphmem._torch_api import hint_of, tree_map

__all__ = ["GraphBuilder"]


class GraphBuilder:
    """Builds the fx graph; a tensor the graph has not seen becomes a constant (``get_attr``)."""

    def __init__(self) -> None:
        self.graph = torch.fx.Graph()
        self._nodes: WeakIdKeyDictionary = WeakIdKeyDictionary()  # tensor -> fx node
        self._constants = 0

    def weak_tables(self) -> list[WeakIdKeyDictionary]:
        """The tables that hold tensors by weak reference (graphmem.trace.core.recorder's swap)."""
        return [self._nodes]

    def add_placeholder(self, t: torch.Tensor, name: str) -> None:
        self._nodes[t] = self.graph.placeholder(name.replace(".", "_"))

    def add_op(self, func: Any, args: Any, kwargs: Any, out: Any, index: int) -> torch.fx.Node:
        """The node of op number ``index``, and one ``getitem`` node per tensor of a tuple output."""
        node_args, node_kwargs = tree_map(self._node_of, (tuple(args), dict(kwargs)))
        node = self.graph.call_function(func, node_args, node_kwargs)
        node.meta["graphmem"] = {"op_index": index}
        if isinstance(out, torch.Tensor):
            self._nodes[out] = node
        elif isinstance(out, (tuple, list)):
            for i, item in enumerate(out):
                if isinstance(item, torch.Tensor):
                    self._nodes[item] = self.graph.call_function(operator.getitem, (node, i))
        return node

    def _node_of(self, value: Any) -> Any:
        if isinstance(value, (torch.UntypedStorage, torch.TypedStorage)):
            # a storage (torch.load's ``set_(storage, ...)``): named, not held; a real run frees
            # it with its tensors, and the graph would keep it for the whole recording
            return f"<storage of {value.nbytes()} bytes>"
        if not isinstance(value, torch.Tensor):  # a size symbol: its value while recording
            return hint_of(value) if isinstance(value, torch.SymInt) else value
        node = self._nodes.get(value)
        if node is None:
            self._constants += 1
            node = self.graph.get_attr(f"_tensor_constant{self._constants}")
            self._nodes[value] = node
        return node
