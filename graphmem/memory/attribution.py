"""Stage 3 helper: the one place that decides where bytes are blamed (pure).

Input: a ``Trace`` (its ops' phases and module paths, its storages' names and creators).
Output: the module path an op, or a storage of a given category, is charged to.

Memory is blamed where it is made.  An op of the forward, the loss or the backward is
charged to the module the recorder saw running it.  An op of the optimizer step is charged
to the optimizer step, whatever parameter it reads: the recorder names such an op after
the parameter of its first input, and a foreach kernel (``_foreach_sqrt`` over every
parameter, the CUDA default for AdamW) reads every parameter, so its bytes would land on
the first parameter's module (the embedding of a GPT).  Storages follow: parameters,
buffers and gradients belong to their parameter's module by name (a gradient is made by
its parameter's backward); optimizer state and every storage the optimizer step makes
belong to ``OPTIMIZER_STEP``; inputs and targets to ``INPUTS``; the rest to the op that
made them.  Every optimizer graphmem builds holds one parameter group (``make_optimizer``
passes one parameter list), so the optimizer step is one row.
"""

from __future__ import annotations

from graphmem.memory.results import Category
from graphmem.records import OpRecord, Phase, StorageRecord, Trace

__all__ = ["INPUTS", "LOSS", "OPTIMIZER_STEP", "ROOT", "charged_module", "op_module", "storage_module"]

INPUTS = "(inputs)"
LOSS = "(loss)"
ROOT = "(root)"
OPTIMIZER_STEP = "(optimizer step)"

# Categories named after a parameter: how many trailing name parts to drop to reach the
# module path ("layers.0.weight" -> "layers.0"; "layers.0.weight.grad" -> "layers.0").
_NAMED = {Category.PARAMETER: 1, Category.BUFFER: 1, Category.GRADIENT: 2}


def charged_module(op: OpRecord) -> str:
    """The module path ``op``'s bytes are charged to: ``OPTIMIZER_STEP`` for an op of the
    optimizer step, else the module that ran it ("" outside every module)."""
    return OPTIMIZER_STEP if op.phase == Phase.OPTIMIZER else op.module


def op_module(trace: Trace, index: int) -> str:
    """The module path of op ``index`` (``charged_module``); ops outside every module are
    the loss's (``LOSS``) or the root's (``ROOT``)."""
    op = trace.ops[index]
    module = charged_module(op)
    if module:
        return module
    return LOSS if op.phase == Phase.LOSS else ROOT


def storage_module(storage: StorageRecord, category: Category, trace: Trace) -> str:
    """The full module path a storage of ``category`` is charged to (see the module docstring)."""
    if category == Category.INPUT:
        return INPUTS
    if category == Category.OPTIMIZER_STATE:
        return OPTIMIZER_STEP
    if category in _NAMED and storage.label:
        return ".".join(storage.label.split(".")[:-_NAMED[category]]) or ROOT
    return op_module(trace, storage.created) if storage.created >= 0 else ROOT
