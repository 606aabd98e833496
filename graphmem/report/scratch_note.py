"""Stage 4 helper: which ops without a scratch-memory rule could matter, and what they could add.

Input: the op types a report ran without a scratch rule (``ModeReport.unmodeled_ops``) and
the target device.  Output: a note for the text report, or None when none can matter.

On cpu the prediction is checked against real execution (tests/oracles.py), so the note
names only ops outside PyTorch's own namespaces (custom kernels).  On cuda it names the op
types whose kernels take a workspace the graph cannot show (below); the cuBLAS GEMMs are
not among them: their workspace is modelled (graphmem.memory.cuda_replay.CUBLAS_OPS).
The JSON report keeps the full list.
"""

from __future__ import annotations

from collections.abc import Iterable

from graphmem.memory.cuda_replay import CUBLAS_OPS

__all__ = ["CUDA_WORKSPACE_OPS", "scratch_note", "workspace_ops"]

# op namespaces whose kernels PyTorch ships (custom ops live in others)
_PYTORCH_NAMESPACES = frozenset({"aten", "prims", "c10d", "_c10d_functional", "_c10d_functional_autograd",
                                 "_dtensor", "profiler"})

# short op name -> what its CUDA kernel may allocate for itself while it runs.  Sources (PyTorch):
# aten/src/ATen/native/cudnn/Conv_v7.cpp (getMaxWorkspaceSize: the free memory bounds the
# algorithm's workspace), cudnn/RNN.cpp (cudnnGetRNNWorkspaceSize), transformers/cuda/flash_attn
# (dq_accum) and mem_eff_attention (AttentionBackwardKernel::workspace_size), cuda/Blas.cpp
# (_scaled_mm's cuBLASLt workspace), cuda/SpectralOps.cpp (cuFFT plan cache), cuda/linalg.
CUDA_WORKSPACE_OPS: dict[str, str] = {
    **dict.fromkeys(("convolution", "convolution_backward", "_convolution", "cudnn_convolution",
                     "cudnn_convolution_transpose"),
                    "cuDNN's workspace for the algorithm it picks, up to the free GPU memory"),
    **dict.fromkeys(("_cudnn_rnn", "_cudnn_rnn_backward", "lstm", "gru", "rnn_tanh", "rnn_relu"),
                    "cuDNN's RNN workspace, sized by the sequence, batch and hidden size"),
    **dict.fromkeys(("_flash_attention_backward", "_scaled_dot_product_flash_attention_backward",
                     "_efficient_attention_backward", "_scaled_dot_product_efficient_attention_backward"),
                    "float32 accumulators about the size of the query's gradient"),
    **dict.fromkeys(("_scaled_dot_product_cudnn_attention", "_scaled_dot_product_cudnn_attention_backward"),
                    "cuDNN's attention workspace"),
    **dict.fromkeys(("_scaled_mm", "_int_mm", "_grouped_mm", "_scaled_grouped_mm"),
                    "a cuBLASLt workspace per call"),
    **dict.fromkeys(("_fft_c2c", "_fft_r2c", "_fft_c2r"), "cuFFT's plan workspace, kept in the plan cache"),
}


def _split(op: str) -> tuple[str, str]:
    parts = op.split(".")
    return (parts[0], parts[1]) if len(parts) == 3 else ("", op)


def workspace_ops(unmodeled: Iterable[str], device: str) -> dict[str, str]:
    """The unmodeled op types (full names) that can add memory on ``device``, with what they could add."""
    found: dict[str, str] = {}
    for op in sorted(set(unmodeled)):
        namespace, name = _split(op)
        if namespace not in _PYTORCH_NAMESPACES:
            found[op] = "a custom kernel: whatever it allocates without dispatching an op"
        elif device == "cuda" and op not in CUBLAS_OPS and name in CUDA_WORKSPACE_OPS:
            found[op] = CUDA_WORKSPACE_OPS[name]
        elif device == "cuda" and op not in CUBLAS_OPS and name.startswith(("linalg_", "_linalg_")):
            found[op] = "a cuSOLVER / MAGMA workspace for the factorisation"
    return found


def scratch_note(unmodeled: Iterable[str], device: str) -> str | None:
    """The text report's note: the op types that may allocate scratch memory graphmem does not
    model, grouped by what they could add while they run; None when there is none."""
    groups: dict[str, list[str]] = {}
    for op, what in workspace_ops(unmodeled, device).items():
        groups.setdefault(what, []).append(_split(op)[1])
    if not groups:
        return None
    lines = [f"- {', '.join(names)}: {what}" for what, names in groups.items()]
    return ("Not modelled: scratch memory these ops' kernels may allocate while they run (it raises the peak "
            "only when one runs at the peak; --format json lists every op type without a rule)\n"
            + "\n".join(lines))
