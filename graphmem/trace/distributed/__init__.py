"""PyTorch's own parallel engines under a fake process group, one file per engine.

Input: a model and a ``ParallelSpec``.  Output: the model as DDP, FSDP2, tensor or pipeline
parallelism make it for one rank, and the rank processes that share a recording.  Knows
nothing of the recorder's books or the report.

process_group.py applies the engines (ddp.py, fsdp.py, tensor_parallel.py) to one rank's model
in the fake process group; pipeline.py builds a rank's stage and its schedule; ranks.py says
which ranks' memory can differ; rank_fork.py runs the ranks that share a recording.
"""

from graphmem.trace.distributed.ddp import ddp_on_fakes
from graphmem.trace.distributed.fsdp import following_resizes
from graphmem.trace.distributed.pipeline import (
    pipeline_schedule,
    pipeline_split,
    pipeline_stage_module,
    pipeline_warmup_known,
)
from graphmem.trace.distributed.process_group import Applied, apply_parallel, fake_process_group, meta_copy
from graphmem.trace.distributed.rank_fork import RankFork
from graphmem.trace.distributed.ranks import distinct_ranks, zero_partition

__all__ = ["Applied", "RankFork", "apply_parallel", "ddp_on_fakes", "distinct_ranks", "fake_process_group",
           "following_resizes", "meta_copy", "pipeline_schedule", "pipeline_split", "pipeline_stage_module",
           "pipeline_warmup_known", "zero_partition"]
