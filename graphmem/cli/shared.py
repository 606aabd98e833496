"""What the commands share: the analysis imported on first use, the output paths checked while
the options are parsed, the library call's errors mapped to exit codes, the result written
whole (graphmem.cli.commands, graphmem.cli.preflight_commands)."""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Callable, Iterator, Mapping, Sequence
from fractions import Fraction
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from graphmem._lazy import lazy_exports
from graphmem.cli.exit_codes import errors_to_exit_codes
from graphmem.cli.options import ParsedType, job_from
from graphmem.cli.process import print_result, raise_if_interrupted, user_output_to_stderr
from graphmem.errors import UserInputError
from graphmem.job.option import spelling
from graphmem.preflight.budget import BudgetAmount, parse_budget, parse_margin
from graphmem.report.paths import check_html_path, check_output_path

if TYPE_CHECKING:
    from graphmem.job.job import Job
    from graphmem.report.files import StagedFiles

__all__ = ["PREFLIGHT_MODES", "analysis", "budget_options", "distinct", "job_of", "lazy_commands", "output_kind",
           "picture", "write"]

# the pre-flight commands analyse these modes (graphmem.preflight.search.PREFLIGHT_MODES; a test keeps them equal)
PREFLIGHT_MODES = ("train", "inference")


def lazy_commands(namespace: dict[str, Any], where: Mapping[str, Sequence[str]]
                  ) -> tuple[Callable[[str], Any], Callable[[], None]]:
    """A command module's ``__getattr__`` (graphmem._lazy) and its ``load()``, which imports
    every name of ``where`` into ``namespace`` (keeping any already bound, e.g. by a test)."""
    get = lazy_exports(namespace, where)

    def load() -> None:
        for names in where.values():
            for name in names:
                if name not in namespace:
                    get(name)

    return get, load


def job_of(options: Mapping[str, Any], load: Callable[[], None]) -> Job:
    """The Job the options describe (``job_from``: a job they leave undescribed is refused before
    anything heavy is imported), then the analysis loaded (``load``)."""
    job = job_from(options)
    load()
    return job


def output_kind(kind: str) -> Callable[[Any, Any, str | None], str | None]:
    """A click callback refusing a path where no ``kind`` file (graphmem.report.paths) can be written."""
    def check(_: Any, param: Any, path: str | None) -> str | None:
        try:
            return None if path is None else check_output_path(kind, path)
        except UserInputError as exc:
            raise click.BadParameter(str(exc), param=param) from None
    return check


def picture(param: Any, path: str | None) -> str | None:
    """Refuse a picture (or --html page) path with the wrong suffix, in a folder where no file
    can be written, or whose extra is missing, before analysing."""
    try:
        if path is None:
            return None
        return check_html_path(path) if param.name == "html" else check_output_path(param.name, path)
    except UserInputError as exc:
        raise click.BadParameter(str(exc), param=param) from None


@contextlib.contextmanager
def analysis(debug: bool) -> Iterator[None]:
    """Around the library call: the user's code prints to stderr, errors leave with their exit codes."""
    with errors_to_exit_codes(debug), user_output_to_stderr():
        yield


def write(text: str, output: str | None, debug: bool, pictures: Callable[[StagedFiles], None] | None = None) -> None:
    """The result to --output (with the pictures: each written whole under a temporary name,
    all renamed into place once all are written, none left on failure) or to stdout.  Nothing
    is written once interrupted.  ``--output /dev/stdout`` is stdout: the command's own fd 1 is
    stderr (graphmem.cli.supervisor prints the result)."""
    if output is not None and os.path.abspath(output) in ("/dev/stdout", "/dev/fd/1", "/proc/self/fd/1"):
        output = None
    from graphmem.report.files import staged_files

    with errors_to_exit_codes(debug), staged_files() as staged:
        if pictures is not None:
            pictures(staged)
        if output:
            Path(staged.path_for(output)).write_text(text, encoding="utf-8")
        raise_if_interrupted()
    if not output:
        print_result(text)


def distinct(**paths: str | None) -> None:
    """Refuse two outputs of one run that name the same file (one would overwrite the other): the
    same path after symbolic links, or two hard links of one file.  A device or FIFO may take two."""
    seen: dict[object, str] = {}
    for option, path in paths.items():
        if path is None:
            continue
        try:
            found = os.stat(path)
        except OSError:  # a new file: its path, links resolved, is its identity
            key: object = os.path.realpath(path)
        else:
            if not stat.S_ISREG(found.st_mode):
                continue
            key = (found.st_dev, found.st_ino)
        if key in seen:
            raise click.UsageError(f"--{seen[key]} and --{option} name the same file {path!r}; give each its own")
        seen[key] = option



# 80GiB, 80GB, 512MiB, 123456B, or 0.9 / 90% of --gpu -> BudgetAmount
BudgetType = lambda: ParsedType("BYTES|FRACTION", parse_budget, BudgetAmount)
# 5% or 0.05 -> Fraction
MarginType = lambda: ParsedType("PERCENT", parse_margin, Fraction)


def budget_options(command: Any) -> Any:
    """Add --budget and --margin to a pre-flight command."""
    command = click.option("--margin", type=MarginType(), default="0%", show_default=True,
                           help="Keep this share free: fits when peak x (1 + margin) <= budget.")(command)
    return click.option("--budget", type=BudgetType(), default=None,
                        help="Memory available: 123456B, 512MiB, 80GiB, 80GB (decimal), or 0.9 / 90% of "
                             f"{spelling('gpu')}. "
                             f"Default: all of {spelling('gpu')}'s memory.")(command)
