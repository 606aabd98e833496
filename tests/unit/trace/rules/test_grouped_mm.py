"""``_grouped_mm`` under graphmem's fake tensors against the real CPU kernel: the same dtypes
accepted and refused, the same output shape, strides and storage size."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import graphmem
from graphmem.trace.core.fake_mode import recording_fake_mode
from tests.optional import installed

aten = torch.ops.aten
_OFFS = torch.tensor([3, 5, 8], dtype=torch.int32)

# name -> (mat_a, mat_b, offs); the transposed sides make outputs whose rows are not 16 bytes
# long, which the kernels pad
_LAYOUTS: dict[str, tuple[Callable[[], torch.Tensor], Callable[[], torch.Tensor], torch.Tensor | None]] = {
    "2d x 3d": (lambda: torch.randn(8, 16), lambda: torch.randn(3, 16, 8), _OFFS),
    "2d x 3d, padded rows": (lambda: torch.randn(8, 16), lambda: torch.randn(3, 6, 16).transpose(-2, -1), _OFFS),
    "3d x 3d": (lambda: torch.randn(3, 5, 16), lambda: torch.randn(3, 16, 8), None),
    "3d x 3d, padded rows": (lambda: torch.randn(3, 5, 16), lambda: torch.randn(3, 6, 16).transpose(-2, -1), None),
    "2d x 2d": (lambda: torch.randn(16, 8), lambda: torch.randn(8, 16), _OFFS),
    "3d x 2d, padded rows": (lambda: torch.randn(3, 6, 8), lambda: torch.randn(6, 8).t(), _OFFS),
    "misaligned strides": (lambda: torch.randn(8, 6), lambda: torch.randn(3, 6, 8), _OFFS),
    "offsets missing": (lambda: torch.randn(8, 16), lambda: torch.randn(3, 16, 8), None),
}


def _outcome(run: Callable[[], torch.Tensor]) -> Any:
    try:
        out = run()
    except RuntimeError as exc:
        return "refused: " + str(exc).splitlines()[0]
    return tuple(out.shape), out.stride(), out.dtype, out.untyped_storage().nbytes()


@pytest.mark.parametrize("dtype_b", [None, torch.bfloat16], ids=["same dtypes", "mat_b bf16"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64], ids=str)
@pytest.mark.parametrize("layout", list(_LAYOUTS))
def test_fake_kernel_matches_the_cpu_kernel(layout: str, dtype: torch.dtype, dtype_b: torch.dtype | None) -> None:
    make_a, make_b, offs = _LAYOUTS[layout]
    a, b = make_a().to(dtype), make_b().to(dtype_b or dtype)
    real = _outcome(lambda: aten._grouped_mm.default(a, b, offs=offs))
    mode = recording_fake_mode()
    fa, fb = mode.from_tensor(a), mode.from_tensor(b)
    fo = None if offs is None else mode.from_tensor(offs)
    with mode:
        fake = _outcome(lambda: aten._grouped_mm.default(fa, fb, offs=fo))
    if isinstance(real, str):  # refused by both (the messages name the dtypes their own way)
        assert isinstance(fake, str), f"the real kernel refuses ({real}); the fake one returns {fake}"
        assert real.split()[:3] == fake.split()[:3]
    else:
        assert fake == real


def test_out_dtype_other_than_mat_a_is_refused_as_the_kernel_does() -> None:
    a, b = torch.randn(8, 16, dtype=torch.bfloat16), torch.randn(3, 16, 8, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="must match `mat_a` dtype"):
        aten._grouped_mm.default(a, b, offs=_OFFS, out_dtype=torch.float32)
    mode = recording_fake_mode()
    with mode, pytest.raises(RuntimeError, match="must match `mat_a` dtype"):
        aten._grouped_mm.default(mode.from_tensor(a), mode.from_tensor(b), offs=mode.from_tensor(_OFFS),
                                 out_dtype=torch.float32)


_MOE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2)
_SPECS = ["input_ids=2x32:int64", "labels=2x32:int64"]


def _mixtral() -> torch.nn.Module:
    T = installed("transformers")
    return T.MixtralForCausalLM(T.MixtralConfig(num_local_experts=4, num_experts_per_tok=2, **_MOE))


def _qwen2_moe() -> torch.nn.Module:
    T = installed("transformers")
    return T.Qwen2MoeForCausalLM(T.Qwen2MoeConfig(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                                  shared_expert_intermediate_size=64, **_MOE))


@pytest.mark.parametrize("build", [_mixtral, _qwen2_moe], ids=["mixtral", "qwen2-moe"])
def test_fp32_moe_training_matches_real_execution(build: Callable[[], torch.nn.Module]) -> None:
    """The experts run ``_grouped_mm`` in float32; the real CPU kernel accepts it, and so does
    graphmem: the training peak equals the real run's, per phase too."""
    from tests.oracles import OPTIMIZERS, measure_training

    installed("transformers")  # imported before anything is measured: its import-time tensors count in nothing

    class Ops(TorchDispatchMode):
        seen: set[Any] = set()

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            self.seen.add(func)
            return func(*args, **(kwargs or {}))
    with Ops(), torch.no_grad():
        build()(torch.randint(0, 2, (2, 32)))
    assert aten._grouped_mm.default in Ops.seen, "the experts no longer run _grouped_mm"
    real = {"input_ids": torch.randint(0, 2, (2, 32)), "labels": torch.randint(0, 2, (2, 32))}
    measured = measure_training(build, [], OPTIMIZERS["adamw"], "auto", kw_inputs=real)
    report = graphmem.analyze(build, _SPECS, mode="train", optimizer="adamw")
    assert report.train is not None
    assert report.train.peak_bytes == measured.peak_bytes
    assert {p.phase: p.peak_bytes for p in report.train.phases} == measured.phase_peaks
