"""``graphmem plan --policy``: the activation-checkpointing policy with the least recompute whose
peak fits a budget, block by block, verified by analysis.

Input: a ``Job`` (training, on one device or under ``--parallel fsdp=N``) and a ``Budget``.
Output: a frozen ``PolicyPlan``: the chosen blocks (and FSDP2's settings), the peak that an
analysis of the job with them applied gives (never a predicted number alone), the recompute FLOPs,
and the front of policies where no other has both less memory and less recompute.

The rooms, each importing only those before it:

- ``runs``: a recorded step cut into runs of ops, each run inside one block or outside all.
- ``costs``: what recomputing an op costs (FLOPs, or on a GPU with known peak rates a roofline
  time), the objective.
- ``composite``: the peak of any per-block choice, from four recordings of the step (no block
  checkpointed, every block, every even one, every odd one), storage by storage.
- ``solve``: the choice with the least recompute under a cap, as an integer program (PuLP's CBC).
- ``finer``: inside the chosen blocks, the ops whose outputs could be kept, with what each saves.
- ``gathers``: the bytes FSDP2 all-gathers in backward, from an analysed step.
- ``results``: the answer's types (``CheckpointChoice``, ``PolicyPlan``, FSDP2's ``Sharding``).
- ``verify``: how a choice becomes a job, and the analysis that verifies each choice (made once).
- ``refine``: the chosen blocks keeping single ops' outputs (finer's items), and under FSDP2 some
  units their parameters, greedily where the budget leaves room, each step analysed.
- ``search``: the recordings, the solver, and the verified choice from its front.
- ``sharding``: under ``--parallel fsdp=N``, FSDP2's ``reshard_after_forward`` chosen with the
  blocks (each setting searched as above; the least recompute, then the least communication).

Knows nothing of rendering or of the command line.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from graphmem._lazy import lazy_exports

__all__ = ["CheckpointChoice", "PolicyPlan", "make_policy"]

if TYPE_CHECKING:
    from graphmem.preflight.policy.results import CheckpointChoice, PolicyPlan
    from graphmem.preflight.policy.search import make_policy

__getattr__ = lazy_exports(globals(), {
    "graphmem.preflight.policy.results": ("CheckpointChoice", "PolicyPlan"),
    "graphmem.preflight.policy.search": ("make_policy",),
})
