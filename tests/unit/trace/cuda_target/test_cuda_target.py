"""The CUDA target without a GPU: kernel choices, saved tensors, allocator arithmetic by hand."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import graphmem
from graphmem.cuda.gpus import get_gpu
from graphmem.errors import UserInputError
from graphmem.records import Role
from graphmem.trace.cuda_target.kernels import select_sdpa_backend

H100, V100, T4 = get_gpu("h100-80gb"), get_gpu("v100-16gb"), get_gpu("t4")


@pytest.mark.parametrize("dtype, head_dim, mask, gpu, expected", [
    (torch.bfloat16, 64, False, H100, "flash"),      # half precision, sm90, no mask
    (torch.float32, 64, False, H100, "efficient"),   # flash takes no fp32
    (torch.bfloat16, 64, True, H100, "efficient"),   # flash takes no arbitrary mask
    (torch.float16, 64, False, V100, "efficient"),   # flash needs sm80+
    (torch.bfloat16, 64, False, T4, "math"),         # bf16 efficient needs sm80+
    (torch.float16, 60, False, H100, "math"),        # head dim not a multiple of 8
    (torch.float16, 512, False, H100, "efficient"),  # flash head dim <= 256
])
def test_sdpa_backend_choice(dtype: torch.dtype, head_dim: int, mask: bool, gpu: object, expected: str) -> None:
    assert select_sdpa_backend(dtype, head_dim, mask, gpu) == expected  # type: ignore[arg-type]


def test_forcing_an_impossible_backend_is_a_usage_error() -> None:
    with pytest.raises(UserInputError, match="--sdpa flash cannot run float32"):
        select_sdpa_backend(torch.float32, 64, False, H100, "flash")


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(64, 192)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (t.view(2, 128, 4, 16).transpose(1, 2) for t in self.qkv(x).split(64, -1))
        return self.drop(F.scaled_dot_product_attention(q, k, v, is_causal=True))


def _saved(report: graphmem.MemoryReport) -> list[tuple[tuple[int, ...], str]]:
    assert report.train is not None
    return [(s.shape, s.dtype) for s in report.train.trace.storages if Role.SAVED in s.roles]


def test_flash_attention_saves_logsumexp_not_the_score_matrix() -> None:
    report = graphmem.analyze(Attention, ["2x128x64:bf16"], mode="train", device="cuda", dtype=torch.bfloat16)
    saved = _saved(report)
    # CUDA flash attention's meta kernel: out (2,4,128,16) and logsumexp (2,4,128) in fp32
    assert ((2, 4, 128), "float32") in saved
    assert all(shape[-2:] != (128, 128) for shape, _ in saved)  # no s x s matrix
    cpu = _saved(graphmem.analyze(Attention, ["2x128x64:bf16"], mode="train", dtype=torch.bfloat16))
    assert saved != cpu


class KeywordAttention(Attention):
    """As transformers 4.4x's GPT-NeoX calls it: query=, key=, value= by name."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (t.view(2, 128, 4, 16).transpose(1, 2) for t in self.qkv(x).split(64, -1))
        return self.drop(F.scaled_dot_product_attention(query=q, key=k, value=v, is_causal=True))


def test_attention_called_with_keywords_is_the_same_kernel() -> None:
    by_name = graphmem.analyze(KeywordAttention, ["2x128x64:bf16"], mode="train", device="cuda", dtype=torch.bfloat16)
    assert by_name.train is not None and by_name.train.sdpa_backends == {"flash": 2}  # two iterations
    assert _saved(by_name) == _saved(graphmem.analyze(Attention, ["2x128x64:bf16"], mode="train", device="cuda",
                                                      dtype=torch.bfloat16))


def test_fused_dropout_saves_a_bool_mask() -> None:
    report = graphmem.analyze(Attention, ["2x128x64"], mode="train", device="cuda")
    assert ((2, 4, 128, 16), "bool") in _saved(report)
    cpu = graphmem.analyze(Attention, ["2x128x64"], mode="train")
    assert ((2, 4, 128, 16), "bool") not in _saved(cpu)


def test_cuda_optimizer_default_is_foreach() -> None:
    report = graphmem.analyze(lambda: nn.Linear(8, 8), ["2x8"], mode="train", device="cuda", optimizer="adam")
    assert report.train is not None
    assert any(op.op.startswith("aten._foreach_") for op in report.train.trace.ops)


def test_allocator_numbers_by_hand() -> None:
    # Linear(4,3) no bias on 2x4 fp32: weight 48 B, input 32 B, output 24 B -> three 512-B
    # blocks in one 2 MiB small segment; the first mm allocates the cuBLAS workspace, 32 MiB
    # on Hopper (>= 10 MiB: rounded to 2 MiB, its own segment).
    report = graphmem.analyze(lambda: nn.Linear(4, 3, bias=False), ["2x4"], mode="inference",
                              device="cuda", gpu="h100-80gb", alloc_conf="")
    stats = report.inference.allocator  # type: ignore[union-attr]
    assert stats is not None
    assert stats.allocated_peak_bytes == 3 * 512 + 32 * 2**20
    assert stats.reserved_peak_bytes == 2 * 2**20 + 32 * 2**20


def test_amp_checkpoint_and_cuda_together() -> None:
    from tests.models import CheckpointedMLP

    report = graphmem.analyze(CheckpointedMLP, ["8x128"], mode="train", device="cuda", amp="bf16")
    assert report.train is not None and report.train.recompute_flops > 0
