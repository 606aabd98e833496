"""The one GPU a program sees on a CPU-only torch (or a CUDA build without asking its driver).

Input: what the GPU is (``FakeGpu``: available or not, its properties, the allocator model's
counters; the node's device count per rank).  Output: ``answering(gpu)``, under which every
device question torch or a library asks answers from that one state, consistently:
``torch.cuda``, ``torch.accelerator``, torch's C accelerator hooks (``_get_accelerator``: FSDP2's
and DeviceMesh's defaults), ``torch.Stream``/``torch.Event``, ``torch.device(1)``; a name
graphmem does not model raises one ``UnsupportedError`` saying so (graphmem.job.fake_gpu.cuda's
tables).  analyze (graphmem.job.devices) and graphmem run (graphmem.trace.program.gpu) both
answer through it.  Knows nothing of the recorder, the allocator model or the report: the
counters come as a function.
"""

from __future__ import annotations

from graphmem.job.fake_gpu.answering import answering, gpus_on_the_node, import_dynamo_first
from graphmem.job.fake_gpu.int_devices import as_gpu_device
from graphmem.job.fake_gpu.state import FakeGpu, GpuMemory, GpuProperties, IdleEvent, IdleStream, active_gpu

__all__ = ["FakeGpu", "GpuMemory", "GpuProperties", "IdleEvent", "IdleStream", "active_gpu", "answering",
           "as_gpu_device", "gpus_on_the_node", "import_dynamo_first"]
