"""``--lora``'s text, parsed and checked without torch: ``read_lora`` -> a frozen LoraSpec.

Input: a ``--lora`` text such as ``r=16,alpha=32,target=q_proj,v_proj``.  Output: a LoraSpec,
checked when built, and whether peft is installed (``require_peft``).  The command line reads
the text while it parses its options; job.finetune applies the spec to a built model.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from graphmem.errors import UserInputError
from graphmem.job.option import spelling

__all__ = ["LORA_KEYS", "LoraSpec", "quiet_logger", "read_lora", "require_peft"]

LORA_KEYS = ("r", "alpha", "target", "dropout")
_PEFT_HINT = "pip install 'graphmem[lora]'"


@dataclass(frozen=True, slots=True)
class LoraSpec:
    """peft's ``LoraConfig(r, lora_alpha, target_modules, lora_dropout)``; checked when built.

    ``targets``: module names as peft matches them (a name or its last parts, ``q_proj``), or
    ``("all-linear",)``.  ``alpha`` (peft's ``lora_alpha``, an integer) defaults to peft's default, 8.
    """

    r: int
    targets: tuple[str, ...]
    alpha: int = 8
    dropout: float = 0.0

    def __post_init__(self) -> None:
        if isinstance(self.r, bool) or not isinstance(self.r, int) or self.r < 1:
            raise UserInputError(f"{spelling('lora')} r={self.r!r}: expected a positive integer such as r=16")
        if not self.targets or not all(isinstance(t, str) and t for t in self.targets):
            raise UserInputError(f"{spelling('lora')} needs target=MODULE[,MODULE], e.g. target=q_proj,v_proj (or "
                                 "all-linear)")
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, int) or self.alpha < 1:
            raise UserInputError(f"{spelling('lora')} alpha={self.alpha!r}: expected a positive integer such as "
                                 "alpha=32")
        if not 0 <= self.dropout < 1:
            raise UserInputError(f"{spelling('lora')} dropout={self.dropout!r}: expected a number from 0 to below 1")

    def __str__(self) -> str:
        return f"LoRA r={self.r} on {', '.join(self.targets)}"


def read_lora(text: str | LoraSpec) -> LoraSpec:
    """``"r=16,alpha=32,target=q_proj,v_proj,dropout=0.05"`` -> LoraSpec.

    A part without ``=`` adds one more target (``target=q_proj,v_proj``).  Whether peft is
    installed is ``require_peft``'s to say.

    Raises:
        UserInputError: an unknown key, a bad value or no target.
    """
    if isinstance(text, LoraSpec):
        return text
    values: dict[str, list[str]] = {}
    key = None
    for part in (p.strip() for p in str(text).split(",")):
        name, eq, value = part.partition("=")
        if eq:
            key = name.strip()
            if key not in LORA_KEYS:
                raise UserInputError(f"{spelling('lora')} {text!r}: unknown key {key!r}; expected: "
                                     f"{', '.join(LORA_KEYS)} "
                                     "(e.g. r=16,alpha=32,target=q_proj,v_proj)")
            values[key] = [value.strip()]
        elif part and key == "target":
            values[key].append(part)
        elif part:
            raise UserInputError(f"{spelling('lora')} {text!r}: {part!r} is not KEY=VALUE; expected "
                                 "r=16,alpha=32,target=q_proj,v_proj[,dropout=0.05]")
    return LoraSpec(r=_number(values, "r", int, None), targets=tuple(t for t in values.get("target", []) if t),
                    alpha=_number(values, "alpha", int, 8), dropout=_number(values, "dropout", float, 0.0))


def _number(values: dict[str, list[str]], key: str, kind: type, default: Any) -> Any:
    if key not in values:
        if default is None:
            raise UserInputError(f"{spelling('lora')} needs {key}=N, e.g. r=16,alpha=32,target=q_proj,v_proj")
        return default
    text = values[key][0]
    try:
        return kind(text)
    except ValueError:
        example = {"r": "a positive integer such as r=16", "alpha": "a positive integer such as alpha=32",
                   "dropout": "a number such as dropout=0.05"}[key]
        raise UserInputError(f"{spelling('lora')} {key}={text!r}: expected {example}") from None


def require_peft() -> None:
    """UserInputError naming the extra to install when peft is not installed."""
    try:
        with quiet_logger("bitsandbytes"):  # peft imports it when installed
            import peft  # noqa: F401
    except ImportError:
        raise UserInputError(f"{spelling('lora')} needs the peft package: {_PEFT_HINT}") from None


@contextlib.contextmanager
def quiet_logger(name: str) -> Iterator[None]:
    """The logger ``name`` says only errors while the block runs."""
    logger = logging.getLogger(name)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)
