"""``--assume``, resolved once: what the user declared about values graphmem does not see.

Input: the job's ``assume`` mapping (``NAME=VALUE`` pairs as ``job.spec.parse_assumption``
normalised them).  Output: a frozen ``Assumptions``: the values of named inputs, and the
knobs that are about no one input (``nonzero=F``, ``reads=N``, ``routing=...``, ``boxes=N``),
typed and checked before anything is recorded.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from graphmem.errors import UserInputError
from graphmem.job.option import spelling
from graphmem.job.spec import KEPT_FRACTION, READ_VALUE, ROUTING

__all__ = ["BOXES", "DEFAULT_BOXES", "KNOBS", "Assumptions"]

BOXES = "boxes"  # --assume boxes=N: ground-truth boxes per image a detection model is trained on
DEFAULT_BOXES = 8
KNOBS = frozenset({KEPT_FRACTION, READ_VALUE, ROUTING, BOXES})  # assumptions that are not about one input


@dataclass(frozen=True, slots=True)
class Assumptions:
    """What was declared: ``inputs`` maps an input's name to its value (``ones``, ``zeros``,
    ``arange`` or an integer); ``kept`` the fraction of their most that value-dependent sizes
    keep; ``reads`` the number a read of unknown values gives; ``routing`` how choices from
    unknown values spread; ``boxes`` the ground-truth boxes per image graphmem makes."""

    inputs: Mapping[str, str] = field(default_factory=dict)
    kept: float | None = None
    reads: int | None = None
    routing: str = "uneven"
    boxes: int = DEFAULT_BOXES

    @classmethod
    def of(cls, assume: Mapping[str, str]) -> Assumptions:
        """The typed assumptions of a job's ``assume`` mapping.

        Raises:
            UserInputError: ``boxes`` is not a positive whole number.
        """
        try:
            boxes = int(assume.get(BOXES, DEFAULT_BOXES))
        except ValueError:
            boxes = -1
        if boxes < 1:
            raise UserInputError(f"{spelling('assume')} boxes={assume.get(BOXES)}: expected a positive number of "
                                 "ground-truth "
                                 "boxes per image, e.g. boxes=8")
        return cls(inputs={k: v for k, v in assume.items() if k not in KNOBS},
                   kept=float(assume[KEPT_FRACTION]) if KEPT_FRACTION in assume else None,
                   reads=int(assume[READ_VALUE]) if READ_VALUE in assume else None,
                   routing=assume.get(ROUTING, "uneven"), boxes=boxes)

    def check_names(self, names: Sequence[str]) -> None:
        """Every input named is one of ``names``.

        Raises:
            UserInputError: one names no input; lists the inputs.
        """
        unknown = set(self.inputs) - set(names)
        if unknown:
            raise UserInputError(f"{spelling('assume')} names {', '.join(sorted(unknown))}, which is not an input; "
                                 f"inputs: {', '.join(names)}")
