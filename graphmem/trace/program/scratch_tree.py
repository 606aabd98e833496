"""The copy-on-write tree behind the scratch layer (``scratch``): what the program changed, by
path, and how a path it names resolves.

Input: absolute, normalised paths as the program names them.  Output: ``Spot``s (a path's
resolved name, the program's change there, the real path under that name) and merged folder
listings.  Knows nothing of Python's file APIs, of locks, errors or of where the layer keeps
its bytes: ``scratch_layer`` does that.

A path the program never changed, under folders it never changed, is the real one.  A change
is a node keyed by the resolved path: ``Gone`` (deleted), ``Copy`` (the program's bytes, in the
layer), ``Alias`` (a real file under a new name: renamed or hard-linked, its bytes read from
the real file until written), ``Folder`` (a folder the program made, or a real one renamed or
given new metadata) and ``Link`` (a symlink it made).  Below a ``Folder`` the entries of its
``lower`` real folder show through (none when ``lower`` is None: a new folder, or one deleted
and made again).  Symlinks in the folders of a path, real ones and the program's, are followed
here, so one file named two ways is one node.  ``..`` is taken lexically, as
``os.path.abspath`` takes it.
"""

from __future__ import annotations

import errno
import posix
import posixpath
import stat
from dataclasses import dataclass, replace
from typing import NamedTuple

__all__ = ["Alias", "Copy", "Folder", "Gone", "Link", "Node", "Spot", "Tree", "Where", "joined"]

# the posix module's own functions: the layer never patches them (importlib reads through them)
_lstat = posix.lstat
_readlink = posix.readlink
_listdir = posix.listdir

# Linux's MAXSYMLINKS (include/linux/namei.h): more hops than this and the OS answers ELOOP
_MAX_HOPS = 40
# caches are cleared whole when they grow past this many entries (a program listing a data set)
_CACHE_LIMIT = 100_000


@dataclass(frozen=True, slots=True)
class Gone:
    """A path the program deleted (or renamed away): nothing is there for it."""


@dataclass(frozen=True, slots=True)
class Copy:
    """A file whose bytes the program wrote: the layer's file ``store`` holds them."""

    store: str


@dataclass(frozen=True, slots=True)
class Alias:
    """A real file under another name (renamed, hard-linked): its bytes are read from ``lower``."""

    lower: str


@dataclass(frozen=True, slots=True)
class Folder:
    """A folder in the program's view: the entries of the real folder ``lower`` show through
    (none where it is None); ``store`` is the layer's folder holding its own metadata (None: the
    real folder's metadata is shown)."""

    lower: str | None
    store: str | None


@dataclass(frozen=True, slots=True)
class Link:
    """A symlink the program made, to ``target``; ``store`` is the layer's copy of it."""

    target: str
    store: str


Node = Gone | Copy | Alias | Folder | Link


@dataclass(frozen=True, slots=True)
class Where:
    """A folder as the program sees it, every symlink on the way followed."""

    path: str  # its resolved name
    lower: str | None  # the real folder whose entries show through it (None: none do)
    error: int  # 0, or the errno of reaching it (ENOENT, ENOTDIR, ELOOP)
    known: bool  # a folder of the layer's (or "/"): it exists without asking the real file system
    plain: bool  # no change of the program's on the way: the OS resolves it the same way


class Spot(NamedTuple):
    """A path as the program sees it.  (A named tuple, not a frozen dataclass: one is made for
    every call of the program's, and a named tuple is made in a third of the time.)"""

    path: str  # its resolved name (the key of its node)
    node: Node | None  # the program's change there; None where it made none
    lower: str | None  # the real path under this name, which shows through where node is None
    parent: Where  # its folder
    plain: bool  # the OS sees there exactly what the program sees: real files only


_TOP = Where("/", "/", 0, True, True)


def joined(folder: str, name: str) -> str:
    """``folder/name`` for an absolute folder (``/`` included)."""
    return folder + name if folder == "/" else folder + "/" + name


def _split(path: str) -> tuple[str, str]:
    head, _, name = path.rpartition("/")
    return head or "/", name


class Tree:
    """The program's changes by resolved path, with the index and caches that resolve paths
    quickly.  Not thread-safe: the layer holds its lock around every call."""

    def __init__(self) -> None:
        self.nodes: dict[str, Node] = {}
        self.children: dict[str, set[str]] = {}  # folder -> names with a node in it
        self._folders: dict[str, Where] = {}  # lexical folder path -> where it resolves
        self._links: dict[str, str | None] = {}  # real path -> its symlink's target, None: no link
        # the program's arguments (text) known to name what the OS sees, by ``follow``; with
        # ``generation``, bumped at each change, so that a stale answer is never added
        self.passing: tuple[set[str], set[str]] = (set(), set())
        self.generation = 0

    def locate(self, path: str, follow: bool, hops: int = 0) -> Spot:
        """Where ``path`` (absolute, normalised) is; with ``follow``, a symlink at its end is
        followed as well."""
        if path == "/":
            return Spot("/", self.nodes.get("/"), "/", _TOP, "/" not in self.nodes)
        head, name = _split(path)
        parent = self.folder(head)
        full = joined(parent.path, name)
        if parent.error:
            return Spot(full, None, None, parent, False)
        node = self.nodes.get(full)
        lower = joined(parent.lower, name) if parent.lower is not None else None
        target = None
        if follow and isinstance(node, Link):
            target = node.target
        elif follow and node is None and lower is not None:
            target = self.real_link(lower)
        if target is None:
            return Spot(full, node, lower, parent, parent.plain and node is None)
        if hops >= _MAX_HOPS:
            return Spot(full, None, None, replace(parent, error=errno.ELOOP), False)
        spot = self.locate(_normal(posixpath.join(parent.path, target)), True, hops + 1)
        return spot if node is None else spot._replace(plain=False)

    def folder(self, path: str) -> Where:
        """Where the folder named ``path`` (absolute, normalised) is, every symlink followed."""
        where = self._folders.get(path)
        if where is None:
            where = self._walk(path, 0)
            if len(self._folders) > _CACHE_LIMIT:
                self._folders.clear()
            self._folders[path] = where
        return where

    def _walk(self, path: str, hops: int) -> Where:
        """``folder`` without the cache: one component at a time from ``/``."""
        here, known, plain = "/", True, True
        lower: str | None = "/"
        parts = [part for part in path.split("/") if part]
        for index, name in enumerate(parts):
            there = joined(here, name)
            node = self.nodes.get(there)
            if node is None:
                if lower is None:
                    return Where(there, None, errno.ENOENT, False, False)
                real = joined(lower, name)
                target = self.real_link(real)
                if target is None:
                    here, lower, known = there, real, False
                    continue
            elif isinstance(node, Folder):
                here, lower, known, plain = there, node.lower, True, False
                continue
            elif isinstance(node, Link):
                target, plain = node.target, False
            else:
                return Where(there, None, errno.ENOENT if isinstance(node, Gone) else errno.ENOTDIR, False, False)
            if hops >= _MAX_HOPS:
                return Where(there, None, errno.ELOOP, False, False)
            rest = "/".join(parts[index + 1 :])
            where = self._walk(_normal(posixpath.join(here, target, rest)), hops + 1)
            return where if plain else replace(where, plain=False)
        return Where(here, lower, 0, known, plain)

    def real_link(self, real: str) -> str | None:
        """The target of the real symlink ``real``; None where it is no symlink (or missing).
        Real symlinks are taken to stay as they are for the length of a run (a path missing
        now that C code makes later is a file or a folder, not a symlink)."""
        try:
            return self._links[real]
        except KeyError:
            pass
        try:
            mode = _lstat(real).st_mode
        except (OSError, ValueError):
            mode = 0
        target = _readlink(real) if stat.S_ISLNK(mode) else None
        if len(self._links) > _CACHE_LIMIT:
            self._links.clear()
        self._links[real] = target
        return target

    def names(self, path: str, lower: str | None) -> list[str]:
        """The names in the folder ``path`` as the program sees it: the real ones of ``lower``
        (its listing's errors raised) less the ones it changed, then the ones it made."""
        real = _listdir(lower) if lower is not None else []
        mine = self.children.get(path, set())
        kept = [name for name in real if name not in mine]
        return kept + [name for name in sorted(mine) if not isinstance(self.nodes[joined(path, name)], Gone)]

    def changed(self) -> None:
        """Forget what was worked out from the nodes (or the working folder)."""
        self._folders.clear()
        self.passing[0].clear()
        self.passing[1].clear()
        self.generation += 1

    def pass_through(self, arg: str, follow: bool, generation: int) -> None:
        """Remember that the OS sees ``arg`` as the program does, worked out at ``generation``."""
        passing = self.passing[follow]
        if generation == self.generation:
            if len(passing) > _CACHE_LIMIT:
                passing.clear()
            passing.add(arg)

    def set(self, path: str, node: Node) -> None:
        self.nodes[path] = node
        head, name = _split(path)
        self.children.setdefault(head, set()).add(name)
        self.changed()

    def unset(self, path: str) -> Node | None:
        node = self.nodes.pop(path, None)
        if node is not None:
            head, name = _split(path)
            names = self.children.get(head)
            if names is not None:
                names.discard(name)
                if not names:
                    del self.children[head]
            self.changed()
        return node

    def below(self, path: str) -> list[str]:
        """The paths with a node under the folder ``path`` (found through the folders holding
        nodes, fewer than the nodes: deleting one of many files the program made stays cheap)."""
        prefix = joined(path, "")
        folders = [folder for folder in self.children if folder == path or folder.startswith(prefix)]
        return [joined(folder, name) for folder in folders for name in self.children[folder]]

    def move_below(self, old: str, new: str) -> None:
        """The nodes under folder ``old`` move under folder ``new``."""
        for key in self.below(old):
            node = self.unset(key)
            if node is not None:
                self.set(new + key[len(old) :], node)

    def forget_links(self) -> None:
        """Drop what is known of real symlinks (a forked try may see another real tree)."""
        self._links.clear()
        self.changed()


def _normal(path: str) -> str:
    """``path`` normalised, ``//`` at its start (which POSIX leaves alone) made ``/``."""
    path = posixpath.normpath(path)
    return "/" + path.lstrip("/") if path.startswith("//") else path
