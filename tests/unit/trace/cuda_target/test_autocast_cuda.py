"""cuda_autocast against the truth: the installed torch's dispatcher registrations and its
shipped autocast_mode.h, CUDA's documented dtype behaviour, and plain CPU autocast."""

from __future__ import annotations

import re
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

from graphmem.trace.cuda_target.autocast import (
    CUDA_POLICIES,
    FP32_OUTSIDE_THE_MACROS,
    NOT_MODELLED,
    CastPolicy,
    cuda_autocast,
    cuda_autocast_lists,
)

aten = torch.ops.aten
BF16, FP32 = torch.bfloat16, torch.float32
HEADER = Path(torch.__file__).parent / "include" / "ATen" / "autocast_mode.h"


def registered(key: str) -> set[str]:
    """Ops the installed torch gives a kernel for ``key``, straight from the dispatcher."""
    return {name for name in torch._C._dispatch_get_all_op_names()
            if torch._C._dispatch_has_kernel_for_dispatch_key(name, key)}


def autocast_cpu_line(op: str) -> str:
    """The AutocastCPU row of the dispatcher's table for ``op``."""
    rows = torch._C._dispatch_dump_table(op).splitlines()
    return next(row for row in rows if row.startswith("AutocastCPU:"))


class Casts(TorchDispatchMode):
    """Records every cast: (source tensor, weak reference to the result).  Under
    inference_mode the mode sees aten.to itself, otherwise its decomposition _to_copy."""

    def __init__(self) -> None:
        super().__init__()
        self.casts: list[tuple[torch.Tensor, weakref.ref[torch.Tensor]]] = []
        self.softmax_dtypes: list[torch.dtype] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func in (aten._to_copy.default, aten.to.dtype):
            self.casts.append((args[0], weakref.ref(out)))
        if func is aten._softmax.default:
            self.softmax_dtypes.append(out.dtype)
        return out

    def of(self, source: torch.Tensor) -> int:
        return sum(src is source for src, _ in self.casts)


# ---- (1) the table is the installed torch's --------------------------------------------------------

def test_policy_table_is_exactly_the_ops_torch_registers_for_autocast_cuda() -> None:
    assert {f"aten::{name}" for name in CUDA_POLICIES} == _cuda_ops()


def _cuda_ops() -> set[str]:
    """The ops with an AutocastCUDA kernel, but those a CUDA build adds that are not modelled."""
    return set(registered("AutocastCUDA")) - {f"aten::{name}" for name in NOT_MODELLED}


def _header_macro(text: str, macro: str) -> set[str]:
    body = text.split(f"#define {macro}(_)", 1)[1].split("\n\n", 1)[0]
    if macro == "AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE":
        return set(re.findall(r'"([\w.]+)"', body))
    return {".".join(p.strip() for p in m.split(",")) for m in re.findall(r"_\(([\w, ]+)\)", body)}


@pytest.mark.skipif(not HEADER.exists(), reason="this torch install ships no ATen headers")
def test_policies_follow_the_macros_of_the_installed_autocast_mode_h() -> None:
    text = HEADER.read_text()
    by_policy = {policy: {n for n, p in CUDA_POLICIES.items() if p is policy} for policy in CastPolicy}
    # KERNEL_CUDA(cudnn_convolution[_transpose], lower_precision_fp) and the banned
    # binary_cross_entropy are registered in autocast_mode.cpp, outside the macros
    assert by_policy[CastPolicy.LOWER_PRECISION_FP] == _header_macro(text, "AT_FORALL_LOWER_PRECISION_FP") | {
        "cudnn_convolution", "cudnn_convolution_transpose"}
    assert by_policy[CastPolicy.FP32] == _header_macro(text, "AT_FORALL_FP32") | set(FP32_OUTSIDE_THE_MACROS)
    assert by_policy[CastPolicy.FP32_SET_OPT_DTYPE] == _header_macro(text, "AT_FORALL_FP32_SET_OPT_DTYPE")
    assert by_policy[CastPolicy.FP32_APPEND_DTYPE] == _header_macro(
        text, "AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE")
    assert by_policy[CastPolicy.PROMOTE] == _header_macro(text, "AT_FORALL_PROMOTE")
    assert by_policy[CastPolicy.BANNED] == {"binary_cross_entropy"}


def test_every_autocast_kernel_is_overridden_inside_and_restored_after() -> None:
    cuda_ops, cpu_only = _cuda_ops(), registered("AutocastCPU") - registered("AutocastCUDA")
    before = {op: autocast_cpu_line(op) for op in cuda_ops | cpu_only}
    with cuda_autocast(BF16):
        for op in cpu_only:  # CUDA does not autocast these: cat, stack, fft_*, linalg_* ...
            assert autocast_cpu_line(op).startswith("AutocastCPU: fallthrough registered"), op
        for op in cuda_ops:
            assert autocast_cpu_line(op) != before[op] and "fallthrough" not in autocast_cpu_line(op), op
    assert {op: autocast_cpu_line(op) for op in before} == before


# ---- (2) dtypes as on CUDA -------------------------------------------------------------------------

def test_matmuls_and_convolutions_run_in_the_low_dtype() -> None:
    x, w = torch.randn(4, 8), torch.randn(8, 8)
    with cuda_autocast(BF16):
        assert (x @ w).dtype == F.linear(x, w).dtype == torch.matmul(x, w).dtype == BF16
        assert F.conv2d(torch.randn(1, 3, 8, 8), torch.randn(4, 3, 3, 3)).dtype == BF16
    with cuda_autocast(torch.float16):
        assert torch.mm(x, w).dtype == torch.float16


def test_softmax_norms_reductions_and_exp_return_fp32_from_a_bf16_input() -> None:
    # CUDA: softmax/log_softmax/sum fp32_set_opt_dtype, layer_norm/exp fp32; CPU autocast has
    # no kernel for them and would keep bf16
    xb = torch.randn(4, 8).to(BF16)
    with cuda_autocast(BF16):
        outs = [xb.softmax(-1), xb.log_softmax(-1), F.layer_norm(xb, (8,)), xb.sum(), xb.sum(0), xb.exp()]
        assert [o.dtype for o in outs] == [FP32] * 6
        assert xb.softmax(-1, dtype=torch.float64).dtype == torch.float64  # an explicit dtype is kept
        assert aten.norm.Scalar(xb).dtype == FP32  # fp32_append_dtype
        assert F.gelu(xb).dtype == BF16  # on no list: runs in its input dtype


def test_promote_takes_the_widest_floating_dtype() -> None:
    xb, x = torch.randn(4).to(BF16), torch.randn(4)
    with cuda_autocast(BF16):
        assert torch.addcmul(xb, x, xb).dtype == FP32
        assert torch.addcmul(xb, xb, xb).dtype == BF16


_x, _v, _w = torch.randn(4, 8), torch.randn(8), torch.randn(8, 8)
_xb, _vb = _x.to(BF16), _v.to(BF16)
# one call per argument shape the kernels handle, with the dtype CUDA's policy gives
ARGUMENT_SHAPES: dict[str, tuple[Callable[[], torch.Tensor], torch.dtype]] = {
    "TensorList (multi_dot)": (lambda: torch.linalg.multi_dot([_x, _w, _w]), BF16),
    "Tensor? mask (sdpa)": (lambda: F.scaled_dot_product_attention(
        _x[None], _x[None], _x[None], attn_mask=torch.zeros(4, 4)), BF16),
    "tuple output (lstm_cell)": (
        lambda: torch.lstm_cell(_x, (_x, _x), torch.randn(32, 8), torch.randn(32, 8))[0], BF16),
    "fp32 with Scalar first (pow.Scalar)": (lambda: torch.pow(2.0, _xb), FP32),
    "fp32 with int target (nll_loss)": (lambda: F.nll_loss(_xb, torch.tensor([0, 1, 2, 3])), FP32),
    "kwarg-only dtype (sum.dim_IntList)": (lambda: _xb.sum(dim=1, keepdim=True), FP32),
    "str ord (linalg_matrix_norm.str_ord)": (lambda: torch.linalg.matrix_norm(_xb, "fro"), FP32),
    "ineligible first arg (sum of int64)": (lambda: torch.arange(4).sum(), torch.int64),
    "norm.ScalarOpt_dim": (lambda: aten.norm.ScalarOpt_dim(_xb, None, [1]), FP32),
    "Tensor? bias not voting (bilinear)": (lambda: F.bilinear(_xb, _xb, torch.randn(3, 8, 8).to(BF16),
                                                              torch.randn(3)), BF16),
    "Tensor?[] indices (index_put)": (
        lambda: _xb.index_put((torch.tensor([0, 1]),), torch.randn(2, 8)), FP32),
    "int index (scatter_add)": (lambda: _xb.scatter_add(0, torch.zeros(4, 8, dtype=torch.long), _x), FP32),
    "both low (vdot)": (lambda: torch.vdot(_vb, _vb), BF16),
    "double is not cast (mm)": (lambda: _x.double() @ _w.double(), torch.float64),
}


@pytest.mark.parametrize("name", sorted(ARGUMENT_SHAPES))
def test_every_argument_shape_binds_and_gives_cudas_dtype(name: str) -> None:
    call, dtype = ARGUMENT_SHAPES[name]
    with cuda_autocast(BF16):
        assert call().dtype == dtype


def test_cat_is_not_autocast_it_type_promotes_without_a_cast() -> None:
    # CUDA has no autocast kernel for cat: regular type promotion inside cat, no _to_copy;
    # CPU autocast casts the bf16 input to fp32 first
    xb, x = torch.randn(4, 8).to(BF16), torch.randn(4, 8)
    with Casts() as cuda_side, cuda_autocast(BF16):
        assert torch.cat([xb, x]).dtype == torch.stack([xb, x]).dtype == FP32
    with Casts() as cpu_side, torch.autocast("cpu", dtype=BF16):
        assert torch.cat([xb, x]).dtype == FP32
    assert (cuda_side.of(xb), cpu_side.of(xb)) == (0, 1)


def test_binary_cross_entropy_is_refused_as_on_cuda() -> None:
    with cuda_autocast(BF16), pytest.raises(RuntimeError, match="unsafe to autocast"):
        F.binary_cross_entropy(torch.rand(3), torch.rand(3))


# ---- (3) the weight-cast cache ---------------------------------------------------------------------

def test_a_weight_is_cast_once_per_region_and_the_cast_is_freed_at_exit() -> None:
    linear, x = nn.Linear(8, 8, bias=False), torch.randn(4, 8).to(BF16)
    with Casts() as mode:
        with cuda_autocast(BF16):
            linear(x), linear(x)
            assert mode.of(linear.weight) == 1
            cached = mode.casts[0][1]
            assert cached() is not None  # held by the cache, not by any output
        assert cached() is None
        with cuda_autocast(BF16):
            linear(x)
    assert mode.of(linear.weight) == 2  # one per region


@pytest.mark.parametrize("region", ["cuda_autocast", "torch.autocast"])
def test_the_cache_skips_inputs_and_inference_mode_like_torchs_own(region: str) -> None:
    # linear is lower_precision_fp on CPU too, so plain CPU autocast runs torch's C++
    # cached_cast on the same calls: both must count the same casts
    linear, x = nn.Linear(8, 8, bias=False), torch.randn(4, 8)
    autocast = cuda_autocast(BF16) if region == "cuda_autocast" else torch.autocast("cpu", dtype=BF16)
    with Casts() as mode, autocast:
        with torch.no_grad():  # cached under no_grad too, with a grad_fn for later use
            linear(x)
        linear(x), linear(x)  # the input is no leaf that requires grad: cast every time
        with torch.inference_mode():  # never cached in inference mode (pytorch#158232)
            linear(x), linear(x)
        no_grad_cast = next(cast() for source, cast in mode.casts if source is linear.weight)
        assert no_grad_cast is not None and no_grad_cast.grad_fn is not None
    assert (mode.of(x), mode.of(linear.weight)) == (5, 3)


def test_casts_come_in_torchs_order() -> None:
    # addmm is lower_precision_fp on CPU too: torch's own wrapper is the oracle for the order
    linear, x = nn.Linear(8, 8), torch.randn(4, 8)
    orders = []
    for autocast in (cuda_autocast(BF16), torch.autocast("cpu", dtype=BF16)):
        with Casts() as mode, autocast:
            linear(x)
        orders.append([next(name for name, t in (("x", x), *linear.named_parameters()) if t is source)
                       for source, _ in mode.casts])
    assert orders[0] == orders[1] and len(orders[0]) == 3


# ---- (4) after exit, CPU autocast is CPU's again ---------------------------------------------------

def test_plain_cpu_autocast_is_unchanged_after_exit() -> None:
    xb = torch.randn(4, 8).to(BF16)
    with cuda_autocast(BF16):
        pass
    with torch.autocast("cpu", dtype=BF16):
        assert xb.softmax(-1).dtype == xb.sum().dtype == BF16
    assert torch.clear_autocast_cache is torch._C.clear_autocast_cache


def test_regions_nest_and_only_the_outermost_exit_removes_the_overrides() -> None:
    xb = torch.randn(4, 8).to(BF16)
    with cuda_autocast(BF16):
        with cuda_autocast(BF16):
            pass
        assert xb.softmax(-1).dtype == FP32
    with torch.autocast("cpu", dtype=BF16):
        assert xb.softmax(-1).dtype == BF16


# ---- (5) fake tensors with autograd ----------------------------------------------------------------

class Block(nn.Module):
    """A GPT block's memory-relevant ops: LayerNorm, Linear, softmax attention, GELU MLP."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
        attention = (q @ k.transpose(-2, -1) / 4).softmax(-1)
        x = x + self.proj(attention @ v)
        out: torch.Tensor = x + self.out(F.gelu(self.fc(self.ln2(x))))
        return out


def test_a_block_trains_on_fake_tensors() -> None:
    with FakeTensorMode():
        block, x = Block(), torch.randn(2, 5, 16)
        with Casts() as mode:
            with cuda_autocast(BF16):
                out = block(x)
                assert block.ln1(x).dtype == FP32  # layer_norm is fp32 on CUDA
            out.float().sum().backward()
    assert mode.softmax_dtypes == [FP32]  # from a bf16 matmul, as on CUDA
    assert all(p.grad is not None and p.grad.dtype == FP32 for p in block.parameters())
    assert mode.of(block.qkv.weight) == 1


def test_checkpoint_recompute_in_backward_uses_cuda_lists() -> None:
    block, x = Block(), torch.randn(2, 5, 16)
    with Casts() as mode, cuda_autocast_lists():
        with cuda_autocast(BF16):
            out = checkpoint(block, x, use_reentrant=False)
        out.float().sum().backward()
        # the recompute's own autocast region cast the weight again and dropped it at its exit
        assert mode.of(block.qkv.weight) == 2
        assert all(ref() is None for src, ref in mode.casts if src is block.qkv.weight)
    assert mode.softmax_dtypes == [FP32, FP32]  # forward and recompute


@pytest.fixture(autouse=True)
def no_overrides_left() -> Iterator[None]:
    yield
    assert "fallthrough" not in autocast_cpu_line("aten::cat")
