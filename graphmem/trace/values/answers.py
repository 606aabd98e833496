"""The answers the recorder gives when an op reads values its fake tensors do not hold.

Input: an op that raised a data-dependent error on fake tensors (``.item()``, ``nonzero``, a
size that depends on values), with what the user declared (``--assume``) and what graphmem
knows (shadows of assumed inputs, mask counts, the optimizer replica's reads).  Output: the
op's outputs, or its value, and the note the report shows.  The answerers are tried in one
order, written once in ``ValueAnswers.ANSWERERS``: the known values (shadows), a rule that
computes sizes from known values, a declared read, a declared size, the op's largest output.

Two reads raise no error and are answered here too: an op whose fake kernel sizes its output
without the values the real kernel reads (a conversion to a sparse layout: ``sized``), and a
read of a whole tensor's values that no op makes (``repr``, ``numpy()``: ``values_of``, for
graphmem.trace.values.reads).
"""

from __future__ import annotations

import linecache
import math
import sys
from collections.abc import Callable
from typing import Any

import torch

from graphmem._torch_api import (
    DynamicOutputShapeException,
    fake_like,
    hint_of,
    outside_modes,
    sparse_nnz,
    tree_flatten,
    tree_map,
    unset_fake_temporarily,
)
from graphmem.errors import TraceError
from graphmem.job.assume import KNOBS, Assumptions
from graphmem.job.option import spelling
from graphmem.trace.rules import ops
from graphmem.trace.rules.registry import ArgMeta, RuleTable, metas, output_bounds
from graphmem.trace.values.counts import NonzeroCounts
from graphmem.trace.values.shadows import FINITE, Shadows
from graphmem.trace.values.sparse import SPARSE_CONVERSIONS, is_sparse, most_elements, with_elements

__all__ = ["ValueAnswers"]

_NOT_MINE = object()  # an answerer's "not a read I answer"
# what a value-dependent op is called in a note
_BOUNDED_NAMES = {"index": "boolean-mask indexing", "_unique2": "unique", "unique_dim": "unique",
                  "_to_sparse": "to_sparse", "_to_sparse_csr": "to_sparse_csr", "_to_sparse_csc": "to_sparse_csc",
                  "_to_sparse_bsr": "to_sparse_bsr", "_to_sparse_bsc": "to_sparse_bsc"}
# bitsandbytes' LLM.int8 ops whose outlier columns are bounded (graphmem.trace.rules.quantized)
_INT8_OUTLIER_OPS = frozenset({"int8_vectorwise_quant", "int8_double_quant", "int8_mixed_scaled_mm"})
_INT8_OUTLIERS = ("LLM.int8 computes the input columns holding a value past its threshold (6.0) in 16 bits, "
                  "and how many there are depends on values; ")


class ValueAnswers:
    """Answers value reads for one recording; ``notes`` is the list of the report's
    assumptions, appended to as answers rest on one."""

    ANSWERERS = ("_from_shadows", "_from_values", "_declared_read", "_declared_size", "_bounded")

    def __init__(self, rules: RuleTable, assume: Assumptions, notes: list[str], read_note: str = "",
                 where: Callable[[], str] | None = None) -> None:
        self._rules = rules
        self.notes = notes
        self.kept = assume.kept  # --assume nonzero=F: value-dependent sizes at F of their most
        self.read_value = assume.reads  # --assume reads=N: a read of unknown values gives N
        self.read_note = read_note  # how notes say where read_value came from, when not from --assume reads=N
        self.where = where  # graphmem run: the program's line running now ("train.py:12"), named in read notes
        self.shadows = Shadows()
        self.shadows.routing = assume.routing
        self.counts = NonzeroCounts()  # masks built from zeros by setting k elements
        self.declared: dict[str, set[str]] = {}  # where a declared value answered (the model's line) -> modules
        self.bounded = False  # a value-dependent op was recorded at its bound
        self.declared_inputs = frozenset(assume.inputs)  # inputs whose values the user gave
        self.unseen: dict[str, set[str]] = {}  # input -> the ops its invented values would have sized
        # values the optimizer step reads, from graphmem.trace.step.replica; None: no optimizer step
        # is running (graphmem run: a program that updates its parameters itself reads as any code)
        self._replica: list[Any] | None = []
        self._replica_index = 0

    def weak_tables(self) -> tuple[list[Any], list[Any]]:
        """The tables that hold tensors by weak reference (graphmem.trace.core.recorder's swap):
        of their values, and of the tensors themselves."""
        values, kept = self.shadows.weak_tables()
        return [*values, *self.counts.weak_tables()], kept

    def use_replica(self, reads: list[Any] | None) -> None:
        """The optimizer step's reads from now on: ``reads``, in order (graphmem.trace.step.replica);
        None: no optimizer step is running (its reads are answered as any other's)."""
        self._replica, self._replica_index = reads, 0

    @property
    def replica_active(self) -> bool:
        """Whether an optimizer step's reads come from its replica now."""
        return self._replica is not None

    def replica_value(self) -> Any:
        """The optimizer step's next read, from its real one-element replica."""
        assert self._replica is not None, "replica_value: no optimizer step's replica is in use"
        if self._replica_index >= len(self._replica):
            raise TraceError("the optimizer's step reads values that depend on its parameters' sizes or values: "
                             "graphmem answers a step's reads from a real copy of the optimizer with one-element "
                             "parameters, and this step read more than that copy did; please report the optimizer")
        self._replica_index += 1
        return self._replica[self._replica_index - 1]

    def follow(self, func: Any, args: Any, kwargs: Any, out: Any, model: bool = True) -> None:
        """An op of the model's forward or loss (``model``), or of a program's own code, ran:
        carry the known values (and in the model, mask counts) to its outputs."""
        if not model:
            self.shadows.propagate(func, args, kwargs, out, decisions=False)
            return
        self.shadows.propagate(func, args, kwargs, out)
        self.counts.propagate(func, args, kwargs, out)
        if func == ops.SUM and args[0].dtype == torch.bool and self.shadows.get(out) is None:
            most = self.counts.most(args[0])
            self.shadows.mask_count(out, hint_of(args[0].numel()) if most is None else most)

    def answer(self, func: Any, args: Any, kwargs: Any, error: Exception, module: str) -> Any:
        """The outputs (or value) of ``func``, which raised ``error`` reading values, from the
        first answerer that can give them; ``module`` is where it runs, for the notes.

        Raises:
            ``error`` itself, when none can.
        """
        for name in self.ANSWERERS:
            out = getattr(self, name)(func, args, kwargs, error, module)
            if out is not _NOT_MINE:
                return out
        raise error

    def _from_shadows(self, func: Any, args: Any, kwargs: Any, error: Exception, module: str) -> Any:
        """The real answer of a value read, or fake outputs with the real (value-dependent) shapes.

        A size from values graphmem invented (an integer input nobody gave, filled with zeros)
        is no fact: where it is below the largest the op can give, the op is recorded at that
        (``_bounded``) and the input named in the report."""
        if not self.shadows.answerable(args, kwargs):
            return _NOT_MINE
        sources = self.shadows.sources(args, kwargs)
        real = self.shadows.run(func, args, kwargs)
        invented = sorted(self._invented(sources))
        if invented and self._below_bound(func, args, kwargs, error, real):
            op = func.__name__.split(".")[0]
            for name in invented:
                self.unseen.setdefault(name, set()).add(_BOUNDED_NAMES.get(op, op))
            return _NOT_MINE
        self.shadows.used |= sources
        if FINITE in sources and self.where is not None:  # graphmem run: the line that decided on it
            note = ("the program checked values graphmem does not know for NaN or inf, taken as finite: "
                    f"{self._read_at()}")
            if note not in self.notes:
                self.notes.append(note)
        if not isinstance(real, (torch.Tensor, tuple, list)):
            return real
        fake = tree_map(lambda r: torch.empty_strided(r.shape, r.stride(), dtype=r.dtype)
                        if isinstance(r, torch.Tensor) else r, real)
        self.shadows.attach(args, kwargs, fake, real)
        return fake

    def _invented(self, sources: frozenset[str]) -> set[str]:
        """The inputs among ``sources`` whose values graphmem chose by default (none declared)."""
        return {name for name, _, kind in (s.partition("=") for s in sources)
                if kind and name not in self.declared_inputs and name not in KNOBS}

    def _below_bound(self, func: Any, args: Any, kwargs: Any, error: Exception, real: Any) -> bool:
        """Whether a value-dependent size answered from ``real`` is below the op's bound."""
        rule = self._rules.output_bounds.get(func)
        if rule is None or not isinstance(error, DynamicOutputShapeException):
            return False
        try:
            bound = output_bounds(rule, *metas(args, kwargs))
        except NotImplementedError:
            return False
        got = [t.numel() for t in tree_flatten(real)[0] if isinstance(t, torch.Tensor)]
        most = [math.prod(shape) for shape in bound.shapes(hint_of(bound.count))]
        return sum(got) < sum(most)

    def _from_values(self, func: Any, args: Any, kwargs: Any, error: Exception, module: str) -> Any:
        """Fake outputs from the op's ``value_kernel`` rule, given the known values of its
        arguments (not mine: no rule, or a value it needs is unknown)."""
        rule = self._rules.value_kernels.get(func)
        if rule is None:
            return _NOT_MINE
        known, sources = self.shadows.known_values(args, kwargs)
        with unset_fake_temporarily():  # the rule computes on the real values
            out = rule(*metas(args, kwargs, known))
        if out is None:
            return _NOT_MINE
        self.shadows.used |= sources
        return tree_map(lambda m: torch.empty_strided(m.shape, m.stride, dtype=m.dtype)
                        if isinstance(m, ArgMeta) else m, out)

    def _declared_read(self, func: Any, args: Any, kwargs: Any, error: Exception, module: str) -> Any:
        """A number read from values no shadow knows, as declared with ``--assume reads=N``: N in
        the tensor's kind (a condition: true unless N is 0).  Any other op that answers with a
        number or a condition (``torch.equal``, ``torch.allclose``) runs on the known values and
        N everywhere for the unknown (``values_of``)."""
        n = self.read_value
        if n is not None and func != ops.READ and _answers_a_number(func):
            swap = {id(t): self.values_of(t) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
            if all(value is not None for value in swap.values()):
                real_args, real_kwargs = tree_map(lambda a: swap.get(id(a), a) if isinstance(a, torch.Tensor) else a,
                                                  (tuple(args), dict(kwargs)))
                with outside_modes():
                    return func(*real_args, **real_kwargs)
        if func != ops.READ or n is None:
            return _NOT_MINE
        value = _in_kind(n, args[0])
        self.declared.setdefault(f"{self._read_at()} read as {value}", set()).add(module)
        return value

    def _read_at(self) -> str:
        """The line a read ran, as a note names it: its code (``where`` given: the program's
        line, ``file:line`` after it; else the model's)."""
        if self.where is None:
            return f"`{_model_line()}`"
        place = self.where()
        path, _, number = place.rpartition(":")
        code = _code_at(path, int(number)) if number.isdigit() else ""
        return f"`{code}` at {place}" if code else place

    def values_of(self, t: torch.Tensor) -> torch.Tensor | None:
        """The values of fake ``t`` as a real tensor, read as Python reads a whole tensor (``repr``,
        ``numpy()``, ``tolist()``; no op is recorded): the known ones (the shadow itself: writes
        through a numpy array reach it, as a real tensor's reach its storage), else the declared
        read in every element (no memory: one element, expanded), noted like ``_declared_read``'s;
        None where nothing is known or declared."""
        shadow = self.shadows.get(t)
        if shadow is not None:
            self.shadows.used |= shadow.sources
            return shadow.value
        if self.read_value is None or t.layout in (torch.sparse_bsr, torch.sparse_bsc):  # (blocks of what size?)
            return None
        value = _in_kind(self.read_value, t)
        shape = tuple(hint_of(d) for d in t.shape)
        self.declared.setdefault(f"{self._read_at()} read as {value}{' everywhere' * (math.prod(shape) != 1)}",
                                 set()).add("")
        with outside_modes():
            every = torch.full((), value, dtype=t.dtype).expand(shape)
            if t.layout is torch.sparse_coo:
                return every.to_sparse(t.sparse_dim())
            return every.to_sparse(layout=t.layout) if is_sparse(t) else every

    def sized(self, func: Any, args: Any, kwargs: Any, out: Any) -> Any:
        """``out``, or its stand-in, where ``func``'s fake kernel sizes it without the values the
        real kernel reads: a conversion to a sparse layout keeps the elements that are not zero
        (graphmem.trace.values.sparse), as many as the known values have, else the most it can
        keep (noted, like ``_bounded``).  Any other op: ``out`` itself."""
        if func not in SPARSE_CONVERSIONS or not isinstance(out, torch.Tensor):
            return out
        if self.shadows.answerable(args, kwargs):
            real = self.shadows.run(func, args, kwargs)
            with unset_fake_temporarily():  # (the fake mode would make it a fake first, of none)
                nnz = sparse_nnz(real)
            self.shadows.used |= self.shadows.sources(args, kwargs)
        else:
            most = most_elements(args[0], out)
            nnz = most if self.kept is None else min(most, math.ceil(most * self.kept))
            self.bounded = True
            note = self._bound_note(func.__name__.split(".")[0], "", nnz, most)
            if note not in self.notes:
                self.notes.append(note)
        if nnz == hint_of(sparse_nnz(out)) and not (is_sparse(out) and out.layout is not torch.sparse_coo):
            return out
        return fake_like(out, with_elements(out, nnz, args[0]))

    def _declared_size(self, func: Any, args: Any, kwargs: Any, error: Exception, module: str) -> Any:
        """``repeat_interleave`` of repeats no shadow knows (its output as long as their sum), as
        declared with ``--assume reads=N``: N elements."""
        if func != ops.REPEAT_BY_VALUES or self.read_value is None:
            return _NOT_MINE
        self.declared.setdefault(f"`{_model_line()}` repeating to {self.read_value} elements", set()).add(module)
        return torch.empty(self.read_value, dtype=args[0].dtype)

    def _bounded(self, func: Any, args: Any, kwargs: Any, error: Exception, module: str) -> Any:
        """Outputs at the op's largest size (``output_bounds`` rules), or at the declared
        fraction of it (``kept``), noted in the report: the peak is then an upper bound."""
        rule = self._rules.output_bounds.get(func)
        if rule is None or not isinstance(error, DynamicOutputShapeException):
            return _NOT_MINE
        try:
            bound = output_bounds(rule, *metas(args, kwargs))
        except NotImplementedError:
            raise error from None
        most = hint_of(bound.count)  # with sizes as symbols, the trace is then not kept as a formula
        set_at_most = self.counts.most(args[0]) if func == ops.NONZERO else None
        if set_at_most is not None:  # a mask made from zeros by setting some elements
            most = min(most, set_at_most)
        count = most if self.kept is None else min(most, math.ceil(most * self.kept))
        self.bounded = True
        outs = tuple(torch.empty(shape, dtype=dtype)
                     for shape, (_, dtype) in zip(bound.shapes(count), bound.outputs, strict=True))
        note = self._bound_note(func.__name__.split(".")[0], module, count, most)
        if note not in self.notes:
            self.notes.append(note)
        self.counts.propagate(func, args, kwargs, outs[0] if len(outs) == 1 else outs)  # nonzero: its positions
        return outs[0] if len(outs) == 1 else outs

    def _bound_note(self, op: str, module: str, count: int, most: int) -> str:
        if op in _INT8_OUTLIER_OPS and self.kept is None:  # one note for every int8 layer
            return (f"upper bound (int8 base): {_INT8_OUTLIERS}recorded with every column an outlier, the most "
                    f"there can be (declare a fraction with {spelling('assume')} nonzero=0.5)")
        if op in _INT8_OUTLIER_OPS:
            return (f"int8 base: {_INT8_OUTLIERS}recorded with {self.kept:g} of the columns outliers, as declared "
                    f"with {spelling('assume')} nonzero={self.kept:g}")
        name = _BOUNDED_NAMES.get(op, op)
        where = f"{name} in {module}" if module else name
        if self.kept is None:  # (graphmem run, with read_note, has no --assume)
            declare = "" if self.read_note else f" (declare a fraction with {spelling('assume')} nonzero=0.5)"
            return (f"upper bound: {where} depends on values; recorded keeping {count:,} elements, the most it "
                    f"can{declare}")
        return (f"{where} depends on values; recorded keeping {count:,} of {most:,} elements, "
                f"as declared with {spelling('assume')} nonzero={self.kept:g}")

    def unseen_note(self) -> list[str]:
        """The note on sizes recorded at their bound because the values they depend on were
        invented (empty when none were)."""
        if not self.unseen:
            return []
        ops, names = sorted(set().union(*self.unseen.values())), ", ".join(sorted(self.unseen))
        return [f"upper bound: the sizes of {' and '.join(ops)} depend on values of {names} that graphmem did not "
                "see (an integer input nobody gave is filled with zeros, which would have made them smaller): they "
                f"were recorded at the most they can be; give the real values with {spelling('sample')} FILE"]

    def declared_notes(self) -> list[str]:
        """The report's notes on ``--assume reads=N``: each line of the model's code it answered.
        With ``read_note`` (graphmem run, whose report takes these notes alone) every other note
        of the recording after them (sizes recorded at their bound)."""
        if self.read_note:
            return [f"{self.read_note}: {what}{f' ({len(modules)} places)' if len(modules) > 1 else ''}"
                    for what, modules in self.declared.items()] + self.notes
        return [f"a value the model computes and reads was taken as declared with {spelling('assume')} "
                f"reads={self.read_value}: "
                f"{what}{f' (in {len(modules)} modules)' if len(modules) > 1 else ''}; the peak holds for that value"
                for what, modules in self.declared.items()]


def _answers_a_number(func: Any) -> bool:
    """Whether op ``func`` returns numbers or conditions only, no tensor (``aten.equal``)."""
    returns: Any = getattr(getattr(func, "_schema", None), "returns", None) or ()
    return bool(returns) and all(str(r.type) in ("bool", "int", "float", "Scalar") for r in returns)


def _in_kind(n: int, t: torch.Tensor) -> Any:
    """The declared read ``n`` as a value of ``t``'s kind: a condition (true unless ``n`` is 0), a
    float, or an integer."""
    return bool(n) if t.dtype == torch.bool else float(n) if t.is_floating_point() else n


def _model_line() -> str:
    """The innermost line of the model's own code on the stack (not torch's, not graphmem's)."""
    frame = sys._getframe(1)
    while frame is not None:
        path = frame.f_code.co_filename
        if not any(part in path for part in ("/torch/", "/graphmem/", "<")):
            return _code_at(path, frame.f_lineno)
        frame = frame.f_back  # type: ignore[assignment]
    return ""


def _code_at(path: str, number: int) -> str:
    """Line ``number`` of the file at ``path``, stripped, without its comment, cut to 100 characters."""
    return linecache.getline(path, number).split("  #")[0].strip()[:100]
