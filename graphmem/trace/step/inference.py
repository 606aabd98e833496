"""The inference driver: one forward in eval mode under no_grad, its output kept to the end."""

from __future__ import annotations

import functools

import torch

from graphmem.records import Phase
from graphmem.trace.step.run import StepRun, mark_output
from graphmem.trace.values.shadows import PREDICTED_BOXES
from graphmem.trace.values.targets import predicted_boxes

__all__ = ["run_inference"]


def run_inference(run: StepRun) -> int:
    """``model(*args, **kwargs)`` as ``model.eval()`` and ``torch.no_grad()`` run it; returns 0
    (no KV cache)."""
    recorder = run.recorder
    run.model.eval()
    recorder.phase = Phase.FORWARD
    boxes = functools.partial(recorder.answers.shadows.built, source=PREDICTED_BOXES)
    with torch.no_grad(), run.autocast(), predicted_boxes(run.model, boxes):
        out = run.model(*run.args, **run.kwargs)
    mark_output(recorder, out)
    recorder.poll()  # the output is still referenced here: it stays live to the end
    return 0
