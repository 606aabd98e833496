"""A folder's entries as ``os.scandir`` gives them, for a folder the scratch layer changed
(``scratch``).

Input: the layer, the program's argument to ``scandir`` and the names the layer lists there.
Output: ``Listing``, an iterator and context manager of ``Entry`` objects with ``os.DirEntry``'s
interface (``name``, ``path``, ``is_dir``, ``is_file``, ``is_symlink``, ``stat``, ``inode``,
``__fspath__``), each answering through the layer.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from typing import TYPE_CHECKING

from graphmem.trace.program.scratch_tree import joined

if TYPE_CHECKING:
    from graphmem.trace.program.scratch_layer import Layer

__all__ = ["Entry", "Listing"]


class Entry:
    """One name in a folder, as ``os.DirEntry``: its stat results are cached once asked."""

    __slots__ = ("_full", "_layer", "_stats", "name", "path")

    def __init__(self, layer: Layer, name: str | bytes, path: str | bytes, full: str) -> None:
        self._layer = layer
        self.name = name
        self.path = path  # the scandir argument joined with the name, as os.DirEntry's
        self._full = full  # the program's resolved path
        self._stats: dict[bool, os.stat_result] = {}

    @classmethod
    def of(cls, layer: Layer, stem: str | bytes | None, folder: str, name: str) -> Entry:
        """The entry ``name`` of ``folder`` (resolved), listed through the argument ``stem``
        (None: a file descriptor, whose entries' paths are their names)."""
        full = joined(folder, name)
        if isinstance(stem, bytes):
            named = os.fsencode(name)
            return cls(layer, named, os.path.join(stem, named), full)
        return cls(layer, name, name if stem is None else os.path.join(stem, name), full)

    def __fspath__(self) -> str | bytes:
        return self.path

    def __repr__(self) -> str:
        return f"<DirEntry {self.name!r}>"

    def stat(self, *, follow_symlinks: bool = True) -> os.stat_result:
        found = self._stats.get(follow_symlinks)
        if found is None:
            found = self._layer.stat(self._full, self._full, None, follow_symlinks)
            self._stats[follow_symlinks] = found
        return found

    def _mode(self, follow: bool) -> int:
        try:
            return self.stat(follow_symlinks=follow).st_mode
        except OSError:
            return 0

    def is_dir(self, *, follow_symlinks: bool = True) -> bool:
        return stat.S_ISDIR(self._mode(follow_symlinks))

    def is_file(self, *, follow_symlinks: bool = True) -> bool:
        return stat.S_ISREG(self._mode(follow_symlinks))

    def is_symlink(self) -> bool:
        return stat.S_ISLNK(self._mode(False))

    def is_junction(self) -> bool:
        return False

    def inode(self) -> int:
        return self.stat(follow_symlinks=False).st_ino


class Listing:
    """``os.scandir``'s iterator: iterate it, or use it in ``with``."""

    def __init__(self, entries: list[Entry]) -> None:
        self._entries: Iterator[Entry] = iter(entries)

    def __iter__(self) -> Listing:
        return self

    def __next__(self) -> Entry:
        return next(self._entries)

    def __enter__(self) -> Listing:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def close(self) -> None:
        self._entries = iter(())
