"""Repeated blocks: the stack of identical blocks a model runs one after another.

Input: a module.  Output: its longest stack of identical blocks (an ``nn.ModuleList`` or
``nn.Sequential`` whose children are alike), or None; and a context that runs the model
with the stack cut to its first few blocks.  graphmem.trace.repeat.place records the cut model
and places the other blocks' ops and storages by offset.

Blocks are alike when every submodule has the same class, the same parameters and buffers
(names, shapes, dtypes, ``requires_grad``, tensor class), no hooks (but torch.nn.utils.prune's,
alike), and the same plain attributes, except integers (and numbers in names) that grow with
the block's position (``layer_idx``).  A module held as a plain attribute, not a submodule, is
compared by the same rules: transformers 5 decorates its attention classes with the kernels
package's ``use_kernelized_func``, which gives each block its own ``_kernel_funcs`` wrapper of
``apply_rotary_pos_emb`` (kernels/_internals/layer/layer.py).  The first block need not be like
the others: it is recorded as it is (a ResNet stage's first block downsamples, T5's first holds
the position bias).  A transformers config with a per-layer list whose entries differ, or a
list of some layers' indices, makes the stack unlike: the model's code reads it by layer index
where no attribute of a block shows it.  A block whose behaviour depends on its position only
through such an integer is caught by the check graphmem.trace.repeat.place makes on the recording
itself.
"""

from __future__ import annotations

import contextlib
import functools
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn.utils import prune

__all__ = ["Stack", "find_stack", "cut_to"]

MIN_BLOCKS = 6  # below this, recording four blocks and checking them saves little
_HIDDEN_DEPTH = 3  # modules held as plain attributes compared this deep (a module holding itself ends)
_PLAIN = (int, float, bool, type(None), torch.dtype, torch.device)
_NUMBER = re.compile(r"(\d+)")
_HOOK_PREFIXES = ("_forward", "_backward", "_state_dict", "_load")
_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
          "_state_dict_hooks", "_load_state_dict_pre_hooks")


@dataclass(frozen=True, slots=True)
class Stack:
    """A stack of ``length`` alike blocks at module path ``path`` (``model.layers``)."""

    path: str
    length: int
    container: nn.Module


def find_stack(model: nn.Module) -> Stack | None:
    """The stack of alike blocks holding the most parameters, or None when there is none
    with at least MIN_BLOCKS blocks (or a block shares a tensor with anything else)."""
    counts: dict[int, int] = {}
    for _, tensor in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        counts[id(tensor)] = counts.get(id(tensor), 0) + 1
    best: tuple[int, Stack] | None = None
    for path, module in model.named_modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential)) or len(module) < MIN_BLOCKS:
            continue
        blocks = list(module.children())
        if len(blocks) != len(module) or len({id(b) for b in blocks}) != len(blocks) or not _alike(blocks[1:]):
            continue  # (the first block is recorded as it is: it may differ, as a ResNet stage's first)
        if any(counts.get(id(t), 0) != 1 for b in blocks for t in (*b.parameters(), *b.buffers())):
            continue  # a tensor shared between blocks, or with the rest of the model
        if not _config_alike(model, len(blocks)):
            continue
        size = sum(t.numel() for b in blocks for t in b.parameters())
        if best is None or size > best[0]:
            best = (size, Stack(path=path, length=len(blocks), container=module))
    return best[1] if best else None


def _config_alike(model: nn.Module, length: int) -> bool:
    """Whether the model's configuration (a transformers ``config`` and its sub-configs) treats
    a stack of ``length`` layers alike: no per-layer list whose entries differ (``layer_types``)
    and no list of some layers' indices (``rope_scaling_layers = [0, 1, 2, 3]``), which the
    model's own code reads by layer index where no block attribute shows it."""
    configs, seen = [getattr(model, "config", None)], set()
    while configs:
        config = configs.pop()
        if config is None or id(config) in seen or not hasattr(config, "to_dict"):
            continue
        seen.add(id(config))
        for key, value in vars(config).items():
            if hasattr(value, "to_dict"):
                configs.append(value)
            if not isinstance(value, (list, tuple)) or not value:
                continue
            if len(value) == length and any(v != value[0] for v in value):
                return False
            named = any(word in key for word in ("layer", "indices", "idx"))
            if named and len(value) < length and all(isinstance(v, int) and 0 <= v < length for v in value):
                return False
    return True


def _alike(blocks: list[nn.Module]) -> bool:
    """Whether every block has the first one's signature (integers may grow with position)."""
    first = _signature(blocks[0])
    if first is None:
        return False
    for position, block in enumerate(blocks[1:], start=1):
        other = _signature(block)
        if other is None or len(other) != len(first):
            return False
        for (key, a), (key2, b) in zip(first, other, strict=True):
            if key != key2 or not _same_value(a, b, position):
                return False
    return True


def _signature(block: nn.Module) -> list[tuple[str, Any]] | None:
    """(key, value) pairs describing ``block``; None when it has hooks (they may differ) other
    than pruning's."""
    items: list[tuple[str, Any]] = []
    for name, module in block.named_modules(remove_duplicate=False):
        pruning = _pruning_hooks(module)
        if pruning is None:
            return None
        items.append((f"{name}:class", type(module)))
        items += [(f"{name}:pruned", (type(hook), vars(hook))) for hook in pruning]
        for kind, table in (("p", module._parameters), ("b", module._buffers)):
            for key, t in table.items():
                items.append((f"{name}.{key}:{kind}", None if t is None else
                              (type(t), tuple(t.shape), t.dtype, t.requires_grad)))
        for key, value in sorted(vars(module).items()):
            if key in ("_parameters", "_buffers", "_modules") or key.startswith(_HOOK_PREFIXES):  # (hooks: above)
                continue
            items.append((f"{name}.{key}", value))
    return items


def _pruning_hooks(module: nn.Module) -> list[Any] | None:
    """``module``'s hooks when it has none but torch.nn.utils.prune's (each recomputes a weight
    from its copy and mask, the same way in every block); None when it has any other."""
    pre = list(getattr(module, "_forward_pre_hooks", {}).values())
    if any(getattr(module, hooks, None) for hooks in _HOOKS if hooks != "_forward_pre_hooks") \
            or not all(isinstance(hook, prune.BasePruningMethod) for hook in pre):
        return None
    return pre


def _same_value(a: Any, b: Any, position: int, depth: int = 0) -> bool:
    """``a`` (block 0's) and ``b`` (the block at ``position``'s) are the same attribute: equal,
    the same object, integers (and numbers in names) that differ by the position (a layer
    index, ``model.layers.3.self_attn``), or each block's own module held as a plain attribute
    and alike (``depth``: how many such modules deep the comparison is)."""
    if a is b:
        return True
    if isinstance(a, nn.Module) or isinstance(b, nn.Module):  # before callable: a module is one
        return isinstance(a, nn.Module) and isinstance(b, nn.Module) and _same_hidden(a, b, position, depth)
    if isinstance(a, int) and isinstance(b, int) and not isinstance(a, bool) and b - a == position:
        return True
    if isinstance(a, str) and isinstance(b, str):  # a name with the block's index in it
        x, y = _NUMBER.split(a), _NUMBER.split(b)
        return len(x) == len(y) and all(p == q or (n % 2 and int(q) - int(p) == position)
                                        for n, (p, q) in enumerate(zip(x, y, strict=True)))
    if isinstance(a, _PLAIN) and isinstance(b, _PLAIN):
        return type(a) is type(b) and a == b
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) \
            and all(_same_value(x, y, 0, depth) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same_value(a[k], b[k], position, depth) for k in a)
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape \
            and a.dtype == b.dtype
    if isinstance(a, functools.partial) and isinstance(b, functools.partial):  # an activation with arguments
        return a.func is b.func and _same_value(a.args, b.args, 0, depth) \
            and _same_value(a.keywords, b.keywords, 0, depth)
    if callable(a) and callable(b):  # the same function bound to each block's own module
        return getattr(a, "__func__", a) is getattr(b, "__func__", b)
    try:
        return bool(type(a) is type(b) and a == b)
    except Exception:  # broad: a user object's == may raise anything (an array's is ambiguous); not alike
        return False


def _same_hidden(a: nn.Module, b: nn.Module, position: int, depth: int) -> bool:
    """Block 0's and the block at ``position``'s module held as a plain attribute, not a
    submodule, are alike: the same class and signature (``_signature``), compared at most
    _HIDDEN_DEPTH such modules deep."""
    if type(a) is not type(b) or depth >= _HIDDEN_DEPTH:
        return False
    first, other = _signature(a), _signature(b)
    if first is None or other is None or len(first) != len(other):
        return False
    return all(key == key2 and _same_value(x, y, position, depth + 1)
               for (key, x), (key2, y) in zip(first, other, strict=True))


@contextlib.contextmanager
def cut_to(stack: Stack, keep: int) -> Iterator[None]:
    """Run with ``stack`` holding only its first ``keep`` blocks; restored after."""
    container = stack.container
    saved = container._modules
    container._modules = type(saved)((key, saved[key]) for key in list(saved)[:keep])
    try:
        yield
    finally:
        container._modules = saved
        kept = list(saved.values())[keep - 1]
        for block in list(saved.values())[keep:]:  # as model.train()/eval() in the recording left the kept
            if block is not None and kept is not None:
                block.train(kept.training)
