"""Pure parsing of what the command line says about the job's data: input specifications
(``[NAME=]DIMS[:DTYPE]``), dtype names, ``--generate P+N`` and ``--assume NAME=VALUE``.

Input: strings from the command line or the Python API.  Output: frozen values.
Nothing here touches a model or allocates a tensor.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from graphmem.errors import UserInputError

__all__ = ["ASSUMPTION_KINDS", "DTYPE_ALIASES", "KEPT_FRACTION", "MODEL_DTYPES", "READ_VALUE", "ROUTING", "ROUTINGS",
           "GenerateSpec", "InputSpec", "input_dims", "input_symbol", "parse_assumption", "parse_dtype",
           "parse_generate", "parse_input_spec", "parse_sweep", "spec_at", "substitute", "validate_inputs"]

# Every name a user may write for a dtype, mapped to torch's dtype.
DTYPE_ALIASES: dict[str, torch.dtype] = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32, "f32": torch.float32,
    "float64": torch.float64, "fp64": torch.float64, "double": torch.float64, "f64": torch.float64,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16, "f16": torch.float16,
    "int64": torch.int64, "long": torch.int64, "i64": torch.int64,
    "int32": torch.int32, "int": torch.int32, "i32": torch.int32,
    "int16": torch.int16, "short": torch.int16,
    "int8": torch.int8, "uint8": torch.uint8, "byte": torch.uint8,
    "bool": torch.bool,
    "complex64": torch.complex64, "cfloat": torch.complex64,
}

# The values ``--assume NAME=VALUE`` may give an integer input, besides an integer.
ASSUMPTION_KINDS = ("ones", "zeros", "arange")

# The dtypes a whole model may be converted to with ``--dtype``.
MODEL_DTYPES = ("float32", "bfloat16", "float16")

_SYMBOL_RE = re.compile(r"^[A-WYZ]$")  # one capital letter; x/X separate dimensions
_SPEC_PARTS_RE = re.compile(r"^(?P<name>\s*[A-Za-z_][A-Za-z0-9_]*\s*=)?(?P<dims>[^:=]*)(?P<dtype>:.*)?$")
_SPEC_RE = re.compile(
    r"^(?:(?P<name>[A-Za-z_][A-Za-z0-9_]*)=)?(?P<dims>[^:=]*)(?::(?P<dtype>[A-Za-z0-9_]+))?$"
)


# A tensor's size in bytes is an int64 (c10's storage size computation refuses more), as are
# its dimensions and the values graphmem may assume for an integer input.
_MAX_TENSOR_BYTES = _MAX_INT = 2**63 - 1


@dataclass(frozen=True, slots=True)
class InputSpec:
    """One example input: its shape, dtype and, for keyword inputs, its name.

    ``symbolic``: the dimensions that are the job's size symbol (``B`` in ``Bx1000``) when the
    input is recorded with that size as a symbol (graphmem.trace.symbolic); ``shape`` then
    holds the value it has while recording."""

    shape: tuple[int, ...]
    dtype: torch.dtype = torch.float32
    name: str | None = None
    symbolic: tuple[int, ...] = ()

    def __str__(self) -> str:
        dims = "x".join(str(d) for d in self.shape) or "scalar"
        dtype = str(self.dtype).removeprefix("torch.")
        return f"{self.name + '=' if self.name else ''}{dims}:{dtype}"


def parse_dtype(text: str) -> torch.dtype:
    """Return the torch dtype named by ``text`` (case-insensitive, aliases allowed).

    Raises:
        UserInputError: the name is unknown; the message lists the valid names.
    """
    dtype = DTYPE_ALIASES.get(text.strip().lower().removeprefix("torch."))
    if dtype is None:
        choices = ", ".join(sorted(DTYPE_ALIASES))
        raise UserInputError(f"unknown dtype {text!r}; expected one of: {choices}")
    return dtype


def parse_input_spec(text: str) -> InputSpec:
    """Parse ``[NAME=]DIMS[:DTYPE]``, e.g. ``32x1000``, ``8x512:int64``, ``ids=2x128:int64``.

    DIMS are positive integers joined by ``x`` (``scalar`` or an empty string for a 0-d
    tensor).  DTYPE defaults to float32.

    Raises:
        UserInputError: malformed text, a non-positive dimension, an unknown dtype, or more
            than 2**63 - 1 bytes in all.
    """
    match = _SPEC_RE.match(text.strip())
    hint = "expected [NAME=]DIMS[:DTYPE] such as 32x1000, 8x512:int64 or input_ids=2x128:int64"
    if match is None:
        raise UserInputError(f"malformed input spec {text!r}; {hint}")
    dims_text = match["dims"].strip().lower()
    dims: list[int] = []
    if dims_text not in ("", "scalar"):
        for part in dims_text.split("x"):
            if not part.strip().isdecimal():  # not isdigit: int() refuses "²", which isdigit takes
                raise UserInputError(f"malformed input spec {text!r}: dimension {part!r} "
                                     f"is not a positive integer; {hint}")
            dims.append(int(part))
    if any(d <= 0 for d in dims):
        raise UserInputError(f"input spec {text!r} has a dimension <= 0; dimensions must be "
                             "positive integers")
    dtype = parse_dtype(match["dtype"]) if match["dtype"] else torch.float32
    elements = math.prod(dims)
    if elements * dtype.itemsize > _MAX_TENSOR_BYTES:
        raise UserInputError(f"input spec {text!r} is too large: {elements:,} elements of {dtype.itemsize} bytes "
                             f"pass the {_MAX_TENSOR_BYTES:,} bytes a tensor can hold; give smaller dimensions")
    return InputSpec(shape=tuple(dims), dtype=dtype, name=match["name"])


@dataclass(frozen=True, slots=True)
class GenerateSpec:
    """``--generate P+N`` with ``--batch B``."""

    prompt: int
    new: int
    batch: int = 1


def parse_generate(text: str, batch: int = 1) -> GenerateSpec:
    """``"2048+512"`` -> GenerateSpec(2048, 512, batch)."""
    match = re.fullmatch(r"\s*(\d+)\s*\+\s*(\d+)\s*", text)
    if match is None or int(match[1]) < 1 or int(match[2]) < 1 or batch < 1:
        raise UserInputError(f"malformed --generate {text!r}; expected PROMPT+NEW with positive "
                             "token counts, e.g. 2048+512 (and --batch >= 1)")
    if (int(match[1]) + int(match[2])) * batch > _MAX_INT:
        raise UserInputError(f"--generate {text!r} with --batch {batch}: more tokens than a tensor can index "
                             f"({_MAX_INT:,}); give smaller counts")
    return GenerateSpec(int(match[1]), int(match[2]), batch)


# --assume nonzero=F: the fraction of their most that value-dependent sizes keep
KEPT_FRACTION = "nonzero"
# --assume routing=uneven|balanced: the choices top-k / argmax make on values graphmem does not have
ROUTING = "routing"
ROUTINGS = ("uneven", "balanced")
# --assume reads=N: a number the model reads from values graphmem does not have is taken as N
READ_VALUE = "reads"


def parse_assumption(text: str) -> tuple[str, str]:
    """``NAME=ones|zeros|arange|INT`` -> (name, value); or ``nonzero=F``, F in [0, 1]: the
    fraction of their most that value-dependent sizes (nonzero, masks, unique, LLM.int8's
    outlier columns) keep."""
    name, sep, value = text.partition("=")
    value = value.strip().lower()
    if name.strip() == KEPT_FRACTION:
        try:
            fraction = float(value)
        except ValueError:
            fraction = -1.0
        if not 0 <= fraction <= 1:
            raise UserInputError(f"malformed --assume {text!r}; expected {KEPT_FRACTION}=F with F a fraction in "
                                 "[0, 1], e.g. nonzero=0.5: value-dependent selections keep half their elements")
        return KEPT_FRACTION, repr(fraction)
    if name.strip() == READ_VALUE:
        if not value.isdecimal() or int(value) > _MAX_INT:
            raise UserInputError(f"malformed --assume {text!r}; expected {READ_VALUE}=N with N a whole number up to "
                                 f"{_MAX_INT:,}, e.g. "
                                 "reads=1000: each number the model reads from values it computed (a predicted "
                                 "length) is taken as 1000")
        return READ_VALUE, value
    if name.strip() == ROUTING:
        if value not in ROUTINGS:
            raise UserInputError(f"malformed --assume {text!r}; expected {ROUTING}=uneven (every expert gets a token, "
                                 "the first ones all the rest) or routing=balanced (tokens spread evenly)")
        return ROUTING, value
    integer = value.removeprefix("-").isdecimal() and -_MAX_INT - 1 <= int(value) <= _MAX_INT
    if not sep or not name.strip() or not (value in ASSUMPTION_KINDS or integer):
        raise UserInputError(f"malformed --assume {text!r}; expected NAME=VALUE with VALUE one of "
                             f"{', '.join(ASSUMPTION_KINDS)} or an integer that fits int64, e.g. attention_mask=ones")
    return name.strip(), value


def _split_spec(text: str) -> tuple[str, list[str], str]:
    match = _SPEC_PARTS_RE.match(text.strip())
    if match is None:
        parse_input_spec(text)  # raises the spec parser's own message
        raise AssertionError(f"_split_spec: {text!r} matched neither parser")
    return match["name"] or "", match["dims"].strip().replace("X", "x").split("x"), match["dtype"] or ""


def input_dims(text: str) -> list[str]:
    """The dimensions of ``[NAME=]DIMS[:DTYPE]`` as written: ``"ids=1xSx64"`` -> ``["1", "S", "64"]``."""
    return [d.strip() for d in _split_spec(text)[1]]


def input_symbol(texts: Sequence[str]) -> str | None:
    """The one capital letter used as a dimension in ``texts`` (``"Bx1000"`` -> ``"B"``), or None.

    Raises:
        UserInputError: two different letters.
    """
    symbols = sorted({d.strip() for t in texts for d in _split_spec(t)[1] if _SYMBOL_RE.match(d.strip())})
    if len(symbols) > 1:
        raise UserInputError(f"inputs {list(texts)!r} use {len(symbols)} symbolic dimensions "
                             f"({', '.join(symbols)}); expected one, e.g. Bx1000 or 1xSx64")
    return symbols[0] if symbols else None


def substitute(text: str, symbol: str | None, value: int) -> str:
    """``text`` with every dimension named ``symbol`` replaced by ``value``."""
    name, dims, dtype = _split_spec(text)
    dims = [str(value) if symbol and d.strip() == symbol else d for d in dims]
    return f"{name}{'x'.join(dims)}{dtype}"


def spec_at(text: str, symbol: str | None, value: int) -> InputSpec:
    """``text`` parsed with its ``symbol`` dimensions set to ``value`` and marked symbolic."""
    spec = parse_input_spec(substitute(text, symbol, value))
    dims = tuple(i for i, d in enumerate(input_dims(text)) if symbol and d == symbol)
    return InputSpec(spec.shape, spec.dtype, spec.name, dims)


_MAX_SWEEP_ROWS = 32


def parse_sweep(text: str) -> tuple[str, tuple[int, ...]]:
    """``--sweep B=1..64`` or ``B=1,8,32`` -> ("B", values).  A range gives every value when
    there are at most 32, else 32 values spread evenly on a log scale (both ends included).

    Raises:
        UserInputError: malformed text, a value below 1, or an empty range.
    """
    hint = "expected LETTER=LO..HI or LETTER=A,B,C with positive integers, e.g. B=1..64 or S=512,1024,2048"
    name, sep, values = text.partition("=")
    name = name.strip()
    if not sep or not _SYMBOL_RE.match(name):
        raise UserInputError(f"malformed --sweep {text!r}; {hint}")
    low, dots, high = values.partition("..")
    try:
        if dots:
            lo, hi = int(low), int(high)
            picked: list[int] = list(range(lo, hi + 1)) if hi - lo < _MAX_SWEEP_ROWS else sorted(
                {round(lo * (hi / lo) ** (i / (_MAX_SWEEP_ROWS - 1))) for i in range(_MAX_SWEEP_ROWS)})
        else:
            picked = sorted({int(v) for v in values.split(",")})
    except (ValueError, ZeroDivisionError):
        raise UserInputError(f"malformed --sweep {text!r}; {hint}") from None
    if not picked or picked[0] < 1 or picked[-1] > _MAX_INT:
        raise UserInputError(f"--sweep {text!r} has no value, a value below 1 or one past {_MAX_INT:,}; {hint}")
    return name, tuple(picked)


def validate_inputs(texts: Sequence[str], *, symbolic: bool | None) -> str | None:
    """Check every input spec before anything is traced; return the symbol (if any).

    Args:
        symbolic: True when exactly one symbolic dimension is required (max-batch), False
            when none is allowed (check, plan), None when either will do.

    Raises:
        UserInputError: a malformed spec, a missing or an unexpected symbol.
    """
    if not texts:
        raise UserInputError("no input given; pass at least one --input such as 32x1000")
    symbol = input_symbol(texts)
    for text in texts:
        parse_input_spec(substitute(text, symbol, 1))
    if symbolic is True and symbol is None:
        raise UserInputError(f"no symbolic dimension in {list(texts)!r}; mark the one to search with a "
                             "capital letter: --input Bx1000 (batch) or --input 1xSx64 (sequence)")
    if symbolic is False and symbol is not None:
        raise UserInputError(f"input {list(texts)!r} has a symbolic dimension {symbol!r}; give numbers, "
                             f"or search it with graphmem max-batch / max-seq")
    return symbol
