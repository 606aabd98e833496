"""Pipeline parallelism (pp=N): ``torch.distributed.pipelining`` on one stage per rank.

The model's repeated blocks (the classes ``fsdp_units`` names) are cut into contiguous
stages; a rank's stage is the model with every module it does not own made an
``nn.Identity``.

Input: a model (a copy that may be changed), a ``ParallelSpec``, the rank and the step's
inputs.  Output: the rank's ``PipelineStageModule`` with example input and output of one
microbatch, and the schedule (``spec.schedule``) over it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from graphmem._torch_api import (
    module_children,
    pipeline_inference_mode,
    pipeline_warmup_owners,
    set_stage_inference_mode,
    stage_user_meta,
)
from graphmem.errors import UnsupportedError, UserInputError
from graphmem.job.option import spelling
from graphmem.job.parallel import ParallelSpec
from graphmem.patching import patched
from graphmem.trace.distributed.fsdp import fsdp_units

__all__ = ["PipelineStageModule", "pipeline_schedule", "pipeline_split", "pipeline_stage_module",
           "pipeline_warmup_known"]


def pipeline_split(n_blocks: int, stages: int) -> list[range]:
    """The blocks of each stage: contiguous, as even as possible, the first stages one more."""
    if n_blocks < stages:
        raise UserInputError(f"{spelling('parallel')} pp={stages}: the model has {n_blocks} repeated blocks, fewer "
                             "than "
                             "the stages; use at most that many stages")
    sizes = [n_blocks // stages + (1 if k < n_blocks % stages else 0) for k in range(stages)]
    starts = [sum(sizes[:k]) for k in range(stages)]
    return [range(start, start + size) for start, size in zip(starts, sizes, strict=True)]


class _Cut(Exception):
    """Raised by the first stage's last block: its output is the stage's output."""

    def __init__(self, output: Any) -> None:
        super().__init__()
        self.output = output


def _cut(module: nn.Module, args: Any, output: Any) -> None:
    raise _Cut(output)


class PipelineStageModule(nn.Module):
    """One rank's stage, running only its part of the model.

    ``model`` is a copy of the model in which every module this stage does not own is an
    ``nn.Identity`` (no parameters).  The first stage runs the model's own forward and stops
    at the output of its last block (a hook raises); the other stages run their blocks in
    order on the received activation, and the last one then the modules the model's forward
    calls after its last block (checked to be a chain: each takes the previous one's output).
    """

    def __init__(self, model: nn.Module, blocks: list[nn.Module], after: list[nn.Module],
                 first: bool, last: bool) -> None:
        super().__init__()
        self.model = model
        self.first, self.last = first, last
        # not registered as children: they are the model's own modules (paths stay model.*)
        self.__dict__["_stage_blocks"] = blocks
        self.__dict__["_stage_after"] = after
        if first and not last:
            blocks[-1].register_forward_hook(_cut)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.first:
            if self.last:
                return self.model(*args, **kwargs)
            try:
                self.model(*args, **kwargs)
            except _Cut as cut:
                output = cut.output
            else:
                raise UnsupportedError("pipeline stage 0: the model's forward did not reach its last block")
            return output
        (x,) = args
        for module in [*self.__dict__["_stage_blocks"], *(self.__dict__["_stage_after"] if self.last else ())]:
            x = module(x)
        return x


@dataclass(slots=True)
class _Probe:
    """What one forward of the whole model on a microbatch shows: the blocks' outputs, the
    modules called after the last block, and the model's output."""

    outputs: dict[int, Any]
    after: list[tuple[nn.Module, Any, Any, Any]]   # (module, args, kwargs, output) of top-level calls
    block_inputs: dict[int, tuple[Any, Any]]       # block index -> (args, kwargs)
    output: Any


def _probe(model: nn.Module, blocks: list[nn.Module], args: list[Any], kwargs: dict[str, Any]) -> _Probe:
    index = {id(b): i for i, b in enumerate(blocks)}
    probe = _Probe({}, [], {}, None)
    depth = [0]

    def pre(module: nn.Module, a: Any, kw: Any) -> None:
        if id(module) in index:
            probe.block_inputs[index[id(module)]] = (a, kw)
        depth[0] += 1

    def post(module: nn.Module, a: Any, kw: Any, out: Any) -> None:
        depth[0] -= 1
        if id(module) in index:
            probe.outputs[index[id(module)]] = out
        elif len(probe.outputs) == len(blocks) and depth[0] == 1 and module is not model:
            probe.after.append((module, a, kw, out))

    handles = [m.register_forward_pre_hook(pre, with_kwargs=True) for m in model.modules()]
    handles += [m.register_forward_hook(post, with_kwargs=True) for m in model.modules()]
    try:
        with torch.no_grad():
            probe.output = model(*args, **kwargs)
    finally:
        for handle in handles:
            handle.remove()
    return probe


def _is_chain(calls: list[tuple[Any, Any]], first_input: Any) -> bool:
    """Every call takes exactly the previous output (one positional tensor, no tensor keywords)."""
    previous = first_input
    for (a, kw), out in calls:
        if len(a) != 1 or a[0] is not previous or any(isinstance(v, torch.Tensor) for v in kw.values()):
            return False
        previous = out
    return True


def _replace(model: nn.Module, target: nn.Module) -> None:
    """Put an nn.Identity wherever ``target`` sits in ``model``."""
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if child is target:
                module_children(module)[name] = nn.Identity()


def pipeline_stage_module(model: nn.Module, spec: ParallelSpec, rank: int, fake_mode: Any,
                          args: list[Any], kwargs: dict[str, Any]) -> tuple[PipelineStageModule, Any, Any]:
    """Stage ``rank`` of ``model`` (a copy it may change: its unowned modules become
    nn.Identity) and example (input, output) of one microbatch for ``PipelineStage``.

    The blocks are the modules of the classes ``fsdp_units`` names (the model's repeated
    blocks), cut by ``pipeline_split``; what the forward runs before the first block goes with
    stage 0, what it runs after the last block with the last stage.
    """
    stages = spec.degree("pp")
    blocks = _stage_blocks(model, spec)
    mine = pipeline_split(len(blocks), stages)[rank]
    first, last = rank == 0, rank == stages - 1
    microbatch = _first_microbatch(args, kwargs, spec.n_microbatches)
    with fake_mode:
        probe = _probe(model, blocks, *microbatch)
    _check_chain(model, len(blocks), probe)
    after = [module for module, _, _, _ in probe.after]
    _drop_unowned(model, blocks, mine, after, first, last)
    stage = PipelineStageModule(model, [blocks[i] for i in mine], after, first, last)
    example_in, example_out = _example_shapes(probe, microbatch[0], mine, fake_mode, first, last)
    return stage, example_in, example_out


def _stage_blocks(model: nn.Module, spec: ParallelSpec) -> list[nn.Module]:
    """The model's repeated blocks, outermost only, in the order ``modules()`` gives them."""
    units = fsdp_units(model, spec)
    blocks: list[nn.Module] = []
    for m in model.modules():
        if type(m).__name__ in units and m is not model and not any(m in set(b.modules()) for b in blocks):
            blocks.append(m)
    if not blocks:
        raise UserInputError(f"{spelling('parallel')} pp: {type(model).__name__} has no repeated blocks to cut into "
                             "stages; "
                             f"name their class with {spelling('fsdp_units')}")
    return blocks


def _check_chain(model: nn.Module, n_blocks: int, probe: _Probe) -> None:
    """Refuse a forward a stage cannot run on its own: one that does not call each block once,
    or is no chain (each block, then each module after the last, taking only the previous output)."""
    if len(probe.outputs) != n_blocks:
        raise UnsupportedError(f"{spelling('parallel')} pp: the forward of {type(model).__name__} does not call each "
                               "of its "
                               f"{n_blocks} blocks once")
    ordered = [probe.block_inputs[i] for i in range(n_blocks)]
    after_calls = [((a, kw), out) for _, a, kw, out in probe.after]
    if not _is_chain([(ordered[i], probe.outputs[i]) for i in range(1, n_blocks)], probe.outputs[0]) or \
            not _is_chain(after_calls, probe.outputs[n_blocks - 1]) or \
            (after_calls and probe.output is not after_calls[-1][1]) or \
            (not after_calls and probe.output is not probe.outputs[n_blocks - 1]):
        raise UnsupportedError(f"{spelling('parallel')} pp: {type(model).__name__} is not a chain after its first "
                               "block (each "
                               "block, then each module after the last, taking only the previous output); "
                               "graphmem cannot run one of its stages on its own")


def _drop_unowned(model: nn.Module, blocks: list[nn.Module], mine: range, after: list[nn.Module],
                  first: bool, last: bool) -> None:
    """Make an nn.Identity of every module of ``model`` the stage does not run: the other
    stages' blocks, the modules after the last block (except on the last stage), and on every
    stage but the first, the parametrised modules the forward runs before the first block."""
    own = {id(m) for i in mine for m in blocks[i].modules()}
    if last:
        own |= {id(m) for a in after for m in a.modules()}
    dropped = [b for i, b in enumerate(blocks) if i not in mine]
    if not last:
        dropped += after
    for module in dropped:
        _replace(model, module)
    if not first:  # what runs before the first block: every parametrised module no longer needed
        kept = {id(m) for m in model.modules() if id(m) in own}
        for module in list(model.modules()):
            if module is not model and id(module) not in kept and \
                    not any(id(m) in kept for m in module.modules()) and \
                    (any(True for _ in module.parameters(recurse=False)) or
                     any(True for _ in module.buffers(recurse=False))):
                _replace(model, module)


def _example_shapes(probe: _Probe, microbatch_args: list[Any], mine: range, fake_mode: Any,
                    first: bool, last: bool) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """The stage's example input and output of one microbatch (fresh fakes of the probe's
    shapes; the output requires grad, except on the last stage)."""
    def like(t: Any, grad: bool) -> Any:
        with fake_mode:
            return torch.empty(t.shape, dtype=t.dtype, device=t.device, requires_grad=grad)

    if first:
        example_in = tuple(a for a in microbatch_args if isinstance(a, torch.Tensor))
    else:
        example_in = (like(probe.outputs[mine[0] - 1], False),)
    out = probe.output if last else probe.outputs[mine[-1]]
    if not isinstance(out, torch.Tensor):
        raise UnsupportedError(f"{spelling('parallel')} pp: a stage's output must be one tensor")
    return example_in, (like(out, not last),)


def _first_microbatch(args: list[Any], kwargs: dict[str, Any], n: int) -> tuple[list[Any], dict[str, Any]]:
    """The first of ``n`` microbatches: every tensor's dim 0 split evenly, as the schedule splits it."""
    def chunk(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        if t.shape[0] % n:
            raise UserInputError(f"{spelling('microbatches')} {n}: the batch ({t.shape[0]}, dim 0 of the inputs) "
                                 "must be a "
                                 "multiple of the microbatches")
        return t[: t.shape[0] // n]
    return [chunk(a) for a in args], {k: chunk(v) for k, v in kwargs.items()}


def pipeline_schedule(stage_module: nn.Module, spec: ParallelSpec, rank: int, example_in: Any, example_out: Any,
                      loss_fn: Callable[[Any, Any], torch.Tensor]) -> Any:
    """``PipelineStage`` on the stage module and the schedule ``spec.schedule`` over it (needs
    the fake process group; the stage's shapes are given, so no shape inference is run)."""
    from torch.distributed import pipelining

    device = next(iter(stage_module.parameters()), torch.empty(0)).device
    stage = pipelining.PipelineStage(stage_module, rank, spec.degree("pp"), device,
                                     input_args=example_in, output_args=example_out)
    cls = getattr(pipelining, {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B"}[spec.schedule])
    return cls(stage, spec.n_microbatches, loss_fn=loss_fn)


@contextlib.contextmanager
def pipeline_warmup_known() -> Iterator[None]:
    """The schedules' first step votes, over point-to-point messages, whether every stage was
    given its shapes, and reads the vote's value (``.item()``): no values on the fake process
    group.  Every stage here is given its shapes, so each stage is told the vote's outcome."""
    InferenceMode = pipeline_inference_mode()

    def warmup(self: Any, stages: list[Any], has_backward: bool, p2p_done: bool) -> None:
        for stage in stages:
            if InferenceMode.needs_dynamic(stage_user_meta(stage), has_backward):
                raise UnsupportedError(f"{spelling('parallel')} pp: a stage needs shape inference at run time")
            set_stage_inference_mode(stage, InferenceMode.STATIC)

    with patched(*((cls, "_warmup_p2p", warmup) for cls in pipeline_warmup_owners())):
        yield
