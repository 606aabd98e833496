"""The options every command shares, derived from the job's tree and parsed once into one ``Job``.

``job_options(modes, default_mode)`` adds the TARGET argument and every option the job's
sections declare (graphmem.job.option: each setting one field carrying its flag, help and
parser), in the tree's order; ``job_from`` folds their values into a ``graphmem.job.Job`` by
their keywords.  ``section_options(section)`` adds one section's options (graphmem run: the
target).  ``output_options`` adds --format, --units, --output and --debug.

Parsing imports no torch: the sections, choices and parsers come from modules that import none
(job.option, job.sections, job.step_config, job.parallel, job.choices, job.grammar,
job.lora_spec, report.formats, report.paths), so --help and usage errors are printed at once.
What does need torch, the user's code or an optional package (importing TARGET, finding peft
for --lora) is an option's ``then``, run by ``GraphmemCommand`` once click has parsed every
other parameter, still as a usage error of that parameter.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from gettext import ngettext
from typing import TYPE_CHECKING, Any, TypeVar

import click
from click.core import ParameterSource

from graphmem.cli.process import set_progress, user_output_to_stderr
from graphmem.errors import UserInputError
from graphmem.job.grammar import validate_inputs
from graphmem.job.option import Option, declared
from graphmem.report import UNIT_CHOICES
from graphmem.report.paths import check_destination
from graphmem.units import parse_duration

if TYPE_CHECKING:
    from graphmem.job.job import Job

__all__ = ["JOB_OPTION_NAMES", "GraphmemCommand", "JsonObjectType", "ParsedType", "click_parameter", "job_from",
           "job_options", "output_options", "section_options"]

F = TypeVar("F", bound=Callable[..., Any])
_THEN = "graphmem.then"  # ctx.meta: the (parameter, value) pairs whose ``then`` is still to run


class ParsedType(click.ParamType):  # type: ignore[type-arg]  # generic only in click >= 8.2
    """A value parsed by one of graphmem's parsers; its UserInputError becomes a usage error.

    Args:
        name: the metavar shown in --help.
        parse: str -> value, raising UserInputError.
        done: values of this type are already parsed (click may convert defaults twice).
        then: value -> value, raising UserInputError: the part that needs torch, the user's
            code or an optional package, run by ``GraphmemCommand`` once every other
            parameter is parsed.
    """

    def __init__(self, name: str, parse: Callable[[str], Any], done: type | tuple[type, ...] = (),
                 then: Callable[[Any], Any] | None = None) -> None:
        self.name, self.parse, self.done, self.then = name, parse, done, then

    def convert(self, value: Any, param: Any, ctx: Any) -> Any:
        if self.done and isinstance(value, self.done):
            return value
        try:
            parsed = self.parse(value)
        except UserInputError as exc:
            self.fail(str(exc), param, ctx)
        if self.then is not None and ctx is not None:
            ctx.meta.setdefault(_THEN, []).append((param, parsed))
        elif self.then is not None:
            parsed = self.then(parsed)
        return parsed


class GraphmemCommand(click.Command):
    """A command whose ParsedType values are finished (``then``) once click has parsed every
    parameter: a usage error that needs no torch is shown before anything heavy is imported.

    The arguments (TARGET) are the last parameters click converts, after every option given;
    the defaults it converts after them cannot fail.  So the errors come in click's order, but
    for its check of unexpected extra arguments, which it makes last and so is made here after
    the ``then`` steps, as it was after TARGET's import."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        allowed, ctx.allow_extra_args = ctx.allow_extra_args, True
        try:
            rest = super().parse_args(ctx, args)
        finally:
            ctx.allow_extra_args = allowed
        for param, value in ctx.meta.pop(_THEN, []):
            if ctx.resilient_parsing:  # shell completion: nothing is imported
                continue
            try:
                with user_output_to_stderr():  # importing TARGET may print
                    ctx.params[str(param.name)] = param.type.then(value)
            except UserInputError as exc:
                raise click.BadParameter(str(exc), ctx=ctx, param=param) from None
        if rest and not allowed and not ctx.resilient_parsing:  # click's own words (click.core.Command.parse_args)
            ctx.fail(ngettext("Got unexpected extra argument ({args})", "Got unexpected extra arguments ({args})",
                              len(rest)).format(args=" ".join(map(str, rest))))
        return rest


class JsonObjectType(click.ParamType):  # type: ignore[type-arg]
    """A JSON object given on the command line, e.g. ``'{"hidden": 256}'``."""

    name = "JSON"

    def convert(self, value: Any, param: Any, ctx: Any) -> dict[str, Any]:
        if isinstance(value, dict):
            return value
        try:
            data = json.loads(value)
        except json.JSONDecodeError as exc:
            self.fail(f"not valid JSON ({exc.msg} at column {exc.colno}): {_excerpt(value)}; "
                      "expected an object such as '{\"hidden\": 256}'", param, ctx)
        except (RecursionError, ValueError) as exc:  # nested past Python's limit; an int of 5,000 digits
            what = "nested too deeply" if isinstance(exc, RecursionError) else "with a number too long to read"
            self.fail(f"JSON {what}: {_excerpt(value)}; expected an object such as '{{\"hidden\": 256}}'",
                      param, ctx)
        if not isinstance(data, dict):
            self.fail(f"expected a JSON object such as '{{\"hidden\": 256}}', got {_excerpt(value)}", param, ctx)
        return data


def _excerpt(text: str, limit: int = 80) -> str:
    """``text`` quoted, cut to ``limit`` characters (a 100,000-character value makes no message)."""
    return repr(text) if len(text) <= limit else f"{text[:limit]!r}... ({len(text):,} characters)"


def _destination(param: Any, path: str | None) -> str | None:
    """Refuse an output path no file can be written to, before anything is analysed."""
    try:
        return None if path is None else check_destination(path)
    except UserInputError as exc:
        raise click.BadParameter(str(exc), param=param) from None


def _timeout(ctx: Any, param: Any, value: str | None) -> None:
    """Validate --timeout (graphmem.cli.supervisor, which runs the command, enforces it)."""
    if value is not None:
        try:
            parse_duration(value)
        except ValueError as exc:
            raise click.BadParameter(str(exc), param=param) from None


def _click_type(option: Option) -> Any:
    """The click type of an option of the tree (graphmem.job.option)."""
    if option.parse is not None:
        return ParsedType(option.metavar or option.name, option.parse, option.done, then=option.then)
    if option.choices is not None:
        return click.Choice(list(option.choices))
    if option.kind == "int":
        return click.IntRange(min=None if option.minimum is None else int(option.minimum))
    if option.kind == "float":
        return click.FloatRange(min=option.minimum, min_open=option.open_minimum)
    if option.kind == "json":
        return JsonObjectType()
    if option.kind == "path":
        return click.Path(dir_okay=False)
    return None


def click_parameter(option: Option, **changes: Any) -> click.Parameter:
    """The click parameter of an option of the tree (``changes``: settings of this command's)."""
    settings = {"help": option.help_text, "default": option.default, "show_default": option.show_default,
                "multiple": option.multiple, **changes}
    if option.argument:
        return click.Argument([option.keyword], type=_click_type(option), required=False, metavar=f"[{option.name}]")
    kind = _click_type(option)
    metavar = option.metavar if option.parse is None and option.choices is None else None
    return click.Option([*option.flags, option.keyword], type=kind, metavar=metavar,
                        is_flag=True if option.kind == "flag" else None, **settings)


def _job_params(modes: Sequence[str], default_mode: str) -> list[click.Parameter]:
    """TARGET and the job options, in the tree's order (graphmem.job.job.Job's sections)."""
    from graphmem.job.job import Job

    params = []
    for found in declared(Job):
        option = found.option
        if option is None or not option.flags:
            continue
        if option.keyword == "mode":  # each command analyses its own modes
            help_text = option.help if "both" in modes else option.help.replace(", or both.", ".")
            option = replace(option, choices=tuple(modes), default=default_mode, help=help_text)
        params.append(click_parameter(option))
    return params


# the parameter names job_options adds (the tree's keywords); job_from takes exactly these
JOB_OPTION_NAMES = tuple(str(p.name) for p in _job_params(("both",), "both"))


def job_options(modes: Sequence[str], default_mode: str) -> Callable[[F], F]:
    """Add TARGET and the job options to a command (``--mode`` with these choices)."""
    def add(command: F) -> F:
        params = _job_params(modes, default_mode)
        command.__click_params__ = [*getattr(command, "__click_params__", []), *reversed(params)]  # type: ignore[attr-defined]
        return command
    return add


def section_options(section_type: type) -> Callable[[F], F]:
    """Add the options of one section of the job's tree (graphmem.job.option) to a command."""
    def add(command: F) -> F:
        params = [click_parameter(found.option) for found in declared(section_type)
                  if found.option is not None and found.option.flags]
        command.__click_params__ = [*getattr(command, "__click_params__", []), *reversed(params)]  # type: ignore[attr-defined]
        return command
    return add


def output_options(formats: Sequence[str]) -> Callable[[F], F]:
    """Add --format (these choices), --units, --output, --debug and --progress to a command."""
    def add(command: F) -> F:
        params = [
            click.Option(["--format", "fmt"], type=click.Choice(list(formats)), default="table", show_default=True,
                         help="Output format; json follows docs/json-schema.md."),
            click.Option(["--units"], type=click.Choice(UNIT_CHOICES), default="auto", show_default=True,
                         help="Units of sizes in tables (JSON is always in bytes)."),
            click.Option(["--output", "-o"], type=click.Path(dir_okay=False, writable=True), default=None,
                         callback=lambda c, p, v: _destination(p, v),
                         help="Write the report to this file instead of standard output (whole or not at all)."),
            click.Option(["--debug"], is_flag=True, help="Show the full traceback on errors."),
            click.Option(["--timeout"], metavar="DURATION", default=None, expose_value=False, callback=_timeout,
                         help="Stop after DURATION (90s, 10m, 2h) with exit 3, naming the stage reached  "
                              "[default: none]."),
            click.Option(["--progress/--no-progress"], default=None, expose_value=False, callback=set_progress,
                         help="Phase lines on stderr for work longer than two seconds  [default: on a terminal]."),
        ]
        command.__click_params__ = [*getattr(command, "__click_params__", []), *reversed(params)]  # type: ignore[attr-defined]
        return command
    return add


def job_from(options: Mapping[str, Any]) -> Job:
    """The Job the job options describe (``options``: the command's keyword arguments, named by
    the tree's keywords).

    With every job option but --input at its default (``graphmem analyze`` alone), the job's
    first check, of the inputs, is made before the job modules (and torch) are imported: its
    refusal (no input given, two capital letters) comes at once.
    """
    context = click.get_current_context(silent=True)
    if context is not None and all(context.get_parameter_source(name) is ParameterSource.DEFAULT
                                   for name in JOB_OPTION_NAMES if name != "inputs"):
        validate_inputs(options["inputs"], symbolic=None)  # the job's first check of such a job
    from graphmem.job.job import make_job

    return make_job(**{name: options[name] for name in JOB_OPTION_NAMES})
