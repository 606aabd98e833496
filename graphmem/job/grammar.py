"""The grammar of an input specification, ``[NAME=]DIMS[:DTYPE]``, without torch: what the
command line checks while it parses ``--input`` and ``--sweep``.

Input: texts.  Output: a spec's parts (``read_input_spec``: its shape, torch's name of its
dtype, its name), the capital letter that stands for one of its dimensions and the text with
a value in its place, and ``validate_inputs``' verdict on a job's inputs.  job.spec turns the
parts into an InputSpec holding torch's dtype.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

from graphmem.errors import UserInputError
from graphmem.job.option import spelling

__all__ = ["DTYPE_BYTES", "DTYPE_NAMES", "MAX_INT", "MAX_TENSOR_BYTES", "dtype_name", "format_blocks", "input_dims",
           "input_symbol", "parse_blocks", "parse_sweep", "read_input_spec", "substitute", "validate_inputs"]

# Every name a user may write for a dtype, mapped to torch's name of it.
DTYPE_NAMES: dict[str, str] = {
    "float32": "float32", "fp32": "float32", "float": "float32", "f32": "float32",
    "float64": "float64", "fp64": "float64", "double": "float64", "f64": "float64",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float16": "float16", "fp16": "float16", "half": "float16", "f16": "float16",
    "int64": "int64", "long": "int64", "i64": "int64",
    "int32": "int32", "int": "int32", "i32": "int32",
    "int16": "int16", "short": "int16",
    "int8": "int8", "uint8": "uint8", "byte": "uint8",
    "bool": "bool",
    "complex64": "complex64", "cfloat": "complex64",
}
# Bytes per element of each (torch's ``dtype.itemsize``).
DTYPE_BYTES = {"float32": 4, "float64": 8, "bfloat16": 2, "float16": 2, "int64": 8, "int32": 4, "int16": 2,
               "int8": 1, "uint8": 1, "bool": 1, "complex64": 8}

_SYMBOL_RE = re.compile(r"^[A-WYZ]$")  # one capital letter; x/X separate dimensions
_SPEC_PARTS_RE = re.compile(r"^(?P<name>\s*[A-Za-z_][A-Za-z0-9_]*\s*=)?(?P<dims>[^:=]*)(?P<dtype>:.*)?$")
_SPEC_RE = re.compile(
    r"^(?:(?P<name>[A-Za-z_][A-Za-z0-9_]*)=)?(?P<dims>[^:=]*)(?::(?P<dtype>[A-Za-z0-9_]+))?$"
)


# A tensor's size in bytes is an int64 (c10's storage size computation refuses more), as are
# its dimensions and the values graphmem may assume for an integer input.
MAX_TENSOR_BYTES = MAX_INT = 2**63 - 1


def dtype_name(text: str) -> str:
    """torch's name of the dtype named by ``text`` (case-insensitive, aliases allowed).

    Raises:
        UserInputError: the name is unknown; the message lists the valid names.
    """
    dtype = DTYPE_NAMES.get(text.strip().lower().removeprefix("torch."))
    if dtype is None:
        choices = ", ".join(sorted(DTYPE_NAMES))
        raise UserInputError(f"unknown dtype {text!r}; expected one of: {choices}")
    return dtype


def read_input_spec(text: str) -> tuple[tuple[int, ...], str, str | None]:
    """Read ``[NAME=]DIMS[:DTYPE]``, e.g. ``32x1000``, ``8x512:int64``, ``ids=2x128:int64``:
    (the shape, torch's name of the dtype, the name or None).

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
    dtype = dtype_name(match["dtype"]) if match["dtype"] else "float32"
    elements, itemsize = math.prod(dims), DTYPE_BYTES[dtype]
    if elements * itemsize > MAX_TENSOR_BYTES:
        raise UserInputError(f"input spec {text!r} is too large: {elements:,} elements of {itemsize} bytes "
                             f"pass the {MAX_TENSOR_BYTES:,} bytes a tensor can hold; give smaller dimensions")
    return tuple(dims), dtype, match["name"]


def _split_spec(text: str) -> tuple[str, list[str], str]:
    match = _SPEC_PARTS_RE.match(text.strip())
    if match is None:
        read_input_spec(text)  # raises the spec parser's own message
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
    if not picked or picked[0] < 1 or picked[-1] > MAX_INT:
        raise UserInputError(f"--sweep {text!r} has no value, a value below 1 or one past {MAX_INT:,}; {hint}")
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
        raise UserInputError(f"no input given; pass at least one {spelling('inputs')} such as 32x1000")
    symbol = input_symbol(texts)
    for text in texts:
        read_input_spec(substitute(text, symbol, 1))
    if symbolic is True and symbol is None:
        raise UserInputError(f"no symbolic dimension in {list(texts)!r}; mark the one to search with a "
                             f"capital letter: {spelling('inputs')} Bx1000 (batch) or {spelling('inputs')} 1xSx64 "
                             "(sequence)")
    if symbolic is False and symbol is not None:
        raise UserInputError(f"input {list(texts)!r} has a symbolic dimension {symbol!r}; give numbers, "
                             f"or search it with graphmem max-batch / max-seq")
    return symbol


_BLOCKS_RE = re.compile(r"^\d+(-\d+)?$")


def parse_blocks(text: str) -> tuple[int, ...]:
    """``--checkpoint-blocks``: ``"0-3,6"`` -> ``(0, 1, 2, 3, 6)`` (0-based block indices,
    ranges inclusive); ``""`` -> ``()``.

    Raises:
        UserInputError: a part that is no index or range, a range that runs backwards, or an
            index given twice.
    """
    found: list[int] = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        if not _BLOCKS_RE.match(part):
            raise UserInputError(f"{spelling('checkpoint_blocks')}: {part!r} is no block index or range; expected "
                                 "indices and ranges from 0, e.g. 0-3,6")
        first, _, last = part.partition("-")
        low, high = int(first), int(last or first)
        if high < low:
            raise UserInputError(f"{spelling('checkpoint_blocks')}: the range {part!r} runs backwards; write it "
                                 f"{high}-{low}")
        found += range(low, high + 1)
    if len(set(found)) != len(found):
        raise UserInputError(f"{spelling('checkpoint_blocks')}: {text!r} names a block twice")
    return tuple(sorted(found))


def parse_save_in(text: str) -> tuple[tuple[int, tuple[str, ...]], ...]:
    """``--checkpoint-save-in``: ``"0=attn.proj:matmuls;2-3=matmuls,attention"`` -> each block
    with the outputs it keeps, in block order; ``""`` -> ``()``.

    Raises:
        UserInputError: a group without ``BLOCKS=NAMES``, bad blocks, or a block given twice.
    """
    found: dict[int, tuple[str, ...]] = {}
    for group in (g.strip() for g in text.split(";") if g.strip()):
        blocks, equals, names = group.partition("=")
        saved = tuple(n.strip() for n in names.split(",") if n.strip())
        if not equals or not saved:
            raise UserInputError(f"{spelling('checkpoint_save_in')}: {group!r} is not BLOCKS=NAMES; expected e.g. "
                                 "0=attn.proj:matmuls;2-3=matmuls,attention")
        try:
            chosen = parse_blocks(blocks)
        except UserInputError as exc:
            raise UserInputError(f"{spelling('checkpoint_save_in')}: {group!r}: {str(exc).split(': ', 1)[1]}") from None
        for block in chosen:
            if block in found:
                raise UserInputError(f"{spelling('checkpoint_save_in')}: block {block} is given twice")
            found[block] = saved
    return tuple(sorted(found.items()))


def format_save_in(save_in: Sequence[tuple[int, Sequence[str]]]) -> str:
    """The inverse of parse_save_in, blocks with the same names grouped: ``"0,2=fc:matmuls"``."""
    return ";".join(f"{format_blocks(blocks)}={','.join(names)}" for names, blocks in grouped_by_names(save_in))


def grouped_by_names(save_in: Sequence[tuple[int, Sequence[str]]]) -> list[tuple[tuple[str, ...], list[int]]]:
    """``((0, ("a",)), (1, ("a",)), (2, ("b",)))`` -> ``[(("a",), [0, 1]), (("b",), [2])]``."""
    groups: dict[tuple[str, ...], list[int]] = {}
    for block, names in save_in:
        groups.setdefault(tuple(names), []).append(block)
    return list(groups.items())


def format_units(units: Sequence[int]) -> str:
    """FSDP2 units by index: ``"unit 3"``, ``"units 2-3"``."""
    return f"unit{'' if len(units) == 1 else 's'} {format_blocks(units)}"


def format_blocks(blocks: Sequence[int]) -> str:
    """``(0, 1, 2, 3, 6)`` -> ``"0-3,6"``: block indices as ``--checkpoint-blocks`` takes them."""
    runs: list[list[int]] = []
    for block in sorted(blocks):
        if runs and block == runs[-1][1] + 1:
            runs[-1][1] = block
        else:
            runs.append([block, block])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
