"""DDP on fakes: PyTorch's ``DistributedDataParallel`` built under the fake process group.

DDP allocates its gradient buckets in C++ at construction (seen here as ops, since the fake
mode is active) and checks parameter values across ranks (no values on fake tensors:
skipped); its all-reduce runs through a comm hook that does what the default one does
(divide the bucket in place, all-reduce it in place) because the fake backend's future
holds no tensor.  DDP's rebuild of its buckets at the start of the second forward (same
sizes, in the order gradients became ready) is skipped: its transient second set of
buckets is not modelled.  The user's own ``parallelize(model, mesh)`` runs here too, with the
same value check skipped, and a DDP it returns is given the same hook.

Input: a model whose parameters are fake and a ``ParallelSpec`` (or a program that builds its
own DDP, inside ``ddp_on_fakes``).  Output: the model wrapped by DDP, its all-reduce on the
fake backend and its buckets never rebuilt.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from graphmem._torch_api import TorchDispatchMode
from graphmem.errors import GraphmemError, UserInputError
from graphmem.job.option import spelling
from graphmem.job.parallel import ParallelSpec
from graphmem.patching import patched
from graphmem.trace.distributed.user_code import _import_function

__all__ = ["ddp_on_fakes"]

# DDP's check that every rank has the same parameter shapes (it reads values)
_VERIFY = "_verify_param_shape_across_processes"


def _ddp(model: nn.Module, spec: ParallelSpec) -> nn.Module:
    import torch.nn.parallel.distributed as ddp_module

    world = spec.world_size
    with patched((ddp_module, _VERIFY, lambda *args, **kwargs: None)):  # it reads values, which fakes lack
        wrapped = ddp_module.DistributedDataParallel(model, bucket_cap_mb=spec.bucket_mb,
                                                     gradient_as_bucket_view=spec.bucket_view)
    _fake_allreduce(wrapped, world)
    return wrapped


@contextlib.contextmanager
def ddp_on_fakes(world: int) -> Iterator[None]:
    """Inside, a ``DistributedDataParallel`` anyone's code builds (a program's own) is built as
    ``apply_parallel`` builds it on fakes: no value check across ranks, the default hook's
    all-reduce through a comm hook, no bucket rebuild (see the module docstring)."""
    import torch.nn.parallel.distributed as ddp_module

    cls = ddp_module.DistributedDataParallel
    build = cls.__init__

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        build(self, *args, **kwargs)
        _fake_allreduce(self, world)

    with patched((ddp_module, _VERIFY, lambda *args, **kwargs: None), (cls, "__init__", init)):
        yield


def _fake_allreduce(wrapped: Any, world: int) -> None:
    """Give a DDP module the all-reduce of DDP's default hook, and no bucket rebuild."""
    import torch.distributed as dist

    def allreduce_hook(state: Any, bucket: Any) -> torch.futures.Future[torch.Tensor]:
        # what DDP's default C++ hook does: divide in place, all-reduce in place, return the bucket
        tensor = bucket.buffer()
        tensor.div_(world)
        dist.all_reduce(tensor)
        future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        future.set_result(tensor)
        return future

    allreduce_hook.__annotations__ = {}  # DDP checks the annotations are its own classes, or none
    wrapped.register_comm_hook(None, allreduce_hook)
    wrapped.reducer = _NoRebuild(wrapped.reducer)


class _NoRebuild:
    """DDP's reducer, except that it never rebuilds its buckets (that syncs values across ranks)."""

    def __init__(self, reducer: Any) -> None:
        self._reducer = reducer

    def __getattr__(self, name: str) -> Any:
        return getattr(self._reducer, name)

    def _rebuild_buckets(self) -> bool:
        return False


def _users_own(model: nn.Module, spec: ParallelSpec, mesh: Any, fake_mode: Any,
               created: TorchDispatchMode) -> nn.Module:
    """Run the user's ``parallelize(model, mesh)`` unchanged on the fake model."""
    import torch.nn.parallel.distributed as ddp_module

    fn = spec.parallelize
    if isinstance(fn, str):
        fn = _import_function(fn)
    assert callable(fn), "apply_parallel: parallelize is neither text nor callable"
    try:
        with patched((ddp_module, _VERIFY, lambda *args, **kwargs: None)), fake_mode, created:
            result = fn(model, mesh)
    except GraphmemError:
        raise
    except Exception as exc:  # broad: the user's function may raise anything; reported as theirs
        raise UserInputError(f"your {spelling('parallelize')} function {getattr(fn, '__qualname__', fn)} failed on "
                             "the fake "
                             f"model: {type(exc).__name__}: {exc}") from exc
    wrapped = result if isinstance(result, nn.Module) else model
    if isinstance(wrapped, ddp_module.DistributedDataParallel):
        _fake_allreduce(wrapped, spec.world_size)
    return wrapped
