"""Rules for CUDA's matrix multiplies: the operand copies cuBLAS needs.

cuBLAS reads a matrix in row- or column-major order with a leading dimension of at least its
rows (columns); PyTorch's CUDA kernels copy any operand laid out otherwise into a contiguous
temporary before the call and free it on return (aten/src/ATen/native/cuda/Blas.cpp,
``prepare_matrix_for_cublas`` for ``mm``/``addmm``, ``prepare_batch_matrix_for_cublas`` for
``bmm``/``baddbmm``: ``tensor.clone(at::MemoryFormat::Contiguous)``).  The copy is made inside
the kernel, so no op of it is dispatched and a fake tensor never allocates it.

The common case is a gradient made by broadcasting: ``loss = logits.sum()`` gives backward a
gradient of the logits' shape with every stride 0 (``expand``), and the language-model head's
two backward matmuls each copy it whole: a logits-sized temporary (62.5 MB for 1024 tokens of
a 30522-word vocabulary in fp16).  A dense operand (contiguous or transposed) is never copied.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from graphmem.trace.rules.registry import ArgMeta, register

aten = torch.ops.aten


def _dense(meta: ArgMeta) -> bool:
    """``TensorImpl::compute_non_overlapping_and_dense``: the elements fill a block of memory
    exactly once, in some order of the dimensions (size-1 dimensions ignored).  Ordered by stride
    alone, as c10 orders them: comparing sizes would tie a size symbol to a number for nothing."""
    dims = sorted(((stride, size) for size, stride in zip(meta.shape, meta.stride, strict=True) if size != 1),
                  key=lambda pair: pair[0])
    expected = 1
    for stride, size in dims:
        if stride != expected:
            return False
        expected *= size
    return True


def _nbytes(meta: ArgMeta) -> int:
    """The operand's bytes; a size symbol stays a symbol (no int(): that would fix its value)."""
    numel = 1
    for size in meta.shape:
        numel *= size
    return numel * meta.dtype.itemsize


def _matrix_copy(meta: Any) -> int:
    """Bytes ``prepare_matrix_for_cublas`` copies for one 2-D operand (0: used in place)."""
    if not isinstance(meta, ArgMeta) or len(meta.shape) != 2 or _dense(meta):
        return 0
    (rows, cols), (row_stride, col_stride) = meta.shape, meta.stride
    if row_stride == 1 and col_stride >= max(1, rows):  # column-major with a valid leading dimension
        return 0
    if col_stride == 1 and row_stride >= max(1, cols):  # row-major with a valid leading dimension
        return 0
    return _nbytes(meta)


def _contiguous(meta: ArgMeta) -> bool:
    """``is_contiguous()``: row-major with no gaps (size-1 dimensions ignored)."""
    expected = 1
    for size, stride in zip(reversed(meta.shape), reversed(meta.stride), strict=True):
        if size != 1:
            if stride != expected:
                return False
            expected *= size
    return True


def _batch_copy(meta: Any, m: int, n: int, transpose_result: bool) -> int:
    """Bytes ``prepare_batch_matrix_for_cublas`` copies for one 3-D operand; ``m``, ``n`` are the
    bounds its leading dimensions are checked against, as ``baddbmm_out_cuda_impl`` passes them."""
    if not isinstance(meta, ArgMeta) or len(meta.shape) != 3:
        return 0
    fast, lead = (meta.stride[2], meta.stride[1]) if transpose_result else (meta.stride[1], meta.stride[2])
    if fast == 1 and lead >= max(1, m):
        return 0
    if lead == 1 and fast >= max(1, n):
        return 0
    # "gemm call requires leading dimension and stride parameters to be non-zero"
    return 0 if _contiguous(meta) and meta.stride[1] != 0 and meta.stride[2] != 0 else _nbytes(meta)


@register(aten.mm.default, device="cuda")
def mm_operand_copies(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> int:
    """``mm_out_cuda`` -> ``addmm_out_cuda_impl``: both operands are prepared (and copied where
    needed) before the one cuBLAS call, and both copies live until it returns."""
    return _matrix_copy(args[0]) + _matrix_copy(args[1])


@register([aten.addmm.default, aten._addmm_activation.default], device="cuda")
def addmm_operand_copies(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> int:
    """As ``mm``; the bias is expanded into the result by ``copy_``, with no temporary."""
    return _matrix_copy(args[1]) + _matrix_copy(args[2])


@register(aten.bmm.default, device="cuda")
def bmm_operand_copies(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> int:
    """``bmm_out_cuda`` -> ``baddbmm_out_cuda_impl`` on a fresh (contiguous) result."""
    return _batched(args[0], args[1])


@register(aten.baddbmm.default, device="cuda")
def baddbmm_operand_copies(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> int:
    """``baddbmm_out_cuda_impl``: ``self`` is expanded into the fresh result by ``copy_``."""
    return _batched(args[1], args[2])


def _batched(batch1: Any, batch2: Any) -> int:
    """The copies for a (b, rows, k) x (b, k, cols) product into a fresh contiguous result: the
    result is read transposed (``transpose_result``) unless it has one column; then (m, k, n)
    are (cols, k, rows), and batch2 is prepared before batch1 (else (rows, k, cols) in order)."""
    if not isinstance(batch1, ArgMeta) or not isinstance(batch2, ArgMeta):
        return 0
    rows, k, cols = batch1.shape[1], batch1.shape[2], batch2.shape[2]
    if cols != 1:
        return _batch_copy(batch2, cols, k, True) + _batch_copy(batch1, k, rows, True)
    return _batch_copy(batch1, rows, k, False) + _batch_copy(batch2, k, cols, False)
