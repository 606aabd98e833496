"""Rules for recurrent layers."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from graphmem.trace.rules.registry import ArgMeta, RuleKind, register

aten = torch.ops.aten

_PAGE = 4096  # oneDNN starts each part of an RNN workspace on a page


def _good_ld(dim: int, itemsize: int) -> int:
    """oneDNN's leading dimension for ``dim`` elements: a multiple of 64 bytes, bumped by 64
    bytes when it is a multiple of 256 elements (against 4K aliasing); rnn_utils::get_good_ld."""
    step = 64 // itemsize
    ld = -(-dim // step) * step
    return ld + step if ld % 256 == 0 else ld


def _page(nbytes: int) -> int:
    return -(-nbytes // _PAGE) * _PAGE


def onednn_lstm_workspace_bytes(seq: int, batch: int, input_size: int, hidden: int,
                                itemsize: int, c_itemsize: int) -> int:
    """Bytes of the workspace oneDNN's LSTM forward-training primitive asks for, for one layer
    in one direction (PyTorch runs one primitive per layer and direction).

    Derived from oneDNN's layout (src/cpu/rnn/rnn_utils.hpp ``init_conf`` and
    ``set_workspace_sizes``, rnn_utils.cpp ``set_offsets``) with n_layer = n_dir = 1; each
    part starts on a 4096-byte page, and the empty part after the last one rounds the end up
    to a page too.  With T = seq, N = batch, I = input_size, H = hidden, s = the input's
    element size (bf16/fp16 run the cell in their own dtype), c = the cell state's, and
    S = 2 (T + 1) N (the states of the layer's input and output, T + 1 steps each):

        gates                T N good_ld(4H, s) s    the four gates of every step
        ht                   T N good_ld(H, s) s     the hidden state of every step
        states (h)           S good_ld(max(I, H), s) s
        states (c)           S H c
        diff states (layer)  S good_ld(max(I, H), 4) 4   fp32 gradient buffers, reserved by
        diff states (iter)   S good_ld(max(I, H), 4) 4   the forward for the backward
        diff states (c)      S H 4

    Checked to the byte against the real kernel (torch 2.13, oneDNN 3.12) over a grid of
    sizes in fp32 and bf16 in tests/unit/trace/rules/test_rnn_workspace.py; fp16 takes oneDNN only on
    CPUs with AVX512-FP16 and follows the bf16 formula, not measured here.
    """
    states = 2 * (seq + 1) * batch
    wide = max(input_size, hidden)
    parts = (seq * batch * _good_ld(4 * hidden, itemsize) * itemsize,
             seq * batch * _good_ld(hidden, itemsize) * itemsize,
             states * _good_ld(wide, itemsize) * itemsize,
             states * hidden * c_itemsize,
             states * _good_ld(wide, 4) * 4,
             states * _good_ld(wide, 4) * 4,
             states * hidden * 4)
    return sum(_page(part) for part in parts)


@register(aten.mkldnn_rnn_layer.default, device="cpu", kind=RuleKind.OUTPUT_SHAPES)
def onednn_lstm_workspace(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> dict[int, tuple[int, ...]]:
    """CPU LSTM training runs oneDNN (aten/src/ATen/native/mkldnn/RNN.cpp, one
    mkldnn_rnn_layer call per layer and direction).  When grad mode is on, the real kernel
    returns oneDNN's workspace as its fourth output, a uint8 tensor of
    ``onednn_lstm_workspace_bytes``, which autograd keeps for the backward; the meta kernel
    returns an empty one.  With grad mode off the real kernel returns no workspace, and the
    rule leaves the empty one.  The input is sequence-first (RNN.cpp transposes a batch-first
    input before the call): (T, N, I); hx and cx are (N, H)."""
    if not torch.is_grad_enabled():  # the kernel's own test (RNN.cpp: at::GradMode::is_enabled())
        return {}
    x, cx, hidden = args[0], args[6], args[10]
    if not (isinstance(x, ArgMeta) and isinstance(cx, ArgMeta) and len(x.shape) == 3):
        return {}
    seq, batch, input_size = x.shape
    return {3: (onednn_lstm_workspace_bytes(seq, batch, input_size, int(hidden), x.dtype.itemsize,
                                            cx.dtype.itemsize),)}
