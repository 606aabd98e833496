"""The verifier: how a per-block choice becomes a job, and the analysis of each choice (made once),
turned into a CheckpointChoice.

Input: the job without checkpointing, the blocks' class, the composite, the budget.  Output:
analysed ``CheckpointChoice`` values.  Every peak here comes from an analysis of the job with
the choice applied (``--checkpoint CLASS --checkpoint-blocks ...``), never from the composite.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from graphmem.job.grammar import format_blocks
from graphmem.job.job import Job
from graphmem.job.option import spelling
from graphmem.job.step_config import Checkpointing, ChosenBlocks, EveryBlock, Selective, save_in_of
from graphmem.memory.results import without_graphs
from graphmem.preflight.budget import Budget
from graphmem.preflight.footprint import footprint_of
from graphmem.preflight.policy.composite import Composite
from graphmem.preflight.policy.costs import CostModel
from graphmem.preflight.policy.gathers import backward_gather_bytes
from graphmem.preflight.policy.results import CheckpointChoice
from graphmem.preflight.search import Prediction, predict
from graphmem.process import progress
from graphmem.process.workers import fork_map

__all__ = ["Choices", "Verifier", "analyse", "analyse_all", "blocks_of", "choice_of", "kept_key", "train_of"]


@dataclass(frozen=True, slots=True)
class Choices:
    """How a choice (each block's variant: 0 kept, 1 checkpointed whole, 2 checkpointed keeping
    the ``save`` outputs) becomes a job."""

    job: Job  # without checkpointing
    cls: str
    save: tuple[str, ...]

    @property
    def variants(self) -> int:
        return 3 if self.save else 2

    def job_of(self, choice: Sequence[int], kept: Mapping[int, tuple[str, ...]] | None = None,
               keep_units: tuple[int, ...] = ()) -> Job:
        """The job with ``choice`` applied, as --checkpoint-blocks (--checkpoint-save-blocks) say;
        ``kept``: blocks that keep these outputs instead (--checkpoint-save-in); ``keep_units``:
        FSDP2 units that keep their parameters after forward (--fsdp-keep-units)."""
        job = self.job
        if keep_units:
            assert job.parallel is not None, f"job_of: units to keep under {spelling('parallel')} fsdp=N"
            job = replace(job, parallel=replace(job.parallel, keep_units=keep_units))
        blocks = [i for i, v in enumerate(choice) if v]
        if not blocks:
            return job
        own = dict(kept or {})
        selective = [i for i, v in enumerate(choice) if v == 2 and i not in own]
        own_saves = save_in_of(own)
        alike = not own and len(set(choice)) == 1  # every block in one variant
        if alike or (not own and choice == tuple(1 - i % 2 for i in range(len(choice)))):
            # said without block indices (every block, or every second from the first), the same
            # step is recorded with the model's repeated blocks recorded once (graphmem.trace.repeat)
            every = 1 if alike else 2
            chosen: Checkpointing = (Selective((self.cls,), every, self.save) if choice[0] == 2
                                     else EveryBlock((self.cls,), every))
        elif not selective:
            chosen = ChosenBlocks((self.cls,), tuple(blocks), save_in=own_saves)
        else:
            chosen = ChosenBlocks((self.cls,), tuple(blocks), self.save, tuple(selective), own_saves)
        return replace(job, step=replace(job.step, checkpoint=chosen))

    def names_of(self, choice: Sequence[int], block: int) -> tuple[str, ...]:
        """The outputs ``block`` keeps in ``choice`` (the ``save`` names where selective)."""
        return self.save if choice[block] == 2 else ()

    def label(self, choice: Sequence[int]) -> str:
        whole = format_blocks([i for i, v in enumerate(choice) if v == 1]) or "none"
        kept = format_blocks([i for i, v in enumerate(choice) if v == 2])
        return f"blocks {whole} checkpointed" + (f", {kept} keeping {', '.join(self.save)}" if kept else "")

    def patterns(self, n: int) -> list[tuple[int, ...]]:
        """Every block alike in each checkpointed variant, and every ordered pair of variants
        alternating (a on even blocks, b on odd): each pair of neighbours both ways."""
        alike = [tuple([v] * n) for v in range(1, self.variants)]
        pairs = [tuple(a if i % 2 == 0 else b for i in range(n))
                 for a in range(self.variants) for b in range(self.variants) if a != b]
        return [p for p in dict.fromkeys([*alike, *pairs]) if any(p)]


def analyse(job: Job) -> Prediction:
    made = predict(job, checkpoint_comparison=False)
    return Prediction(made.peak_bytes, without_graphs(made.report))


def _analyse_in_worker(item: tuple[Job, str, int]) -> Prediction:
    job, label, parent = item
    if os.getpid() != parent:
        progress.mute()
    with progress.labelled(label):
        return analyse(job)


def analyse_all(jobs: Sequence[tuple[Job, str]]) -> list[Prediction]:
    """Each job analysed, side by side in worker processes where there are cores."""
    return fork_map(_analyse_in_worker, [(job, label, os.getpid()) for job, label in jobs],
                    what="analysing a checkpointing choice")


def train_of(prediction: Prediction) -> Any:
    mode = prediction.report.train
    assert mode is not None, "make_policy: a training analysis"
    return mode


class Verifier:
    """Analyses choices (each once) and turns them into CheckpointChoices."""

    def __init__(self, choices: Choices, composite: Composite, budget: Budget, base: Prediction,
                 done: Mapping[tuple[int, ...], Prediction], costs: CostModel) -> None:
        self.choices, self.composite, self.budget, self.costs = choices, composite, budget, costs
        self.flops = train_of(base).flops
        # on a GPU, what the budget compares besides the tensors: the CUDA context, NCCL's buffers
        self.outside = footprint_of(base.report, "train").outside_bytes
        self.done: dict[tuple[int, ...], Prediction] = dict(done)
        self.finer: dict[tuple[tuple[int, ...], Any], Prediction] = {}
        self.made: dict[tuple[tuple[int, ...], Any, tuple[int, ...]], CheckpointChoice] = {}
        self.analyses = 0  # made here, to verify

    def analyse(self, choices: Sequence[tuple[int, ...]]) -> None:
        todo = [c for c in dict.fromkeys(choices) if c not in self.done]
        jobs = [(self.choices.job_of(c), f"analysing {self.choices.label(c)}") for c in todo]
        self.done.update(zip(todo, analyse_all(jobs), strict=True))
        self.analyses += len(todo)

    def choice(self, choice: tuple[int, ...]) -> CheckpointChoice:
        self.analyse([choice])
        return self._made(choice, self.done[choice], {})

    def kept_choice(self, choice: tuple[int, ...], kept: Mapping[int, tuple[str, ...]],
                    keep_units: tuple[int, ...] = ()) -> CheckpointChoice:
        """``choice`` with the blocks of ``kept`` keeping those outputs (and the FSDP2 units of
        ``keep_units`` their parameters), analysed."""
        self.analyse_kept(choice, [(kept, keep_units)])
        return self._made(choice, self.finer[choice, kept_key(kept, keep_units)], kept, keep_units)

    def analyse_kept(self, choice: tuple[int, ...],
                     trials: Sequence[tuple[Mapping[int, tuple[str, ...]], tuple[int, ...]]]) -> None:
        """kept_choice's analyses of ``choice`` with each (kept, keep_units) of ``trials``, side by side."""
        todo = {kept_key(kept, units): (kept, units) for kept, units in trials
                if (choice, kept_key(kept, units)) not in self.finer}
        jobs = [(self.choices.job_of(choice, kept, units), f"analysing {self.choices.label(choice)} with "
                 + ("outputs kept" if not units else "parameters kept in some units")) for kept, units in todo.values()]
        self.finer.update({(choice, key): made for key, made in zip(todo, analyse_all(jobs), strict=True)})
        self.analyses += len(todo)

    def _made(self, choice: tuple[int, ...], made: Prediction, kept: Mapping[int, tuple[str, ...]],
              keep_units: tuple[int, ...] = ()) -> CheckpointChoice:
        """The CheckpointChoice of an analysis, made once (its recompute cost reads the whole trace)."""
        key = (choice, tuple(sorted(kept.items())), keep_units)
        if key not in self.made:
            self.made[key] = self._checkpoint_choice(choice, made, kept, keep_units)
        return self.made[key]

    def _checkpoint_choice(self, choice: tuple[int, ...], made: Prediction, kept: Mapping[int, tuple[str, ...]],
                           keep_units: tuple[int, ...]) -> CheckpointChoice:
        recompute = train_of(made).recompute_flops
        return CheckpointChoice(blocks=blocks_of(choice),
                                selective=tuple(i for i, v in enumerate(choice) if v == 2 and i not in kept),
                                peak_bytes=made.peak_bytes,
                                predicted_bytes=self.composite.peak(choice), recompute_flops=recompute,
                                extra_compute=recompute / self.flops if self.flops else 0.0,
                                fits=self.budget.fits(made.peak_bytes),
                                gathered_bytes=backward_gather_bytes(train_of(made)),
                                kept=tuple(sorted(kept.items())), keep_units=keep_units,
                                recompute_cost=self.costs.recompute(train_of(made)))


def kept_key(kept: Mapping[int, tuple[str, ...]], keep_units: tuple[int, ...]) -> Any:
    return tuple(sorted(kept.items())), keep_units


def blocks_of(choice: Sequence[int]) -> tuple[int, ...]:
    return tuple(i for i, v in enumerate(choice) if v)


def choice_of(made: CheckpointChoice, n: int) -> tuple[int, ...]:
    return tuple(2 if i in made.selective else int(i in made.blocks) for i in range(n))
