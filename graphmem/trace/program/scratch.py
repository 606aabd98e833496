"""A copy-on-write view of the file system for a program run in-process (``graphmem run``): the
program sees its own writes, and the user's files are never changed.

Input: a ``Scratch`` (an empty private folder, the layer's root) and the length of a ``with
layered(scratch):`` block.  Output: inside it, Python's file calls go through the layer; after
it, ``scratch.changes()``, what the program did to the file system, for the report.

Like an overlay file system: a path the program wrote reads the program's copy; a path it
deleted does not exist for it; every other path reads the real file.  Writing, truncating,
appending (the real bytes copied in first), creating, renaming (nothing is copied: a renamed real
file or folder is read where it really is), deleting, making and removing folders, chmod, utime,
chown, extended attributes, symlinks and hard links happen in the layer only.  Listings merge the
real entries (less the deleted ones) with the program's.  Paths are taken relative to the
working folder, symlinked folders resolved (one file named two ways is one file), ``dir_fd``
arguments resolved to their folder (``/proc/self/fd`` on Linux, ``F_GETPATH`` on macOS; an
``OSError`` where that fails: never a silent write); errors are the OS's, naming the program's
path.  Passing through untouched: the layer's root, ``/dev`` (``/dev/null``, ``/dev/shm``),
``/proc``, ``/sys`` and the program's temporary folder, ``<root>/tmp``: inside ``layered``,
``tempfile.tempdir`` and ``TMPDIR``/``TEMP``/``TMP`` name it, so temporary files are written for
real and dropped with the root.

Covered (the functions are replaced process-wide, in every loaded module that bound them by
name, ``from os import remove`` included; any thread of the program goes through the layer):
``open`` (``builtins``, ``io``, ``_io``; ``bz2``/``tarfile``/``tokenize``'s aliases of it, and
numpy's ``_datasource`` table for ``loadtxt``/``savetxt``), ``os.open`` (its flags; ``O_TMPFILE``
in the temporary folder), ``os.stat``/``lstat``/``access``/``readlink``/``statvfs``,
``os.listdir``/``scandir`` (entries like ``os.DirEntry``), ``os.remove``/``unlink``/``rename``/
``replace``/``mkdir``/``rmdir``/``truncate``/``chmod``/``chown``/``lchown``/``utime``/``symlink``/
``link``/``mkfifo``/``mknod``, the ``*xattr`` functions, ``os.chdir``/``getcwd``/``getcwdb`` (a
folder only the layer has can be the working folder) and ``shutil.rmtree``.  What calls these
through the ``os`` module follows: ``os.path`` (``exists``, ``isfile``, ``getsize``,
``realpath``...), ``os.makedirs``/``removedirs``/``walk``, ``glob``, ``pathlib`` (3.11 calls
``os.*`` and ``io.open`` when called), ``shutil``'s copies and ``move``, ``tempfile``, ``numpy``
(``save``, ``savez``, ``load``, ``memmap``), ``pickle``/``json``/``csv`` through file objects,
``zipfile``, ``gzip``, and ``logging.FileHandler`` created inside the block.  A file the program
opens has its ``name`` as the program gave it.

Not covered, and why:
- files written by C, C++ or Rust code that opens paths itself: torch's C++ writer for
  ``torch.save(path)`` (graphmem skips ``torch.save``), h5py (HDF5's C library), sqlite3,
  safetensors' Rust writer (``save_file``; graphmem skips it); and subprocesses (their own
  processes, though they inherit ``TMPDIR``);
- ``io.FileIO(path)`` constructed directly (a class, not a function: replacing it would change
  ``isinstance`` checks);
- files and handlers opened before the block (a ``logging.FileHandler`` made before it keeps the
  original ``open``; an open file object writes where it was opened), and functions captured
  before it under another name (``my_open = open`` at import);
- imports: importlib reads through the ``posix`` module, which the layer leaves alone (fast
  imports), so a module the program writes is not importable from the layer (inside the block
  ``sys.dont_write_bytecode`` is set, so importlib writes no ``__pycache__`` beside the
  program's modules either);
- reads by C, C++ or Rust code of a path the program wrote (safetensors' ``safe_open``, a
  C++ loader) read the real file, not the program's copy;
- a hard link to a file the program wrote is a copy (writes through one name are not seen
  through the other); a metadata change to a real file (chmod, utime) copies its bytes in;
  ``..`` after a symlink is taken lexically, as ``os.path.abspath`` does; ``os.fwalk`` works
  through its ``dir_fd``s, slowly;
- after ``detach`` in a forked child, file objects opened before the fork still write to the
  parent's layer files.

Calls through a replacement kept past the block (a handler made inside it) still go through
the layer while the ``Scratch`` lives: nothing the program set up writes a user's file later.
"""

from __future__ import annotations

import contextlib
import io
import os
import posix
import shutil
import stat
import sys
import tempfile
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

from graphmem.patching import environment, patched, replaced_everywhere
from graphmem.records import FileChange
from graphmem.trace.program import scratch_changes as changes
from graphmem.trace.program.scratch_calls import Reads
from graphmem.trace.program.scratch_layer import Layer
from graphmem.trace.program.scratch_writes import Writes

__all__ = ["Change", "Scratch", "layered"]

_TEMPORARY = ("TMPDIR", "TEMP", "TMP")
_NO_BYTES = frozenset({"deleted", "directory deleted", "directory created", "symlink created"})
# names other modules bind ``open`` under (bz2, lzma, tokenize: _builtin_open; tarfile: bltn_open)
_OPEN_ALIASES = ("_builtin_open", "bltn_open")


Change = FileChange  # one thing the program did to the file system (in the layer only)


class Scratch:
    """The layer: copies of what the program wrote, and what it deleted, under a private root."""

    def __init__(self, root: str, through: tuple[str, ...] = ()) -> None:
        """Args:
        root: an empty private folder for the layer (made if missing); deleting it after the
            run drops everything the program wrote.
        through: folders (or files) the program writes for real, as the user asked
            (``graphmem run --write-through``): outside the layer.
        """
        self.layer = Layer(root, through)
        self.installed = 0  # open ``layered`` blocks
        _forked_children_unlock(self)

    @property
    def root(self) -> str:
        """The layer's folder (symlinks resolved)."""
        return self.layer.root

    @property
    def tmp(self) -> str:
        """The program's temporary folder, ``<root>/tmp``, written for real."""
        return self.layer.tmp

    def detach(self, root: str) -> None:
        """In a process forked from the one running the program (a forked try): copy the
        layer's files to the new folder ``root`` and continue there, so the parent's layer is
        untouched.  The old root is no longer outside the layer: the child reads it as real
        files and writes its own copies."""
        layer = self.layer
        layer.lock = threading.RLock()  # the parent's may have been held by another thread
        with layer.lock:
            layer.settle(root)
            layer.tree.nodes.update(changes.copies(layer))
            layer.tree.forget_links()
            if layer.cwd is not None:
                changes.chdir(layer, layer.cwd[1], layer.cwd[1])
        if self.installed:
            tempfile.tempdir = layer.tmp
            os.environ.update(dict.fromkeys(_TEMPORARY, layer.tmp))

    def changes(self) -> tuple[Change, ...]:
        """What the program did to the file system, in the order it first did each thing
        (each path and action once), with the sizes of the files as it left them."""
        with self.layer.lock:
            logged = list(self.layer.log)
        return tuple(Change(path, action, self._size(to or path, action), to) for path, action, to in logged)

    def _size(self, path: str, action: str) -> int:
        if action in _NO_BYTES:
            return 0
        found = self.layer.found(self.layer.locate(path, True))
        return found.st_size if found is not None and stat.S_ISREG(found.st_mode) else 0


# the os functions replaced (by Reads, then Writes, methods of the same names)
_REPLACED = (
    *("stat", "lstat", "access", "readlink", "statvfs", "getxattr", "listxattr", "listdir", "scandir"),
    *("chdir", "getcwd", "getcwdb", "remove", "unlink", "rename", "replace", "mkdir", "rmdir", "truncate"),
    *("chmod", "chown", "lchown", "utime", "symlink", "link", "mkfifo", "mknod", "setxattr", "removexattr"),
)
# the originals, taken at import (a layer installed later never takes another's replacements)
_OPEN: Callable[..., Any] = io.open
_ORIGINALS = {name: getattr(os, name) for name in _REPLACED if hasattr(os, name)}
_ORIGINALS |= {"open": _OPEN, "os_open": os.open, "rmtree": shutil.rmtree}


def _replacements(layer: Layer) -> dict[Any, Any]:
    """{original function: the layer's replacement} for every function the layer covers that
    this platform has."""
    reads, writes = Reads(layer), Writes(layer)
    return {original: getattr(reads, name, None) or getattr(writes, name) for name, original in _ORIGINALS.items()}


@contextlib.contextmanager
def layered(scratch: Scratch) -> Iterator[None]:
    """Inside, Python's file calls go through ``scratch``'s layer and the temporary folder is
    ``scratch.tmp``; on exit (an exception too) every replaced name holds its original again.
    One layer at a time: blocks are not nested."""
    layer = scratch.layer
    table = _replacements(layer)
    names = tuple(sorted({function.__name__ for function in table} | set(_OPEN_ALIASES)))
    tmp = layer.tmp
    with contextlib.ExitStack() as stack:
        stack.enter_context(replaced_everywhere(table, names))
        stack.enter_context(patched(*_posix_kept(table, names)))
        stack.enter_context(_numpy_openers(table[_OPEN]))
        # importlib writes bytecode through posix, beside the program's own modules: not inside
        stack.enter_context(patched((tempfile, "tempdir", tmp), (sys, "dont_write_bytecode", True)))
        stack.enter_context(environment(dict.fromkeys(_TEMPORARY, tmp)))
        scratch.installed += 1
        stack.callback(_uninstall, scratch)
        yield


def _uninstall(scratch: Scratch) -> None:
    scratch.installed -= 1


def _posix_kept(table: dict[Any, Any], names: tuple[str, ...]) -> list[tuple[Any, str, Any]]:
    """The ``posix`` module's functions as they were: importlib (and the layer itself) call them."""
    originals = {replacement: original for original, replacement in table.items()}
    kept = []
    for name in names:
        value = getattr(posix, name, None)
        if value is not None and value in originals:
            kept.append((posix, name, originals[value]))
    return kept


@contextlib.contextmanager
def _numpy_openers(replacement: Callable[..., Any]) -> Iterator[None]:
    """numpy keeps ``open`` in a table (``_datasource._file_openers``, for ``loadtxt``,
    ``savetxt``, ``genfromtxt``): inside, the table holds the replacement; after, the original
    again, numpy imported inside the block too."""
    openers = _numpy_table()
    if openers is not None and openers.get(None) is _OPEN:
        openers[None] = replacement
    try:
        yield
    finally:
        openers = _numpy_table()
        if openers is not None and openers.get(None) == replacement:
            openers[None] = _OPEN


def _numpy_table() -> dict[Any, Any] | None:
    module = sys.modules.get("numpy.lib._datasource")
    table = getattr(getattr(module, "_file_openers", None), "_file_openers", None)
    return table if isinstance(table, dict) else None


_LIVE: weakref.WeakSet[Scratch] = weakref.WeakSet()
_AT_FORK: list[bool] = []


def _forked_children_unlock(scratch: Scratch) -> None:
    """In a forked child, each live layer gets a new lock (a thread of the parent may have
    held the old one at the fork, and no thread of the child will release it)."""
    _LIVE.add(scratch)
    if not _AT_FORK and hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=_new_locks)
        _AT_FORK.append(True)


def _new_locks() -> None:
    for scratch in list(_LIVE):
        scratch.layer.lock = threading.RLock()
