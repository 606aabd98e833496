"""Stage 1, the job: what to analyse.

Input: the command line's or the Python API's words: a target (``pkg.module:Attr``), a
preset, a Hugging Face config, input specs, the training-step configuration, the device and
GPU.  Output: one frozen, validated ``Job``, and the model built on the meta device
(``load.construct_model``; ``fallback`` for constructors that read tensor values;
``finetune`` freezes parameters or adds LoRA adapters).  Knows nothing of tracing, liveness,
reports or the command line.

``choices``, ``grammar`` and ``lora_spec`` import no torch: the command line checks its
options with them before anything heavy is loaded; so the names below are imported on first
use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from graphmem._lazy import lazy_exports

__all__ = ["ANALYSIS_MODES", "DEVICES", "InputSpec", "Job", "StepConfig", "make_job", "parse_input_spec"]

if TYPE_CHECKING:
    from graphmem.job.job import ANALYSIS_MODES, DEVICES, Job, make_job
    from graphmem.job.spec import InputSpec, parse_input_spec
    from graphmem.job.step import StepConfig

__getattr__ = lazy_exports(globals(), {
    "graphmem.job.job": ("ANALYSIS_MODES", "DEVICES", "Job", "make_job"),
    "graphmem.job.spec": ("InputSpec", "parse_input_spec"),
    "graphmem.job.step": ("StepConfig",),
})
