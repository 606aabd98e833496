"""NCCL's own GPU buffers: memory the communication library allocates with cudaMalloc, outside
PyTorch's caching allocator (data + pure arithmetic).

Input: the number of NCCL communicators a rank holds and the buffer size of one.  Output:
bytes that nvidia-smi counts for the process but ``torch.cuda.memory_reserved()`` does not
(like the CUDA context, ``graphmem.cuda.gpus``).

Where the default comes from (NCCL 2.x source, not measured on a GPU): each connection between
two ranks on one channel has one buffer per protocol, sized in ``computeBuffSizes``
(src/init.cc): Simple ``DEFAULT_BUFFSIZE`` = 4 MiB (the ``NCCL_BUFFSIZE`` variable), LL
``NCCL_LL_LINES_PER_THREAD x NCCL_LL_MAX_NTHREADS x NCCL_STEPS x sizeof(ncclLLFifoLine)``
= 8 x 512 x 8 x 16 B and LL128 ``NCCL_LL128_ELEMS_PER_THREAD x NCCL_LL128_MAX_NTHREADS x
NCCL_STEPS x sizeof(uint64_t)`` = 120 x 640 x 8 x 8 B (src/include/device.h).  The P2P
transport puts the LL and LL128 buffers on the receiving rank and, when it reads over NVLink,
the Simple buffer on the sending one; in a ring every rank receives from one neighbour and sends
to the other, so it holds one connection's worth per channel.  The channel count is chosen by
NCCL from the topology (``NCCL_DEBUG=INFO`` prints it as "N coll channels"); 32 is assumed.
Not counted: NVLink SHARP (NVLS) buffers on NVSwitch systems, tree and point-to-point
connections beyond the ring, and NCCL's small device-side work and proxy structures.
"""

from __future__ import annotations

__all__ = ["ASSUMED_CHANNELS", "DEFAULT_NCCL_BUFFER_MB", "NCCL_CONNECTION_BYTES", "nccl_buffer_bytes"]

MiB = 1 << 20

NCCL_SIMPLE_BUFFER_BYTES = 1 << 22           # DEFAULT_BUFFSIZE (NCCL_BUFFSIZE), "4MiB"
NCCL_LL_BUFFER_BYTES = 8 * 512 * 8 * 16      # DEFAULT_LL_BUFFSIZE: 524,288 B
NCCL_LL128_BUFFER_BYTES = 120 * 640 * 8 * 8  # DEFAULT_LL128_BUFFSIZE: 4,915,200 B
# one connection's buffers, all three protocols: 9,633,792 B
NCCL_CONNECTION_BYTES = NCCL_SIMPLE_BUFFER_BYTES + NCCL_LL_BUFFER_BYTES + NCCL_LL128_BUFFER_BYTES
ASSUMED_CHANNELS = 32
# per communicator: 32 x 9,633,792 B = 308,281,344 B = 294 MiB exactly
DEFAULT_NCCL_BUFFER_MB = ASSUMED_CHANNELS * NCCL_CONNECTION_BYTES / MiB


def nccl_buffer_bytes(communicators: int, buffer_mb: float = DEFAULT_NCCL_BUFFER_MB) -> int:
    """Bytes NCCL holds on one rank's GPU, outside PyTorch's caching allocator.

    Args:
        communicators: the NCCL communicators the rank holds (one per process group it
            communicates over; ``graphmem.job.parallel.ParallelSpec.communicators``).
        buffer_mb: MiB of buffers per communicator (``--nccl-buffer-mb``).

    Returns:
        ``communicators x buffer_mb`` MiB, in bytes (rounded to a whole byte).
    """
    if communicators < 0 or buffer_mb < 0:
        raise AssertionError(f"nccl_buffer_bytes: communicators={communicators}, buffer_mb={buffer_mb}; "
                             "expected both >= 0")
    return communicators * round(buffer_mb * MiB)
