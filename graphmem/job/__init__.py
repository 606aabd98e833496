"""Stage 1, the job: what to analyse.

Input: the command line's or the Python API's words: a target (``pkg.module:Attr``), a
preset, a Hugging Face config, input specs, the training-step configuration, the device and
GPU.  Output: one frozen, validated ``Job``, and the model built on the meta device
(``load.construct_model``; ``fallback`` for constructors that read tensor values;
``finetune`` freezes parameters or adds LoRA adapters).  Knows nothing of tracing, liveness,
reports or the command line.
"""

from __future__ import annotations

from graphmem.job.job import ANALYSIS_MODES, DEVICES, Job, make_job
from graphmem.job.spec import InputSpec, parse_input_spec
from graphmem.job.step import StepConfig

__all__ = ["ANALYSIS_MODES", "DEVICES", "InputSpec", "Job", "StepConfig", "make_job", "parse_input_spec"]
