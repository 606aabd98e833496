"""Python's file-changing calls over the scratch layer (``scratch``): ``os.remove``/``unlink``,
``rename``/``replace``, ``mkdir``/``rmdir``, ``truncate``, ``chmod``/``chown``/``lchown``/
``utime``, ``symlink``/``link``, ``mkfifo``/``mknod``, the extended attributes' writers, and
``shutil.rmtree``.

Input: a ``Layer``.  Output: ``Writes``, whose bound methods replace those functions.  An int
file descriptor is already open: it passes through (it is a layer's file or a file the program
opened outside the layer).  ``os.makedirs``/``removedirs``/``walk`` and ``shutil``'s copies
and ``move`` call these through ``os``, so they need no replacement of their own.
"""

from __future__ import annotations

import errno
import os
import posix
import shutil
import stat
import sys
from collections.abc import Callable
from typing import Any

from graphmem.trace.program import scratch_changes as changes
from graphmem.trace.program.scratch_calls import PathArg, text_of
from graphmem.trace.program.scratch_layer import Layer, failure, original

__all__ = ["Writes"]

_truncate = posix.truncate
_chmod = posix.chmod
_chown = posix.chown
_utime = posix.utime
_mkfifo = posix.mkfifo
_mknod = posix.mknod
_lstat = posix.lstat
_rmtree: Callable[..., Any] = shutil.rmtree
_setxattr = original("setxattr")
_removexattr = original("removexattr")

Failed = Callable[[Callable[..., Any], Any, OSError], None]


class Writes:
    """The changing calls, each through ``layer``."""

    def __init__(self, layer: Layer) -> None:
        self.layer = layer

    def where(self, path: PathArg, dir_fd: int | None = None) -> str:
        return self.layer.absolute(text_of(path), dir_fd)

    def remove(self, path: PathArg, *, dir_fd: int | None = None) -> None:
        changes.unlink(self.layer, path, self.where(path, dir_fd))

    def unlink(self, path: PathArg, *, dir_fd: int | None = None) -> None:
        changes.unlink(self.layer, path, self.where(path, dir_fd))

    def rename(
        self, src: PathArg, dst: PathArg, *, src_dir_fd: int | None = None, dst_dir_fd: int | None = None
    ) -> None:
        changes.rename(self.layer, src, self.where(src, src_dir_fd), dst, self.where(dst, dst_dir_fd))

    def replace(
        self, src: PathArg, dst: PathArg, *, src_dir_fd: int | None = None, dst_dir_fd: int | None = None
    ) -> None:
        changes.rename(self.layer, src, self.where(src, src_dir_fd), dst, self.where(dst, dst_dir_fd))

    def mkdir(self, path: PathArg, mode: int = 0o777, *, dir_fd: int | None = None) -> None:
        changes.mkdir(self.layer, path, self.where(path, dir_fd), mode)

    def rmdir(self, path: PathArg, *, dir_fd: int | None = None) -> None:
        changes.rmdir(self.layer, path, self.where(path, dir_fd))

    def truncate(self, path: Any, length: int) -> None:
        if isinstance(path, int):
            return _truncate(path, length)
        target = self.where(path)
        real, _ = self.layer.writable(path, target, create=False, trunc=False, excl=False, action="truncated")
        _truncate(real, length)

    def change(
        self, path: PathArg, dir_fd: int | None, follow: bool, apply: Callable[[str], None], action: str
    ) -> None:
        """Apply a metadata change to the layer's copy of ``path``."""
        changes.metadata(self.layer, path, self.where(path, dir_fd), follow, apply, action)

    def chmod(self, path: Any, mode: int, *, dir_fd: int | None = None, follow_symlinks: bool = True) -> None:
        if isinstance(path, int):
            return _chmod(path, mode, dir_fd=dir_fd, follow_symlinks=follow_symlinks)
        apply = lambda real: _chmod(real, mode, follow_symlinks=follow_symlinks)
        self.change(path, dir_fd, follow_symlinks, apply, "mode changed")

    def chown(self, path: Any, uid: int, gid: int, *, dir_fd: int | None = None, follow_symlinks: bool = True) -> None:
        if isinstance(path, int):
            return _chown(path, uid, gid, dir_fd=dir_fd, follow_symlinks=follow_symlinks)
        apply = lambda real: _chown(real, uid, gid, follow_symlinks=follow_symlinks)
        self.change(path, dir_fd, follow_symlinks, apply, "owner changed")

    def lchown(self, path: PathArg, uid: int, gid: int) -> None:
        self.chown(path, uid, gid, follow_symlinks=False)

    def utime(
        self, path: Any, times: Any = None, *, dir_fd: int | None = None, follow_symlinks: bool = True, **ns: Any
    ) -> None:
        if isinstance(path, int):
            return _utime(path, times, dir_fd=dir_fd, follow_symlinks=follow_symlinks, **ns)
        apply = lambda real: _utime(real, times, follow_symlinks=follow_symlinks, **ns)
        self.change(path, dir_fd, follow_symlinks, apply, "times changed")

    def setxattr(
        self, path: Any, attribute: Any, value: bytes, flags: int = 0, *, follow_symlinks: bool = True
    ) -> None:
        if isinstance(path, int):
            return _setxattr(path, attribute, value, flags, follow_symlinks=follow_symlinks)  # type: ignore[no-any-return]
        apply = lambda real: _setxattr(real, attribute, value, flags, follow_symlinks=follow_symlinks)
        self.change(path, None, follow_symlinks, apply, "attributes changed")

    def removexattr(self, path: Any, attribute: Any, *, follow_symlinks: bool = True) -> None:
        if isinstance(path, int):
            return _removexattr(path, attribute, follow_symlinks=follow_symlinks)  # type: ignore[no-any-return]
        apply = lambda real: _removexattr(real, attribute, follow_symlinks=follow_symlinks)
        self.change(path, None, follow_symlinks, apply, "attributes changed")

    def symlink(
        self, src: PathArg, dst: PathArg, target_is_directory: bool = False, *, dir_fd: int | None = None
    ) -> None:
        changes.symlink(self.layer, text_of(src), dst, self.where(dst, dir_fd))

    def link(
        self,
        src: PathArg,
        dst: PathArg,
        *,
        src_dir_fd: int | None = None,
        dst_dir_fd: int | None = None,
        follow_symlinks: bool = True,
    ) -> None:
        source, target = (src, self.where(src, src_dir_fd)), (dst, self.where(dst, dst_dir_fd))
        changes.link(self.layer, source, target, follow_symlinks)

    def mkfifo(self, path: PathArg, mode: int = 0o666, *, dir_fd: int | None = None) -> None:
        changes.special(self.layer, path, self.where(path, dir_fd), lambda real: _mkfifo(real, mode))

    def mknod(self, path: PathArg, mode: int = 0o600, device: int = 0, *, dir_fd: int | None = None) -> None:
        changes.special(self.layer, path, self.where(path, dir_fd), lambda real: _mknod(real, mode, device))

    def rmtree(
        self,
        path: PathArg,
        ignore_errors: bool = False,
        onerror: Callable[..., Any] | None = None,
        *,
        onexc: Callable[..., Any] | None = None,
        dir_fd: int | None = None,
    ) -> None:
        """``shutil.rmtree`` over the layer: the folder and all below it gone for the program,
        in one step (3.11's rmtree walks with ``dir_fd``s, which the layer resolves slowly)."""
        target = self.where(path, dir_fd)
        if self.layer.is_outside(target):
            extra = {} if onexc is None else {"onexc": onexc}
            _rmtree(target, ignore_errors, onerror, **extra)
            return
        failed = _reporter(ignore_errors, onerror, onexc)
        try:
            found = self.layer.stat(path, target, None, False)
        except OSError as error:
            return failed(os.lstat, path, error)
        if stat.S_ISLNK(found.st_mode):
            return failed(os.path.islink, path, OSError("Cannot call rmtree on a symbolic link"))
        if not stat.S_ISDIR(found.st_mode):
            return failed(os.scandir, path, failure(errno.ENOTDIR, path))
        try:
            changes.rmdir(self.layer, path, target, whole=True)
        except OSError as error:
            failed(os.rmdir, path, error)

    rmtree.avoids_symlink_attacks = True  # type: ignore[attr-defined]  # as shutil's (no real file is touched)


def _reporter(ignore_errors: bool, onerror: Callable[..., Any] | None, onexc: Callable[..., Any] | None) -> Failed:
    """What ``shutil.rmtree`` does with an error: ignore it, hand it to ``onexc`` (3.12) or
    ``onerror`` (with ``sys.exc_info()``), or raise it."""

    def failed(function: Callable[..., Any], path: Any, error: OSError) -> None:
        if ignore_errors:
            return
        if onexc is not None:
            onexc(function, path, error)
            return
        if onerror is None:
            raise error
        try:
            raise error
        except OSError:
            onerror(function, path, sys.exc_info())

    return failed
