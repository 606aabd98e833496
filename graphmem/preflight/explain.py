"""The plan's explanation: why training takes N times inference for this model, which
category dominates, and common rules of thumb checked against the analysed numbers.

Input: the analysed training and inference ModeReports and their peaks.  Output: a short
plain-language paragraph (str).  Pure.

The rules of thumb checked (docs/preflight.md quotes them): "training takes 5-9x inference"
(5-9N, with N the parameters' memory) and "Adam adds 2N", from the two articles that started
this project (checked in the docs page of common claims).  The text names them as common rules of thumb.
"""

from __future__ import annotations

from collections.abc import Callable

from graphmem.memory.results import Category, ModeReport
from graphmem.units import format_bytes

__all__ = ["RULE_OF_THUMB_RATIO", "explain"]

RULE_OF_THUMB_RATIO = (5.0, 9.0)  # the rule of thumb "Итого: 5-9N памяти" for training, N for inference


def explain(train: ModeReport | None, inference: ModeReport | None, train_peak: int, inference_peak: int,
            bytes_per_sample: int | None = None, units: str = "auto") -> str:
    """One paragraph about the ratio, the dominant category and the rules of thumb.

    Args:
        train / inference: the analysed baseline (either may be None: then less is said).
        train_peak / inference_peak: the peaks the budget is compared with (bytes).
        bytes_per_sample: the training peak's growth per extra sample, if measured.
    """
    fmt: Callable[[int], str] = lambda n: format_bytes(n, units)
    if train is None or inference is None or inference_peak == 0:
        return _dominant(train or inference, fmt) if (train or inference) else ""
    ratio = train_peak / inference_peak
    params = train.params_bytes
    parts = [f"Training takes {ratio:.2f}x the memory of inference here ({fmt(train_peak)} vs "
             f"{fmt(inference_peak)}). Inference holds the parameters ({fmt(params)}, "
             f"{_share(params, inference_peak)} of its peak) and only a few activations at a time; "
             f"a training step also keeps the gradients ({fmt(train.grads_bytes)}), "
             + _optimizer_words(train, fmt)
             + f" and the activations saved for backward ({fmt(train.activations_bytes)} at the end of "
             "the forward pass)."]
    parts.append(_dominant(train, fmt))
    parts.append(_rule_of_thumb_words(ratio, train_peak / params if params else None))
    if bytes_per_sample:
        parts.append(f"Each extra sample adds about {fmt(bytes_per_sample)} to the training peak, while "
                     "parameters, gradients and optimizer state stay the same, so the ratio changes "
                     "with the batch size.")
    return " ".join(parts)


def _share(part: int, whole: int) -> str:
    return f"{part / whole:.0%}" if whole else "0%"


def _optimizer_words(train: ModeReport, fmt: Callable[[int], str]) -> str:
    state, params = train.optimizer_state_bytes, train.params_bytes
    name = train.optimizer or "no optimizer"
    if not state:
        return f"no optimizer state ({name})"
    words = f"{name}'s state ({fmt(state)}, {state / params:.2f}x the parameters"
    if name in ("adam", "adamw") and params:
        words += '; a common rule of thumb says "Adam adds 2N"'
    return words + ")"


def _dominant(mode: ModeReport | None, fmt: Callable[[int], str]) -> str:
    if mode is None or not mode.peak_bytes:
        return ""
    ranked = sorted(((b, c) for c, b in mode.breakdown.items() if b), key=lambda item: -item[0])
    top = ", then ".join(f"{Category(c).value.replace('_', ' ')} ({fmt(b)}, {_share(b, mode.peak_bytes)})"
                         for b, c in ranked[:3])
    return (f"At the {mode.mode} peak ({mode.peak.phase} phase, op {mode.peak.op_name}) the largest category "
            f"is {top}.")


def _rule_of_thumb_words(ratio: float, per_param: float | None) -> str:
    low, high = RULE_OF_THUMB_RATIO
    where = "inside" if low <= ratio <= high else ("below" if ratio < low else "above")
    text = (f'A common rule of thumb says "training takes 5-9x inference"; this model and batch are {where} '
            "that range")
    if where == "below":
        text += " (its count assumes activations of 2-5x the parameters and Adam's state)"
    elif where == "above":
        text += " (activations, which grow with the batch, outweigh the parameters)"
    if per_param is not None:
        text += f"; measured against the parameters alone, training takes {per_param:.2f}N"
    return text + "."
