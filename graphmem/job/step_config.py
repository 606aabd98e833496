"""The step section: how the training step runs, and its activation checkpointing as one of
three typed variants (after torchtitan's ``FullAC.Config`` / ``SelectiveAC.Config``):

- ``EveryBlock``: every k-th module of the named classes recomputed whole;
- ``Selective``: the same modules, keeping the outputs of some ops (recomputing the rest);
- ``ChosenBlocks``: the blocks ``plan --policy`` chooses, each whole or keeping some outputs.

Imports no torch (the command line derives its options from these fields).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from graphmem.errors import UserInputError
from graphmem.job.choices import AMP_CHOICES, LOSSES, OPTIMIZER_CHOICES, OPTIMIZER_IMPLS
from graphmem.job.grammar import format_blocks, format_save_in, parse_blocks, parse_save_in
from graphmem.job.option import flag, option, section, shown

__all__ = ["SAVE_CHOICES", "ChosenBlocks", "EveryBlock", "Selective", "StepConfig", "split_save"]

# --checkpoint-save: the outputs kept by selective activation checkpointing
SAVE_CHOICES = {
    "matmuls": "every matrix multiply (mm, addmm, bmm, baddbmm)",
    "every-2nd-matmul": "every second matrix multiply of a block's forward (torchtitan's op policy)",
    "attention": "the scaled-dot-product attention kernels",
}


def split_save(name: str) -> tuple[str, str]:
    """A ``--checkpoint-save`` name as (submodule path inside the block, what it keeps):
    ``"attn.proj:matmuls"`` -> ``("attn.proj", "matmuls")``, ``"matmuls"`` -> ``("", "matmuls")``."""
    path, _, kind = name.rpartition(":")
    return path, kind


def names_of(value: Sequence[str] | str) -> tuple[str, ...]:
    """``"A,B"`` or ``["A", "B"]`` -> ``("A", "B")``."""
    if isinstance(value, str):
        value = value.split(",")
    return tuple(c.strip() for c in value if c.strip())


def blocks_of(blocks: Sequence[int] | str) -> tuple[int, ...]:
    """``"0-3,6"`` or ``[0, 1, 2, 3, 6]`` -> ``(0, 1, 2, 3, 6)`` (graphmem.job.grammar.parse_blocks)."""
    return parse_blocks(blocks) if isinstance(blocks, str) else tuple(sorted(int(b) for b in blocks))


def save_in_of(save_in: Mapping[int, Sequence[str]] | Sequence[tuple[int, Sequence[str]]] | str
               ) -> tuple[tuple[int, tuple[str, ...]], ...]:
    """``"0=attn.proj:matmuls"`` or ``{0: ["attn.proj:matmuls"]}`` -> ``((0, ("attn.proj:matmuls",)),)``."""
    if isinstance(save_in, str):
        return parse_save_in(save_in)
    pairs = save_in.items() if isinstance(save_in, Mapping) else save_in
    return tuple(sorted((int(block), names_of(names)) for block, names in pairs))


_BLOCKS_METAVAR = "I[-J][,...]"
_CLASSES = option("--checkpoint", default="", metavar="CLASS[,CLASS]", to_field=names_of,
                  help="What-if: run every module of these classes under non-reentrant activation checkpointing; "
                       "the report shows the peak with and without it.")
_EVERY = option("--checkpoint-every", kind="int", minimum=1, default=1, show_default=True,
                help="With --checkpoint: checkpoint only every K-th module of those classes (1st, K+1-th, ...).")
_SAVE = option("--checkpoint-save", default="", metavar="OPS", to_field=names_of,
               help="With --checkpoint: selective activation checkpointing: keep the outputs of these ops and "
                    "recompute the rest: matmuls, every-2nd-matmul, attention, or aten op names (aten.mm,aten.addmm); "
                    "PATH:NAME keeps them only inside the block's submodule at PATH (attn.proj:matmuls).")
_BLOCKS = option("--checkpoint-blocks", parse=parse_blocks, done=tuple, metavar=_BLOCKS_METAVAR, default="",
                 to_field=blocks_of, to_text=format_blocks,
                 help="With --checkpoint: checkpoint only these of the modules of those classes (0-based, in the "
                      "model's order), e.g. 0-5,8: the choice graphmem plan --policy makes.")
_SAVE_BLOCKS = option("--checkpoint-save-blocks", parse=parse_blocks, done=tuple, metavar=_BLOCKS_METAVAR,
                      default="", to_field=blocks_of, to_text=format_blocks,
                      help="With --checkpoint-blocks and --checkpoint-save: only these blocks keep those outputs "
                           "(selective); the other chosen blocks are checkpointed whole.")
_SAVE_IN = option("--checkpoint-save-in", parse=parse_save_in, done=tuple, metavar="I[-J]=OPS[;...]", default="",
                  to_field=save_in_of, to_text=format_save_in,
                  help="With --checkpoint-blocks: the outputs each of these blocks keeps, in place of "
                       "--checkpoint-save, e.g. 0=attn.proj:matmuls;2-3=matmuls,attention: the op-by-op choice "
                       "graphmem plan --policy makes.")


def _check_saved(names: Sequence[str]) -> None:
    unknown = [n for n in dict.fromkeys(names) if split_save(n)[1] not in SAVE_CHOICES
               and not split_save(n)[1].startswith("aten.")]
    if unknown:
        raise UserInputError(f"{flag(Selective, 'save')}: unknown {', '.join(unknown)}; expected "
                             f"{', '.join(SAVE_CHOICES)} or aten op names such as aten.mm, each optionally after a "
                             "submodule path inside the block (attn.proj:matmuls)")


@dataclass(frozen=True, slots=True)
class EveryBlock:
    """Every ``every``-th module of the ``classes`` (the 1st, k+1-th, ...) recomputed whole in
    backward (non-reentrant torch.utils.checkpoint)."""

    classes: tuple[str, ...] = field(metadata=_CLASSES)
    """Class names whose modules are checkpointed."""
    every: int = field(default=1, metadata=_EVERY)
    """Only every k-th of those modules."""

    def __post_init__(self) -> None:
        if not self.classes:
            raise AssertionError("EveryBlock: no class")
        if self.every < 1:
            raise UserInputError(f"{flag(EveryBlock, 'every')} must be >= 1, got {self.every}")

    # what the other variants say, here nothing: every k-th module, recomputed whole
    blocks: ClassVar[tuple[int, ...]] = ()
    save: ClassVar[tuple[str, ...]] = ()
    save_blocks: ClassVar[tuple[int, ...]] = ()
    save_in: ClassVar[tuple[tuple[int, tuple[str, ...]], ...]] = ()

    @classmethod
    def fold(cls, values: Mapping[str, Any]) -> EveryBlock | Selective | ChosenBlocks | None:
        """The variant the checkpoint options describe (None: no checkpointing)."""
        classes, every = names_of(values.get("checkpoint", ())), int(values.get("checkpoint_every", 1))
        save, blocks = names_of(values.get("checkpoint_save", ())), blocks_of(values.get("checkpoint_blocks", ()))
        save_blocks = blocks_of(values.get("checkpoint_save_blocks", ()))
        save_in = save_in_of(values.get("checkpoint_save_in", ()))
        if (every != 1 or save or blocks) and not classes:
            raise UserInputError(f"{flag(EveryBlock, 'every')}, {flag(ChosenBlocks, 'blocks')} and "
                                 f"{flag(Selective, 'save')} refine {flag(EveryBlock, 'classes')} CLASS; give the "
                                 "class of the blocks to checkpoint too")
        if blocks and every != 1:
            raise UserInputError(f"{flag(ChosenBlocks, 'blocks')} names the blocks to checkpoint; "
                                 f"{flag(EveryBlock, 'every')} picks every k-th: give one of them")
        if blocks or save_blocks or save_in:
            return ChosenBlocks(classes, blocks, save, save_blocks, save_in) if classes else None
        if not classes:
            return None
        return Selective(classes, every, save) if save else EveryBlock(classes, every)


@dataclass(frozen=True, slots=True)
class Selective:
    """Every ``every``-th module of the ``classes`` checkpointed selectively: the outputs of the
    ``save`` ops are kept, every other op is recomputed in backward."""

    classes: tuple[str, ...] = field(metadata=_CLASSES)
    every: int = field(default=1, metadata=_EVERY)
    save: tuple[str, ...] = field(default=(), metadata=_SAVE)
    """Names from SAVE_CHOICES or aten op names such as ``aten.mm``, each for the whole block or,
    as ``PATH:NAME``, only for the ops run inside the block's submodule at PATH."""

    def __post_init__(self) -> None:
        if self.every < 1:
            raise UserInputError(f"{flag(EveryBlock, 'every')} must be >= 1, got {self.every}")
        _check_saved(self.save)

    blocks: ClassVar[tuple[int, ...]] = ()
    save_blocks: ClassVar[tuple[int, ...]] = ()
    save_in: ClassVar[tuple[tuple[int, tuple[str, ...]], ...]] = ()


@dataclass(frozen=True, slots=True)
class ChosenBlocks:
    """The ``blocks`` (0-based, in ``model.modules()`` order) of the ``classes`` checkpointed,
    what ``graphmem plan --policy`` chooses: with ``save``, those among ``save_blocks`` (all,
    when empty) keep the ``save`` outputs; ``save_in`` gives a block its own."""

    classes: tuple[str, ...] = field(metadata=_CLASSES)
    blocks: tuple[int, ...] = field(default=(), metadata=_BLOCKS)
    save: tuple[str, ...] = field(default=(), metadata=_SAVE)
    save_blocks: tuple[int, ...] = field(default=(), metadata=_SAVE_BLOCKS)
    save_in: tuple[tuple[int, tuple[str, ...]], ...] = field(default=(), metadata=_SAVE_IN)

    def __post_init__(self) -> None:
        blocks, saving, own = flag(ChosenBlocks, "blocks"), flag(ChosenBlocks, "save"), flag(ChosenBlocks, "save_in")
        if self.save_blocks and not (self.save and set(self.save_blocks) <= set(self.blocks)):
            raise UserInputError(f"{flag(ChosenBlocks, 'save_blocks')} names which of the {blocks} keep the "
                                 f"{saving} outputs: give both, and only blocks among {blocks}")
        if any(b < 0 for b in self.blocks) or len(set(self.blocks)) != len(self.blocks):
            raise UserInputError(f"{blocks}: block indices must be distinct and >= 0, got "
                                 f"{','.join(map(str, self.blocks))}")
        _check_saved([*self.save, *(n for _, saved in self.save_in for n in saved)])
        chosen = [b for b, _ in self.save_in]
        if chosen and not (set(chosen) <= set(self.blocks) and len(set(chosen)) == len(chosen)):
            raise UserInputError(f"{own} names blocks among {blocks}, each once, with the outputs each keeps "
                                 "(0=attn.proj:matmuls)")

    every: ClassVar[int] = 1


Checkpointing = EveryBlock | Selective | ChosenBlocks


def checkpoint_json(chosen: Checkpointing) -> dict[str, Any]:
    """The checkpointing as the JSON ``setup`` shows it (docs/json-schema.md)."""
    return {"classes": list(chosen.classes), "every": chosen.every, "save": list(chosen.save),
            **({"blocks": list(chosen.blocks)} if chosen.blocks else {}),
            **({"save_blocks": list(chosen.save_blocks)} if chosen.save_blocks else {}),
            **({"save_in": {str(b): list(names) for b, names in chosen.save_in}} if chosen.save_in else {})}


def checkpoint_text(chosen: Checkpointing | None) -> str:
    """The checkpointing in words, as the report's header says it."""
    if chosen is None:
        return ""
    every = {1: "", 2: "2nd "}.get(chosen.every, f"{chosen.every}th ")
    saved = f"; keeps the outputs of {', '.join(chosen.save)}" if chosen.save else ""
    if chosen.save_blocks:
        saved += f" in blocks {format_blocks(chosen.save_blocks)}"
    for block, names in chosen.save_in:
        saved += f"; block {block} keeps the outputs of {', '.join(names)}"
    which = (f"blocks {format_blocks(chosen.blocks)} of the {', '.join(chosen.classes)} modules" if chosen.blocks
             else f"every {every}{', '.join(chosen.classes)}")
    return which + saved


def _trained(value: Any, facts: Mapping[str, Any]) -> Any:
    """A training setting: shown when the step trains (None otherwise)."""
    return value if facts["training"] else None


def _autocast_row(amp: str | None, facts: Mapping[str, Any]) -> str:
    scaler = " + GradScaler" if amp == "fp16" and facts["training"] else ""
    return f"{amp} (torch.autocast{scaler})" if amp else ""


@dataclass(frozen=True, slots=True)
class StepConfig:
    """How the training step runs."""

    optimizer: str = field(default="adam", metadata=option(
        "--optimizer", default="adam", show_default=True, metavar="NAME|pkg.module:Class",
        help="Optimizer of the training step: the real torch.optim class with its defaults "
             f"({', '.join(OPTIMIZER_CHOICES)}; the *8bit ones are bitsandbytes sized by formula), or any "
             "importable torch.optim.Optimizer subclass.") | shown(key="optimizer", at_json=10, json=_trained))
    """A name from OPTIMIZER_CHOICES, or ``pkg.module:Class`` of a torch.optim.Optimizer subclass."""
    optimizer_kwargs: Mapping[str, Any] = field(default_factory=dict, metadata=option(
        "--optimizer-kwargs", kind="json", to_field=lambda value: dict(value or {}),
        help="JSON object of extra optimizer arguments, e.g. '{\"lr\": 0.01, \"amsgrad\": true}'.")
        | shown(key="optimizer_kwargs", at_json=12, json=lambda value, facts: _trained(dict(value), facts)))
    """Extra keyword arguments for the optimizer."""
    optimizer_impl: str = field(default="auto", metadata=option(
        "--optimizer-impl", choices=tuple(OPTIMIZER_IMPLS), default="auto", show_default=True,
        help="auto: what PyTorch picks for the target device (for-loop on CPU).")
        | shown(key="optimizer_impl", at_json=11,
                json=lambda value, facts: _trained(facts.get("implementation") or value, facts)))
    """``auto``, ``for-loop``, ``foreach`` or ``fused``."""
    amp: str | None = field(default=None, metadata=option(
        "--amp", choices=AMP_CHOICES,
        help="Mixed precision: torch.autocast around forward and loss; fp16 adds a GradScaler.")
        | shown(key="amp", at_json=30, label="autocast", at_row=20, row=_autocast_row))
    """None, ``"bf16"`` or ``"fp16"``: torch.autocast around forward and loss (fp16 adds a GradScaler)."""
    checkpoint: Checkpointing | None = field(default=None, metadata=section(
        EveryBlock, Selective, ChosenBlocks) | shown(
        key="checkpoint", at_json=40,
        json=lambda value, facts: _trained(checkpoint_json(value), facts) if value else None,
        label="checkpointing", at_row=30, row=lambda value, facts: _trained(checkpoint_text(value), facts) or ""))
    """Activation checkpointing (None: none)."""
    grad_accum: int = field(default=1, metadata=option(
        "--grad-accum", kind="int", minimum=1, default=1, show_default=True,
        help="Forward/backward micro-steps per optimizer step.")
        | shown(key="grad_accum", at_json=50, json=_trained, label="accumulation", at_row=40,
                row=lambda value, facts: f"{value} micro-batches per optimizer step"
                if value > 1 and facts["training"] else ""))
    """Micro-steps (forward + backward) per optimizer step."""
    loss: str = field(default="auto", metadata=option(
        "--loss", choices=LOSSES, default="auto", show_default=True,
        help="auto: output.loss if present, else sum of the first float output; cross_entropy/nll use int64 "
             "class targets."))
    """A name from LOSSES."""
    iterations: int = 2
    """Optimizer steps recorded (2: the first creates the optimizer state)."""

    def __post_init__(self) -> None:
        if self.optimizer not in OPTIMIZER_CHOICES and ":" not in self.optimizer:
            raise UserInputError(f"unknown optimizer {self.optimizer!r}; expected one of: "
                                 f"{', '.join(OPTIMIZER_CHOICES)}, or pkg.module:Class")
        for value, choices, what in ((self.optimizer_impl, tuple(OPTIMIZER_IMPLS), "optimizer-impl"),
                                     (self.loss, LOSSES, "loss"), (self.amp or "bf16", AMP_CHOICES, "amp")):
            if value not in choices:
                raise UserInputError(f"unknown {what} {value!r}; expected one of: {', '.join(choices)}")
        if self.grad_accum < 1 or self.iterations < 1:
            raise UserInputError(f"grad-accum and iterations must be >= 1, got {self.grad_accum} "
                                 f"and {self.iterations}")
