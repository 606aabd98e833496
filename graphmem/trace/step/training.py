"""The training driver: the loop a trainer runs, step for step as tests/oracles.py ``one_step`` runs it.

Per iteration (locals are released when it returns)::

    out = model(*inputs); loss = loss_fn(out); loss.backward(); opt.step()
    opt.zero_grad(set_to_none=True)

With gradient accumulation, micro-steps (forward, loss / N, backward) then the update.
Input: a ``StepRun``.  Output: the step's ops in the recorder, and the roles of gradients,
optimizer state and the targets the loss is given.
"""

from __future__ import annotations

from typing import Any

import torch

from graphmem._torch_api import backward_keeping_modes
from graphmem.errors import TraceError
from graphmem.job.option import spelling
from graphmem.job.parallel import ParallelSpec
from graphmem.job.step import StepConfig
from graphmem.patching import patched
from graphmem.records import Phase, Role
from graphmem.trace.distributed import RankFork, zero_partition
from graphmem.trace.step.checkpointing import checkpointed
from graphmem.trace.step.optim import compute_loss, find_logits, loss_taken, make_optimizer, make_targets
from graphmem.trace.step.replica import optimizer_scalar_reads
from graphmem.trace.step.run import StepRun, mark_output, saving

__all__ = ["Loop", "optimizer_reads", "optimizer_step", "run_training"]


class Loop:
    """The training loop's fixed parts: what ``_micro_step`` and ``optimizer_step`` share."""

    def __init__(self, run: StepRun) -> None:
        self.run, self.recorder, self.step = run, run.recorder, run.step
        self.params = {name: p for name, p in run.inner.named_parameters() if p.requires_grad}
        self.opt = make_optimizer(run.step, list(self.params.values()), zero=run.zero)
        self.scaler = torch.amp.GradScaler(run.device.type) if run.step.amp == "fp16" else None
        self.targets: list[torch.Tensor] = []  # created at the first loss, then kept like data


def run_training(run: StepRun) -> int:
    """Train ``run.model`` (the module called: ``run.inner`` itself or its DDP wrapper) on the
    parameters of ``run.inner``; returns 0 (no KV cache)."""
    run.model.train()
    loop, recorder, step = Loop(run), run.recorder, run.step
    # micro-steps after the second repeat it exactly (same tensors, gradients resident)
    micro_steps = min(step.grad_accum, 2)
    with torch.autograd.graph.saved_tensors_hooks(saving(recorder), lambda t: t), \
            checkpointed(run.inner, step, recorder):
        for iteration in range(step.iterations):
            recorder.iteration = iteration
            if step.grad_accum == 1:
                held = _micro_step(loop)  # a plain step keeps out and loss through the update
                optimizer_step(loop)
                del held
            else:
                for _ in range(micro_steps):
                    _micro_step(loop)
                optimizer_step(loop)
            recorder.poll()
    return 0


def _micro_step(loop: Loop) -> tuple[Any, torch.Tensor]:
    recorder, step, run = loop.recorder, loop.step, loop.run
    recorder.phase = Phase.FORWARD
    with run.autocast():
        out = run.model(*run.args, **run.kwargs)
        recorder.phase = Phase.LOSS
        if step.loss in ("cross_entropy", "nll") and not loop.targets:
            loop.targets.append(make_targets(find_logits(out)))
            recorder.mark(loop.targets[0], Role.INPUT, "targets")
        loss = compute_loss(step.loss, out, loop.targets[0] if loop.targets else None)
        recorder.loss = recorder.loss or loss_taken(step.loss, out)
    if step.grad_accum > 1:
        loss = loss / step.grad_accum
    if not (isinstance(loss, torch.Tensor) and loss.numel() == 1 and loss.requires_grad):
        raise TraceError("the loss is not a scalar that requires grad; does the model have "
                         f"trainable parameters on its output path? try {spelling('loss')} or {spelling('mode')} "
                         "inference")
    mark_output(recorder, (out, loss))
    recorder.phase = Phase.BACKWARD
    backward_keeping_modes(loop.scaler.scale(loss) if loop.scaler else loss)
    mark_gradients(loop)
    return out, loss


def mark_gradients(loop: Loop) -> None:
    """Each trained parameter's ``.grad`` is its gradient."""
    for name, p in loop.params.items():
        if p.grad is not None:
            loop.recorder.mark(p.grad, Role.GRADIENT, f"{name}.grad", owner=name)


def optimizer_step(loop: Loop) -> None:
    """``opt.step()`` (through the GradScaler with fp16), the state's roles, ``zero_grad``."""
    if loop.run.fork is not None:
        _fork_ranks(loop, loop.run.fork)
    recorder, opt = loop.recorder, loop.opt
    recorder.phase = Phase.OPTIMIZER
    if opt is None:
        for p in loop.params.values():
            p.grad = None
        return
    if loop.scaler is not None:
        loop.scaler.step(opt)
        loop.scaler.update()
        for key in ("_scale", "_growth_tracker"):
            value = getattr(loop.scaler, key, None)
            if isinstance(value, torch.Tensor):
                recorder.mark(value, Role.OPTIMIZER_STATE, f"grad_scaler.{key}")
    else:
        opt.step()
    state = getattr(opt, "optim", opt).state  # ZeroRedundancyOptimizer: its rank's local optimizer
    for name, p in loop.params.items():
        for key, value in state.get(p, {}).items():
            if isinstance(value, torch.Tensor):
                recorder.mark(value, Role.OPTIMIZER_STATE, f"{name}.{key}", owner=name)
    opt.zero_grad(set_to_none=True)


def _fork_ranks(loop: Loop, fork: RankFork) -> None:
    """Where ZeRO-1's ranks start to differ: in a child, the optimizer becomes its rank's (the
    one ZeroRedundancyOptimizer builds on that rank, reading its values)."""
    rank = fork.split()
    if rank is None:
        return
    import torch.distributed as dist

    with patched((dist, "get_rank", lambda group=None: rank)):  # what the rank's optimizer asks
        loop.opt = make_optimizer(loop.step, list(loop.params.values()), zero=True)
    loop.recorder.answers.use_replica(fork.reads[rank])


def optimizer_reads(model: torch.nn.Module, step: StepConfig, device: torch.device, parallel: ParallelSpec | None,
                    rank: int) -> list[Any]:
    """The values the optimizer step of ``rank`` reads with .item(), from a real one-element replica."""
    ndims = [p.dim() for p in model.parameters() if p.requires_grad]
    if parallel is not None and parallel.degree("zero1") > 1:  # the rank steps its own partition only
        ndims = [ndims[i] for i in zero_partition(model, parallel.world_size)[rank]]
    return optimizer_scalar_reads(ndims, step, device.type) if ndims else []
