"""What ``plan --policy`` answers: the analysed choices, FSDP2's settings and the plan.

Input: none (the types only).  Output: frozen dataclasses that search.py and sharding.py fill
and report/ renders.
"""

from __future__ import annotations

from dataclasses import dataclass

from graphmem.preflight.budget import Budget

__all__ = ["CheckpointChoice", "PolicyPlan", "Sharding", "ShardingOption"]


@dataclass(frozen=True, slots=True)
class CheckpointChoice:
    """One per-block choice, analysed.

    Attributes:
        blocks: the checkpointed blocks (0-based, among the modules of the class in the model's
            order), as ``--checkpoint-blocks`` takes them.
        selective: those of them that keep the outputs of the plan's ``save`` ops (selective
            checkpointing), as ``--checkpoint-save-blocks`` takes them; the others are whole.
        peak_bytes: the analysed peak, what the budget compares (graphmem/preflight/footprint.py).
        predicted_bytes: the composite's peak for it (tensor bytes), before the analysis.
        recompute_flops: FLOPs the analysis recomputed (both recorded iterations).
        extra_compute: recompute_flops over the job's own FLOPs (0.25: a quarter more).
        fits: peak_bytes fits the budget.
        gathered_bytes: with ``--parallel fsdp=N``, the bytes one rank all-gathers in backward
            per step (the analysis's; 0 without FSDP2).
        kept: blocks that keep outputs op by op (finer.py), each with every output it keeps
            (``--checkpoint-save`` names: ``attn.proj:matmuls``), as ``--checkpoint-save-in``
            takes them; they are not in ``selective``.
        keep_units: with ``--parallel fsdp=N``, FSDP2 units (the blocks) that keep their
            parameters after forward where the setting reshards the others (--fsdp-keep-units).
        recompute_cost: the recompute by the plan's cost model (costs.py), what it minimises:
            FLOPs, or on a GPU with known peak rates a roofline time in nanoseconds.
    """

    blocks: tuple[int, ...]
    selective: tuple[int, ...]
    peak_bytes: int
    predicted_bytes: int
    recompute_flops: int
    extra_compute: float
    fits: bool
    gathered_bytes: int = 0
    kept: tuple[tuple[int, tuple[str, ...]], ...] = ()
    keep_units: tuple[int, ...] = ()
    recompute_cost: int = 0


@dataclass(frozen=True, slots=True)
class ShardingOption:
    """One ``reshard_after_forward`` setting with its own checkpointing policy, analysed.

    Attributes:
        reshard_after_forward: fully_shard's argument for every unit (None: FSDP2's default,
            every unit but the root reshards).
        chosen: the least recompute that fits under this setting (None: none fits).
        lowest: the lowest peak any checkpointing choice reaches under it.
        gathered_bytes: bytes one rank all-gathers in backward per step, with ``chosen`` (else
            ``lowest``); ``saved_bytes``: fewer than FSDP2's default setting gathers.
        units: the classes sharded as FSDP2 units under this setting.
    """

    reshard_after_forward: bool | None
    chosen: CheckpointChoice | None
    lowest: CheckpointChoice
    gathered_bytes: int
    saved_bytes: int
    units: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Sharding:
    """FSDP2's settings of the plan: the strategy (``fsdp=8``), the classes sharded as units, the
    MixedPrecisionPolicy dtypes, the setting chosen and every setting searched."""

    parallel: str
    units: tuple[str, ...]
    param_dtype: str | None
    reduce_dtype: str | None
    reshard_after_forward: bool | None
    options: tuple[ShardingOption, ...]
    # finer units tried with the job's own units' blocks checkpointed and found no lower: those
    # units, their analysed peak and the job's own (not searched further)
    probed: tuple[tuple[str, ...], int, int] | None = None

    @property
    def finer(self) -> bool:
        """The units chosen split the job's own (the first searched) finer."""
        return bool(self.options) and bool(self.options[0].units) and self.units != self.options[0].units

    def taken(self, option: ShardingOption) -> bool:
        """Whether ``option`` is the setting chosen."""
        return option.reshard_after_forward == self.reshard_after_forward and (option.units or self.units) == self.units


@dataclass(frozen=True, slots=True)
class PolicyPlan:
    """``plan --policy``'s answer.

    Attributes:
        block_class: the class whose modules are the blocks.
        block_paths: the blocks' module paths, in the model's order.
        chosen: the least recompute whose analysed peak fits; None when none fits.
        lowest: the lowest peak any choice reaches (analysed), the least recompute among equals.
        front: analysed points of the front (no other choice has both less recompute and a lower
            peak), the fewest recompute first; ``front_size``: the front's points in all.
        baseline_bytes: the job as given (no block checkpointed).
        exact: the composite was exact by its own checks (composite.py); ``notes`` say where not.
        transformers: the model is a transformers PreTrainedModel (the emitted file says how to
            turn its own checkpointing on for these layers).
        recordings: analyses the composite read; ``analyses``: analyses that verified choices.
        save: with ``--policy-save``, the outputs a block may keep (``--checkpoint-save``'s names),
            so each block is kept, checkpointed whole or checkpointed keeping them; ``saved_ops``:
            the aten ops they name.
        sharding: with ``--parallel fsdp=N``, FSDP2's settings searched with the blocks and the
            one chosen (graphmem.preflight.policy.sharding); None on one device.
        per_block: where ``chosen`` keeps single ops' outputs (its ``kept``) or some FSDP2 units
            their parameters (``keep_units``), the per-block answer it started from (a point of
            the front); None otherwise.
        cost_model / cost_unit: what "recompute" means in the search (costs.py), in words, and
            the unit of each choice's ``recompute_cost`` (``FLOPs`` or ``ns``).
    """

    block_class: str
    block_paths: tuple[str, ...]
    budget: Budget
    chosen: CheckpointChoice | None
    lowest: CheckpointChoice
    front: tuple[CheckpointChoice, ...]
    front_size: int
    baseline_bytes: int
    exact: bool
    notes: tuple[str, ...]
    transformers: bool
    solver: str
    recordings: int
    analyses: int
    save: tuple[str, ...] = ()
    saved_ops: tuple[str, ...] = ()
    sharding: Sharding | None = None
    per_block: CheckpointChoice | None = None
    cost_model: str = "FLOPs (torch.utils.flop_counter's formulas)"
    cost_unit: str = "FLOPs"

    @property
    def blocks(self) -> int:
        return len(self.block_paths)
