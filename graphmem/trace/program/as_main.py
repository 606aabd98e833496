"""The program started as Python starts ``python SCRIPT ARGS`` (``graphmem run``).

Input: a ``Program``.  Output: ``as_main``, inside which ``sys.argv`` and ``sys.path[0]`` are the
program's, as Python sets them, with the environment a recording needs (``_ENVIRON``) and the
process-wide singletons it may not inherit emptied; everything restored after.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from typing import Any

from graphmem.job.program import Program
from graphmem.patching import environment

__all__ = ["as_main"]


# process-wide singletons a program sets up once and a second program in the same process may
# not change: accelerate's state (its device, "cuda" on a GPU target) is kept as it was before
_SINGLETONS = (("accelerate.state", ("PartialState", "AcceleratorState", "GradientState")),)


# the program's environment: transformers loads a checkpoint's tensors in a pool of threads
# unless told not to, and a thread's ops are not seen by the recording (dispatch modes belong
# to the thread that entered them); loaded in the program's thread, the same tensors result.
# Weights & Biases logs nothing and sends nothing (its runs are no-ops: a pre-flight is no run)
_ENVIRON = {"HF_DEACTIVATE_ASYNC_LOAD": "1", "WANDB_MODE": "disabled"}


def _singletons() -> list[dict[str, Any]]:
    """The shared state of each loaded singleton."""
    found = []
    for module_name, names in _SINGLETONS:
        module = sys.modules.get(module_name)
        for name in names:
            shared = getattr(getattr(module, name, None), "_shared_state", None)
            if isinstance(shared, dict):
                found.append(shared)
    return found


@contextlib.contextmanager
def as_main(program: Program) -> Iterator[None]:
    """``sys.argv`` and ``sys.path[0]`` as Python sets them for the program, and ``_ENVIRON``;
    restored after, with the singletons of ``_SINGLETONS`` (the program may have made them
    for a fake GPU).  The program starts with those singletons empty, as in a new process: a
    rank's process forked from one that ran accelerate on one process must not inherit that
    state (it would not see torchrun's environment; accelerate's own ``_reset_state`` clears
    them the same)."""
    argv, path = sys.argv[:], sys.path[:]
    before = {id(shared): dict(shared) for shared in _singletons()}
    for shared in _singletons():
        shared.clear()
    sys.argv = [program.target, *program.argv]
    sys.path.insert(0, os.getcwd() if program.module else _script_folder(program.target))
    try:
        with environment(_ENVIRON):
            yield
    finally:
        sys.argv[:], sys.path[:] = argv, path
        for shared in _singletons():
            shared.clear()
            shared.update(before.get(id(shared), {}))


def _script_folder(target: str) -> str:
    """``sys.path[0]`` as python sets it for ``python TARGET``: the script's folder, or the
    folder itself when it is one (run through its ``__main__.py``)."""
    path = os.path.abspath(target)
    return path if os.path.isdir(path) else os.path.dirname(path)
