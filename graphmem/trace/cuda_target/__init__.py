"""The CUDA target on fake CPU tensors: which kernels CUDA would choose, and its autocast.

Input: ops as the model calls them, and the target GPU.  Output: the attention backends and
matmul kernels a CUDA build would run, and autocast's casts as CUDA makes them.  Knows nothing
of the caching allocator (graphmem.cuda) or the report.
"""
