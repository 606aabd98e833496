"""Activation checkpointing as a trainer applies it: chosen modules' forwards under
torch.utils.checkpoint (non-reentrant), every N-th of the named classes, optionally selective."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.utils.checkpoint
from torch import nn

from graphmem.errors import UserInputError
from graphmem.job.option import flag
from graphmem.job.step import StepConfig, split_save
from graphmem.job.step_config import Checkpointing, ChosenBlocks, EveryBlock, Selective
from graphmem.trace.core.recorder import Recorder
from graphmem.trace.step.optim import selective_policy

__all__ = ["checkpointed"]


@contextlib.contextmanager
def checkpointed(model: nn.Module, step: StepConfig, recorder: Recorder) -> Iterator[None]:
    """Run every ``every``-th module of the checkpoint's classes (or those its ``blocks`` name)
    under non-reentrant torch.utils.checkpoint; with ``save``, selectively (op outputs kept; only
    in ``save_blocks`` where it names some)."""
    chosen = step.checkpoint
    if chosen is None:
        yield
        return
    paths = {id(m): name for name, m in model.named_modules()}
    modules = _modules_of(model, chosen.classes)
    targets = _chosen(modules, chosen)
    index_of = {id(m): i for i, m in enumerate(modules)}
    own = dict(chosen.save_in)
    # with save_blocks, only those blocks are selective; the others are checkpointed whole
    selective = chosen.save_blocks
    counted: list[tuple[nn.Module, Any]] = []  # submodules whose forwards are counted, and what they had
    for module in targets:
        index = index_of[id(module)]
        save = own.get(index, () if selective and index not in selective else chosen.save)
        context = _context(module, index, save, counted) if save else None
        module.forward = functools.partial(_checkpoint_call, module.forward, paths.get(id(module), ""), recorder,
                                           context)
    # transformers' own gradient checkpointing turns the KV cache off while training (a cache
    # filled in the forward would be appended to again by every recompute); so does this
    config: Any = getattr(model, "config", None)
    cached = getattr(config, "use_cache", None)
    if cached:
        config.use_cache = False
    try:
        yield
    finally:
        for module in targets:
            del module.forward
        for submodule, before in reversed(counted):
            if before is None:
                del submodule.forward
            else:
                submodule.forward = before
        if cached:
            config.use_cache = cached


def _context(block: nn.Module, index: int, save: tuple[str, ...], counted: list[tuple[nn.Module, Any]]
             ) -> Callable[[], Any]:
    """The selective ``context_fn`` of one block; a ``PATH:NAME`` save counts the forwards of the
    block's submodule at PATH running (in forward and in the recompute alike).

    Raises:
        UserInputError: the block has no submodule at PATH.
    """
    inside: dict[str, list[int]] = {}
    for path in dict.fromkeys(split_save(name)[0] for name in save):
        if not path:
            continue
        try:
            submodule = block.get_submodule(path)
        except AttributeError:
            names = ", ".join(name for name, _ in block.named_modules() if name) or "none"
            raise UserInputError(f"{flag(Selective, 'save')}: block {index} ({type(block).__name__}) has no submodule "
                                 f"{path!r}; its submodules: {names}") from None
        inside[path] = [0]
        counted.append((submodule, submodule.__dict__.get("forward")))
        submodule.forward = functools.partial(_counted, submodule.forward, inside[path])
    return selective_policy(save, inside)


def _counted(forward: Any, running: list[int], *args: Any, **kwargs: Any) -> Any:
    running[0] += 1
    try:
        return forward(*args, **kwargs)
    finally:
        running[0] -= 1


def _modules_of(model: nn.Module, class_names: tuple[str, ...]) -> list[nn.Module]:
    """The modules of the named classes, in order.

    Raises:
        UserInputError: a class names no module of the model; lists its classes.
    """
    # by the class or its direct base: FSDP2's fully_shard turns Class into FSDPClass(FSDPModule, Class)
    def names(m: nn.Module) -> set[str]:
        return {type(m).__name__, *(base.__name__ for base in type(m).__bases__)}

    found = [m for m in model.modules() if names(m) & set(class_names)]
    missing = set(class_names) - {name for m in found for name in names(m)}
    if missing:
        available = sorted({type(m).__name__ for m in model.modules()})
        raise UserInputError(f"{flag(EveryBlock, 'classes')}: no module of class {', '.join(sorted(missing))} in the "
                             f"model; its classes are: {', '.join(available)}")
    return found


def _chosen(modules: list[nn.Module], chosen: Checkpointing) -> list[nn.Module]:
    """Every ``every``-th of ``modules``, or those ``blocks`` names.

    Raises:
        UserInputError: a block index past the modules of the named classes.
    """
    if not chosen.blocks:
        return modules[::chosen.every]
    past = [b for b in chosen.blocks if b >= len(modules)]
    if past:
        raise UserInputError(f"{flag(ChosenBlocks, 'blocks')}: no block {', '.join(map(str, past))}; the model has "
                             f"{len(modules)} modules of class {', '.join(chosen.classes)} (0 to {len(modules) - 1})")
    return [modules[b] for b in sorted(chosen.blocks)]


def _checkpoint_call(forward: Any, path: str, recorder: Recorder, context: Callable[[], Any] | None,
                     *args: Any, **kwargs: Any) -> Any:
    def run(*inner: Any, **inner_kwargs: Any) -> Any:
        recorder.modules.stack.append(path)  # names the module in the backward recompute too
        try:
            return forward(*inner, **inner_kwargs)
        finally:
            recorder.modules.stack.pop()

    if context is None:
        return torch.utils.checkpoint.checkpoint(run, *args, use_reentrant=False, **kwargs)
    return torch.utils.checkpoint.checkpoint(run, *args, use_reentrant=False, context_fn=context, **kwargs)
