"""Pure parsing of what the command line says about the job's data: input specifications
(``[NAME=]DIMS[:DTYPE]``), dtype names, ``--generate P+N`` and ``--assume NAME=VALUE``.

Input: strings from the command line or the Python API.  Output: frozen values.
Nothing here touches a model or allocates a tensor.  The spec grammar itself, which imports
no torch, is graphmem.job.grammar (the command line checks ``--input`` with it); here its
parts become torch dtypes and InputSpecs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from graphmem.errors import UserInputError
from graphmem.job.choices import MODEL_DTYPES
from graphmem.job.grammar import (
    DTYPE_NAMES,
    dtype_name,
    input_dims,
    input_symbol,
    parse_sweep,
    read_input_spec,
    substitute,
    validate_inputs,
)
from graphmem.job.grammar import MAX_INT as _MAX_INT
from graphmem.job.option import spelling

__all__ = ["ASSUMPTION_KINDS", "BELOW", "DTYPE_ALIASES", "KEPT_FRACTION", "MODEL_DTYPES", "READ_VALUE", "ROUTING",
           "ROUTINGS", "InputSpec", "input_dims", "input_symbol", "parse_assumption", "parse_dtype",
           "input_texts", "parse_input_spec", "parse_sweep", "spec_at", "substitute",
           "validate_inputs"]

# Every name a user may write for a dtype, mapped to torch's dtype.
DTYPE_ALIASES: dict[str, torch.dtype] = {alias: getattr(torch, name) for alias, name in DTYPE_NAMES.items()}

# The values ``--assume NAME=VALUE`` may give an integer input, besides an integer.
ASSUMPTION_KINDS = ("ones", "zeros", "arange")
BELOW = "below:"  # --assume NAME=below:N: integers drawn uniformly from [0, N), a generator started at 0


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
    return DTYPE_ALIASES[dtype_name(text)]


def parse_input_spec(text: str) -> InputSpec:
    """Parse ``[NAME=]DIMS[:DTYPE]`` (``graphmem.job.grammar.read_input_spec``), e.g. ``32x1000``,
    ``8x512:int64``, ``ids=2x128:int64``.

    Raises:
        UserInputError: malformed text, a non-positive dimension, an unknown dtype, or more
            than 2**63 - 1 bytes in all.
    """
    shape, dtype, name = read_input_spec(text)
    return InputSpec(shape=shape, dtype=DTYPE_ALIASES[dtype], name=name)


# --assume nonzero=F: the fraction of their most that value-dependent sizes keep
KEPT_FRACTION = "nonzero"
# --assume routing=uneven|balanced: the choices top-k / argmax make on values graphmem does not have
ROUTING = "routing"
ROUTINGS = ("uneven", "balanced")
# --assume reads=N: a number the model reads from values graphmem does not have is taken as N
READ_VALUE = "reads"


def parse_assumption(text: str) -> tuple[str, str]:
    """``NAME=ones|zeros|arange|INT|below:N`` -> (name, value) (``below:N``: integers drawn
    uniformly from [0, N) by a generator started at 0: token ids below the vocabulary, node indices below
    the node count); or ``nonzero=F``, F in [0, 1]: the
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
            raise UserInputError(f"malformed {spelling('assume')} {text!r}; expected {KEPT_FRACTION}=F with F a "
                                 "fraction in "
                                 "[0, 1], e.g. nonzero=0.5: value-dependent selections keep half their elements")
        return KEPT_FRACTION, repr(fraction)
    if name.strip() == READ_VALUE:
        if not value.isdecimal() or int(value) > _MAX_INT:
            raise UserInputError(f"malformed {spelling('assume')} {text!r}; expected {READ_VALUE}=N with N a whole "
                                 "number up to "
                                 f"{_MAX_INT:,}, e.g. "
                                 "reads=1000: each number the model reads from values it computed (a predicted "
                                 "length) is taken as 1000")
        return READ_VALUE, value
    if name.strip() == ROUTING:
        if value not in ROUTINGS:
            raise UserInputError(f"malformed {spelling('assume')} {text!r}; expected {ROUTING}=uneven (every expert "
                                 "gets a token, "
                                 "the first ones all the rest) or routing=balanced (tokens spread evenly)")
        return ROUTING, value
    integer = value.removeprefix("-").isdecimal() and -_MAX_INT - 1 <= int(value) <= _MAX_INT
    bound = value.removeprefix(BELOW)
    drawn = value.startswith(BELOW) and bound.isdecimal() and 1 <= int(bound) <= _MAX_INT
    if not sep or not name.strip() or not (value in ASSUMPTION_KINDS or integer or drawn):
        raise UserInputError(f"malformed {spelling('assume')} {text!r}; expected NAME=VALUE with VALUE one of "
                             f"{', '.join(ASSUMPTION_KINDS)}, an integer that fits int64, or {BELOW}N (random "
                             "integers from 0 to N-1), e.g. attention_mask=ones or edge_index=below:2000")
    return name.strip(), value


def spec_at(text: str, symbol: str | None, value: int) -> InputSpec:
    """``text`` parsed with its ``symbol`` dimensions set to ``value`` and marked symbolic."""
    spec = parse_input_spec(substitute(text, symbol, value))
    dims = tuple(i for i, d in enumerate(input_dims(text)) if symbol and d == symbol)
    return InputSpec(spec.shape, spec.dtype, spec.name, dims)




def input_texts(inputs: Sequence[InputSpec | str | torch.Tensor] | InputSpec | str | torch.Tensor) -> tuple[str, ...]:
    """Input specs as text; an example tensor stands for its shape and dtype (never its values)."""
    if isinstance(inputs, (str, InputSpec, torch.Tensor)):
        inputs = [inputs]
    return tuple(str(InputSpec(tuple(spec.shape), spec.dtype)) if isinstance(spec, torch.Tensor) else str(spec)
                 for spec in inputs)
