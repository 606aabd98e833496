"""The names a job's options may take, without torch: the command line offers them as choices
(and lists them in --help) before anything heavy is imported.

Input: nothing.  Output: tuples and tables of names.  The modules that act on the names
(job.job, job.step, job.finetune) import them from here; where the engine's own table holds
torch objects (AMP_DTYPES, PRESETS, FORMULA_OPTIMIZERS), the names are repeated here and
tests/unit/cli/test_cli_startup.py keeps them equal to the table's keys.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

__all__ = ["AMP_CHOICES", "ANALYSIS_MODES", "DEFAULT_GPU", "DEVICES", "FORMULA_OPTIMIZER_NAMES", "LOSSES",
           "MODEL_DTYPES", "OPTIMIZERS", "OPTIMIZER_CHOICES", "OPTIMIZER_IMPLS", "PRESET_NAMES", "QUANTIZED_BASES",
           "SDPA_CHOICES"]


def _torch_ships(path: str) -> bool:
    """Whether the installed torch has the file ``path`` (relative to its package), found
    without importing torch."""
    spec = importlib.util.find_spec("torch")
    folders = (spec.submodule_search_locations or []) if spec is not None else []
    return any(Path(folder, path).is_file() for folder in folders)


ANALYSIS_MODES = ("both", "train", "inference")
DEVICES = ("cpu", "cuda")
DEFAULT_GPU = "h100-80gb"
# attention backends of the CUDA target: auto is PyTorch's own choice for the GPU and dtype
SDPA_CHOICES = ("auto", "flash", "efficient", "cudnn", "math")

# The dtypes a whole model may be converted to with ``--dtype``.
MODEL_DTYPES = ("float32", "bfloat16", "float16")

# name -> (torch.optim class name, default kwargs): the real classes with their defaults.
OPTIMIZERS: dict[str, tuple[str, dict[str, Any]]] = {
    "sgd": ("SGD", {}),
    "sgd-momentum": ("SGD", {"momentum": 0.9}),
    "sgd-nesterov": ("SGD", {"momentum": 0.9, "nesterov": True}),
    "adam": ("Adam", {}),
    "adamw": ("AdamW", {}),
    "adam-amsgrad": ("Adam", {"amsgrad": True}),
    "adamw-amsgrad": ("AdamW", {"amsgrad": True}),
    "adagrad": ("Adagrad", {}),
    "adadelta": ("Adadelta", {}),
    "adamax": ("Adamax", {}),
    "nadam": ("NAdam", {}),
    "radam": ("RAdam", {}),
    "rmsprop": ("RMSprop", {}),
    "rprop": ("Rprop", {}),
    "asgd": ("ASGD", {}),
    # torch.optim.Adafactor (torch >= 2.5) is defined in torch/optim/_adafactor.py
    **({"adafactor": ("Adafactor", {})} if _torch_ships("optim/_adafactor.py") else {}),
    "lbfgs": ("LBFGS", {}),
}
# bitsandbytes' 8-bit optimizers, sized by formula (job.optim_formula.FORMULA_OPTIMIZERS' keys)
FORMULA_OPTIMIZER_NAMES = ("adam8bit", "adamw8bit", "paged-adamw8bit", "lion8bit", "sgd8bit-momentum")
OPTIMIZER_CHOICES = (*OPTIMIZERS, *FORMULA_OPTIMIZER_NAMES, "none")
# --optimizer-impl: auto lets PyTorch pick for the target device (for-loop on CPU).
OPTIMIZER_IMPLS = {"auto": {}, "for-loop": {"foreach": False}, "foreach": {"foreach": True},
                   "fused": {"fused": True}}
LOSSES = ("auto", "sum", "mean", "cross_entropy", "nll")
# --amp: job.step.AMP_DTYPES' keys
AMP_CHOICES = ("bf16", "fp16")

# --preset: job.presets.PRESETS' keys
PRESET_NAMES = ("gpt2", "gpt2-xl", "bert-base", "t5-base", "vit-base", "llama-2-7b", "llama-3-8b", "llama-3-70b",
                "llama-3.1-405b", "mistral-7b", "qwen2-7b", "mixtral-8x7b")

# --quantize-base: the base weights as transformers loads them, kind -> its BitsAndBytesConfig
# (4-bit: the compute dtype is the job's dtype; int8: LLM.int8 with its defaults, threshold 6.0)
QUANTIZED_BASES: dict[str, dict[str, Any]] = {
    "nf4": {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4"},
    "nf4-dq": {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": True},
    "fp4": {"load_in_4bit": True, "bnb_4bit_quant_type": "fp4"},
    "int8": {"load_in_8bit": True},
}
