"""Configs for ``--module tiny_titan --config NAME`` (torchtitan 0.3.0 finds them here).

Assets: the folder TINY_TITAN_ASSETS names (tests/programs/titan/make_assets.py writes it):
``tokenizer/`` (tokenizer.json, tokenizer_config.json) and ``c4_test/`` (JSON lines of text).
"""

import os

from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.components.validate import Validator
from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader
from torchtitan.models.common.attention import ScaledDotProductAttention
from torchtitan.models.llama3.config_registry import llama3_debugmodel
from torchtitan.trainer import Trainer


def _assets() -> str:
    return os.environ.get("TINY_TITAN_ASSETS", os.path.join(os.getcwd(), "assets"))


def llama3_debug_local() -> Trainer.Config:
    """torchtitan's own llama3 debugmodel (dim 256, 6 layers, vocab 2048, FlexAttention,
    selective activation checkpointing, bf16 FSDP parameters, seq 2048, batch 8), with only its
    assets read from the local folder; its outputs go there too."""
    config = llama3_debugmodel()
    config.hf_assets_path = os.path.join(_assets(), "tokenizer")
    config.dataloader = HuggingFaceTextDataLoader.Config(dataset="c4_test",
                                                         dataset_path=os.path.join(_assets(), "c4_test"))
    config.dump_folder = os.path.join(_assets(), "outputs")
    return config


def llama3_cpu_tiny() -> Trainer.Config:
    """The debugmodel made to train on the CPU, small and the same on every run."""
    config = llama3_debug_local()
    # FlexAttention has no backward on the CPU: SDPA instead (is_causal; then no masks are built)
    for layer in config.model_spec.model.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    config.training = TrainingConfig(local_batch_size=2, seq_len=256, steps=5,
                                     disable_cuda_graphs=True,  # 0.3.0 captures CUDA graphs by default
                                     mixed_precision_param="float32")  # FSDP2's parameters as stored
    config.parallelism = ParallelismConfig()  # data_parallel_shard_degree -1: every rank
    config.compile = CompileConfig(enable=False)
    config.activation_checkpoint = None
    config.checkpoint = CheckpointManager.Config(enable=False)
    config.validator = Validator.Config(enable=False)
    config.debug.seed = 0  # the default draws a new seed each run
    return config
