"""Each setting written once: a section's field carries its option in its metadata.

Input: the sections of a ``Job`` (frozen dataclasses whose fields carry ``option(...)`` in
``field(metadata=...)``).  Output: the walk over them (``declared``), from which the command
line's parameters (graphmem.cli.options), the Python keywords (graphmem.job.job.make_job), the
report's header rows and its JSON ``setup`` (graphmem.report.header) are all derived; and an
option's spelling (``flag``), so that a message naming an option takes it from here.

A field may also carry ``shown(...)``: how the report's header and JSON show it.  A field whose
value is itself a section (or None, or one of several section types: ``variants``) is walked
into.  Imports neither torch nor click: the command line derives its options before anything
heavy is loaded.
"""

from __future__ import annotations

import dataclasses
import importlib
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["Declared", "Option", "Shown", "declared", "field_values", "flag", "fold", "option", "section",
           "section_types", "shown", "spelling"]

_OPTION, _SHOWN, _VARIANTS = "graphmem.option", "graphmem.shown", "graphmem.variants"
_BY_KEYWORD: dict[str, Option] = {}  # every option declared, by its keyword (``spelling``)


@dataclass(frozen=True, slots=True)
class Option:
    """How one setting is given, on the command line and as a Python keyword.

    Attributes:
        flags: the command line's spelling, e.g. ``("--input", "-i")`` (a flag pair as
            ``"--x/--no-x"``); empty: a Python keyword only; ``("TARGET",)`` with ``argument``.
        keyword: the Python keyword (``graphmem.analyze(..., keyword=...)``) and the command's
            parameter name.
        help: the --help text.
        metavar: shown in --help in place of the value.
        kind: ``text``, ``int``, ``float``, ``flag``, ``json`` or ``path``.
        choices: the values accepted (a click Choice).
        minimum / open_minimum: the lowest value of an int or float (excluded when open).
        parse: text -> value (raising UserInputError), for values with a grammar; ``done``:
            the types already parsed; ``then``: the part that needs imports, run last.
        multiple: repeatable; default / show_default: the command line's default.
        to_field: the keyword's value (or the command line's) -> the field's value;
            ``from_field``: back (default: the field's value is a keyword's value); ``to_text``:
            a value as the command line writes it (default: items joined by commas).
        argument: a positional argument, not an option.
    """

    flags: tuple[str, ...]
    keyword: str
    help: str = ""
    metavar: str | None = None
    kind: str = "text"
    choices: tuple[str, ...] | None = None
    minimum: float | None = None
    open_minimum: bool = False
    parse: Callable[[str], Any] | None = None
    done: type | tuple[type, ...] = ()
    then: Callable[[Any], Any] | None = None
    multiple: bool = False
    default: Any = None
    show_default: bool = False
    to_field: Callable[[Any], Any] | None = None
    from_field: Callable[[Any], Any] | None = None
    to_text: Callable[[Any], str] | None = None
    argument: bool = False

    @property
    def help_text(self) -> str:
        """The --help text, each ``%(keyword)s`` in it spelled as that option (an option declared
        in a section loaded later)."""
        return re.sub(r"%\((\w+)\)s", lambda found: spelling(found[1]), self.help)

    @property
    def name(self) -> str:
        """The spelling a message uses: ``--gpu`` (``TARGET`` for the argument)."""
        return self.flags[0].split("/")[0] if self.flags else self.keyword

    def field_value(self, value: Any) -> Any:
        return self.to_field(value) if self.to_field is not None else value

    def text_of(self, value: Any) -> str:
        """A value as the command line writes it: ``("A", "B")`` -> ``A,B`` (``to_text`` where
        the option has its own way, e.g. block ranges ``0-3``)."""
        if self.to_text is not None:
            return self.to_text(value)
        if isinstance(value, (tuple, list)):
            return ",".join(map(str, value))
        return str(value)


@dataclass(frozen=True, slots=True)
class Shown:
    """How the report shows a setting.

    Attributes:
        key: its key in the JSON ``setup`` (None: not there); ``json``: value, facts -> the
            JSON value (default: the value itself).
        at_json / at_row: where it goes among the others (lower first); a new setting without
            them goes last.
        label: its row's label in the header (None: no row); ``row``: value, facts -> the
            row's text, or "" for no row.
    """

    key: str | None = None
    json: Callable[[Any, Mapping[str, Any]], Any] | None = None
    at_json: float = 1000.0
    label: str | None = None
    row: Callable[[Any, Mapping[str, Any]], str] | None = None
    at_row: float = 1000.0


def option(*flags: str, keyword: str = "", **settings: Any) -> dict[str, Any]:
    """The ``field(metadata=...)`` of a setting given as ``flags`` (see Option)."""
    keyword = keyword or (flags[0].split("/")[0].lstrip("-").replace("-", "_") if flags else "")
    declared_option = Option(tuple(flags), keyword, **settings)
    _BY_KEYWORD.setdefault(keyword, declared_option)
    return {_OPTION: declared_option}


def shown(**settings: Any) -> dict[str, Any]:
    """The ``field(metadata=...)`` part saying how the report shows a setting (see Shown)."""
    return {_SHOWN: Shown(**settings)}


@dataclass(frozen=True, slots=True)
class Declared:
    """One setting of the tree: the path of sections to it, its field, its option and how it is shown."""

    path: tuple[str, ...]
    field: dataclasses.Field[Any]
    option: Option | None
    shown: Shown | None


def declared(section_type: type, path: tuple[str, ...] = ()) -> Iterator[Declared]:
    """Every setting of ``section_type`` and of its sections, depth first in field order; a
    setting two variants share (one option in both) comes once."""
    seen: set[int] = set()
    for found in _walk(section_type, path):
        if found.option is not None:
            if id(found.option) in seen:
                continue
            seen.add(id(found.option))
        yield found


def _walk(section_type: type, path: tuple[str, ...]) -> Iterator[Declared]:
    for field in dataclasses.fields(section_type):
        metadata = field.metadata
        if _OPTION in metadata or _SHOWN in metadata:
            yield Declared((*path, field.name), field, metadata.get(_OPTION), metadata.get(_SHOWN))
        for kind in section_types(field):
            yield from _walk(kind, (*path, field.name))


def section_types(field: dataclasses.Field[Any]) -> tuple[type, ...]:
    """The section types a field holds (empty: a plain value)."""
    return tuple(field.metadata.get(_VARIANTS, ()))


def section(*types: type, **metadata: Any) -> dict[str, Any]:
    """The ``field(metadata=...)`` of a field holding a section of one of ``types`` (or None)."""
    return {_VARIANTS: types, **metadata}


def field_values(section_type: type, values: Mapping[str, Any]) -> dict[str, Any]:
    """The fields of ``section_type`` that ``values`` give (options converted, sections folded)."""
    found: dict[str, Any] = {}
    for field in dataclasses.fields(section_type):
        kinds = section_types(field)
        option: Option | None = field.metadata.get(_OPTION)
        if kinds:
            found[field.name] = fold(kinds[0], values)
        elif option is not None and option.keyword in values:
            found[field.name] = option.field_value(values[option.keyword])
    return found


def fold(section_type: type, values: Mapping[str, Any]) -> Any:
    """The ``section_type`` section that ``values`` (keyword -> value) describe: its own ``fold``
    where it has one (a section that may be absent, a choice among variants), else its fields."""
    own = getattr(section_type, "fold", None)
    return own(values) if own is not None else section_type(**field_values(section_type, values))


def flag(section_type: type, name: str) -> str:
    """The spelling of the option of field ``name`` of ``section_type``, e.g. ``--gpu``."""
    found = next(f for f in dataclasses.fields(section_type) if f.name == name)
    return str(found.metadata[_OPTION].name)


def spelling(keyword: str) -> str:
    """The spelling of the option whose keyword is ``keyword`` (``"gpu"`` -> ``--gpu``), for a
    message of a module below the sections (graphmem.job.sections imports it)."""
    if keyword not in _BY_KEYWORD:
        importlib.import_module("graphmem.job.job")  # the tree, declared when its modules load
    return _BY_KEYWORD[keyword].name
