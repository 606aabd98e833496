"""torchtitan 0.3.0's trainer (``python -m torchtitan.train``), as torchrun launches it:

    torchrun --nproc-per-node 4 tests/programs/titan/train.py --module tiny_titan \
        --config llama3_cpu_tiny --parallelism.data_parallel_shard_degree 4 \
        --parallelism.spmd_backend partial_dtensor

``tiny_titan`` (next to this file: torchrun puts the script's folder on sys.path) holds the
configs; TINY_TITAN_ASSETS names the folder of make_assets.py's tokenizer and c4_test data.

torchtitan 0.3.0 expects a newer torch than 2.13 and a GPU; what is patched here, before the
trainer is imported, and why:
- always (torch's version): torchtitan calls ``torch.distributed.set_timeout(timeout, group)``
  after step 1; torch 2.13 has only the private ``distributed_c10d._set_pg_timeout``.
- without CUDA only (a GPU, real or graphmem's ``--gpu``, needs none of these):
  - torchtitan picks its device at import as ``_get_available_device_type() or "cuda"``:
    made "cpu" (then its device module is ``torch.cpu`` and its backend gloo);
  - its memory monitor asks ``torch.cpu`` for what only ``torch.cuda`` has (device name and
    properties, memory stats, cache): answered with nothing;
  - ``torch.cpu.current_device()`` is the string "cpu"; ``barrier(device_ids=[...])`` wants an int;
  - gloo has no ``ReduceOp.PREMUL_SUM``, which FSDP2 reduce-scatters with once torchtitan sets
    the gradient divide factor to 1 (it scales the gradients itself): plain SUM instead, the
    same sums for a factor of 1.
"""

import runpy
import types

import torch
import torch._utils
import torch.distributed as dist

if not hasattr(dist, "set_timeout"):
    from torch.distributed.distributed_c10d import _set_pg_timeout

    dist.set_timeout = lambda timeout, group=None: _set_pg_timeout(timeout, group)

if not torch.cuda.is_available():
    from torch.distributed.fsdp import FSDPModule

    torch._utils._get_available_device_type = lambda: "cpu"
    for name, answer in {
        "get_device_name": lambda *a, **k: "cpu",
        "get_device_properties": lambda *a, **k: types.SimpleNamespace(total_memory=2**34, name="cpu"),
        "reset_peak_memory_stats": lambda *a, **k: None,
        "empty_cache": lambda *a, **k: None,
        "memory_stats": lambda *a, **k: {},
    }.items():
        if not hasattr(torch.cpu, name):
            setattr(torch.cpu, name, answer)
    torch.cpu.current_device = lambda: 0
    divide = FSDPModule.set_gradient_divide_factor

    def set_gradient_divide_factor(self: FSDPModule, factor: float) -> None:
        divide(self, factor)
        self.set_force_sum_reduction_for_comms(True)

    FSDPModule.set_gradient_divide_factor = set_gradient_divide_factor

runpy.run_module("torchtitan.train", run_name="__main__", alter_sys=True)
