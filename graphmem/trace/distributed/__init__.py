"""PyTorch's own parallel engines under a fake process group, one file per engine.

Input: a model and a ``ParallelSpec``.  Output: the model as DDP, FSDP2, tensor or pipeline
parallelism make it for one rank, and the rank processes that share a recording.  Knows
nothing of the recorder's books or the report.
"""

from graphmem.trace.distributed.parallel import (
    Applied,
    apply_parallel,
    ddp_on_fakes,
    distinct_ranks,
    fake_process_group,
    following_resizes,
    meta_copy,
    pipeline_schedule,
    pipeline_split,
    pipeline_stage_module,
    pipeline_warmup_known,
    zero_partition,
)
from graphmem.trace.distributed.rank_fork import RankFork

__all__ = ["Applied", "RankFork", "apply_parallel", "ddp_on_fakes", "distinct_ranks", "fake_process_group",
           "following_resizes", "meta_copy", "pipeline_schedule", "pipeline_split", "pipeline_stage_module",
           "pipeline_warmup_known", "zero_partition"]
