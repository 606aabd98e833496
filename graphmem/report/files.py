"""Stage 4: the picture files of one analysis (``--timeline``, ``--snapshot``, ``--dot``).

Input: a MemoryReport and the paths asked for.  Output: the files, all drawn from the same
analysis and the same mode (training when analysed, else inference); nothing is re-traced.
``check_output_path`` validates a path's suffix, its folder and the optional dependency it
needs, so the CLI can refuse a bad option before the analysis starts.

Every file is written whole under a temporary name in its own folder and renamed into place
when all of a run's files are complete (``staged_files``): a reader never sees a partial
file, and when one output fails none of that run's outputs is left behind.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import tempfile
from collections.abc import Iterator
from pathlib import Path

from graphmem.errors import OutputError, UserInputError
from graphmem.memory.results import MemoryReport
from graphmem.report.dot import COLLAPSE_CHOICES, DOT_FORMATS, require_pydot, write_dot
from graphmem.report.series import drawn_mode
from graphmem.report.snapshot import write_snapshot
from graphmem.report.timeline import TIMELINE_FORMATS, require_matplotlib, write_timeline

__all__ = ["OUTPUT_FORMATS", "StagedFiles", "check_destination", "check_output_path", "picture_title",
           "staged_files", "write_files"]

OUTPUT_FORMATS = {"timeline": TIMELINE_FORMATS, "snapshot": ("pickle",), "dot": DOT_FORMATS}


def check_destination(path: str) -> str:
    """``path`` when a file can be written there: not a directory, in an existing folder where
    a file can be created (tried, not guessed from permission bits: root, read-only mounts),
    and, if it exists, writable.  Else UserInputError saying which and how to fix it."""
    target = Path(path)
    folder = target.parent
    if target.is_dir():
        raise UserInputError(f"{path!r} is a directory; expected a file path such as {str(target / 'report.txt')!r}")
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
    if target.exists() and not os.access(target, os.W_OK):
        raise UserInputError(f"cannot write {path!r}: the file exists and is not writable")
    return path


def check_output_path(kind: str, path: str) -> str:
    """``path`` when its suffix suits ``kind`` (timeline, snapshot, dot), a file can be written
    there (``check_destination``) and the optional dependency that output needs is installed;
    else UserInputError naming the choices."""
    suffix = Path(path).suffix.lower().lstrip(".")
    formats = OUTPUT_FORMATS[kind]
    if suffix not in formats:
        raise UserInputError(f"{kind} file {path!r}: unknown file type {'.' + suffix if suffix else '(none)'}; "
                             f"expected a file ending in {', '.join('.' + f for f in formats)}")
    check_destination(path)
    if kind == "timeline":
        require_matplotlib()
    if kind == "dot":
        require_pydot()
    return path


def picture_title(report: MemoryReport) -> str:
    """``graphmem: TARGET (INPUTS), MODE``: the title every picture carries."""
    mode = drawn_mode(report)
    what = "inference" if mode.mode == "inference" else f"train ({mode.optimizer})"
    return f"graphmem: {report.target} ({', '.join(report.inputs)}), {what}"


class StagedFiles:
    """Files written under temporary names beside their final paths (same folder, so the
    rename is atomic), renamed into place together by ``commit``; ``discard`` removes them."""

    def __init__(self) -> None:
        self._pending: list[tuple[Path, Path]] = []

    def path_for(self, final: str) -> str:
        """The temporary path to write ``final``'s content to (same suffix: writers pick the
        format by it), e.g. ``out/.graph.svg.1f2e3d4c.partial.svg``."""
        target = Path(final)
        temporary = target.with_name(f".{target.name}.{secrets.token_hex(4)}.partial{target.suffix}")
        self._pending.append((temporary, target))
        return str(temporary)

    def commit(self) -> None:
        """Rename every file into place; if one rename fails, remove those already renamed too."""
        renamed: list[Path] = []
        try:
            for temporary, final in self._pending:
                os.replace(temporary, final)
                renamed.append(final)
        except BaseException:
            for final in renamed:
                with contextlib.suppress(OSError):
                    final.unlink()
            self.discard()
            raise
        self._pending.clear()

    def discard(self) -> None:
        """Remove the temporary files (those written so far)."""
        for temporary, _ in self._pending:
            with contextlib.suppress(OSError):
                temporary.unlink()
        self._pending.clear()


@contextlib.contextmanager
def staged_files() -> Iterator[StagedFiles]:
    """A ``StagedFiles`` committed when the block completes, discarded when it raises
    (KeyboardInterrupt included).  An OSError while writing or renaming becomes OutputError."""
    staged = StagedFiles()
    try:
        try:
            yield staged
        except BaseException:
            staged.discard()
            raise
        staged.commit()
    except OSError as exc:
        raise OutputError(f"writing the output failed, nothing was written: {exc}") from exc


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
