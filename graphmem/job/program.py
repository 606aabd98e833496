"""What ``graphmem run`` analyses: a training program and its own arguments.

Input: the script (or ``-m`` module), its argv, the optimizer steps to record.  Output: a
frozen ``Program``, checked (the script exists, at least one step).  Knows nothing of how it
is recorded.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from graphmem.errors import UserInputError

__all__ = ["Program", "make_program"]


@dataclass(frozen=True)
class Program:
    """``python SCRIPT ARGS`` or ``python -m MODULE ARGS``, recorded for ``steps`` optimizer steps."""

    target: str  # the script's path, or the module's name
    argv: tuple[str, ...] = ()
    module: bool = False  # ``-m``
    steps: int = 2

    @property
    def command(self) -> str:
        return " ".join(["python", *(["-m"] if self.module else []), self.target, *self.argv])


def make_program(target: str, argv: tuple[str, ...] = (), *, module: bool = False, steps: int = 2) -> Program:
    """A checked Program.

    Raises:
        UserInputError: no such script, or fewer than one step.
    """
    if steps < 1:
        raise UserInputError(f"--steps {steps}: record at least one optimizer step")
    if not module and not os.path.isfile(target):
        raise UserInputError(f"no such program: {target!r}; give the path of a Python script "
                             "(graphmem run train.py ARGS) or a module with -m (graphmem run -m pkg.train ARGS)")
    return Program(target=target, argv=tuple(argv), module=module, steps=steps)
