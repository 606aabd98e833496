"""The recorded step: phases, storage roles, and the frozen op and storage records.

Every record is a frozen, slotted dataclass, complete when built.  Sizes are int bytes
named ``*_bytes``; positions are int op indices ("steps").
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum, unique

import torch

__all__ = ["Phase", "Role", "OpRecord", "StorageRecord", "Trace"]


@unique
class Phase(StrEnum):
    """Where in the step an op runs."""

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
    op: str
    node: str
    phase: Phase
    iteration: int
    module: str
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    scratch_bytes: int
    flops: int = 0
    recompute: bool = False  # a forward op re-run in backward by activation checkpointing


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
class Trace:
    """Stage 2's output: the recorded fx graph, its ops and its storages."""

    mode: str
    graph: torch.fx.Graph
    ops: tuple[OpRecord, ...]
    storages: tuple[StorageRecord, ...]
    optimizer: str | None
    assumptions: tuple[str, ...] = ()
    kv_cache_bytes: int = 0  # generation: the KV cache at the end
