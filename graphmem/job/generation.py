"""The generate section: inference with a KV cache (``--generate P+N``, ``--batch B``).

Imports no torch (the command line derives its options from these fields).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from graphmem.errors import UserInputError
from graphmem.job.grammar import MAX_INT
from graphmem.job.option import option

__all__ = ["GENERATE", "GenerateSpec", "parse_generate"]


@dataclass(frozen=True, slots=True)
class GenerateSpec:
    """Inference with a KV cache: a ``prompt``-token prefill and ``new`` decode steps, ``batch``
    sequences at once."""

    prompt: int
    new: int
    batch: int = field(default=1, metadata=option(
        "--batch", kind="int", minimum=1, default=1, show_default=True,
        help="With --generate: sequences generated at once."))
    """Sequences generated at once."""

    @classmethod
    def fold(cls, values: Mapping[str, Any]) -> GenerateSpec | None:
        given = values.get("generate")
        return parse_generate(given, values.get("batch", 1)) if isinstance(given, str) else given


# the option that asks for generation: its field is the Job's ``generate``
GENERATE = option("--generate", metavar="PROMPT+NEW",
                  help="Inference with a KV cache instead of %(mode)s: the prefill of PROMPT tokens and the last of "
                       "NEW decode steps (causal LMs), e.g. 2048+512. %(inputs)s is then optional.")


def parse_generate(text: str, batch: int = 1) -> GenerateSpec:
    """``"2048+512"`` -> GenerateSpec(2048, 512, batch)."""
    match = re.fullmatch(r"\s*(\d+)\s*\+\s*(\d+)\s*", text)
    if match is None or int(match[1]) < 1 or int(match[2]) < 1 or batch < 1:
        raise UserInputError(f"malformed --generate {text!r}; expected PROMPT+NEW with positive "
                             "token counts, e.g. 2048+512 (and --batch >= 1)")
    if (int(match[1]) + int(match[2])) * batch > MAX_INT:
        raise UserInputError(f"--generate {text!r} with --batch {batch}: more tokens than a tensor can index "
                             f"({MAX_INT:,}); give smaller counts")
    return GenerateSpec(int(match[1]), int(match[2]), batch)
