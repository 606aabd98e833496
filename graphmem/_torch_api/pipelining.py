"""torch.distributed.pipelining's internals: a schedule's stage, its shape inference mode and
the first step's vote."""

from __future__ import annotations

from typing import Any

__all__ = ["pipeline_backward_meta", "pipeline_inference_mode", "pipeline_warmup_owners", "schedule_stage",
           "set_stage_inference_mode", "stage_peer_rank", "stage_same_rank", "stage_user_meta"]


def pipeline_inference_mode() -> Any:
    """torch.distributed.pipelining's InferenceMode (whether a stage infers its shapes at run time)."""
    from torch.distributed.pipelining._utils import InferenceMode

    return InferenceMode


def pipeline_warmup_owners() -> list[type]:
    """The pipeline schedule classes that define ``_warmup_p2p``, the first step's vote over
    point-to-point messages on whether every stage knows its shapes."""
    from torch.distributed.pipelining import schedules

    return [cls for cls in (schedules._PipelineSchedule, schedules.PipelineScheduleSingle)
            if "_warmup_p2p" in cls.__dict__]


def pipeline_backward_meta(output_metas: tuple[Any, ...]) -> Any:
    """What a pipeline stage's next stage sends back for outputs of these metas (torch's own
    rule for an input's gradient: same shape, strides and dtype, none where no gradient flows)."""
    from torch.distributed.pipelining._utils import (
        _derive_grad_metas,
        _StageBackwardMeta,
    )

    return _StageBackwardMeta(backward_metas=_derive_grad_metas(output_metas))


def schedule_stage(schedule: Any) -> Any:
    """The PipelineStage a single-stage schedule runs."""
    return schedule._stage


def stage_user_meta(stage: Any) -> Any:
    """What the user told ``stage`` of its inputs and outputs (None where it must infer them)."""
    return stage._user_meta


def set_stage_inference_mode(stage: Any, mode: Any) -> None:
    """Tell ``stage`` whether it infers its shapes at run time (an ``InferenceMode``)."""
    stage._inference_mode = mode


def stage_same_rank(stage: Any, index: int) -> bool:
    """Whether the stage ``index`` runs on ``stage``'s own rank (no message between them)."""
    same: bool = stage._is_same_rank(index)
    return same


def stage_peer_rank(stage: Any, index: int) -> int:
    """The global rank that runs the stage ``index``, as ``stage`` resolves it."""
    rank: int = stage._resolve_peer_global_rank(index)
    return rank
