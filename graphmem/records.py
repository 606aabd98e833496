"""The recorded step: phases, storage roles, and the frozen op and storage records.

Every record is a frozen, slotted dataclass, complete when built.  Sizes are int bytes
named ``*_bytes``; positions are int op indices ("steps").
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum, unique
from typing import Any

import torch

__all__ = ["Phase", "Role", "OpRecord", "StorageRecord", "SymbolicSizes", "Trace"]


@unique
class Phase(StrEnum):
    """Where in the step an op runs."""

    PROGRAM = "program"  # graphmem run: the program's own code outside forward, backward and the optimizer
    FORWARD = "forward"
    LOSS = "loss"
    BACKWARD = "backward"
    OPTIMIZER = "optimizer"
    PREFILL = "prefill"  # generation: the prompt's forward (and filling the cache)
    DECODE = "decode"  # generation: one token's forward with the cache


@unique
class Role(StrEnum):
    """What the step did with a storage; a storage may have several roles."""

    PARAMETER = "parameter"
    BUFFER = "buffer"
    INPUT = "input"
    GRADIENT = "gradient"
    OPTIMIZER_STATE = "optimizer_state"
    SAVED = "saved"
    OUTPUT = "output"
    COMMUNICATION = "communication"  # buffers of collectives: DDP buckets, FSDP2's all-gathered parameters




@dataclass(frozen=True, slots=True)
class OpRecord:
    """One dispatched aten op, in execution order."""

    index: int
    op: str  # its graph node: the one whose meta["graphmem"]["op_index"] is ``index``
    phase: Phase
    iteration: int
    module: str
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    scratch_bytes: int
    flops: int = 0
    recompute: bool = False  # a forward op re-run in backward by activation checkpointing
    line: str = ""  # graphmem run: file:line of the program's code that ran it ("" elsewhere)
    # a multi-tensor op's (``_foreach_*``, ``_fused_*``) tensor arguments' storages, one per
    # tensor, repeats kept (``inputs`` names each storage once: FSDP2's gradients are views of
    # one buffer per group); () for any other op.  Where each of its outputs comes from, for
    # graphmem.trace.repeat; no part of what the op is
    listed: tuple[int, ...] = field(default=(), compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class StorageRecord:
    """One storage: its size, the op that created it and the op after which it was released.

    ``created`` is -1 for storages that exist before the first op (parameters, inputs).
    ``released`` is None when the storage is still referenced after the last op.
    """

    sid: int
    nbytes: int
    created: int
    released: int | None
    roles: frozenset[Role]
    label: str
    shape: tuple[int, ...]
    dtype: str


@dataclass(frozen=True, slots=True)
class SymbolicSizes:
    """The sizes of a trace recorded with one size as a symbol (graphmem.trace.symbolic).

    ``storages``: storage id -> (bytes, shape) as expressions, for the storages whose size
    depends on the symbol; ``ops``: op index -> (scratch bytes, FLOPs) likewise; ``guards``:
    the conditions the recording took as given (sympy booleans)."""

    name: str
    symbol: Any  # sympy.Symbol
    hint: int
    storages: Mapping[int, tuple[Any, tuple[Any, ...]]]
    ops: Mapping[int, tuple[Any, Any]]
    guards: tuple[Any, ...]

    def __post_init__(self) -> None:
        if self.hint < 2:
            raise ValueError(f"SymbolicSizes: hint {self.hint} < 2 (sizes 0 and 1 are specialised)")

    def holds(self, value: int) -> bool:
        """Whether the recorded step is the step at ``value``: every guard holds there."""
        if value < 2:
            return False
        point = {self.symbol: value}
        for guard in self.guards:
            if guard.free_symbols - {self.symbol}:
                return False
            if not bool(guard.xreplace(point)):
                return False
        return True


@dataclass(frozen=True, slots=True)
class Trace:
    """Stage 2's output: the recorded fx graph, its ops and its storages."""

    mode: str
    # the fx graph, or what builds it when first asked for (a trace whose blocks were placed by
    # offset, graphmem.trace.repeat.place: only the DOT output reads it); read it as ``graph``
    fx: torch.fx.Graph | Callable[[], torch.fx.Graph]
    ops: tuple[OpRecord, ...]
    storages: tuple[StorageRecord, ...]
    optimizer: str | None
    assumptions: tuple[str, ...] = ()
    kv_cache_bytes: int = 0  # generation: the KV cache at the end
    # recorded with a size as a symbol: the sizes as expressions (graphmem.trace.symbolic)
    sizes: SymbolicSizes | None = None
    # the inputs whose values graphmem invented (nobody gave them) where a size would have come
    # from them; those sizes were recorded at their bound instead: the peak is an upper bound
    unseen_inputs: tuple[str, ...] = ()
    # training: which loss the step took (``output.loss``, ``losses``, ``output``, or the --loss
    # named); None where not known
    loss: str | None = None

    @property
    def graph(self) -> torch.fx.Graph:
        """The recorded fx graph (built now, once, where it was left to be built)."""
        if not isinstance(self.fx, torch.fx.Graph):
            object.__setattr__(self, "fx", self.fx())  # a cache: the graph is the same either way
        assert isinstance(self.fx, torch.fx.Graph)
        return self.fx


@dataclass(frozen=True, slots=True)
class FileChange:
    """What a program run by ``graphmem run`` did to one path, in its own file layer (the real
    file is unchanged; graphmem.trace.program.scratch)."""

    path: str  # the path the program used, absolute
    action: str  # "created", "overwritten", "appended", "modified", "truncated", "deleted",
    # "renamed" (then `to`), "directory created", "directory deleted", "symlink created",
    # "hard link created", "mode changed", "times changed", "owner changed", "attributes changed"
    size_bytes: int  # bytes of the file as the program left it (0 for a deletion or a folder)
    to: str | None = None  # where a rename put it
