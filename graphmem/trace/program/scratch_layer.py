"""The scratch layer's operations (``scratch``): each file-system call of the program, done on
the copy-on-write tree and the layer's own folder, never on a real file.

Input: the program's path arguments (already turned into text) and what each call asks.
Output: real paths to hand the OS (a layer file, or a real file to read), stat results,
listings; errors as the OS gives them, naming the program's path.  Knows nothing of which
Python functions call it: ``scratch_calls`` wraps these as ``os``, ``io`` and ``shutil``'s.

The layer's folder (``root``) holds ``files/`` (the program's files, folders and symlinks, one
numbered entry each) and ``tmp/`` (the program's temporary folder, written for real).  Paths
under ``root``, ``/dev``, ``/proc`` and ``/sys`` are outside the layer: the OS has them.
"""

from __future__ import annotations

import errno
import itertools
import os
import posix
import stat
import sys
import threading
from collections.abc import Callable
from typing import Any

from graphmem.trace.program.scratch_tree import Alias, Copy, Folder, Gone, Link, Node, Spot, Tree, joined

__all__ = ["Layer", "again", "original", "copy_file", "drop_store", "failure", "ignored", "probe"]

# the originals, taken from posix (which the layer leaves alone) and at import from io
_stat = posix.stat
_fstat = posix.fstat
_access = posix.access
_open = posix.open
_close = posix.close
_read = posix.read
_write = posix.write
_mkdir = posix.mkdir
_rmdir = posix.rmdir
_unlink = posix.unlink
_rename = posix.rename
_symlink = posix.symlink
_readlink = posix.readlink
_chmod = posix.chmod
_utime = posix.utime
_getcwd = posix.getcwd
_chdir = posix.chdir

_OUTSIDE = ("/dev/", "/proc/", "/sys/")
_CHUNK = 1 << 20


def original(name: str) -> Callable[..., Any]:
    """The ``posix`` module's function ``name``; where this platform has none, one raising
    NotImplementedError (the layer then replaces nothing by that name)."""

    def missing(*_: Any, **__: Any) -> Any:
        raise NotImplementedError(f"os.{name} is not available on this platform")

    function: Callable[..., Any] = getattr(posix, name, missing)
    return function


def failure(code: int, filename: object, text: str | None = None) -> OSError:
    """The OSError the OS raises for ``code`` (its subclass: FileNotFoundError for ENOENT...)."""
    return OSError(code, text or os.strerror(code), filename)


def again(error: OSError, filename: object) -> OSError:
    """``error`` naming the program's path rather than the real one the OS was given."""
    return OSError(error.errno, error.strerror, filename)


def probe(path: str) -> os.stat_result | None:
    try:
        return _stat(path, follow_symlinks=False)
    except (OSError, ValueError):
        return None


def copy_file(source: str, target: str) -> None:
    """The bytes and mode bits of ``source`` into a new ``target``, with the originals only."""
    mode = stat.S_IMODE(_stat(source).st_mode)
    reading = _open(source, os.O_RDONLY | os.O_CLOEXEC)
    try:
        writing = _open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            while chunk := _read(reading, _CHUNK):
                while chunk:
                    chunk = chunk[_write(writing, chunk) :]
        finally:
            _close(writing)
    finally:
        _close(reading)
    _chmod(target, mode)


class Layer:
    """The program's changes (a ``Tree``), the layer's folder holding their bytes, the log of
    what it did; one lock around all of it."""

    def __init__(self, root: str, through: tuple[str, ...] = ()) -> None:
        self.through = tuple(joined(Tree().locate(_absolute_real(path), True).path, "") for path in through)
        self.lock = threading.RLock()
        self.tree = Tree()
        self.log: dict[tuple[str, str, str | None], None] = {}  # (path, action, to), in order
        self.created: set[str] = set()  # resolved paths of files the program made itself
        self.folders: dict[int, tuple[str, int, int]] = {}  # folder fd -> (path, st_dev, st_ino)
        self.cwd: tuple[str, str] | None = None  # (real working folder, the program's name for it)
        self._count = itertools.count()
        self.settle(root)

    def settle(self, root: str) -> None:
        """Use ``root`` (made if missing) for the layer's files from now on."""
        path = _absolute_real(root)
        for folder in (path, joined(path, "files"), joined(path, "tmp")):
            _make_folders(folder)
        self.root = Tree().locate(path, True).path
        self.files = joined(self.root, "files")
        self.tmp = joined(self.root, "tmp")
        self.outside = (*_OUTSIDE, joined(self.root, ""), *self.through)

    # -- naming ---------------------------------------------------------------------------

    def absolute(self, text: str, dir_fd: int | None) -> str:
        """The absolute, normalised path the program means by ``text``."""
        if not text:
            raise failure(errno.ENOENT, text)
        if text[0] != "/":
            base = self.getcwd() if dir_fd is None else self.fd_folder(dir_fd)
            text = joined(base, text)
        text = os.path.normpath(text)
        return "/" + text.lstrip("/") if text.startswith("//") else text

    def is_outside(self, path: str) -> bool:
        return (path + "/").startswith(self.outside)

    def plain_arg(self, arg: Any, path: str, dir_fd: int | None) -> Any:
        """What to hand the OS for a path it sees as the program does: the program's own
        argument, unless a working folder of the layer's or ``dir_fd`` would change its meaning."""
        return arg if self.cwd is None and dir_fd is None else path

    def getcwd(self) -> str:
        real = _getcwd()
        cwd = self.cwd
        return cwd[1] if cwd is not None and cwd[0] == real else real

    def fd_folder(self, fd: int) -> str:
        """The folder an open ``dir_fd`` is on, as the program named it."""
        known = self.folders.get(fd)
        if known is not None:
            with ignored():
                found = _fstat(fd)
                if (found.st_dev, found.st_ino) == known[1:]:
                    return known[0]
        if sys.platform.startswith("linux"):
            with ignored():
                return _readlink(f"/proc/self/fd/{fd}")
        if sys.platform == "darwin":
            import fcntl

            with ignored():
                name = fcntl.fcntl(fd, fcntl.F_GETPATH, bytes(1024))  # type: ignore[attr-defined]
                return os.fsdecode(name.rstrip(b"\0"))
        raise failure(errno.EBADF, fd, f"graphmem's scratch layer cannot tell which folder dir_fd {fd} is open on")

    def remember_folder(self, fd: int, path: str) -> None:
        found = _fstat(fd)
        if stat.S_ISDIR(found.st_mode):
            with self.lock:
                self.folders[fd] = (path, found.st_dev, found.st_ino)

    # -- reading ---------------------------------------------------------------------------

    def locate(self, path: str, follow: bool) -> Spot:
        with self.lock:
            return self.tree.locate(path, follow)

    def source(self, spot: Spot, arg: object) -> str:
        """The real path holding what the program sees at ``spot`` (its bytes or metadata)."""
        if spot.parent.error:
            raise failure(spot.parent.error, arg)
        node = spot.node
        if node is None and spot.lower is not None:
            return spot.lower
        if isinstance(node, Copy | Link):
            return node.store
        if isinstance(node, Alias):
            return node.lower
        if isinstance(node, Folder) and (node.store or node.lower):
            return node.store or node.lower  # type: ignore[return-value]
        raise failure(errno.ENOENT, arg)

    def found(self, spot: Spot) -> os.stat_result | None:
        """What is at ``spot`` for the program (its own lstat), None where nothing is."""
        if spot.parent.error or isinstance(spot.node, Gone):
            return None
        try:
            return probe(self.source(spot, None))
        except OSError:
            return None

    def stat(self, arg: Any, path: str, dir_fd: int | None, follow: bool) -> os.stat_result:
        spot = self.locate(path, follow)
        if spot.plain or self.is_outside(spot.path):
            return _stat(self.plain_arg(arg, path, dir_fd) if spot.plain else spot.path, follow_symlinks=follow)
        try:
            return _stat(self.source(spot, arg), follow_symlinks=False)
        except OSError as error:
            raise again(error, arg) from None

    def listing(self, arg: object, path: str) -> tuple[str, list[str]]:
        """The folder's resolved name and the names in it, as the program sees them."""
        with self.lock:
            spot = self.tree.locate(path, True)
            node = spot.node
            if spot.parent.error or isinstance(node, Gone) or (node is None and spot.lower is None):
                raise failure(spot.parent.error or errno.ENOENT, arg)
            if isinstance(node, Copy | Alias):
                raise failure(errno.ENOTDIR, arg)
            if isinstance(node, Folder):
                try:
                    return spot.path, self.tree.names(spot.path, node.lower)
                except OSError:  # its real folder went away under the run
                    return spot.path, self.tree.names(spot.path, None)
            try:
                return spot.path, self.tree.names(spot.path, spot.lower)
            except OSError as error:
                raise again(error, arg) from None

    def readlink(self, arg: object, path: str) -> str:
        spot = self.locate(path, False)
        if isinstance(spot.node, Link):
            return spot.node.target
        if spot.node is None and spot.lower is not None:
            try:
                return _readlink(spot.lower)
            except OSError as error:
                raise again(error, arg) from None
        raise failure(errno.EINVAL if self.found(spot) is not None else errno.ENOENT, arg)

    # -- writing files ---------------------------------------------------------------------

    def new_store(self) -> str:
        return joined(self.files, str(next(self._count)))

    def writable(
        self, arg: object, path: str, *, create: bool, trunc: bool, excl: bool, action: str, mode: int = 0o666
    ) -> tuple[str, bool]:
        """The real path to open for a write to ``path``: the layer's copy of it (made, with
        the real bytes copied in unless ``trunc``), or ``path`` itself outside the layer; and
        whether that is a new, empty layer file (opened without O_TRUNC: ext4 flushes a file
        truncated to zero when it is closed, two milliseconds a save)."""
        if self.is_outside(path):
            return path, False
        with self.lock:
            spot = self.tree.locate(path, not excl)
            if self.is_outside(spot.path):
                return spot.path, False
            found = self.found(spot)
            if found is None and (spot.parent.error or not create):
                raise failure(spot.parent.error or errno.ENOENT, arg)
            if found is not None and excl:
                raise failure(errno.EEXIST, arg)
            if found is not None and stat.S_ISDIR(found.st_mode):
                raise failure(errno.EISDIR, arg)
            if found is None:
                self.need_folder(spot, arg)
                return self.own_file(spot, path, None, "created", mode), True
            fresh = trunc and not isinstance(spot.node, Copy)
            action = "overwritten" if trunc else action
            return self.own_file(spot, path, None if trunc else self.source(spot, arg), action), fresh

    def own_file(self, spot: Spot, path: str, source: str | None, action: str, mode: int = 0o666) -> str:
        """The layer's file for ``spot``: its ``Copy`` if it has one, else a new one holding
        ``source``'s bytes (empty without one).  Lock held."""
        if isinstance(spot.node, Copy):
            self.note(path, spot.path, action)
            return spot.node.store
        if source is not None and not _access(source, os.W_OK):
            raise failure(errno.EACCES, path)
        store = self.new_store()
        if source is None:
            _close(_open(store, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, mode))
        else:
            copy_file(source, store)
        self.tree.set(spot.path, Copy(store))
        self.note(path, spot.path, action)
        return store

    def need_folder(self, spot: Spot, arg: object) -> None:
        """Raise as the OS would where ``spot``'s folder is missing, not a folder, or not
        writable."""
        parent = spot.parent
        if parent.error:
            raise failure(parent.error, arg)
        if parent.known or parent.lower is None:
            return
        try:
            found = _stat(parent.lower)
        except OSError as error:
            raise again(error, arg) from None
        if not stat.S_ISDIR(found.st_mode):
            raise failure(errno.ENOTDIR, arg)
        if not _access(parent.lower, os.W_OK | os.X_OK):
            raise failure(errno.EACCES, arg)

    def note(self, path: str, resolved: str, action: str, to: str | None = None) -> None:
        """Log an action for ``changes`` (lock held); later writes to a file the program made
        are part of its making."""
        if action == "created":
            self.created.add(resolved)
        elif action in ("overwritten", "appended", "modified") and resolved in self.created:
            return
        elif action in ("deleted", "renamed"):
            self.created.discard(resolved)
        self.log.setdefault((path, action, to), None)

    # -- changing the tree -----------------------------------------------------------------

    def forget(self, spot: Spot) -> None:
        """Nothing at ``spot`` for the program any more (lock held)."""
        self.tree.unset(spot.path)
        if spot.lower is not None and probe(spot.lower) is not None:
            self.tree.set(spot.path, Gone())

    def drop(self, spot: Spot) -> None:
        """``spot`` and all below it out of the tree, their layer files deleted (lock held)."""
        for key in self.tree.below(spot.path):
            drop_store(self.tree.unset(key))
        drop_store(spot.node)
        self.forget(spot)


def drop_store(node: Node | None) -> None:
    """Delete the layer's file of a node leaving the tree (an open file keeps its bytes)."""
    with ignored():
        if isinstance(node, Copy | Link):
            _unlink(node.store)
        elif isinstance(node, Folder) and node.store is not None:
            _rmdir(node.store)


def _absolute_real(root: str) -> str:
    path = os.fsdecode(os.fspath(root))
    return os.path.normpath(path if path.startswith("/") else joined(_getcwd(), path))


def _make_folders(path: str) -> None:
    """``os.makedirs(path, exist_ok=True)`` with the originals."""
    if probe(path) is not None:
        return
    head = os.path.dirname(path)
    if head != path:
        _make_folders(head)
    with ignored(FileExistsError):
        _mkdir(path, 0o700)


class ignored:
    """``contextlib.suppress`` for OSError (and ValueError), without importing contextlib's
    machinery into hot paths."""

    def __init__(self, *kinds: type[BaseException]) -> None:
        self.kinds = kinds or (OSError, ValueError)

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> bool:
        return kind is not None and issubclass(kind, self.kinds)
