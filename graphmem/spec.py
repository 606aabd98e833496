"""Input specifications: pure parsing of ``[NAME=]DIMS[:DTYPE]`` strings and dtype names.

Input: strings from the command line or the Python API.  Output: frozen ``InputSpec`` values.
Nothing here touches a model or allocates a tensor.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from graphmem.errors import UserInputError

__all__ = ["BINARY_UNITS", "InputSpec", "parse_input_spec", "parse_dtype", "DTYPE_ALIASES", "MODEL_DTYPES"]

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

# Binary byte units, shared by the renderers (report.units) and budget parsing (budget).
BINARY_UNITS: dict[str, int] = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}

# The dtypes a whole model may be converted to with ``--dtype``.
MODEL_DTYPES = ("float32", "bfloat16", "float16")

_SPEC_RE = re.compile(
    r"^(?:(?P<name>[A-Za-z_][A-Za-z0-9_]*)=)?(?P<dims>[^:=]*)(?::(?P<dtype>[A-Za-z0-9_]+))?$"
)


@dataclass(frozen=True, slots=True)
class InputSpec:
    """One example input: its shape, dtype and, for keyword inputs, its name."""

    shape: tuple[int, ...]
    dtype: torch.dtype = torch.float32
    name: str | None = None

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
        UserInputError: malformed text, a non-positive dimension or an unknown dtype.
    """
    match = _SPEC_RE.match(text.strip())
    hint = "expected [NAME=]DIMS[:DTYPE] such as 32x1000, 8x512:int64 or input_ids=2x128:int64"
    if match is None:
        raise UserInputError(f"malformed input spec {text!r}; {hint}")
    dims_text = match["dims"].strip().lower()
    dims: list[int] = []
    if dims_text not in ("", "scalar"):
        for part in dims_text.split("x"):
            if not part.strip().isdigit():
                raise UserInputError(f"malformed input spec {text!r}: dimension {part!r} "
                                     f"is not a positive integer; {hint}")
            dims.append(int(part))
    if any(d <= 0 for d in dims):
        raise UserInputError(f"input spec {text!r} has a dimension <= 0; dimensions must be "
                             "positive integers")
    dtype = parse_dtype(match["dtype"]) if match["dtype"] else torch.float32
    return InputSpec(shape=tuple(dims), dtype=dtype, name=match["name"])
