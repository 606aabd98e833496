"""The scratch layer's changes to the tree (``scratch``): deleting, making folders, renaming,
linking, metadata, the working folder; each on the layer (``scratch_layer.Layer``), never on a
real file.

Input: a ``Layer`` and the program's paths (text, absolute).  Output: the layer's tree
changed and each action logged for ``changes``; errors as the OS gives them, naming the
program's path.  Knows nothing of which Python functions call it (``scratch_calls``).
"""

from __future__ import annotations

import errno
import os
import posix
import stat
from collections.abc import Callable
from dataclasses import replace

from graphmem.trace.program.scratch_layer import Layer, again, copy_file, drop_store, failure, probe
from graphmem.trace.program.scratch_tree import Alias, Copy, Folder, Link, Node, Spot

__all__ = ["chdir", "copies", "link", "metadata", "mkdir", "rename", "rmdir", "special", "symlink", "unlink"]

_stat = posix.stat
_mkdir = posix.mkdir
_rmdir = posix.rmdir
_unlink = posix.unlink
_rename = posix.rename
_link = posix.link
_symlink = posix.symlink
_readlink = posix.readlink
_chmod = posix.chmod
_utime = posix.utime
_chdir = posix.chdir
_getcwd = posix.getcwd


def unlink(layer: Layer, arg: object, path: str) -> None:
    with layer.lock:
        spot = layer.tree.locate(path, False)
        if layer.is_outside(spot.path):
            return _unlink(spot.path)
        found = layer.found(spot)
        if found is None:
            raise failure(spot.parent.error or errno.ENOENT, arg)
        if stat.S_ISDIR(found.st_mode):
            raise failure(errno.EISDIR, arg)
        layer.need_folder(spot, arg)
        layer.drop(spot)
        layer.note(path, spot.path, "deleted")


def mkdir(layer: Layer, arg: object, path: str, mode: int) -> None:
    with layer.lock:
        spot = layer.tree.locate(path, False)
        if layer.is_outside(spot.path):
            return _mkdir(spot.path, mode)
        if layer.found(spot) is not None:
            raise failure(errno.EEXIST, arg)
        layer.need_folder(spot, arg)
        store = layer.new_store()
        _mkdir(store, mode)
        for key in layer.tree.below(spot.path):
            drop_store(layer.tree.unset(key))
        layer.tree.set(spot.path, Folder(None, store))
        layer.note(path, spot.path, "directory created")


def rmdir(layer: Layer, arg: object, path: str, *, whole: bool = False) -> None:
    """Delete the folder ``path``; with ``whole``, what is in it too (``shutil.rmtree``)."""
    with layer.lock:
        spot = layer.tree.locate(path, False)
        if layer.is_outside(spot.path):
            return _rmdir(spot.path)
        found = layer.found(spot)
        if found is None:
            raise failure(spot.parent.error or errno.ENOENT, arg)
        if not stat.S_ISDIR(found.st_mode):
            raise failure(errno.ENOTDIR, arg)
        if not whole and layer.listing(arg, path)[1]:
            raise failure(errno.ENOTEMPTY, arg)
        layer.need_folder(spot, arg)
        layer.drop(spot)
        layer.note(path, spot.path, "directory deleted")


def symlink(layer: Layer, target: str, arg: object, path: str) -> None:
    with layer.lock:
        spot = layer.tree.locate(path, False)
        if layer.is_outside(spot.path):
            return _symlink(target, spot.path)
        if layer.found(spot) is not None:
            raise failure(errno.EEXIST, arg)
        layer.need_folder(spot, arg)
        store = layer.new_store()
        _symlink(target, store)
        layer.tree.set(spot.path, Link(target, store))
        layer.note(path, spot.path, "symlink created")


def special(layer: Layer, arg: object, path: str, make: Callable[[str], None]) -> None:
    """``os.mkfifo``/``os.mknod``: ``make`` makes the special file in the layer."""
    with layer.lock:
        spot = layer.tree.locate(path, False)
        if layer.is_outside(spot.path):
            return make(spot.path)
        if layer.found(spot) is not None:
            raise failure(errno.EEXIST, arg)
        layer.need_folder(spot, arg)
        store = layer.new_store()
        make(store)
        layer.tree.set(spot.path, Copy(store))
        layer.note(path, spot.path, "created")


def metadata(layer: Layer, arg: object, path: str, follow: bool, change: Callable[[str], None], action: str) -> None:
    """Apply ``change`` (chmod, utime, chown, an xattr...) to the layer's copy of ``path``,
    made first (a file's bytes are copied in)."""
    with layer.lock:
        spot = layer.tree.locate(path, follow)
        if layer.is_outside(spot.path):
            return change(spot.path)
        found = layer.found(spot)
        if found is None:
            raise failure(spot.parent.error or errno.ENOENT, arg)
        if stat.S_ISDIR(found.st_mode):
            target = own_folder(layer, spot)
        elif stat.S_ISLNK(found.st_mode):
            target = own_link(layer, spot)
        else:
            target = layer.own_file(spot, path, layer.source(spot, arg), action)
        change(target)
        layer.note(path, spot.path, action)


def own_folder(layer: Layer, spot: Spot) -> str:
    """The layer's folder holding ``spot``'s metadata, made from the real one's if needed."""
    node = spot.node
    if isinstance(node, Folder) and node.store is not None:
        return node.store
    lower = node.lower if isinstance(node, Folder) else spot.lower
    store = layer.new_store()
    _mkdir(store, 0o700)
    if lower is not None:
        _copy_folder_metadata(lower, store)
    layer.tree.set(spot.path, Folder(lower, store))
    return store


def own_link(layer: Layer, spot: Spot) -> str:
    if isinstance(spot.node, Link):
        return spot.node.store
    target = _readlink(spot.lower or "")
    store = layer.new_store()
    _symlink(target, store)
    layer.tree.set(spot.path, Link(target, store))
    return store


def chdir(layer: Layer, arg: object, path: str) -> None:
    with layer.lock:
        layer.tree.changed()  # relative paths mean other paths now
        spot = layer.tree.locate(path, True)
        if spot.plain or layer.is_outside(spot.path):
            try:
                _chdir(spot.path)
            except OSError as error:
                raise again(error, arg) from None
            layer.cwd = None
            return
        found = layer.found(spot)
        if found is None:
            raise failure(spot.parent.error or errno.ENOENT, arg)
        if not stat.S_ISDIR(found.st_mode):
            raise failure(errno.ENOTDIR, arg)
        node = spot.node
        real = (node.lower or node.store) if isinstance(node, Folder) else spot.lower
        _chdir(real or layer.root)
        layer.cwd = (_getcwd(), spot.path)


def copies(layer: Layer) -> dict[str, Node]:
    """Every node holding a layer file, copied to new layer files (a forked try's own)."""
    moved: dict[str, Node] = {}
    for path, node in layer.tree.nodes.items():
        store = layer.new_store()
        if isinstance(node, Copy):
            copy_file(node.store, store)
            moved[path] = Copy(store)
        elif isinstance(node, Folder) and node.store is not None:
            _mkdir(store, 0o700)
            _copy_folder_metadata(node.store, store)
            moved[path] = replace(node, store=store)
        elif isinstance(node, Link):
            _symlink(node.target, store)
            moved[path] = Link(node.target, store)
    return moved


def _copy_folder_metadata(source: str, target: str) -> None:
    found = _stat(source)
    _chmod(target, stat.S_IMODE(found.st_mode))
    _utime(target, ns=(found.st_atime_ns, found.st_mtime_ns))


def rename(layer: Layer, src_arg: object, src: str, dst_arg: object, dst: str) -> None:
    """``os.rename``/``os.replace``: ``src``'s node (a real file becomes an ``Alias``, a real
    folder a ``Folder`` over it: nothing is copied) moves to ``dst``; ``src`` is gone."""
    with layer.lock:
        old, new = layer.tree.locate(src, False), layer.tree.locate(dst, False)
        out_old, out_new = layer.is_outside(old.path), layer.is_outside(new.path)
        if out_old and out_new:
            return _rename(old.path, new.path)
        if out_old or out_new:
            return _rename_across(layer, (src_arg, src, old), (dst_arg, dst, new), out_old)
        found = layer.found(old)
        if found is None:
            raise failure(old.parent.error or errno.ENOENT, src_arg)
        layer.need_folder(old, src_arg)
        layer.need_folder(new, dst_arg)
        if old.path == new.path:
            return
        there = layer.found(new)
        _check_replaced(layer, (found, old), (there, new), dst_arg)
        node = _moving(layer, old, found)
        _clear(layer, new)
        layer.tree.set(new.path, node)
        if stat.S_ISDIR(found.st_mode):
            layer.tree.move_below(old.path, new.path)
        layer.forget(old)
        layer.note(src, old.path, "renamed", dst)
        if there is not None and not stat.S_ISDIR(there.st_mode):
            layer.note(dst, new.path, "overwritten")


def _check_replaced(
    layer: Layer, moving: tuple[os.stat_result, Spot], replaced: tuple[os.stat_result | None, Spot], arg: object
) -> None:
    """Raise as the OS does where ``moving`` may not replace what is at ``replaced``."""
    (found, old), (there, new) = moving, replaced
    if stat.S_ISDIR(found.st_mode):
        if new.path.startswith(old.path + "/"):
            raise failure(errno.EINVAL, arg)
        if there is not None and not stat.S_ISDIR(there.st_mode):
            raise failure(errno.ENOTDIR, arg)
        if there is not None and layer.listing(arg, new.path)[1]:
            raise failure(errno.ENOTEMPTY, arg)
    elif there is not None and stat.S_ISDIR(there.st_mode):
        raise failure(errno.EISDIR, arg)


def _moving(layer: Layer, old: Spot, found: os.stat_result) -> Node:
    """The node that ``old`` becomes under its new name."""
    if old.node is not None:
        return old.node
    lower = old.lower or ""
    if stat.S_ISDIR(found.st_mode):
        return Folder(lower, None)
    if stat.S_ISLNK(found.st_mode):
        target, store = _readlink(lower), layer.new_store()
        _symlink(target, store)
        return Link(target, store)
    return Alias(lower)


def _clear(layer: Layer, spot: Spot) -> None:
    """What is at ``spot`` (and below it) leaves the tree, its layer files deleted."""
    for key in layer.tree.below(spot.path):
        drop_store(layer.tree.unset(key))
    drop_store(layer.tree.unset(spot.path))


def _rename_across(
    layer: Layer, source: tuple[object, str, Spot], target: tuple[object, str, Spot], coming_in: bool
) -> None:
    """A file renamed into the layer from outside it (the program's temporary folder), or out
    of the layer; a folder answers EXDEV, as across file systems (``shutil.move`` copies)."""
    (src_arg, src, old), (dst_arg, dst, new) = source, target
    found = probe(old.path) if coming_in else layer.found(old)
    if found is None:
        raise failure(old.parent.error or errno.ENOENT, src_arg)
    if stat.S_ISDIR(found.st_mode) or (not coming_in and stat.S_ISLNK(found.st_mode)):
        raise failure(errno.EXDEV, src_arg)
    if coming_in:
        layer.need_folder(new, dst_arg)
        there = layer.found(new)
        if there is not None and stat.S_ISDIR(there.st_mode):
            raise failure(errno.EISDIR, dst_arg)
        store = layer.new_store()
        _rename(old.path, store)
        _clear(layer, new)
        layer.tree.set(new.path, Copy(store))
        layer.note(dst, new.path, "created" if there is None else "overwritten")
        return
    real = layer.source(old, src_arg)
    if isinstance(old.node, Copy):
        _rename(real, new.path)
    else:
        copy_file(real, new.path)
    layer.tree.unset(old.path)
    layer.forget(old)
    layer.note(src, old.path, "renamed", dst)


def link(layer: Layer, source: tuple[object, str], target: tuple[object, str], follow: bool) -> None:
    """``os.link``: in the layer a hard link to a real file is an ``Alias`` of it; one to a
    file of the program's is a copy (later writes through one name are not seen through the
    other)."""
    (src_arg, src), (dst_arg, dst) = source, target
    with layer.lock:
        old, new = layer.tree.locate(src, follow), layer.tree.locate(dst, False)
        out_old, out_new = layer.is_outside(old.path), layer.is_outside(new.path)
        if out_old and out_new:
            return _link(old.path, new.path)
        found = probe(old.path) if out_old else layer.found(old)
        if found is None:
            raise failure(old.parent.error or errno.ENOENT, src_arg)
        if stat.S_ISDIR(found.st_mode):
            raise failure(errno.EPERM, src_arg)
        real = old.path if out_old else layer.source(old, src_arg)
        if out_new:
            return copy_file(real, new.path)
        if layer.found(new) is not None:
            raise failure(errno.EEXIST, dst_arg)
        layer.need_folder(new, dst_arg)
        layer.tree.set(new.path, _linked(layer, old, real, out_old or isinstance(old.node, Copy)))
        layer.note(dst, new.path, "hard link created")


def _linked(layer: Layer, old: Spot, real: str, copied: bool) -> Node:
    store = layer.new_store()
    if copied:
        copy_file(real, store)
        return Copy(store)
    target = old.node.target if isinstance(old.node, Link) else layer.tree.real_link(real)
    if target is not None:
        _symlink(target, store)
        return Link(target, store)
    return old.node if isinstance(old.node, Alias) else Alias(real)
