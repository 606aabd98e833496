"""Stage 1: load.  ``"pkg.module:Attr"`` or ``"path/file.py:Attr"`` -> an ``nn.Module`` on meta.

Input: a target string (or an object from Python), constructor keyword arguments and an
optional dtype.  Output: an ``nn.Module`` whose parameters and buffers live on the meta
device, so no parameter memory is ever allocated, whatever the model's size.

The user's code runs here (its module's import, its constructor) as it would under
``python file.py`` with no arguments: ``sys.argv`` is the target alone, so a module that
parses the command line at import sees none of graphmem's options; a ``SystemExit`` is an
error (UserInputError), never the end of graphmem; CUDA calls in the constructor
(``.cuda()``, ``device="cuda"``, ``torch.cuda.is_available()``) are answered on the meta
device (graphmem.job.devices).  A constructor that reads tensor values, which the meta
device cannot answer, is built again under fake tensors, else once with real CPU tensors under
a limit (``construct_model``); the result is moved to meta and the report says so.  A
Hugging Face config's values are read by ``load_hf_config`` (graphmem.job.hf_config).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import inspect
import json
import os
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from graphmem.errors import UnsupportedError, UserInputError
from graphmem.job.fallback import TooLarge, first_line, on_cpu, on_fake, on_meta, reads_values
from graphmem.job.hf_config import load_hf_config
from graphmem.job.option import spelling
from graphmem.units import format_bytes

__all__ = ["resolve_target", "build_model", "construct_model", "BuiltModel", "load_hf_config", "ModelSource",
           "REAL_BUILD_LIMIT_BYTES"]

# What a user may hand to graphmem: a module class, a factory returning a module, or a module.
ModelSource = type[nn.Module] | Callable[..., nn.Module] | nn.Module

_TARGET_HINT = "expected TARGET as package.module:Attr or path/to/file.py:Attr"
_EXIT_HINT = ("graphmem imports TARGET and calls it; keep code that exits or parses the command line "
              "under `if __name__ == \"__main__\":`")


@contextlib.contextmanager
def _argv(program: str) -> Iterator[None]:
    """``sys.argv`` is ``[program]`` inside (graphmem's own options are not the user's)."""
    saved = sys.argv
    sys.argv = [program]
    try:
        yield
    finally:
        sys.argv = saved


def _exited(exc: SystemExit) -> str:
    return f"SystemExit({exc.code!r})"


def _target_of(source: Any, name: str) -> str:
    """``module:Attr`` or ``path/file.py:Attr`` naming ``source`` as the user would (best effort)."""
    module_name = getattr(source, "__module__", None) or "?"
    module = sys.modules.get(module_name)
    path = getattr(module, "__file__", None)
    if module_name.startswith("graphmem_user_") and path:  # a file target (see _import_module)
        module_name = os.path.relpath(path)
    return f"{module_name}:{name}"


def _import_module(module_part: str) -> Any:
    """Import a dotted module name or a ``.py`` file path.  The current directory is importable
    for this module only when it is not installed (after the installed packages, so a
    ``transformers.py`` there never stands in for the real one); no bytecode cache is written
    beside the user's files."""
    if module_part.split(".")[0] == "transformers":
        # never let transformers reach the network: configs come from local files only
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    with _no_bytecode_written():
        if module_part.endswith(".py") or os.sep in module_part or "/" in module_part:
            return _import_file(module_part)
        here = os.getcwd()
        top = module_part.split(".")[0]
        if here not in sys.path and "" not in sys.path and importlib.util.find_spec(top) is None:
            sys.path.append(here)
        return importlib.import_module(module_part)


def _import_file(module_part: str) -> Any:
    path = Path(module_part)
    if not path.is_file():
        raise UserInputError(f"file not found: {module_part!r}; {_TARGET_HINT}")
    name = f"graphmem_user_{path.stem}_{abs(hash(str(path.resolve())))}"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None, f"_import_module: no spec for {path}"
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    sys.path.insert(0, str(path.resolve().parent))  # let the file import its siblings
    try:
        spec.loader.exec_module(module)
    except BaseException:  # any failure, an interrupt too: cleaned up and re-raised
        sys.modules.pop(name, None)  # as importlib does: no half-imported module stays behind
        raise
    return module


@contextlib.contextmanager
def _no_bytecode_written() -> Iterator[None]:
    before = sys.dont_write_bytecode
    sys.dont_write_bytecode = True
    try:
        yield
    finally:
        sys.dont_write_bytecode = before


def resolve_target(target: str) -> ModelSource:
    """Import ``module:Attr`` and return Attr (a module class, a factory or a module).

    Raises:
        UserInputError: malformed target, module not importable, attribute missing, or the
            attribute is neither an nn.Module class, a callable, nor an nn.Module instance.
    """
    obj = import_attribute(target, "target", _TARGET_HINT, _is_model_like)
    if not _is_model_like(obj):
        raise UserInputError(f"{target!r} is a {type(obj).__name__}, not an nn.Module: expected an "
                             "nn.Module subclass, a function returning one, or a module instance")
    return obj  # type: ignore[no-any-return]


def import_attribute(target: str, what: str = "target", hint: str = _TARGET_HINT,
                     listed: Callable[[Any], bool] = callable) -> Any:
    """Import ``module:Attr`` (or ``path/file.py:Attr``) as python would import it and return Attr;
    ``what`` names it in errors, ``hint`` says how to write it, ``listed`` chooses the
    attributes named when Attr is missing.

    Raises:
        UserInputError: malformed text, module not importable or exits, attribute missing.
    """
    module_part, sep, attr_path = target.rpartition(":")
    if not sep or not module_part or not attr_path:
        raise UserInputError(f"malformed {what} {target!r}; {hint}")
    try:
        with _argv(target):
            module = _import_module(module_part)
    except UserInputError:
        raise
    except SystemExit as exc:
        raise UserInputError(f"{target} exited during import: {_exited(exc)}; {_EXIT_HINT}") from exc
    except ModuleNotFoundError as exc:
        if exc.name == "transformers":
            raise UserInputError("transformers is not installed; install it with: "
                                 "pip install 'graphmem[hf]'") from exc
        raise UserInputError(f"cannot import module {module_part!r}: {exc}; run graphmem from "
                             "the directory that contains it, or give path/to/file.py:Attr") from exc
    except Exception as exc:  # broad: the user's module may raise anything while importing; reported as theirs
        raise UserInputError(f"importing {module_part!r} failed: {type(exc).__name__}: {exc}") from exc
    obj: Any = module
    for part in attr_path.split("."):
        if not hasattr(obj, part):
            names = sorted(n for n, v in vars(module).items() if listed(v))
            kinds = "nn.Module classes and callables" if listed is _is_model_like else "callables"
            raise UserInputError(f"module {module_part!r} has no attribute {attr_path!r}; "
                                 f"{kinds} there: {', '.join(names) or 'none'}")
        obj = getattr(obj, part)
    return obj


def _is_model_like(obj: Any) -> bool:
    if isinstance(obj, nn.Module):
        return True
    if inspect.isclass(obj):
        return issubclass(obj, nn.Module)
    return inspect.isfunction(obj) or inspect.ismethod(obj) or isinstance(obj, Callable)  # type: ignore[arg-type]


def build_model(source: ModelSource, kwargs: Mapping[str, Any] | None = None,
                hf_config: Mapping[str, Any] | None = None, *, device: str = "cpu") -> nn.Module:
    """The model of ``construct_model``, without the note on how it was built."""
    return construct_model(source, kwargs, hf_config, device=device).module


def construct_model(source: ModelSource, kwargs: Mapping[str, Any] | None = None,
                    hf_config: Mapping[str, Any] | None = None, *, device: str = "cpu") -> BuiltModel:
    """Build the model under ``torch.device("meta")``, with ``sys.argv`` the target alone.

    A constructor that reads tensor values (``.item()``, ``int(t)``, ``.tolist()``, ops with
    value-dependent output shapes) cannot run on the meta device.  It is then built again
    under fake tensors (sizes without values; small constants such as ``torch.tensor(3.0)``
    are known), and if that fails too, with real CPU tensors, aborted before it creates more
    than ``REAL_BUILD_LIMIT_BYTES``.  Either way the result holds meta tensors only.

    Args:
        source: an nn.Module subclass, a factory returning an nn.Module, or an nn.Module
            (used as it is; the trace swaps fake tensors in and never modifies it).
        kwargs: keyword arguments for the class or factory.
        hf_config: for a Hugging Face transformers model class: the config values (a
            config.json's contents); the model is built as ``cls(cls.config_class(**values))``.
        device: the analysed device, ``cpu`` or ``cuda``: what ``torch.cuda.is_available()``
            tells the constructor.  Its CUDA calls (``.cuda()``, ``.to("cuda")``,
            ``device="cuda"``) leave the tensors on meta.

    Returns:
        The model (built models hold meta tensors only) and, when it could not be built on
        the meta device, a note saying how it was built and why.

    Raises:
        UserInputError: the constructor raised or exited, or did not return an nn.Module.
        UnsupportedError: only a real build would do, and it would pass the limit.
    """
    given = dict(kwargs or {})
    if isinstance(source, nn.Module):
        if given:
            raise UserInputError(f"{spelling('kwargs')} given, but the target is a module instance, not a "
                                 f"class or factory; drop {spelling('kwargs')} or point at the class")
        return BuiltModel(source, None)
    name = getattr(source, "__qualname__", repr(source))
    call_kwargs = given
    if hf_config is not None:
        config_class = getattr(source, "config_class", None)
        if config_class is None:
            raise UserInputError(f"{spelling('hf_config_file')} given, but {name} is not a transformers model class "
                                 f"(it has no config_class); drop {spelling('hf_config_file')} or point at one")
        call_kwargs = {"config": _make_config(config_class, {**hf_config, **given})}
    program = _target_of(source, name)
    # the model's own error names the options that fed its constructor, when any did, or the
    # arguments it lacks
    missing = _missing_arguments(source, call_kwargs)
    options = [o for o, used in ((spelling("kwargs"), bool(given) and not missing),
                                 (spelling("hf_config_file"), hf_config is not None))
               if used]
    hint = f"; check {' and '.join(options)}" if options else ""
    if hf_config is not None:
        hint += _mistyped(config_class, {**hf_config, **given})
    hint += missing
    build = functools.partial(source, **call_kwargs)
    with _argv(program):
        built = _build_with_fallbacks(build, program, hint, device)
    if not isinstance(built.module, nn.Module):
        raise UserInputError(f"{name}(...) returned a {type(built.module).__name__}, not an "
                             "nn.Module; point TARGET at a class or a factory of nn.Modules")
    return built


def _missing_arguments(source: Callable[..., Any], given: Mapping[str, Any]) -> str:
    """``; give the missing argument width with --kwargs '{"width": ...}'``: the constructor's
    required arguments that ``given`` lacks, for the error its call raises; "" if none (or its
    signature is unknown)."""
    try:
        parameters = inspect.signature(source).parameters.values()
    except (TypeError, ValueError):  # a builtin or C callable: nothing to name
        return ""
    missing = [p.name for p in parameters if p.default is inspect.Parameter.empty and p.name not in given
               and p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)]
    if not missing:
        return ""
    shown = {**{key: _short_json(value) for key, value in given.items()}, **dict.fromkeys(missing, "...")}
    example = "{" + ", ".join(f"{json.dumps(key)}: {value}" for key, value in shown.items()) + "}"
    what = "argument" if len(missing) == 1 else "arguments"
    return f"; give the missing {what} {', '.join(missing)} with {spelling('kwargs')} '{example}'"


def _short_json(value: Any) -> str:
    """A given --kwargs value as the user wrote it, or ``...`` when long or not JSON."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        return "..."
    return text if len(text) <= 40 else "..."


def _make_config(config_class: Any, values: Mapping[str, Any]) -> Any:
    """``config_class(**values)``; its refusal (a value of the wrong type, an unknown choice) is
    the user's config.json, not graphmem's bug."""
    try:
        return config_class(**values)
    except Exception as exc:  # broad: a config class (transformers' or the user's) may refuse with anything
        said = " ".join(str(exc).split()) or type(exc).__name__  # one line, however the class wrote it
        said = said if len(said) <= 200 else said[:197] + "..."
        raise UserInputError(f"{spelling('hf_config_file')}: {config_class.__name__} refused the config values: {said}"
                             f"{_mistyped(config_class, values)}; fix the value in the config.json or "
                             f"{spelling('hf_config')}") from exc


def _mistyped(config_class: Any, values: Mapping[str, Any]) -> str:
    """`` (hidden_size='big' where GPT2Config's default is the int 768)``: the given values whose
    type is not that of the config class's default number or flag, for an error message; "" if none."""
    try:
        defaults = config_class()
    except Exception:  # broad: a config class's own code; without defaults, the hint is left out (no error)
        return ""
    found = [f"{key}={value!r} where {config_class.__name__}'s default is the {type(default).__name__} {default!r}"
             for key, value in values.items()
             if isinstance(default := getattr(defaults, key, None), (int, float)) and not _same_kind(value, default)]
    return f" ({'; '.join(found)})" if found else ""


def _same_kind(value: Any, default: int | float) -> bool:
    """A flag for a flag, a whole number for a whole number, a number for a fraction."""
    if isinstance(default, bool) or isinstance(value, bool):
        return isinstance(default, bool) and isinstance(value, bool)
    return isinstance(value, int) if isinstance(default, int) else isinstance(value, (int, float))


@dataclass(frozen=True, slots=True)
class BuiltModel:
    """``construct_model``'s result."""

    module: nn.Module
    note: str | None  # how it was built, when not on the meta device (for the report)


def _build_with_fallbacks(build: Callable[[], Any], program: str, hint: str, device: str) -> BuiltModel:
    """On the meta device, else under fake tensors, else with real CPU tensors under the limit."""
    with _model_errors(program, hint):
        try:
            return BuiltModel(on_meta(build, device), None)
        except Exception as exc:  # broad: the constructor is user code; all but a value read is re-raised
            if not reads_values(exc):
                raise
            reason = first_line(exc)
    why = f"{program} reads tensor values while it is built, which the meta device cannot answer ({reason})"
    with _model_errors(program, hint, why):
        with contextlib.suppress(Exception):  # broad: user code; a real build then says if the fault is the model's
            return BuiltModel(on_fake(build, device),
                              f"{why}; it was built with fake tensors instead (sizes without values, no memory taken)")
        model, created = on_cpu(build, device, REAL_BUILD_LIMIT_BYTES)
        return BuiltModel(model, f"{why}; it was built once with real tensors on the CPU ({format_bytes(created)} "
                                 f"created, the limit is {format_bytes(REAL_BUILD_LIMIT_BYTES)}), then moved to the "
                                 "meta device")
    raise AssertionError(f"_build_with_fallbacks: no model and no error for {program}")


@contextlib.contextmanager
def _model_errors(program: str, hint: str, why: str = "") -> Iterator[None]:
    """The constructor's failures as graphmem errors naming the model (``why``: the meta
    device's failure, for a real build stopped at the limit)."""
    try:
        yield
    except SystemExit as exc:
        raise UserInputError(f"{program} exited during construction: {_exited(exc)}; {_EXIT_HINT}") from exc
    except TooLarge as exc:
        raise UnsupportedError(
            f"{why}, and building it with real tensors on the CPU would create {format_bytes(exc.nbytes)} "
            f"or more, past graphmem's limit of {format_bytes(REAL_BUILD_LIMIT_BYTES)} for such builds; compute "
            "sizes with Python numbers instead of tensors, or point TARGET at a module instance your file "
            "builds (file.py:model, with model = Net(...) at module level)") from None
    except Exception as exc:  # broad: the constructor is user code and may raise anything; reported as the model's
        raise UserInputError(f"{program} could not be built: {type(exc).__name__}: {exc}{hint}") from exc


# A model whose constructor needs real values is built once on the CPU; past this many bytes of
# tensors created the build is stopped (before the allocation, for torch's factory functions).
REAL_BUILD_LIMIT_BYTES = 2 * 2**30
