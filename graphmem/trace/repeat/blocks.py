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
import dataclasses
import functools
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn.utils import prune

from graphmem._torch_api import module_buffers, module_children, module_parameters, set_module_children

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


def find_stack(model: nn.Module, *, program: bool = False) -> Stack | None:
    """The stack of alike blocks holding the most parameters, or None when there is none
    with at least MIN_BLOCKS blocks (or a block shares a tensor with anything else).

    ``program`` (graphmem run, a model as the program built it, before anything ran on it):
    an ``nn.ModuleDict`` keyed "0", "1", ... counts as a stack too (torchtitan's ``layers``);
    hooks are alike when each block has the same functions (each bound to its own module:
    torchtitan's state-dict hooks); and callables alike when made from the same code, the
    numbers they were made with aside (torchtitan's per-layer ``partial(trunc_normal_,
    std=...)`` initialisers: they set values, not what runs)."""
    counts: dict[int, int] = {}
    for _, tensor in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        counts[id(tensor)] = counts.get(id(tensor), 0) + 1
    best: tuple[int, Stack] | None = None
    kinds = (nn.ModuleList, nn.Sequential, nn.ModuleDict) if program else (nn.ModuleList, nn.Sequential)
    for path, module in model.named_modules():
        if not isinstance(module, kinds) or len(module) < MIN_BLOCKS:
            continue
        if isinstance(module, nn.ModuleDict) and list(module.keys()) != [str(n) for n in range(len(module))]:
            continue  # named blocks: a path names no position
        blocks = list(module.children())
        if len(blocks) != len(module) or len({id(b) for b in blocks}) != len(blocks) \
                or not _alike(blocks[1:], program):
            continue  # (the first block is recorded as it is: it may differ, as a ResNet stage's first)
        if any(counts.get(id(t), 0) != 1 for b in blocks for t in (*b.parameters(), *b.buffers())):
            continue  # a tensor shared between blocks, or with the rest of the model
        if not _config_alike(model, len(blocks), program):
            continue
        size = sum(t.numel() for b in blocks for t in b.parameters())
        if best is None or size > best[0]:
            best = (size, Stack(path=path, length=len(blocks), container=module))
    return best[1] if best else None


def _config_alike(model: nn.Module, length: int, loose: bool = False) -> bool:
    """Whether the model's configuration (a transformers ``config`` and its sub-configs) treats
    a stack of ``length`` layers alike: no per-layer list whose entries differ (``layer_types``)
    and no list of some layers' indices (``rope_scaling_layers = [0, 1, 2, 3]``), which the
    model's own code reads by layer index where no block attribute shows it.  ``loose``: a
    per-layer list of dataclass configs (torchtitan's ``layers``, one block's config each) is
    alike when its entries are, compared as the blocks are (find_stack's ``program``)."""
    configs, seen = [getattr(model, "config", None)], set()
    while configs:
        config = configs.pop()
        if config is None or id(config) in seen or not hasattr(config, "to_dict"):
            continue
        seen.add(id(config))
        for key, value in _fields(config).items():
            if hasattr(value, "to_dict"):
                configs.append(value)
            if not isinstance(value, (list, tuple)) or not value:
                continue
            if len(value) == length and not all(_entry_alike(v, value[1 if loose else 0], loose)
                                                for v in value[1 if loose else 0:]):
                return False
            named = any(word in key for word in ("layer", "indices", "idx"))
            if named and len(value) < length and all(isinstance(v, int) and 0 <= v < length for v in value):
                return False
    return True


def _fields(config: Any) -> dict[str, Any]:
    """A configuration's attributes: its ``__dict__``, or a slotted dataclass's fields."""
    if hasattr(config, "__dict__"):
        return dict(vars(config))
    if dataclasses.is_dataclass(config):
        return {f.name: getattr(config, f.name, None) for f in dataclasses.fields(config)}
    return {}


def _entry_alike(a: Any, b: Any, loose: bool) -> bool:
    """Two entries of a per-layer list are alike: equal; ``loose``: dataclasses whose fields
    are alike as blocks' attributes are (the first entry, as the first block, may differ)."""
    if not loose:
        return bool(a == b)
    if dataclasses.is_dataclass(a) and not isinstance(a, type):
        return type(a) is type(b) and all(_entry_alike(getattr(a, f.name, None), getattr(b, f.name, None), loose)
                                          for f in dataclasses.fields(a))
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) \
            and all(_entry_alike(x, y, loose) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_entry_alike(a[k], b[k], loose) for k in a)
    return _same_value(a, b, 0, loose=True)


def _alike(blocks: list[nn.Module], loose: bool = False) -> bool:
    """Whether every block has the first one's signature (integers may grow with position;
    ``loose``: see find_stack's ``program``)."""
    first = _signature(blocks[0], loose)
    if first is None:
        return False
    for position, block in enumerate(blocks[1:], start=1):
        other = _signature(block, loose)
        if other is None or len(other) != len(first):
            return False
        for (key, a), (key2, b) in zip(first, other, strict=True):
            if key != key2 or not _same_value(a, b, position, loose=loose):
                return False
    return True


def _signature(block: nn.Module, loose: bool = False) -> list[tuple[str, Any]] | None:
    """(key, value) pairs describing ``block``; None when it has hooks (they may differ) other
    than pruning's (``loose``: hooks are described by their functions)."""
    items: list[tuple[str, Any]] = []
    for name, module in block.named_modules(remove_duplicate=False):
        if loose:
            items += [(f"{name}:{hooks}", tuple(_hook_function(hook) for hook in getattr(module, hooks, {}).values()))
                      for hooks in (*_HOOKS, "_forward_pre_hooks")]
            pruning: list[Any] | None = []
        else:
            pruning = _pruning_hooks(module)
        if pruning is None:
            return None
        items.append((f"{name}:class", type(module)))
        items += [(f"{name}:pruned", (type(hook), vars(hook))) for hook in pruning]
        for kind, table in (("p", module_parameters(module)), ("b", module_buffers(module))):
            for key, t in table.items():
                items.append((f"{name}.{key}:{kind}", None if t is None else
                              (type(t), tuple(t.shape), t.dtype, t.requires_grad)))
        for key, value in sorted(vars(module).items()):
            if key in ("_parameters", "_buffers", "_modules") or key.startswith(_HOOK_PREFIXES):  # (hooks: above)
                continue
            items.append((f"{name}.{key}", value))
    return items


def _hook_function(hook: Any) -> Any:
    """The function a hook runs, whichever module it is bound to (a bound method's function, a
    ``_WrappedHook``'s hook)."""
    hook = getattr(hook, "hook", hook)
    return getattr(hook, "__func__", hook)


def _pruning_hooks(module: nn.Module) -> list[Any] | None:
    """``module``'s hooks when it has none but torch.nn.utils.prune's (each recomputes a weight
    from its copy and mask, the same way in every block); None when it has any other."""
    pre = list(getattr(module, "_forward_pre_hooks", {}).values())
    if any(getattr(module, hooks, None) for hooks in _HOOKS if hooks != "_forward_pre_hooks") \
            or not all(isinstance(hook, prune.BasePruningMethod) for hook in pre):
        return None
    return pre


def _same_value(a: Any, b: Any, position: int, depth: int = 0, *, loose: bool = False,
                made_with: bool = False) -> bool:
    """``a`` (block 0's) and ``b`` (the block at ``position``'s) are the same attribute: equal,
    the same object, integers (and numbers in names) that differ by the position (a layer
    index, ``model.layers.3.self_attn``), or each block's own module held as a plain attribute
    and alike (``depth``: how many such modules deep the comparison is).  ``loose``: functions
    made from the same code alike (``made_with``: inside one, any two numbers are alike)."""
    if a is b:
        return True
    same = functools.partial(_same_value, depth=depth, loose=loose, made_with=made_with)
    if made_with and isinstance(a, (int, float)) and isinstance(b, (int, float)) \
            and not isinstance(a, bool) and not isinstance(b, bool):
        return True
    if isinstance(a, nn.Module) or isinstance(b, nn.Module):  # before callable: a module is one
        return isinstance(a, nn.Module) and isinstance(b, nn.Module) and _same_hidden(a, b, position, depth, loose)
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
            and all(same(x, y, 0) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k], position) for k in a)
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape \
            and a.dtype == b.dtype
    if isinstance(a, functools.partial) and isinstance(b, functools.partial):  # an activation with arguments
        inside = functools.partial(_same_value, depth=depth, loose=loose, made_with=loose)
        return same(a.func, b.func, 0) and inside(a.args, b.args, 0) and inside(a.keywords, b.keywords, 0)
    if loose and _made_alike(a, b):
        return True
    if callable(a) and callable(b):  # the same function bound to each block's own module
        return getattr(a, "__func__", a) is getattr(b, "__func__", b)
    try:
        return bool(type(a) is type(b) and a == b)
    except Exception:  # broad: a user object's == may raise anything (an array's is ambiguous); not alike
        return False


def _made_alike(a: Any, b: Any) -> bool:
    """Two functions made from the same code (closures of one ``def``), the values they
    captured alike, numbers aside (``loose``)."""
    code_a, code_b = getattr(a, "__code__", None), getattr(b, "__code__", None)
    if code_a is None or code_a is not code_b:
        return False
    cells_a, cells_b = a.__closure__ or (), b.__closure__ or ()
    if len(cells_a) != len(cells_b):
        return False
    for x, y in zip(cells_a, cells_b, strict=True):
        try:
            x, y = x.cell_contents, y.cell_contents
        except ValueError:  # an empty cell (a name not yet bound)
            return False
        if not _same_value(x, y, 0, _HIDDEN_DEPTH, loose=True, made_with=True):
            return False
    return True


def _same_hidden(a: nn.Module, b: nn.Module, position: int, depth: int, loose: bool = False) -> bool:
    """Block 0's and the block at ``position``'s module held as a plain attribute, not a
    submodule, are alike: the same class and signature (``_signature``), compared at most
    _HIDDEN_DEPTH such modules deep."""
    if type(a) is not type(b) or depth >= _HIDDEN_DEPTH:
        return False
    first, other = _signature(a, loose), _signature(b, loose)
    if first is None or other is None or len(first) != len(other):
        return False
    return all(key == key2 and _same_value(x, y, position, depth + 1, loose=loose)
               for (key, x), (key2, y) in zip(first, other, strict=True))


@contextlib.contextmanager
def cut_to(stack: Stack, keep: int) -> Iterator[None]:
    """Run with ``stack`` holding only its first ``keep`` blocks; restored after."""
    container = stack.container
    saved = module_children(container)
    set_module_children(container, type(saved)((key, saved[key]) for key in list(saved)[:keep]))
    try:
        yield
    finally:
        set_module_children(container, saved)
        kept = list(saved.values())[keep - 1]
        for block in list(saved.values())[keep:]:  # as model.train()/eval() in the recording left the kept
            if block is not None and kept is not None:
                block.train(kept.training)
