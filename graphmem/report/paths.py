"""Stage 4: where the output files may be written, checked before anything is analysed.

Input: the paths given for the report and the pictures.  Output: each path, when a file of its
kind can be written there and the optional package (or Graphviz's ``dot`` program) it needs is
installed (else UserInputError saying which and how to fix it), and how it is written
(``destination_of``: renamed into place, overwritten or appended; graphmem.report.files writes
it so).  Imports no torch: the command line checks its output options while it parses them.
"""

from __future__ import annotations

import errno
import os
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path

from graphmem.errors import UserInputError
from graphmem.report.formats import (
    DOT_FORMATS,
    HTML_SUFFIXES,
    RENDERED_DOT_FORMATS,
    TIMELINE_FORMATS,
    require_graphviz,
    require_matplotlib,
    require_pydot,
)

__all__ = ["OUTPUT_FORMATS", "Destination", "check_destination", "check_html_path", "check_output_path",
           "destination_of"]

OUTPUT_FORMATS = {"timeline": TIMELINE_FORMATS, "snapshot": ("pickle",), "dot": DOT_FORMATS,
                  "policy": ("py",), "policy_curve": ("svg", "png")}

# A symbolic link there is one of the process's own descriptors (/dev/stdout, /dev/fd/1,
# /proc/self/fd/1): written as a stream, never replaced, whatever it resolves to (a shell's
# `> log` or `>> log` redirection included).
_STREAM_ROOTS = ("/dev/", "/proc/")
# Why a path cannot even be looked at, in words (os.stat's errno; the rest use strerror).
_LOOKUP_FAULTS = {errno.ELOOP: "its symbolic links form a loop",
                  errno.ENAMETOOLONG: "a name in it is longer than its file system allows",
                  errno.EACCES: "permission denied on a folder of the path"}


@dataclass(frozen=True, slots=True)
class Destination:
    """How one output path is written.  ``how``: ``rename`` (staged beside ``final`` and renamed
    over it), ``overwrite`` (a hard-linked regular file, truncated and written) or ``append``
    (a device, FIFO or descriptor, opened for appending and written)."""

    final: Path  # the file that receives the content: the path itself, or the target of its symbolic links
    how: str
    existing: os.stat_result | None


def destination_of(path: str) -> Destination:
    """How ``path`` is written; UserInputError when it cannot even be looked up."""
    try:
        found: os.stat_result | None = os.stat(path)
    except (FileNotFoundError, NotADirectoryError):  # the folder checks say which folder is wrong
        found = None
    except OSError as exc:
        why = _LOOKUP_FAULTS.get(exc.errno or 0, (exc.strerror or str(exc)).lower())
        raise UserInputError(f"cannot write {path!r}: {why}; choose another path") from None
    stream = os.path.islink(path) and os.path.abspath(path).startswith(_STREAM_ROOTS)
    if found is not None and not stat.S_ISDIR(found.st_mode) and (not stat.S_ISREG(found.st_mode) or stream):
        return Destination(Path(path), "append", found)
    if found is not None and stat.S_ISREG(found.st_mode) and found.st_nlink > 1:
        return Destination(Path(path), "overwrite", found)
    return Destination(Path(os.path.realpath(path)) if os.path.islink(path) else Path(path), "rename", found)


def check_destination(path: str) -> str:
    """``path`` when a file can be written there: not a folder (nor written as one, ending in
    ``/``), not a socket, and a file that exists must be writable; a new file or one replaced
    by a rename needs an existing folder where a file can be created (tried, not guessed from
    permission bits: root, read-only mounts).  Else UserInputError saying which and how to fix it."""
    if path.endswith(("/", os.sep)):
        raise UserInputError(f"{path!r} ends in {path[-1]!r}, so it names a folder; give a file path such as "
                             f"{os.path.join(path, 'report.txt')!r}")
    destination = destination_of(path)
    existing = destination.existing
    if existing is not None and stat.S_ISDIR(existing.st_mode):
        raise UserInputError(f"{path!r} is a directory; expected a file path such as "
                             f"{os.path.join(path, 'report.txt')!r}")
    if existing is not None and stat.S_ISSOCK(existing.st_mode):
        raise UserInputError(f"cannot write {path!r}: it is a socket, which cannot be opened as a file; choose "
                             "another path")
    if existing is not None and not os.access(path, os.W_OK):
        raise UserInputError(f"cannot write {path!r}: the file exists and is not writable")
    if destination.how == "rename":
        _check_folder(path, destination.final.parent)
    return path


def _check_folder(path: str, folder: Path) -> None:
    """The folder ``path``'s file is staged and renamed in exists and takes a new file."""
    if not folder.is_dir():
        what = "is not a folder" if folder.exists() else "does not exist"
        raise UserInputError(f"cannot write {path!r}: folder {str(folder)!r} {what}; create it or choose "
                             "another path")
    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".graphmem-probe-"):
            pass
    except OSError as exc:
        raise UserInputError(f"cannot write {path!r}: no file can be created in folder {str(folder)!r} "
                             f"({exc.strerror or exc}); choose a writable folder") from exc


def check_output_path(kind: str, path: str) -> str:
    """``path`` when its suffix suits ``kind`` (timeline, snapshot, dot, policy, policy_curve), a file can be written
    there (``check_destination``) and the optional dependency that output needs is installed
    (for a .svg/.png/.pdf graph, Graphviz's ``dot`` program on PATH too); else UserInputError
    naming the choices or what to install."""
    suffix = Path(path).suffix.lower().lstrip(".")
    formats = OUTPUT_FORMATS[kind]
    if suffix not in formats and not path.endswith(("/", os.sep)):
        raise UserInputError(f"{kind} file {path!r}: unknown file type {'.' + suffix if suffix else '(none)'}; "
                             f"expected a file ending in {', '.join('.' + f for f in formats)}")
    check_destination(path)
    if kind in ("timeline", "policy_curve"):
        require_matplotlib()
    if kind == "dot":
        require_pydot()
    if kind == "dot" and suffix in RENDERED_DOT_FORMATS:
        require_graphviz(suffix)
    return path


def check_html_path(path: str) -> str:
    """``path`` when it ends in .html or .htm and a file can be written there; else
    UserInputError naming what was expected (the CLI calls this before analysing)."""
    suffix = Path(path).suffix.lower()
    if suffix not in HTML_SUFFIXES:
        raise UserInputError(f"html file {path!r}: unknown file type {suffix or '(none)'}; "
                             f"expected a file ending in {', '.join(HTML_SUFFIXES)}")
    return check_destination(path)
