"""The part of a command line that is graphmem's own (light: no click, no torch; the supervisor
reads it before the command starts).

``graphmem run``'s options end at the program, as python's do: everything after the script
(or ``-m MODULE``) is the program's argv, whatever it is named.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["RUN_FLAGS", "own_arguments", "program_arguments_apart"]

# ``graphmem run``'s options that take no value; every other option of run takes one
# (tests/unit/cli/test_supervisor_arguments.py keeps this equal to the click command's flags)
RUN_FLAGS = frozenset({"--allow-network", "--debug", "--progress", "--no-progress", "-h", "--help"})


def own_arguments(argv: Sequence[str]) -> list[str]:
    """The part of the command line that is graphmem's own: all of it, but for ``run``, whose
    options end at the program, as python's do: at the script (the first argument that is
    neither an option nor an option's value), after ``-m MODULE``, or at ``--``.  What follows
    is the program's argv (its ``--timeout`` or ``--format json`` are not graphmem's)."""
    if not argv or argv[0] != "run":
        return list(argv)
    at = 1
    while at < len(argv):
        token = argv[at]
        if token == "--" or not token.startswith("-") or token == "-":
            break
        long = token.startswith("--")
        name = token.partition("=")[0] if long else token[:2]
        attached = "=" in token if long else len(token) > 2  # --opt=value, -mMODULE, -oFILE
        at += 1 if name in RUN_FLAGS or attached else 2
        if name == "-m":
            break
    return list(argv[:min(at, len(argv))])


def program_arguments_apart(args: Sequence[str]) -> list[str]:
    """``graphmem run``'s arguments (after ``run``) with ``--`` put after ``-m MODULE``, so that
    click, which reads options after an option's value, leaves the module's own options to it
    (``graphmem run -m pkg.train --steps 5``: ``--steps 5`` is the module's)."""
    own = own_arguments(["run", *args])[1:]
    last = own[-1] if own else ""
    module_last = own[-2:-1] == ["-m"] or (last.startswith("-m") and last != "-m")  # -m MODULE, -mMODULE
    rest = list(args[len(own):])
    if not module_last or rest[:1] == ["--"]:
        return list(args)
    return [*own, "--", *rest]
