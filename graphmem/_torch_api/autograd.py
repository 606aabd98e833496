"""The autograd engine: the node running now, sequence numbers, and backward without the
torch-function hop."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["autograd_sequence_nr", "backward_keeping_modes", "backward_without_hop", "current_autograd_node",
           "node_sequence_nr"]


def current_autograd_node() -> Any:
    """The autograd Node the engine is executing now, or None outside backward."""
    return torch._C._current_autograd_node()


def autograd_sequence_nr() -> int:
    """The sequence number the next autograd Node created on this thread will get."""
    return int(torch._C._autograd._get_sequence_nr())


def backward_keeping_modes(loss: torch.Tensor) -> None:
    """``loss.backward()``, without passing through ``__torch_function__``.

    ``Tensor.backward`` is itself a torch function: an active TorchFunctionMode (graphmem's
    CUDA kernel choices) would be popped while it runs, and checkpoint's recompute inside
    backward would then run without it.  This is what torch.autograd.backward does
    (torch/autograd/__init__.py), minus the torch-function hop.
    """
    from torch.autograd import _make_grads
    from torch.autograd.graph import _engine_run_backward

    grads = _make_grads((loss,), (None,), is_grads_batched=False)
    _engine_run_backward((loss,), grads, False, False, (), allow_unreachable=True, accumulate_grad=True)


def backward_without_hop(tensors: Any, grad_tensors: Any = None, retain_graph: bool | None = None,
                         create_graph: bool = False, inputs: Any = None) -> None:
    """``torch.autograd.backward(...)`` without its torch-function hop (see
    ``backward_keeping_modes``): the TorchFunctionModes active now stay active in the backward."""
    from torch.autograd import _make_grads, _tensor_or_tensors_to_tuple
    from torch.autograd.graph import _engine_run_backward

    tensors = (tensors,) if isinstance(tensors, torch.Tensor) else tuple(tensors)
    inputs = () if inputs is None else (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)
    grads = _make_grads(tensors, _tensor_or_tensors_to_tuple(grad_tensors, len(tensors)), is_grads_batched=False)
    _engine_run_backward(tensors, grads, create_graph if retain_graph is None else retain_graph, create_graph,
                         inputs, allow_unreachable=True, accumulate_grad=True)


def node_sequence_nr(node: Any) -> int:
    """The sequence number autograd gave ``node`` (a Node of the graph) when its op ran."""
    number: int = node._sequence_nr()
    return number
