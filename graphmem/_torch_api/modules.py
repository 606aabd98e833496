"""An ``nn.Module``'s internals: its own tables of parameters, buffers and children (live dicts:
writing one changes the module), ``_apply`` (what ``.to()``, ``.cuda()``, ``.half()`` run), and
bitsandbytes' quantization of a weight as ``from_pretrained`` makes it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = ["MODULE_APPLY", "module_apply", "module_buffers", "module_children", "module_non_persistent_buffers",
           "module_parameters", "quantized_on_meta", "set_module_children", "unpatched_module_apply"]


def module_parameters(module: nn.Module) -> dict[str, nn.Parameter | None]:
    """``module``'s own parameters by name (not its children's), None where registered empty."""
    return module._parameters


def module_buffers(module: nn.Module) -> dict[str, torch.Tensor | None]:
    """``module``'s own buffers by name (not its children's), None where registered empty."""
    return module._buffers


def module_non_persistent_buffers(module: nn.Module) -> set[str]:
    """The names of ``module``'s own buffers that are not in its state dict."""
    return module._non_persistent_buffers_set


def module_children(module: nn.Module) -> dict[str, nn.Module | None]:
    """``module``'s direct children by name, in order."""
    return module._modules


def set_module_children(module: nn.Module, children: dict[str, nn.Module | None]) -> None:
    """Replace ``module``'s table of direct children with ``children``."""
    module._modules = children


def module_apply(module: nn.Module, fn: Callable[[torch.Tensor], torch.Tensor]) -> nn.Module:
    """``module._apply(fn)``: ``fn`` applied to every parameter and buffer, children first."""
    applied: nn.Module = module._apply(fn)
    return applied


def unpatched_module_apply() -> Callable[..., nn.Module]:
    """``nn.Module._apply`` as it is now (a recording may then replace it: ``MODULE_APPLY``)."""
    return nn.Module._apply


MODULE_APPLY = "_apply"  # the name of nn.Module's method that ``.to()`` and its kin run


def quantized_on_meta(params: Any) -> Any:
    """A bitsandbytes ``Int8Params`` or ``Params4bit`` quantized on the meta device, as
    ``from_pretrained`` quantizes each loaded weight."""
    return params._quantize("meta")
