"""PyTorch's own parallel engines under a fake process group, one file per engine.

Input: a model and a ``ParallelSpec``.  Output: the model as DDP, FSDP2, tensor or pipeline
parallelism make it for one rank, and the rank processes that share a recording.  Knows
nothing of the recorder's books or the report.
"""
