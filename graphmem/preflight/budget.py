"""Memory budgets for the pre-flight commands: pure parsing of ``--budget`` and ``--margin``.

Input: strings such as ``80GiB``, ``80GB``, ``123456B``, ``0.9`` (of a GPU) and ``5%``.
Output: a frozen ``Budget``: the bytes available and the safety margin.  Nothing here
analyses a model.

Units: ``B``; binary ``KiB MiB GiB TiB`` (powers of 1024); decimal ``KB MB GB TB`` (powers
of 1000, as disk and GPU marketing sizes are written).  A bare number up to 1 (or a
percentage) is a fraction of the ``--gpu``'s memory (``torch.cuda.get_device_properties``'
``total_memory``, see graphmem/cuda/gpus.py).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from fractions import Fraction

from graphmem.cuda.gpus import GPU
from graphmem.errors import UserInputError
from graphmem.job.option import spelling
from graphmem.units import BINARY_UNITS

__all__ = ["BUDGET_UNITS", "DEFAULT_METRIC", "METRICS", "Budget", "BudgetAmount", "parse_budget", "parse_margin",
           "resolve_budget"]

BUDGET_UNITS: dict[str, int] = {**BINARY_UNITS, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
# ``check --metric``: which of the CUDA target's numbers is compared with the budget (docs/glossary.md).
# A budget is memory on the GPU, so what lives there outside PyTorch's allocator (the CUDA context,
# NCCL's buffers) takes its share whichever counter is compared (graphmem/preflight/footprint.py).
METRICS = ("allocated", "reserved", "nvidia-smi")
DEFAULT_METRIC = "reserved"
_UNIT_BY_LOWER = {name.lower(): factor for name, factor in BUDGET_UNITS.items()}
_AMOUNT_RE = re.compile(r"^\s*(?P<number>[0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*(?P<unit>[A-Za-z%]*)\s*$")
_BUDGET_HINT = (f"expected bytes with a unit (123456B, 512MiB, 80GiB, 80GB) or, with {spelling('gpu')}, a fraction "
                "of the GPU's memory (0.9 or 90%)")


@dataclass(frozen=True, slots=True)
class BudgetAmount:
    """A parsed ``--budget``: either bytes or a fraction of a GPU's memory (exactly one set)."""

    text: str
    nbytes: int | None = None
    fraction: Fraction | None = None


@dataclass(frozen=True, slots=True)
class Budget:
    """The memory a job may use, and the margin kept free.

    A predicted peak P fits when ``P * (1 + margin) <= total_bytes``.
    """

    total_bytes: int
    margin: Fraction
    source: str  # what the user wrote, e.g. "80GiB" or "0.9 of h100-80gb"

    @property
    def cap_bytes(self) -> int:
        """The largest predicted peak that fits: floor(total / (1 + margin))."""
        return math.floor(Fraction(self.total_bytes) / (1 + self.margin))

    def required_bytes(self, peak_bytes: int) -> int:
        """The peak with the margin added, rounded up to a whole byte."""
        return math.ceil(peak_bytes * (1 + self.margin))

    def fits(self, peak_bytes: int) -> bool:
        """Whether ``peak_bytes`` plus the margin stays within the budget."""
        return peak_bytes <= self.cap_bytes


def parse_budget(text: str) -> BudgetAmount:
    """Parse ``--budget``: ``123456B``, ``512MiB``, ``80GiB``, ``80GB``, ``0.9`` or ``90%``.

    Raises:
        UserInputError: malformed text, an unknown unit, a bare number above 1, or zero.
    """
    match = _AMOUNT_RE.match(text)
    if match is None:
        raise UserInputError(f"malformed budget {text!r}; {_BUDGET_HINT}")
    number, unit = Fraction(match["number"]), match["unit"]
    if unit == "%":
        number, unit = number / 100, ""
    if not unit:
        if not 0 < number <= 1:
            raise UserInputError(f"budget {text!r} has no unit; {_BUDGET_HINT}")
        return BudgetAmount(text=text.strip(), fraction=number)
    factor = _UNIT_BY_LOWER.get(unit.lower())
    if factor is None:
        raise UserInputError(f"unknown unit {unit!r} in budget {text!r}; expected one of: "
                             f"{', '.join(BUDGET_UNITS)} (KiB = 1024 B, KB = 1000 B)")
    nbytes = math.floor(number * factor)
    if nbytes <= 0:
        raise UserInputError(f"budget {text!r} is zero bytes; {_BUDGET_HINT}")
    return BudgetAmount(text=text.strip(), nbytes=nbytes)


def parse_margin(text: str) -> Fraction:
    """Parse ``--margin``: ``5%`` or ``0.05`` -> Fraction(1, 20); from 0 to 100%.

    Raises:
        UserInputError: malformed text or a margin above 100%.
    """
    match = _AMOUNT_RE.match(text)
    if match is None or match["unit"] not in ("", "%"):
        raise UserInputError(f"malformed margin {text!r}; expected a percentage such as 5% or a "
                             "fraction such as 0.05")
    margin = Fraction(match["number"]) / (100 if match["unit"] == "%" else 1)
    if margin > 1:
        raise UserInputError(f"margin {text!r} is above 100%; expected e.g. 5% or 0.05")
    return margin


def resolve_budget(amount: BudgetAmount | None, gpu: GPU | None, margin: Fraction = Fraction(0)) -> Budget:
    """The budget in bytes: ``amount`` as given, a fraction of ``gpu``, or the whole ``gpu``.

    Raises:
        UserInputError: neither a budget nor a GPU, or a fraction without a GPU.
    """
    if amount is None:
        if gpu is None:
            raise UserInputError(f"no budget: give --budget (e.g. 80GiB) or {spelling('gpu')} (e.g. h100-80gb)")
        return Budget(gpu.total_memory_bytes, margin, f"{gpu.name} ({gpu.total_memory_bytes:,} B)")
    if amount.nbytes is not None:
        return Budget(amount.nbytes, margin, amount.text)
    if gpu is None:
        raise UserInputError(f"budget {amount.text!r} is a fraction of a GPU, but no {spelling('gpu')} was given; "
                             f"add {spelling('gpu')} h100-80gb (or another preset) or give bytes such as 80GiB")
    assert amount.fraction is not None, "resolve_budget: a BudgetAmount without bytes or fraction"
    total = math.floor(amount.fraction * gpu.total_memory_bytes)
    return Budget(total, margin, f"{amount.text} of {gpu.name}")
