"""Module attribution for the recorder: which module (or parameter) each recorded op belongs to.

Input: the model's modules as they run (global forward hooks), autograd's sequence numbers
and the node the engine runs in backward, and the parameters gradients and optimizer state
belong to (``StorageBooks.owner``).  Output: the module path of the op being recorded.
The same idea as torch.distributed._tools' ModTracker, kept apart from the storage books.
"""

from __future__ import annotations

import bisect
import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

from graphmem._torch_api import autograd_sequence_nr, current_autograd_node, node_sequence_nr
from graphmem.records import OpRecord, Phase
from graphmem.trace.core.storages import StorageBooks

__all__ = ["ModuleTracker"]


class ModuleTracker:
    """The module stack in forward, and for backward the forward module of each autograd node."""

    def __init__(self, books: StorageBooks) -> None:
        self.books = books
        self.stack: list[str] = []  # path of the module running now, innermost last
        self._seq_starts: list[int] = []  # autograd sequence nr -> module, for backward ops
        self._seq_modules: list[str] = []

    def current(self, phase: Phase, in_sids: tuple[int, ...], ops: Sequence[OpRecord]) -> str:
        """Module path of the op running now: the forward module stack, the autograd node
        being executed in backward, or the parameter an optimizer op works on (the owner of
        its first input storage that has one)."""
        if phase in (Phase.FORWARD, Phase.LOSS) or (self.stack and phase == Phase.BACKWARD):
            return self.stack[-1] if self.stack else ""
        if phase == Phase.BACKWARD:
            return self._backward_module()
        for sid in in_sids:
            if sid in self.books.owner:
                return self._param_module(sid)
        # an optimizer temporary: it works on the same parameter as the op before it
        return ops[-1].module if ops and ops[-1].phase == phase else ""

    def _backward_module(self) -> str:
        node = current_autograd_node()
        if node is None:
            return ""
        variable = getattr(node, "variable", None)  # AccumulateGrad
        if isinstance(variable, torch.Tensor):
            return self._param_module(self.books.track(variable, -1).sid)
        i = bisect.bisect_left(self._seq_starts, node_sequence_nr(node))
        return self._seq_modules[min(i, len(self._seq_modules) - 1)] if self._seq_starts else ""

    def _param_module(self, sid: int) -> str:
        return self.books.owner.get(sid, "").rpartition(".")[0]

    def note_sequence(self, module: str) -> None:
        """A forward op in ``module``.  Autograd numbers the op's backward node before the op
        reaches the mode, so the newest number belongs to this op; backward ops look their
        node's number up here."""
        newest = autograd_sequence_nr() - 1
        if not self._seq_starts or newest > self._seq_starts[-1]:
            self._seq_starts.append(newest)
            self._seq_modules.append(module)

    @contextlib.contextmanager
    def tracking(self, model: nn.Module) -> Iterator[None]:
        """Keep ``stack`` equal to the path of the module running now (global module hooks)."""
        paths: dict[int, str] = {}
        for name, module in model.named_modules(remove_duplicate=False):
            paths.setdefault(id(module), name)

        def pre(module: nn.Module, args: Any) -> None:
            self.stack.append(paths.get(id(module), type(module).__name__))

        def post(module: nn.Module, args: Any, out: Any) -> None:
            if self.stack:
                self.stack.pop()

        handles = [nn.modules.module.register_module_forward_pre_hook(pre),
                   nn.modules.module.register_module_forward_hook(post, always_call=True)]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()
