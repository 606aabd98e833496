"""Stage 4: the picture files of one analysis (``--timeline``, ``--snapshot``, ``--dot``).

Input: a MemoryReport and the paths asked for.  Output: the files, all drawn from the same
analysis and the same mode (training when analysed, else inference); nothing is re-traced.
``check_output_path`` (graphmem.report.paths) validates a path's suffix, its folder and the
optional dependency it needs, so the CLI can refuse a bad option before the analysis starts.

Every file is written whole under a temporary name in its own folder and renamed into place
when all of a run's files are complete (``staged_files``): a reader never sees a partial
file, and when one output fails none of that run's outputs is left behind.  A file that is
replaced keeps its mode (and, where the process may set it, its owner); a symbolic link
keeps pointing where it did (its target is replaced).  A path that must not be replaced is
written in place instead, once every renamed file is in place: a device, FIFO or other file
that is not a regular one (``/dev/null``, ``/dev/stdout``: opened for appending, as a
shell's ``>>`` would), and a regular file with more than one hard link (overwritten, so every
link sees the new content; such a file is not replaced atomically).
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import shutil
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

from graphmem.errors import OutputError, UserInputError
from graphmem.memory.results import MemoryReport
from graphmem.report.dot import COLLAPSE_CHOICES, write_dot
from graphmem.report.paths import OUTPUT_FORMATS, check_destination, check_output_path
from graphmem.report.paths import Destination as _Destination
from graphmem.report.paths import destination_of as _destination
from graphmem.report.series import drawn_mode
from graphmem.report.snapshot import write_snapshot
from graphmem.report.timeline import write_timeline

__all__ = ["OUTPUT_FORMATS", "StagedFiles", "check_destination", "check_output_path", "picture_title",
           "staged_files", "write_files"]

def picture_title(report: MemoryReport) -> str:
    """``graphmem: TARGET (INPUTS), MODE``: the title every picture carries."""
    mode = drawn_mode(report)
    what = "inference" if mode.mode == "inference" else f"train ({mode.optimizer})"
    return f"graphmem: {report.target} ({', '.join(report.inputs)}), {what}"


def _staged_name(final: Path) -> str:
    """``.NAME.XXXXXXXX.partial.SUFFIX`` for ``final``, NAME shortened to fit the folder's limit on
    name length (a 250-byte name is a valid output; its temporary name must be one too)."""
    try:
        limit = os.pathconf(final.parent, "PC_NAME_MAX")
    except (OSError, ValueError):
        limit = 255
    suffix = final.suffix if len(os.fsencode(final.suffix)) <= 16 else ""  # writers pick the format by it
    head, tail = f".{final.name}", f".{secrets.token_hex(4)}.partial{suffix}"
    while len(os.fsencode(head + tail)) > limit and len(head) > 1:
        head = head[:-1]
    return head + tail


class StagedFiles:
    """Files written under temporary names, then put in place together by ``commit``: beside
    their final paths (same folder, so the rename is atomic), or, for a path written in place,
    in a private temporary folder; ``discard`` removes them."""

    def __init__(self) -> None:
        self._pending: list[tuple[Path, _Destination]] = []
        self._private: str | None = None  # the temporary folder of the files written in place

    def path_for(self, final: str) -> str:
        """The temporary path to write ``final``'s content to (same suffix: writers pick the
        format by it), e.g. ``out/.graph.svg.1f2e3d4c.partial.svg``."""
        destination = _destination(final)
        if destination.how == "rename":
            temporary = destination.final.with_name(_staged_name(destination.final))
        else:
            self._private = self._private or tempfile.mkdtemp(prefix="graphmem-")
            temporary = Path(self._private) / f"{len(self._pending)}{Path(final).suffix[:16]}"
        self._pending.append((temporary, destination))
        return str(temporary)

    def commit(self) -> None:
        """Rename every file into place, then write those written in place; if one fails,
        remove the files already renamed too."""
        renamed: list[Path] = []
        try:
            for temporary, destination in self._pending:
                if destination.how == "rename":
                    _keep_mode(temporary, destination.existing)
                    os.replace(temporary, destination.final)
                    renamed.append(destination.final)
            for temporary, destination in self._pending:
                if destination.how != "rename":
                    _write_in_place(temporary, destination)
        except BaseException:  # any failure, an interrupt too: undone and re-raised
            for final in renamed:
                with contextlib.suppress(OSError):
                    final.unlink()
            self.discard()
            raise
        self.discard()

    def discard(self) -> None:
        """Remove the temporary files (those written so far)."""
        for temporary, _ in self._pending:
            with contextlib.suppress(OSError):
                temporary.unlink()
        self._pending.clear()
        if self._private is not None:
            shutil.rmtree(self._private, ignore_errors=True)
            self._private = None


def _keep_mode(temporary: Path, existing: os.stat_result | None) -> None:
    """The replacing file takes the replaced one's mode, and its owner where this process may set it."""
    if existing is None:
        return
    os.chmod(temporary, stat.S_IMODE(existing.st_mode))
    mine = os.stat(temporary)
    if (mine.st_uid, mine.st_gid) != (existing.st_uid, existing.st_gid):
        with contextlib.suppress(OSError):  # only root may give a file away
            os.chown(temporary, existing.st_uid, existing.st_gid)


def _write_in_place(temporary: Path, destination: _Destination) -> None:
    """Copy the staged content into the existing file: appended to a stream, over a hard-linked
    file.  A FIFO nobody reads is an error, not a wait without end (opened without blocking)."""
    flags = os.O_WRONLY | (os.O_APPEND | os.O_NONBLOCK if destination.how == "append" else os.O_TRUNC)
    try:
        descriptor = os.open(destination.final, flags)
    except OSError as exc:
        if exc.errno == errno.ENXIO and destination.existing and stat.S_ISFIFO(destination.existing.st_mode):
            raise OSError(exc.errno, f"no process reads the FIFO {str(destination.final)!r}; start its reader "
                          "first") from None
        raise
    os.set_blocking(descriptor, True)
    with open(temporary, "rb") as source, open(descriptor, "wb") as target:
        shutil.copyfileobj(source, target)


@contextlib.contextmanager
def staged_files() -> Iterator[StagedFiles]:
    """A ``StagedFiles`` committed when the block completes, discarded when it raises
    (KeyboardInterrupt included).  An OSError while writing or renaming becomes OutputError."""
    staged = StagedFiles()
    try:
        try:
            yield staged
        except BaseException:  # any failure, an interrupt too: discarded and re-raised
            staged.discard()
            raise
        staged.commit()
    except OSError as exc:
        where = f" ({exc.filename})" if exc.filename else ""
        raise OutputError(f"writing the output failed, nothing was written: {exc.strerror or exc}{where}") from exc


def write_files(report: MemoryReport, *, timeline: str | None = None, snapshot: str | None = None,
                dot: str | None = None, collapse: str = "auto", depth: int = 2, units: str = "auto",
                staged: StagedFiles | None = None) -> None:
    """Write each picture whose path is given: all of them, or (on an error) none.

    Args:
        report: the analysis.
        timeline: .svg, .png or .html path for the memory timeline.
        snapshot: .pickle path for the PyTorch memory_viz snapshot.
        dot: .dot/.gv path for DOT text, or .svg/.png/.pdf rendered by Graphviz.
        collapse: ``auto``, ``module`` or ``op`` (the DOT graph's level).
        depth: module-tree depth of the collapsed DOT graph.
        units: units of sizes in the labels.
        staged: write into these staged files and leave the commit to the caller (who may
            have more outputs of the same run to write); by default they are committed here.
    """
    if collapse not in COLLAPSE_CHOICES:
        raise UserInputError(f"unknown collapse {collapse!r}; expected one of: {', '.join(COLLAPSE_CHOICES)}")
    for kind, path in (("timeline", timeline), ("snapshot", snapshot), ("dot", dot)):
        if path is not None:
            check_output_path(kind, path)
    if staged is None:
        with staged_files() as own:
            write_files(report, timeline=timeline, snapshot=snapshot, dot=dot, collapse=collapse, depth=depth,
                        units=units, staged=own)
        return
    mode = drawn_mode(report)
    title = picture_title(report)
    if timeline is not None:
        write_timeline(mode, staged.path_for(timeline), title, units)
    if snapshot is not None:
        write_snapshot(mode, staged.path_for(snapshot), report.target.rpartition(":")[2] or report.target)
    if dot is not None:
        write_dot(mode, staged.path_for(dot), collapse=collapse, depth=depth, units=units, title=title)
