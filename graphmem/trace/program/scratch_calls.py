"""Python's file-reading calls over the scratch layer (``scratch``): ``open`` (``io.open``,
``builtins.open``), ``os.open``, ``os.stat``/``lstat``/``access``/``readlink``/``statvfs``,
the extended attributes' readers, ``os.listdir``/``os.scandir``, ``os.chdir``/``os.getcwd``.

Input: a ``Layer``.  Output: ``Reads``, whose bound methods replace those functions (a bound
method, like a builtin, is not bound again when a library keeps it as a class attribute, as
``logging.FileHandler`` keeps ``open``).  An int file descriptor is already open: it passes
through.  ``open`` and ``os.open`` for writing go to the layer's copy of the file.
"""

from __future__ import annotations

import io
import os
import posix
from collections.abc import Callable
from typing import Any, TypeAlias

from graphmem.trace.program import scratch_changes as changes
from graphmem.trace.program.scratch_entries import Entry, Listing
from graphmem.trace.program.scratch_layer import Layer, again, original

__all__ = ["PathArg", "Reads", "call", "text_of"]

PathArg: TypeAlias = "str | bytes | os.PathLike[str] | os.PathLike[bytes]"

_io_open = io.open
_os_open = posix.open
_stat = posix.stat
_access = posix.access
_readlink = posix.readlink
_listdir = posix.listdir
_scandir = posix.scandir
_getcwd = posix.getcwd
_chdir = posix.chdir
_statvfs = posix.statvfs
# Linux only: the extended attributes (None elsewhere, where os has none to replace)
_getxattr = original("getxattr")
_listxattr = original("listxattr")

_WRITES = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
_TMPFILE = getattr(os, "O_TMPFILE", 0)


def text_of(path: PathArg) -> str:
    """The path as text (bytes decoded as the OS would)."""
    named = os.fspath(path)
    return named if isinstance(named, str) else os.fsdecode(named)


def call(function: Callable[..., Any], real: object, arg: object, *args: Any, **kwargs: Any) -> Any:
    """``function(real, ...)``; an OSError names the program's ``arg`` where ``real`` is not it."""
    try:
        return function(real, *args, **kwargs)
    except OSError as error:
        if real is arg:
            raise
        raise again(error, arg) from None


def _named(handle: Any, name: str | bytes) -> Any:
    """``handle`` with its ``name`` the program's path, not the layer's file's."""
    raw = getattr(getattr(handle, "buffer", handle), "raw", getattr(handle, "buffer", handle))
    if isinstance(raw, io.FileIO):
        try:
            raw.name = name
        except AttributeError:
            pass
    return handle


class Reads:
    """The reading calls, each through ``layer``."""

    def __init__(self, layer: Layer) -> None:
        self.layer = layer

    def real(self, arg: Any, dir_fd: int | None, follow: bool) -> tuple[Any, int | None, bool]:
        """What to hand the original function for the program's ``arg``: the argument itself
        (with its ``dir_fd``) where the OS sees what the program sees, else the real path and
        whether the OS is still to follow a symlink at its end."""
        layer, tree, follow = self.layer, self.layer.tree, bool(follow)
        simple = layer.cwd is None and dir_fd is None
        if simple and (not tree.nodes or (arg.__class__ is str and arg in tree.passing[follow])):
            return arg, None, follow
        generation = tree.generation
        path = layer.absolute(text_of(arg), dir_fd)
        spot = None if layer.is_outside(path) else layer.locate(path, follow)
        if spot is None or spot.plain:
            if not simple:
                return path, None, follow
            if arg.__class__ is str:
                with layer.lock:
                    tree.pass_through(arg, follow, generation)
            return arg, None, follow
        if layer.is_outside(spot.path):
            return spot.path, None, follow
        return layer.source(spot, arg), None, False

    def open(
        self,
        file: Any,
        mode: str = "r",
        buffering: int = -1,
        encoding: str | None = None,
        errors: str | None = None,
        newline: str | None = None,
        closefd: bool = True,
        opener: Callable[[str, int], int] | None = None,
    ) -> Any:
        """``open``: a read opens what the program sees; a write opens the layer's copy."""
        rest = (buffering, encoding, errors, newline, closefd, opener)
        if isinstance(file, int):
            return _io_open(file, mode, *rest)
        if not any(letter in mode for letter in "wxa+"):
            real = self.real(file, None, True)[0]
        else:
            path = self.layer.absolute(text_of(file), None)
            real, fresh = self.layer.writable(
                file, path, create="r" not in mode, trunc="w" in mode, excl="x" in mode, action=_action(mode)
            )
            mode = mode if real == path else mode.replace("x", "w")
            rest = (*rest[:-1], _untruncated(opener)) if fresh else rest
        handle = call(_io_open, real, file, mode, *rest)
        return handle if real is file else _named(handle, os.fspath(file))

    def os_open(self, path: PathArg, flags: int, mode: int = 0o777, *, dir_fd: int | None = None) -> int:
        """``os.open``: as ``open``; a folder opened through the layer is remembered for
        ``dir_fd``."""
        layer = self.layer
        if not flags & _WRITES:
            real, fd, follow = self.real(path, dir_fd, not flags & os.O_NOFOLLOW)
            opened: int = call(_os_open, real, path, flags, mode, dir_fd=fd)
            if layer.tree.nodes:  # a folder: listed through the layer by fd (glob's, os.fwalk's scandir(fd))
                layer.remember_folder(opened, layer.absolute(text_of(path), dir_fd))
            return opened
        target = layer.absolute(text_of(path), dir_fd)
        if _TMPFILE and flags & _TMPFILE == _TMPFILE:
            return _os_open(layer.tmp, flags, mode)
        create, excl = bool(flags & os.O_CREAT), bool(flags & os.O_CREAT and flags & os.O_EXCL)
        real, fresh = layer.writable(
            path,
            target,
            create=create,
            trunc=bool(flags & os.O_TRUNC),
            excl=excl,
            action=_flag_action(flags),
            mode=mode,
        )
        flags = flags if real == target else flags & ~os.O_EXCL
        flags = flags & ~os.O_TRUNC if fresh else flags
        result: int = call(_os_open, real, path, flags, mode)
        return result

    def stat(self, path: Any, *, dir_fd: int | None = None, follow_symlinks: bool = True) -> os.stat_result:
        if isinstance(path, int):
            return _stat(path, dir_fd=dir_fd, follow_symlinks=follow_symlinks)
        real, fd, follow = self.real(path, dir_fd, follow_symlinks)
        result: os.stat_result = call(_stat, real, path, dir_fd=fd, follow_symlinks=follow)
        return result

    def lstat(self, path: Any, *, dir_fd: int | None = None) -> os.stat_result:
        return self.stat(path, dir_fd=dir_fd, follow_symlinks=False)

    def access(
        self,
        path: Any,
        mode: int,
        *,
        dir_fd: int | None = None,
        effective_ids: bool = False,
        follow_symlinks: bool = True,
    ) -> bool:
        if isinstance(path, int):
            return _access(path, mode, dir_fd=dir_fd, effective_ids=effective_ids, follow_symlinks=follow_symlinks)
        try:
            real, fd, follow = self.real(path, dir_fd, follow_symlinks)
        except OSError:
            return False
        return _access(real, mode, dir_fd=fd, effective_ids=effective_ids, follow_symlinks=follow)

    def readlink(self, path: Any, *, dir_fd: int | None = None) -> str | bytes:
        layer = self.layer
        if not layer.tree.nodes and layer.cwd is None:
            plain: str | bytes = _readlink(path, dir_fd=dir_fd)
            return plain
        target = layer.absolute(text_of(path), dir_fd)
        found: str = _readlink(target) if layer.is_outside(target) else layer.readlink(path, target)
        return os.fsencode(found) if isinstance(os.fspath(path), bytes) else found

    def statvfs(self, path: Any) -> os.statvfs_result:
        if isinstance(path, int):
            return _statvfs(path)
        result: os.statvfs_result = call(_statvfs, self.real(path, None, True)[0], path)
        return result

    def getxattr(self, path: Any, attribute: Any, *, follow_symlinks: bool = True) -> bytes:
        if isinstance(path, int):
            found: bytes = _getxattr(path, attribute, follow_symlinks=follow_symlinks)
            return found
        real, _, follow = self.real(path, None, follow_symlinks)
        result: bytes = call(_getxattr, real, path, attribute, follow_symlinks=follow)
        return result

    def listxattr(self, path: Any = None, *, follow_symlinks: bool = True) -> list[str]:
        if path is None or isinstance(path, int):
            names: list[str] = _listxattr(path, follow_symlinks=follow_symlinks)
            return names
        real, _, follow = self.real(path, None, follow_symlinks)
        result: list[str] = call(_listxattr, real, path, follow_symlinks=follow)
        return result

    def listdir(self, path: Any = None) -> list[str] | list[bytes]:
        path = "." if path is None else path
        folder = self.listed(path)
        if folder is None:
            return _listdir(path)
        names = self.layer.listing(path, folder)[1]
        return [os.fsencode(name) for name in names] if _is_bytes(path) else names

    def scandir(self, path: Any = None) -> Any:
        path = "." if path is None else path
        folder = self.listed(path)
        if folder is None:
            return _scandir(path)
        resolved, names = self.layer.listing(path, folder)
        stem = None if isinstance(path, int) else os.fspath(path)
        return Listing([Entry.of(self.layer, stem, resolved, name) for name in names])

    def listed(self, path: Any) -> str | None:
        """The program's path of the folder ``path`` where the layer is to list it; None where
        the OS lists it as the program sees it (a real folder with no change in it)."""
        layer = self.layer
        if isinstance(path, int):
            return self.known_folder(path)
        if not layer.tree.nodes and layer.cwd is None:
            return None
        target = layer.absolute(text_of(path), None)
        spot = layer.locate(target, True)
        plain = spot.plain and layer.cwd is None and spot.path not in layer.tree.children
        return None if plain else target

    def known_folder(self, fd: int) -> str | None:
        """The program's name for a folder fd opened through the layer (glob's and
        ``os.fwalk``'s ``scandir(fd)``)."""
        if fd not in self.layer.folders:
            return None
        try:
            return self.layer.fd_folder(fd)
        except OSError:
            return None

    def chdir(self, path: Any) -> None:
        if isinstance(path, int):
            _chdir(path)
            with self.layer.lock:
                self.layer.cwd = None
                self.layer.tree.changed()
            return
        changes.chdir(self.layer, path, self.layer.absolute(text_of(path), None))

    def getcwd(self) -> str:
        return self.layer.getcwd()

    def getcwdb(self) -> bytes:
        return os.fsencode(self.layer.getcwd())


def _untruncated(opener: Callable[[str, int], int] | None) -> Callable[[str, int], int]:
    """An ``opener`` for a new, empty layer file: as ``open``'s, without O_TRUNC."""

    def open_untruncated(path: str, flags: int) -> int:
        flags &= ~os.O_TRUNC
        return opener(path, flags) if opener is not None else _os_open(path, flags, 0o666)

    return open_untruncated


def _is_bytes(path: Any) -> bool:
    return not isinstance(path, int) and isinstance(os.fspath(path), bytes)


def _action(mode: str) -> str:
    return "appended" if "a" in mode else "modified"


def _flag_action(flags: int) -> str:
    return "appended" if flags & os.O_APPEND else "modified"
