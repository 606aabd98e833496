"""The bytes FSDP2 all-gathers in backward, from a recorded step: what keeping a unit's
parameters after forward (``reshard_after_forward=False``) saves in communication.

Input: an analysed training ``ModeReport`` (with ``--parallel``, each distinct rank's).  Output:
bytes per rank per step.  Pure.

FSDP2 gathers a unit's parameters with ``torch.distributed.all_gather_into_tensor``
(torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py ``foreach_all_gather``), recorded as
``c10d._allgather_base_`` into the unsharded output: its bytes are what the rank receives (its own
shard among them).  In backward a unit that resharded after forward gathers again; one that kept
its parameters does not.
"""

from __future__ import annotations

from graphmem.memory.results import ModeReport
from graphmem.records import Phase

__all__ = ["ALL_GATHER_OPS", "backward_gather_bytes"]

# the recorded names of an all-gather into one flat tensor (FSDP2's; the functional form's too)
ALL_GATHER_OPS = ("c10d._allgather_base_.default", "_c10d_functional.all_gather_into_tensor.default")


def _one_rank(mode: ModeReport) -> int:
    """Bytes all-gathered in backward in the last recorded iteration of one rank's step."""
    ops = mode.trace.ops
    if not ops:
        return 0
    last = max(op.iteration for op in ops)
    # (the output's storage, the op) of each backward all-gather, then one pass over the lifetimes
    wanted = {(op.outputs[0], op.index) for op in ops if op.op in ALL_GATHER_OPS and op.outputs
              and op.phase == Phase.BACKWARD and op.iteration == last}
    sids = {sid for sid, _ in wanted}
    found: dict[tuple[int, int], int] = {}
    for life in mode.lifetimes:
        if life.sid in sids:
            for sid, index in wanted:
                if sid == life.sid and life.start <= index <= life.end:
                    found[sid, index] = life.nbytes
    return sum(found.values())


def backward_gather_bytes(mode: ModeReport) -> int:
    """Bytes one rank all-gathers in backward per step (the rank that gathers the most)."""
    return max([_one_rank(rank.report) for rank in mode.ranks] or [_one_rank(mode)])
