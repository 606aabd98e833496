"""Configs for ``--module tiny_titan --config NAME`` (torchtitan 0.3.0 finds them here).

Assets: the folder TINY_TITAN_ASSETS names (tests/programs/titan/make_assets.py writes it):
``tokenizer/`` (tokenizer.json, tokenizer_config.json) and ``c4_test/`` (JSON lines of text).
The model's vocabulary is the config's, whatever the tokenizer's size (token ids from a small
tokenizer are valid ids of a larger vocabulary): llama3_8b_local keeps Llama 3's 128,256.
"""

import os

import torch.nn as nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.components.loss import CrossEntropyLoss
from torchtitan.components.validate import Validator
from torchtitan.config import TORCH_DTYPE_MAP, CompileConfig, ParallelismConfig, TrainingConfig
from torchtitan.distributed.fsdp import disable_fsdp_gradient_division
from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader
from torchtitan.models.common import Linear
from torchtitan.models.common.attention import QKVLinear, ScaledDotProductAttention
from torchtitan.models.common.config_utils import decoder_vocab_size
from torchtitan.models.llama3 import _LINEAR_INIT
from torchtitan.models.llama3.config_registry import llama3_8b, llama3_70b, llama3_debugmodel
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


def _local(config: Trainer.Config) -> Trainer.Config:
    """``config`` with only its tokenizer and data read from the local folder (c4_test-style
    lines instead of the c4 download) and its outputs written there."""
    config.hf_assets_path = os.path.join(_assets(), "tokenizer")
    config.dataloader = HuggingFaceTextDataLoader.Config(dataset="c4_test",
                                                         dataset_path=os.path.join(_assets(), "c4_test"))
    config.dump_folder = os.path.join(_assets(), "outputs")
    return config


def llama3_8b_local() -> Trainer.Config:
    """torchtitan's own llama3_8b (Llama 3.1 8B: vocab 128,256, fused wqkv, FlexAttention with
    document masks, selective op activation checkpointing, bf16 FSDP parameters, chunked loss,
    local batch 1 x seq 8192), local assets."""
    return _local(llama3_8b())


def llama3_70b_local() -> Trainer.Config:
    """torchtitan's own llama3_70b (80 layers, dim 8192, tensor parallel 8, full activation
    checkpointing, local batch 8 x seq 8192), local assets."""
    return _local(llama3_70b())


def _parallelize_december_2024(model: nn.Module, *, parallel_dims, training, parallelism, compile_config,
                               ac_config, dump_folder) -> nn.Module:
    """1D FSDP as torchtitan's parallelize_llama applied it in December 2024
    (torchtitan/parallelisms/parallelize_llama.py ``apply_fsdp``): activation checkpointing per
    block, ``fully_shard`` on each block (all but the last resharded after forward), then on the
    whole model, whose own parameters (embedding, final norm, output) form the root group, not
    resharded after forward.  0.3.0 shards the embedding and the output apart."""
    if ac_config is not None:
        ac_config.build(dump_folder=dump_folder).apply(model)
    mesh = parallel_dims.get_mesh(["fsdp"])
    policy = MixedPrecisionPolicy(param_dtype=TORCH_DTYPE_MAP[training.mixed_precision_param],
                                  reduce_dtype=TORCH_DTYPE_MAP[training.mixed_precision_reduce])
    last = len(model.layers) - 1
    for layer_id, block in model.layers.items():
        fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=int(layer_id) < last)
    # torch of the time never resharded the root after forward (FSDPState._lazy_init), whatever
    # it was given; torch 2.13 does that only for reshard_after_forward=None (its default)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    disable_fsdp_gradient_division(model)  # 0.3.0's trainer scales the loss by the global token count itself
    return model


def llama3_8b_table1() -> Trainer.Config:
    """llama3_8b_local as torchtitan's trainer of December 2024 ran it for docs/performance.md's
    Tables 1 and 3 (Llama 3.1 8B, 1D FSDP, local batch 2, seq 8192, selective op activation
    checkpointing, no compile), in the four ways its memory differs from 0.3.0's config:
    separate wq, wk, wv projections (0.3.0 fuses them, which changes which matmuls selective
    checkpointing saves: it saves every second one), causal SDPA (0.3.0: FlexAttention with
    document masks), the cross entropy over the whole [B, L, V] logits in float32 (0.3.0 chunks
    it along the sequence) and the FSDP units of the time (_parallelize_december_2024)."""
    config = llama3_8b_local()
    model = config.model_spec.model
    for layer in model.layers:
        attention = layer.attention
        dim, head_dim = attention.qkv_linear.wqkv.in_features, attention.qkv_linear.head_dim
        attention.qkv_linear = QKVLinear.Config(
            head_dim=head_dim,
            wq=Linear.Config(in_features=dim, out_features=attention.n_heads * head_dim, param_init=_LINEAR_INIT),
            wkv=Linear.Config(in_features=dim, out_features=attention.n_kv_heads * head_dim,
                              param_init=_LINEAR_INIT))
        attention.inner_attention = ScaledDotProductAttention.Config()
    config.model_spec.parallelize_fn = _parallelize_december_2024
    config.loss = CrossEntropyLoss.Config(global_vocab_size=decoder_vocab_size(config.model_spec))
    config.training.local_batch_size = 2
    return config
