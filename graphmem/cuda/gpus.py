"""GPU presets: memory capacity, architecture and per-architecture overheads (data + pure lookups).

Input: a preset name such as ``"h100-80gb"``.  Output: a frozen ``GPU`` record, and the
per-architecture constants the CUDA target needs beyond the caching allocator: the CUDA
context (``nvidia_smi_estimate``) and the cuBLAS workspace (``cublas_workspace_bytes``).

``total_memory_bytes`` is what ``torch.cuda.get_device_properties(i).total_memory``
(cudaDeviceProp.totalGlobalMem) reports, which is less than nvidia-smi's "Total" (the driver
keeps some) and varies by a few MiB with the driver version and ECC.  Where only a torch
print-out was found, ``_CudaDeviceProperties(... total_memory=NMB)`` shows
``totalGlobalMem // 2**20``, so the preset holds N MiB: at most 1 MiB under the real value.
Each preset's ``memory_source`` says where its number comes from.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from graphmem.errors import UserInputError

__all__ = ["CUDA_CONTEXT_BYTES", "GPU", "GPUS", "ROOFLINES", "Roofline", "cublas_workspace_bytes", "get_gpu",
           "nvidia_smi_estimate"]

MiB = 1 << 20

# CUDA context (driver state, kernel images of the loaded modules), which nvidia-smi counts
# for the process but torch.cuda.memory_reserved() does not.  Anchor: PyTorch PR #86509
# (torch 1.13 sets CUDA_MODULE_LOADING=LAZY) measured 287,047,680 B for a context with lazy
# loading vs 666,632,192 B without (GPU not stated).  The per-architecture values are
# assumptions (the context grows with SM count and kernel image size), rounded up so the
# estimate errs high; benchmarks/gpu_validate.py measures the real value
# (cudaMemGetInfo used minus memory_reserved) to calibrate them.
CUDA_CONTEXT_BYTES: dict[str, int] = {
    "volta": 300 * MiB, "turing": 300 * MiB, "ampere": 400 * MiB, "ada": 400 * MiB,
    "hopper": 500 * MiB, "blackwell": 500 * MiB,
}


@dataclass(frozen=True, slots=True)
class GPU:
    """One GPU model as PyTorch sees it."""

    name: str                          # preset key, e.g. "h100-80gb"
    product: str                       # torch.cuda.get_device_name()
    total_memory_bytes: int            # torch.cuda.get_device_properties().total_memory
    memory_source: str                 # where total_memory_bytes comes from
    compute_capability: tuple[int, int]
    architecture: str                  # volta, turing, ampere, ada, hopper, blackwell

    @property
    def cuda_context_bytes(self) -> int:
        """Estimated CUDA context size on this architecture (see CUDA_CONTEXT_BYTES)."""
        return CUDA_CONTEXT_BYTES[self.architecture]


def _torch_mb(mb: int, where: str) -> str:
    return f"torch total_memory={mb}MB print-out ({where}); stored as {mb} MiB"


_PRESETS = (
    GPU("v100-16gb", "Tesla V100-SXM2-16GB", 16160 * MiB,
        _torch_mb(16160, "several public logs, torch 1.7-1.8"), (7, 0), "volta"),
    GPU("v100-32gb", "Tesla V100-PCIE-32GB", 32510 * MiB, _torch_mb(32510, "public notes"), (7, 0), "volta"),
    GPU("t4", "Tesla T4", 15095 * MiB,
        _torch_mb(15095, "Colab; other drivers print 15079-15109MB"), (7, 5), "turing"),
    GPU("a100-40gb", "NVIDIA A100-SXM4-40GB", 42_298_834_944,
        "deviceQuery 'Total amount of global memory: 40339 MBytes (42298834944 bytes)', driver 12.2 "
        "(bottlerocket-os/bottlerocket PR #3873)", (8, 0), "ampere"),
    GPU("a100-80gb", "NVIDIA A100-SXM4-80GB", 85_174_583_296,
        "total_memory_bytes recorded in a public training repo's hardware pin (81229 MiB)", (8, 0), "ampere"),
    GPU("a100-80gb-pcie", "NVIDIA A100 80GB PCIe", 81049 * MiB,
        "mixbench 'Total global mem: 81049 MB' (ekondis/mixbench issue #47); stored as 81049 MiB",
        (8, 0), "ampere"),
    GPU("a10g", "NVIDIA A10G", 22587 * MiB, _torch_mb(22587, "AWS g5 log"), (8, 6), "ampere"),
    GPU("rtx-3090", "NVIDIA GeForce RTX 3090", 24259 * MiB,
        _torch_mb(24259, "public log; older drivers print 24268MB"), (8, 6), "ampere"),
    GPU("l4", "NVIDIA L4", 23_583_784_960,
        "deviceQuery '22491 MBytes (23583784960 bytes)', driver 12.2 "
        "(bottlerocket-os/bottlerocket-kernel-kit PR #139)", (8, 9), "ada"),
    GPU("l40s", "NVIDIA L40S", 45589 * MiB, _torch_mb(45589, "public blog code"), (8, 9), "ada"),
    GPU("rtx-4090", "NVIDIA GeForce RTX 4090", 24563 * MiB, _torch_mb(24563, "public log"), (8, 9), "ada"),
    GPU("h100-80gb", "NVIDIA H100 80GB HBM3", 81089 * MiB,
        _torch_mb(81089, "torch 2.7 / CUDA 12.8; other reports 81082-81090MB; nvidia-smi says 81559MiB"),
        (9, 0), "hopper"),
    GPU("h100-pcie", "NVIDIA H100 PCIe", 81008 * MiB, _torch_mb(81008, "public script"), (9, 0), "hopper"),
    GPU("h100-94gb", "NVIDIA H100 NVL", 94 * 1024 * MiB,
        "NOT MEASURED: the marketing size (94 GB) read as GiB; expect torch to report ~1% less",
        (9, 0), "hopper"),
    GPU("h100-96gb", "NVIDIA H100 96GB", 95 * 1024 * MiB,
        "NOT MEASURED: torchtitan's docs/performance.md, its H100s (Grand Teton, 96GB HBM2e SXM, lower "
        "TDP) 'with 95 GiB memory'; stored as 95 GiB, the product name assumed", (9, 0), "hopper"),
    GPU("h200", "NVIDIA H200", 143156 * MiB, _torch_mb(143156, "public script"), (9, 0), "hopper"),
    GPU("rtx-5090", "NVIDIA GeForce RTX 5090", 33_677_180_928,
        "deviceQuery '32117 MBytes (33677180928 bytes)', driver 12.8 "
        "(aikitoria/open-gpu-kernel-modules issue #1)", (12, 0), "blackwell"),
)

GPUS: dict[str, GPU] = {gpu.name: gpu for gpu in _PRESETS}
# short names; a model sold with several memory sizes (a100, h100, v100) has none (get_gpu asks which)
_ALIASES = {"h100-sxm": "h100-80gb", "h100-nvl": "h100-94gb", "4090": "rtx-4090", "3090": "rtx-3090",
            "5090": "rtx-5090"}


@dataclass(frozen=True, slots=True)
class Roofline:
    """A GPU's peak rates, for a roofline estimate of an op's time: its FLOPs at the matrix
    units' dense 16-bit rate (bf16/fp16 matmuls and attention) or the fp32 rate (everything
    else), or its bytes at the memory bandwidth, whichever takes longer."""

    matrix_16bit_tflops: float
    fp32_tflops: float
    bandwidth_gbs: float
    source: str


# NVIDIA's datasheets (dense rates: the datasheets' tensor figures halved where they are shown
# with sparsity); presets not listed have no roofline here (plan --policy then counts FLOPs)
_HOPPER = "NVIDIA H100 datasheet"
ROOFLINES: dict[str, Roofline] = {
    "h100-80gb": Roofline(989.4, 66.9, 3350, f"{_HOPPER}, SXM5"),
    "h100-pcie": Roofline(756.0, 51.0, 2000, f"{_HOPPER}, PCIe"),
    "h200": Roofline(989.4, 66.9, 4800, "NVIDIA H200 datasheet, SXM (H100's compute, HBM3e)"),
    "a100-80gb": Roofline(312.0, 19.5, 2039, "NVIDIA A100 datasheet, SXM4 80GB"),
    "a100-40gb": Roofline(312.0, 19.5, 1555, "NVIDIA A100 datasheet, SXM4 40GB"),
}


def _sizes_of(key: str) -> list[str]:
    """The presets a model's short name (``a100``, ``h100``) stands for, when they hold different
    amounts of memory (one preset, or several of one size: an unambiguous name)."""
    named = [n for n in GPUS if n.startswith(f"{key}-")] if key not in GPUS else []
    return named if len({GPUS[n].total_memory_bytes for n in named}) > 1 else []


def get_gpu(name: str) -> GPU:
    """The preset for ``name`` (case and ``_``/``-`` insensitive; a few short aliases, never one
    for a model sold with several memory sizes: ``a100`` is refused, naming ``a100-40gb`` and
    ``a100-80gb``).

    Raises:
        UserInputError: an unknown name (the message lists the valid ones), or a model's name
            that stands for several memory sizes (the message lists them).
    """
    key = name.strip().lower().replace("_", "-")
    sizes = _sizes_of(key)
    if len(sizes) > 1:  # "a100": an A100-40GB owner must not get an 80 GB budget
        raise UserInputError(f"GPU {name!r} comes in several memory sizes: give one of "
                             f"{', '.join(f'{n} ({GPUS[n].total_memory_bytes / 2**30:.1f} GiB)' for n in sizes)}")
    key = _ALIASES.get(key, key)
    if key not in GPUS:
        raise UserInputError(f"unknown GPU {name!r}; expected one of {', '.join(GPUS)} "
                             f"(aliases: {', '.join(_ALIASES)}). Hint: pick the closest model and memory size.")
    return GPUS[key]


def nvidia_smi_estimate(reserved_bytes: int, gpu: GPU, nccl_bytes: int = 0) -> int:
    """What nvidia-smi would show for the process: the allocator's reserved bytes plus the
    CUDA context plus ``nccl_bytes``, NCCL's own buffers (``graphmem.cuda.nccl``; 0 for a
    run on one GPU).  Other memory allocated outside PyTorch's allocator (cuDNN/cuFFT plans,
    other libraries' cudaMalloc) is not included."""
    return reserved_bytes + gpu.cuda_context_bytes + nccl_bytes


def cublas_workspace_bytes(gpu: GPU, workspace_config: str | None = None) -> int:
    """Bytes of one cuBLAS workspace (``getChosenWorkspaceSize``, aten/src/ATen/cuda/CublasHandlePool.cpp).

    PyTorch allocates it through the caching allocator at the first cuBLAS call of each
    (handle, stream) and keeps it (``cublas_handle_stream_to_workspace``).  Handles are per
    thread, so a training step usually holds two: the main thread's and the autograd
    engine's device thread's (backward).  With TORCH_CUBLASLT_UNIFIED_WORKSPACE (the default
    on CUDA builds, per the docs of torch.backends.cuda.blas_workspace_size in torch 2.13)
    cuBLASLt reuses it.  Add it to a replay with ``alloc_events.ExtraAllocation(persistent=True)``.

    Args:
        gpu: the target GPU (its compute capability picks the default).
        workspace_config: the ``CUBLAS_WORKSPACE_CONFIG`` value, e.g. ``":4096:8"``; None
            for PyTorch's default.

    Returns:
        Default ``:4096:2:16:8`` = 4096 KiB x 2 + 16 KiB x 8 = 8,519,680 B; 32 MiB when the
        compute capability major is 9, 10, 11 or 12 (Hopper, Blackwell); with a config, the
        sum of SIZE KiB x COUNT over its ``:SIZE:COUNT`` pairs.

    Raises:
        UserInputError: a ``workspace_config`` without any ``:SIZE:COUNT`` pair.
    """
    if workspace_config is None:
        if gpu.compute_capability[0] in (9, 10, 11, 12):
            return 4096 * 8 * 1024
        return 4096 * 1024 * 2 + 16 * 1024 * 8
    pairs = re.findall(r":([0-9]+):([0-9]+)", workspace_config)
    if not pairs:
        raise UserInputError(f"CUBLAS_WORKSPACE_CONFIG {workspace_config!r} has no :SIZE:COUNT pair; "
                             "expected e.g. ':4096:8' or ':4096:2:16:8' (SIZE in KiB).")
    return sum(int(size) * 1024 * int(count) for size, count in pairs)
