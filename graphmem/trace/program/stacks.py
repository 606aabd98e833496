"""graphmem run: the program's model with a stack of alike blocks, built with four of them.

Input: the program, while it runs.  Output: ``cutting_stacks(cuts, silenced)``, a context
manager under which the first model the program builds with a stack of more than KEEP alike
blocks (graphmem.trace.repeat.blocks.find_stack, the program's rules) keeps only its first
KEEP, cut the moment its outermost constructor returns: before the program parallelises,
initialises or optimises it, so everything it then does to the model it does to four blocks.
graphmem.trace.program.repeat places the other blocks in the recording.

The blocks past the first KEEP are built unrecorded (``silenced``): a block whose construction
starts while a container (``nn.ModuleList``, ``nn.ModuleDict``, ``nn.Sequential``) already
holds KEEP blocks of its class, one after another, as torchtitan's models add each block as it
is built.  A model that builds its blocks first and the container after (``nn.ModuleList([Block()
for ...])``) records every block's construction, and its stack is not cut: recorded whole.
Should a block built unrecorded not end up cut away (the model keeps it), the recording is
``spoiled``: ``Spoiled`` is raised at once and the program is recorded whole.

"The moment its constructor starts and returns": every ``nn.Module`` subclass's own
``__init__`` is wrapped while the program runs (those defined later too, through
``__init_subclass__``), so each module's construction is seen from start to end.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from graphmem._torch_api import module_children, set_module_children
from graphmem.trace.repeat.blocks import find_stack
from graphmem.trace.repeat.layout import KEEP

__all__ = ["Cut", "Cuts", "Spoiled", "cutting_stacks"]

_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)


class Spoiled(BaseException):
    """A block was built unrecorded and the model kept it: the recording cannot stand for the
    program; record it whole.  Not an Exception, so the program's handlers let it through."""


@dataclass(frozen=True)
class Cut:
    """A stack cut to KEEP blocks: its container (now holding KEEP), the blocks the program
    built, and the model it is in (the module whose construction built it)."""

    container: nn.Module
    length: int
    model: nn.Module


@dataclass
class Cuts:
    """What ``cutting_stacks`` cut (at most one stack), and the blocks it built unrecorded.

    ``decide`` is asked once, when the first block past the first KEEP starts: True to cut
    (the blocks from there on are built unrecorded), False to record the model whole from that
    moment (graphmem.trace.program.backup: the process that says True has a backup that says
    False)."""

    made: list[Cut] = field(default_factory=list)
    unrecorded: list[nn.Module] = field(default_factory=list)
    decide: Callable[[], bool] = lambda: True
    decided: bool | None = None  # the answer, once asked


def _subclasses(cls: type) -> Iterator[type]:
    seen: set[type] = set()
    todo: list[type] = [cls]
    while todo:
        sub: type
        for sub in todo.pop().__subclasses__():
            if sub not in seen:
                seen.add(sub)
                todo.append(sub)
                yield sub


class _Builds:
    """The constructions running now and the containers filled during the outermost one."""

    def __init__(self, cuts: Cuts, silenced: Callable[[], AbstractContextManager[None]]) -> None:
        self.cuts, self.silenced = cuts, silenced
        self.depth = 0
        self.quiet = 0  # > 0 inside a block built unrecorded
        self.containers: list[nn.Module] = []  # filled during the outermost construction

    def registered(self, parent: nn.Module, name: str, child: Any) -> None:
        if self.depth and isinstance(parent, _CONTAINERS) and isinstance(child, nn.Module) \
                and not any(parent is c for c in self.containers):
            self.containers.append(parent)

    def past_keep(self, module: nn.Module) -> bool:
        """Whether ``module`` starts a block past the first KEEP of a container being filled."""
        if self.cuts.made or self.quiet or not self.depth or self.cuts.decided is False:
            return False
        for container in self.containers:
            children = list(module_children(container).values())
            if len(children) >= KEEP and all(type(c) is type(module) for c in children[1:]):
                if self.cuts.decided is None:
                    self.cuts.decided = self.cuts.decide()
                return self.cuts.decided
        return False

    def built(self, module: nn.Module) -> None:
        """The outermost construction returned: cut its stack, or stand for what went unrecorded."""
        containers, self.containers = self.containers, []
        unrecorded, self.cuts.unrecorded = self.cuts.unrecorded, []
        if self.cuts.made:
            return
        stack = find_stack(module, program=True)
        if stack is not None and stack.length > KEEP and unrecorded and any(stack.container is c for c in containers):
            blocks = list(module_children(stack.container).values())
            if len(unrecorded) == len(blocks) - KEEP \
                    and all(a is b for a, b in zip(blocks[KEEP:], unrecorded, strict=True)):
                keys = list(module_children(stack.container))[:KEEP]
                children = module_children(stack.container)
                set_module_children(stack.container, type(children)((key, children[key]) for key in keys))
                self.cuts.made.append(Cut(container=stack.container, length=stack.length, model=module))
                return
        if unrecorded:
            raise Spoiled("a block built unrecorded was kept")


@contextlib.contextmanager
def cutting_stacks(cuts: Cuts, silenced: Callable[[], AbstractContextManager[None]]) -> Iterator[None]:
    """Inside, the first model built with a stack of more than KEEP alike blocks keeps its first
    KEEP, the others built unrecorded (``silenced()``: the recorder records nothing inside);
    see the module docstring.  The program's model stays cut after."""
    builds = _Builds(cuts, silenced)
    wrapped: list[tuple[type, Any]] = []

    def wrap(cls: type) -> None:
        own = cls.__dict__.get("__init__")
        if own is None or getattr(own, "graphmem_built", False) or not callable(own):
            return

        @functools.wraps(own)
        def init(self: nn.Module, *args: Any, **kwargs: Any) -> None:
            quiet = builds.past_keep(self)
            builds.depth += 1
            builds.quiet += quiet
            try:
                with builds.silenced() if quiet and builds.quiet == 1 else contextlib.nullcontext():
                    own(self, *args, **kwargs)
            finally:
                builds.depth -= 1
                builds.quiet -= quiet
            if quiet:
                cuts.unrecorded.append(self)
            if not builds.depth:
                builds.built(self)

        init.graphmem_built = True  # type: ignore[attr-defined]
        cls.__init__ = init  # type: ignore[misc]
        wrapped.append((cls, own))

    for cls in (nn.Module, *_subclasses(nn.Module)):
        wrap(cls)
    had = nn.Module.__dict__.get("__init_subclass__")

    def init_subclass(cls: Any, /, **kwargs: Any) -> None:
        super(nn.Module, cls).__init_subclass__(**kwargs)
        wrap(cls)

    nn.Module.__init_subclass__ = classmethod(init_subclass)  # type: ignore[assignment]
    handle = nn.modules.module.register_module_module_registration_hook(builds.registered)
    try:
        yield
    finally:
        handle.remove()
        if had is None:
            del nn.Module.__init_subclass__
        else:
            nn.Module.__init_subclass__ = had  # type: ignore[method-assign]
        for cls, own in reversed(wrapped):
            cls.__init__ = own
