"""The ground truth: run the same step for real on CPU and count live tensor storages.

Independent of graphmem's code.  A TorchDispatchMode sees every aten op with real CPU
tensors; each storage (by identity, so views count once) is held by a weak reference; a
storage is live until its weak reference expires (its memory was freed).  Live bytes are
taken after every op; parameters, buffers, inputs and targets are counted from the start.

The step run is the one graphmem documents:
    training, per iteration, in a function whose locals die at return:
        out = model(*args); loss = loss_fn(out); loss.backward(); opt.step();
        opt.zero_grad(set_to_none=True)
    inference: model.eval(); with torch.no_grad(): out = model(*args)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

DTYPES = {"int64": torch.int64, "bf16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class LiveStorages(TorchDispatchMode):
    """Counts bytes of live storages after every op; keeps the peak per phase."""

    def __init__(self) -> None:
        super().__init__()
        self.refs: dict[int, tuple[StorageWeakRef, int]] = {}
        self.phase = "setup"
        self.peak = 0
        self.phase_peaks: dict[str, int] = {}
        self.ops = 0

    def add(self, t: Any) -> None:
        if isinstance(t, torch.Tensor):
            storage = t.untyped_storage()
            ref = StorageWeakRef(storage)
            old = self.refs.get(ref.cdata)
            if old is None or old[0].expired():
                self.refs[ref.cdata] = (ref, storage.nbytes())

    def live_bytes(self) -> int:
        for key in [k for k, (ref, _) in self.refs.items() if ref.expired()]:
            del self.refs[key]
        return sum(n for _, n in self.refs.values())

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        self.live_bytes()  # forget the dead before this op may reuse their addresses
        for t in tree_flatten((args, kwargs))[0]:
            self.add(t)
        out = func(*args, **kwargs)
        for t in tree_flatten(out)[0]:
            self.add(t)
        self.ops += 1
        now = self.live_bytes()
        self.peak = max(self.peak, now)
        self.phase_peaks[self.phase] = max(self.phase_peaks.get(self.phase, 0), now)
        return out


@dataclass(frozen=True)
class Measured:
    peak_bytes: int
    phase_peaks: dict[str, int]


def real_inputs(specs: Sequence[str], int_high: int) -> list[torch.Tensor]:
    """Real tensors for specs like '32x1000' or '4x12:int64' (names not used in the zoo)."""
    out = []
    for spec in specs:
        dims, _, dtype_name = spec.partition(":")
        shape = tuple(int(d) for d in dims.split("x"))
        dtype = DTYPES[dtype_name or "float32"]
        if dtype.is_floating_point:
            out.append(torch.randn(shape).to(dtype))
        else:
            out.append(torch.randint(0, int_high, shape, dtype=dtype))
    return out


def _first_float(out: Any) -> torch.Tensor:
    return next(t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.is_floating_point())


def measure_inference(build: Callable[[], torch.nn.Module], inputs: list[torch.Tensor],
                      kw_inputs: dict[str, torch.Tensor] | None = None,
                      also_held: Callable[[torch.nn.Module], list[torch.Tensor]] | None = None) -> Measured:
    """also_held: as for measure_training."""
    torch.manual_seed(0)
    model = build()
    model.eval()
    kw_inputs = kw_inputs or {}
    counter = LiveStorages()
    for t in [*model.parameters(), *model.buffers(), *inputs, *kw_inputs.values(),
              *(also_held(model) if also_held else ())]:
        counter.add(t)
    counter.phase = "forward"
    with counter, torch.no_grad():
        out = model(*inputs, **kw_inputs)
    del out
    return Measured(counter.peak, dict(counter.phase_peaks))


def measure_training(build: Callable[[], torch.nn.Module], inputs: list[torch.Tensor],
                     make_optimizer: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer],
                     loss: str, iterations: int = 2, amp: torch.dtype | None = None,
                     grad_accum: int = 1, checkpoint_classes: tuple[str, ...] = (),
                     kw_inputs: dict[str, torch.Tensor] | None = None, checkpoint_every: int = 1,
                     checkpoint_save: tuple[str, ...] = (), checkpoint_blocks: tuple[int, ...] | None = None,
                     checkpoint_save_blocks: tuple[int, ...] | None = None,
                     also_held: Callable[[torch.nn.Module], list[torch.Tensor]] | None = None) -> Measured:
    """Run the documented training step for real; see the module docstring.

    amp: autocast dtype on CPU around forward and loss (float16 adds GradScaler("cpu")).
    grad_accum: micro-steps per optimizer step, each in its own function (locals die at its
        return); with 1, out and loss live until the optimizer step is done.
    checkpoint_classes: modules of these classes run under non-reentrant checkpointing;
        only every ``checkpoint_every``-th of them (the 1st, k+1-th, ...), or only those
        ``checkpoint_blocks`` names (0-based, in model order); with
        ``checkpoint_save``, selectively: torch's create_selective_checkpoint_contexts saves
        the outputs of "matmuls" (mm, addmm, bmm, baddbmm), of every second matmul of a call
        ("every-2nd-matmul"), or of "attention" (the SDPA kernels), and recomputes the rest (only in
        the blocks ``checkpoint_save_blocks`` names, where given: the others whole).
    also_held: tensors the model holds outside its parameters and buffers (a quantized
        weight's scales), counted from the start like them.
    """
    torch.manual_seed(0)
    model = build()
    model.train()
    chosen = [m for m in model.modules() if type(m).__name__ in checkpoint_classes]
    if chosen and getattr(getattr(model, "config", None), "use_cache", None):
        model.config.use_cache = False  # as transformers' gradient_checkpointing_enable() trains
    picked = chosen[::checkpoint_every] if checkpoint_blocks is None else [chosen[i] for i in checkpoint_blocks]
    for module in picked:
        whole = checkpoint_save_blocks is not None and chosen.index(module) not in checkpoint_save_blocks
        module.forward = _checkpointed(module.forward, () if whole else checkpoint_save)  # type: ignore[method-assign]
    opt = make_optimizer([p for p in model.parameters() if p.requires_grad])
    # init_scale=1: no overflow, so every step runs (the steady state graphmem models)
    scaler = torch.amp.GradScaler("cpu", init_scale=1.0) if amp == torch.float16 else None
    kw_inputs = kw_inputs or {}
    counter = LiveStorages()
    for t in [*model.parameters(), *model.buffers(), *inputs, *tree_flatten(kw_inputs)[0],
              *(also_held(model) if also_held else ())]:
        counter.add(t)  # kw_inputs may hold lists of dicts of tensors (a detection model's targets)
    targets: list[torch.Tensor] = []

    def micro_step() -> tuple[Any, torch.Tensor]:
        counter.phase = "forward"
        with torch.autocast("cpu", dtype=amp) if amp else contextlib.nullcontext():
            out = model(*inputs, **kw_inputs)
            counter.phase = "loss"
            value = _loss(out, loss, targets)
        if grad_accum > 1:
            value = value / grad_accum
        counter.phase = "backward"
        (scaler.scale(value) if scaler else value).backward()
        return out, value

    def optimizer_step() -> None:
        counter.phase = "optimizer"
        if scaler:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        opt.zero_grad(set_to_none=True)

    def one_step() -> None:
        if grad_accum == 1:
            held = micro_step()
            optimizer_step()
            del held
            return
        for _ in range(grad_accum):
            micro_step()
        optimizer_step()

    with counter:
        for _ in range(iterations):
            one_step()
    return Measured(counter.peak, dict(counter.phase_peaks))


class _Stop(BaseException):
    pass


def count_optimizer_steps(after: Callable[[int], None]) -> list[Any]:
    """Call ``after(n)`` when the program's n-th optimizer step returns: any torch.optim
    optimizer's ``step``, counted at the outermost one (an optimizer whose step steps others,
    as torchtitan's container of optimizers does, is one step with them).  The hooks' handles."""
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    depth, done = [0], [0]

    def before(opt: Any, args: Any, kwargs: Any) -> None:
        depth[0] += 1

    def after_step(opt: Any, args: Any, kwargs: Any) -> None:
        depth[0] -= 1
        if depth[0] == 0:
            done[0] += 1
            after(done[0])

    return [register_optimizer_step_pre_hook(before), register_optimizer_step_post_hook(after_step)]


def save_tiny_gpt2(folder: Any) -> tuple[Any, int]:
    """A tiny GPT-2 saved with save_pretrained (safetensors), and its distinct parameter bytes
    (the tied embedding once)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=512, n_positions=64))
    model.save_pretrained(folder)
    distinct = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()}
    return folder, sum(distinct.values())


def measure_program(script: str, argv: Sequence[str] = (), steps: int = 2) -> Measured:
    """Run ``python SCRIPT ARGV`` for real, counting live storages from its first line, until
    its ``steps``-th optimizer step returns (torch.optim's global step hooks stop it; a step that
    steps other optimizers inside it is one step: ``count_optimizer_steps``).
    ``phase_peaks``: "step N" -> the peak from the end of step N-1 to the end of step N."""
    import os
    import runpy
    import sys

    counter = LiveStorages()
    counter.phase = "step 1"

    def after_step(done: int) -> None:
        if done >= steps:
            raise _Stop
        counter.phase = f"step {done + 1}"

    saved_argv, saved_path = sys.argv[:], sys.path[:]
    sys.argv = [script, *argv]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    handles = count_optimizer_steps(after_step)
    try:
        with counter, contextlib.suppress(_Stop):
            runpy.run_path(script, run_name="__main__")
    finally:
        for handle in handles:
            handle.remove()
        sys.argv[:], sys.path[:] = saved_argv, saved_path
    return Measured(counter.peak, dict(counter.phase_peaks))


def _loss(out: Any, loss: str, targets: list[torch.Tensor]) -> torch.Tensor:
    if loss == "auto" and isinstance(getattr(out, "loss", None), torch.Tensor):
        return out.loss  # transformers style: the model computed it from labels
    if loss == "auto" and isinstance(out, dict) and out and all(
            isinstance(v, torch.Tensor) and v.dim() == 0 for v in out.values()):
        return sum(out.values())  # type: ignore[return-value]  # torchvision detection: summed as its references do
    logits = _first_float(out.to_tuple() if hasattr(out, "to_tuple") else out)
    if loss == "auto":
        return logits.sum()
    if loss == "sum":
        return logits.sum()
    if loss == "mean":
        return logits.mean()
    if not targets:
        targets.append(torch.zeros(logits.shape[:-1], dtype=torch.int64))
    fn = F.cross_entropy if loss == "cross_entropy" else F.nll_loss
    return fn(logits.reshape(-1, logits.shape[-1]), targets[0].reshape(-1))


def _checkpointed(forward: Callable[..., Any], save: tuple[str, ...] = ()) -> Callable[..., Any]:
    def run(*args: Any, **kwargs: Any) -> Any:
        if not save:
            return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False, **kwargs)
        return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False,
                                                 context_fn=lambda: _selective(save), **kwargs)
    return run


def _selective(save: tuple[str, ...]) -> Any:
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    aten = torch.ops.aten
    matmuls = {aten.mm, aten.addmm, aten.bmm, aten.baddbmm}
    kept = set(matmuls) if "matmuls" in save else set()
    kept |= {getattr(aten, n.removeprefix("aten.")) for n in save if n.startswith("aten.")}
    if "attention" in save:
        kept |= {getattr(aten, n) for n in dir(aten) if n.startswith("_scaled_dot_product_")
                 and ("attention" in n) and not n.endswith("backward")}
    seen = {True: 0, False: 0}

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        if "every-2nd-matmul" in save and op.overloadpacket in matmuls:
            seen[ctx.is_recompute] += 1
            if seen[ctx.is_recompute] % 2 == 0:
                return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.MUST_SAVE if op.overloadpacket in kept else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


OPTIMIZERS: dict[str, Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]] = {
    "sgd": lambda p: torch.optim.SGD(p),
    "sgd-momentum": lambda p: torch.optim.SGD(p, momentum=0.9),
    "adam": lambda p: torch.optim.Adam(p),
    "adamw": lambda p: torch.optim.AdamW(p),
}


def detection_targets(images: torch.Tensor, boxes: int = 8, masks: bool = False,
                      keypoints: int = 0) -> list[dict[str, torch.Tensor]]:
    """The targets graphmem documents for a torchvision detection model trained without them
    (docs/how-it-works.md), made here independently: per image ``boxes`` boxes of half the
    image's width and height on a grid, class 1; masks filling the boxes; keypoints on their
    diagonals, visible."""
    height, width = images.shape[-2:]
    out = []
    for _ in range(images.shape[0]):
        corners = [(width * (k % 4) / 8, height * (k // 4 % 4) / 8) for k in range(boxes)]
        box = torch.tensor([[x, y, x + width / 2, y + height / 2] for x, y in corners])
        target = {"boxes": box, "labels": torch.ones(boxes, dtype=torch.int64)}
        if masks:
            target["masks"] = torch.zeros(boxes, height, width, dtype=torch.uint8)
            for k, (x, y) in enumerate(corners):
                target["masks"][k, int(y):int(y + height / 2), int(x):int(x + width / 2)] = 1
        if keypoints:
            steps = torch.linspace(0, 1, keypoints)
            target["keypoints"] = torch.stack([box[:, None, 0] + steps * width / 2,
                                               box[:, None, 1] + steps * height / 2,
                                               torch.ones(boxes, keypoints)], dim=-1)
        out.append(target)
    return out
