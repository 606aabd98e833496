"""Rules for grouped matrix multiplication (the experts of mixture-of-experts layers)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from graphmem.trace.rules.registry import ArgMeta, RuleKind, register

aten = torch.ops.aten
_ACCEPTED = (torch.float32, torch.bfloat16, torch.float16)


def _check_strides(m: ArgMeta) -> None:
    """GroupedMMUtils.h check_valid_strides_and_return_transposed: row- or column-major in
    the last two dimensions, the other stride a multiple of 16 bytes."""
    end, size, stride = len(m.shape) - 1, m.shape, m.stride
    alignment = 16 // m.dtype.itemsize
    if stride[end - 1] == 1 and stride[end] >= max(1, size[end - 1]):
        leading = stride[end]
    elif stride[end] == 1 and stride[end - 1] >= max(1, size[end]):
        leading = stride[end - 1]
    else:
        raise RuntimeError(f"Invalid strides/sizes, got {list(stride)} for strides and {list(size)} for sizes")
    if leading % alignment:
        raise RuntimeError("strides should be multiple of 16 bytes")


def _arguments(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> tuple[Any, ...]:
    names = ("self", "mat2", "offs", "bias", "out_dtype")
    values = dict(zip(names, args, strict=False))
    values.update(kwargs)
    return tuple(values.get(name) for name in names)


@register(aten._grouped_mm.default, device="cpu", kind=RuleKind.FAKE_KERNEL)
def grouped_mm_output(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> ArgMeta:
    """The output of ``_grouped_mm`` as PyTorch's own kernels make it.

    torch 2.13's meta kernel (torch/_meta_registrations.py ``_meta_grouped_mm_common``)
    still has the checks of the first, bf16-only CUDA kernel: it refuses float32 and float16
    ("Expected inputs of BF16 type"), and pads the output's rows to 16 bytes only when torch
    is built with CUDA.  The real kernels, the CPU one (native/Blas.cpp ``_grouped_mm``,
    a loop of mm / bmm) and the CUDA one (cuda/GroupedBlas.cpp
    ``_grouped_mm_cuda``, which falls back to the same loop outside bf16), both run
    GroupedMMUtils.h: ``_grouped_mm_validate_inputs`` (float32, bfloat16 or float16; 2-D or
    3-D; rows or columns contiguous with the other stride a multiple of 16 bytes; int32
    offsets exactly when a side is 2-D; no bias), ``_resolve_grouped_mm_out_dtype`` (the
    output in mat_a's dtype), then ``create_grouped_gemm_output_tensor``: the last dimension's
    stride rounded up to 16 bytes (not on ROCm).  Here the same checks, in the same order, with
    the same messages, and the same output.  The kernels' check that the data pointers are
    16-byte aligned has no fake counterpart: fake tensors have no address.  Checked against
    the real CPU kernel in tests/unit/trace/rules/test_grouped_mm.py."""
    mat_a, mat_b, offs, bias, out_dtype = _arguments(args, kwargs)
    for name, mat in (("mat_a", mat_a), ("mat_b", mat_b)):
        if mat.dtype not in _ACCEPTED:
            raise RuntimeError(f"Expected {name} to be Float32, BFloat16 or Float16 matrix, got {mat.dtype}")
    for name, mat in (("mat_a", mat_a), ("mat_b", mat_b)):
        if len(mat.shape) not in (2, 3):
            raise RuntimeError(f"{name} has to be 2 or 3d")
    a_2d, b_2d = len(mat_a.shape) == 2, len(mat_b.shape) == 2
    if not (a_2d and b_2d) and mat_a.shape[-1] != mat_b.shape[-2]:
        raise RuntimeError("contraction dimension of mat_a and mat_b must match")
    _check_strides(mat_a)
    _check_strides(mat_b)
    if (offs is not None) != (a_2d or b_2d):
        raise RuntimeError("Have to provide offsets if there is a 2d matrix, or no offset if both matrices are 3d")
    if offs is not None and len(offs.shape) != 1:
        raise RuntimeError("offs has to be 1D")
    if offs is not None and offs.dtype != torch.int32:
        raise RuntimeError("Offsets have to be int32")
    if bias is not None:
        raise RuntimeError("Bias not supported yet")
    if (out_dtype or mat_a.dtype) != mat_a.dtype:
        raise RuntimeError("Grouped gemm output dtype must match `mat_a` dtype")
    if mat_a.dtype != mat_b.dtype and (a_2d or b_2d):  # the fallback's mm_out
        raise RuntimeError(f"expected m1 and m2 to have the same dtype, but got: {mat_a.dtype} != {mat_b.dtype}")
    if mat_a.dtype != mat_b.dtype:  # the fallback's bmm_out, into an output in mat_a's dtype
        raise RuntimeError(f"Expected out tensor to have dtype {mat_b.dtype}, but got {mat_a.dtype} instead")
    if a_2d:
        if not b_2d and offs.shape[0] != mat_b.shape[0]:
            raise RuntimeError("matrix batch sizes have to match")
        shape = (offs.shape[0], mat_a.shape[0], mat_b.shape[1]) if b_2d else (mat_a.shape[0], mat_b.shape[-1])
    elif b_2d:
        if offs.shape[0] != mat_a.shape[0]:
            raise RuntimeError("matrix batch sizes have to match")
        shape = (mat_a.shape[1], mat_b.shape[1])
    else:
        if mat_a.shape[0] != mat_b.shape[0]:
            raise RuntimeError("batched dimension has to match")
        shape = (mat_a.shape[0], mat_a.shape[1], mat_b.shape[-1])
    alignment = 1 if torch.version.hip else 16 // mat_a.dtype.itemsize
    row = -(-shape[-1] // alignment) * alignment
    stride = (row, 1) if len(shape) == 2 else (shape[1] * row, row, 1)
    return ArgMeta(shape, mat_a.dtype, stride)
