"""Pre-flight answers on top of analyze(): will the job fit, and the largest batch (or
sequence length) that fits.

Input: a ``graphmem.job.Job`` (one dimension of its inputs may be
a letter such as ``B`` in ``Bx1000`` or ``S`` in ``1xSx64``) and a ``Budget``
(graphmem/preflight/budget.py).  Output: frozen ``Prediction`` / ``SearchResult`` / ``Sweep`` values.

The bytes compared with the budget are the CPU target's tensor bytes at the peak, or on the
CUDA target the caching allocator's reserved peak plus the CUDA context and NCCL's buffers
(graphmem/preflight/footprint.py, the one place the rule is written).  ``check`` itself is in
verdict.py.

The search (``find_largest_fit``) exploits that memory is affine in the batch size for most
models: two analyses (1 and 2) fit a line, the line predicts the answer N, and N and N+1 are
analysed to confirm it.  Where the peak is not affine (it moves to another phase, attention
is quadratic in the sequence, the CUDA allocator rounds), the search keeps a bracket
[fits, does not fit] and falls back to secant and bisection steps, so it is exact for any
peak that does not shrink as the dimension grows, in O(log N) analyses at worst.

An analysis is not a recording: the step is recorded at 1 and once with the dimension as a
symbol (``_Curves``, graphmem.trace.symbolic); every other value is that recording evaluated
there, while its guards hold.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from graphmem.api import PeakCurve, analyze, analyze_curve
from graphmem.errors import UserInputError
from graphmem.job.job import Job
from graphmem.job.load import build_model, resolve_target
from graphmem.job.spec import input_dims, input_symbol, substitute, validate_inputs
from graphmem.memory.results import MemoryReport, ModeReport
from graphmem.preflight.budget import Budget
from graphmem.preflight.footprint import compared_mode, needed_bytes
from graphmem.preflight.model_facts import position_limit
from graphmem.process import progress

__all__ = [
    "PREFLIGHT_MODES",
    "Prediction",
    "SearchResult",
    "find_largest_fit",
    "fit_line",
    "peak_of",
    "predict",
    "search_largest",
    "sweep",
    "Sweep",
    "SweepPoint",
]

PREFLIGHT_MODES = ("train", "inference")
_MAX_ROUNDS = 64


@dataclass(frozen=True, slots=True)
class Prediction:
    """One analysis: the bytes compared with budgets (footprint.needed_bytes), and the full report."""

    peak_bytes: int
    report: MemoryReport

    @property
    def mode_report(self) -> ModeReport:
        """The analysed mode's report (train or inference; with --generate, the higher step)."""
        return compared_mode(self.report, "train" if self.report.train is not None else "inference")


@dataclass(frozen=True, slots=True)
class SearchResult:
    """``graphmem max-batch`` / ``max-seq``'s answer.

    ``max_value`` fits and ``max_value + 1`` does not, both analysed (0: even 1 does not fit).
    ``bytes_per_unit`` and ``fixed_bytes``: the least-squares line through the analysed
    points near the answer (from half of it to twice it); ``affine``: every analysed point
    lies within 0.1% of that line.
    """

    symbol: str
    max_value: int
    peak_bytes_at_max: int | None
    peak_bytes_at_next: int | None  # None: max_value is the model's own limit (limited_by)
    budget: Budget
    bytes_per_unit: int | None  # None: a single analysis (even 1 did not fit)
    fixed_bytes: int | None
    affine: bool
    evaluated: tuple[tuple[int, int], ...]  # (value, peak bytes) of every analysis, by value
    limited_by: str | None = None  # the model's limit that stopped the search before the budget did
    recorded: tuple[int, ...] = ()  # the values the step was recorded at; the others were evaluated
    report_at_max: MemoryReport | None = None  # the analysis at max_value (None when nothing fits)


def peak_of(report: MemoryReport, mode: str) -> int:
    """The bytes the budget is compared with: CPU tensor bytes at the peak; CUDA the reserved
    peak plus the CUDA context and NCCL's buffers (graphmem/preflight/footprint.py)."""
    return needed_bytes(report, mode)


def predict(job: Job, value: int | None = None, *, checkpoint_comparison: bool = True) -> Prediction:
    """Analyse ``job`` (its symbolic dimension set to ``value``) and return its peak
    (``checkpoint_comparison``: as analyze takes it)."""
    if job.generate is None and job.mode not in PREFLIGHT_MODES:
        raise UserInputError(f"unknown mode {job.mode!r}; expected one of: {', '.join(PREFLIGHT_MODES)}")
    symbol = input_symbol(job.inputs.specs)
    if symbol is not None and value is None:
        raise AssertionError(f"predict: inputs {job.inputs.specs} need a value for {symbol}")
    report = analyze(job.with_inputs(tuple(substitute(t, symbol, value or 1) for t in job.inputs.specs)),
                     checkpoint_comparison=checkpoint_comparison)
    return Prediction(peak_of(report, job.mode), report)


def sequence_limit(job: Job, symbol: str) -> tuple[int, str] | None:
    """The longest sequence the model takes, when ``symbol`` is a sequence dimension (not an
    input's first): a transformers config's ``max_position_embeddings`` (``n_positions``,
    ``max_seq_len``), or the size of a position-embedding table (an nn.Embedding named
    ``*pos*``), with the reason; None when the model declares none."""
    if not any(dims.index(symbol) > 0 for dims in map(input_dims, job.inputs.specs) if symbol in dims):
        return None
    resolved = job.with_preset()
    for key in ("max_position_embeddings", "n_positions", "max_seq_len"):
        value = (resolved.model.hf_config or {}).get(key)
        if isinstance(value, int) and value > 0:
            return value, f"the model's {key} is {value}"
    model = resolved.model
    if model.target is None:
        return None
    source = resolve_target(model.target) if isinstance(model.target, str) else model.target
    return position_limit(build_model(source, model.kwargs, model.hf_config, device=resolved.device))


def find_largest_fit(peak_at: Callable[[int], int], cap_bytes: int, *, limit: int = 2**31 - 1
                     ) -> tuple[int, dict[int, int]]:
    """The largest v in [1, limit] with ``peak_at(v) <= cap_bytes``, assuming the peak never
    shrinks as v grows; 0 when even 1 does not fit.

    Returns:
        (v, every evaluated value -> peak).  When v > 0, v and v+1 were both evaluated.

    Raises:
        UserInputError: ``limit`` itself fits (the peak does not grow enough with v).
    """
    seen: dict[int, int] = {}

    def fits(v: int) -> bool:
        if v not in seen:
            seen[v] = peak_at(v)
        return seen[v] <= cap_bytes

    if not fits(1):
        return 0, seen
    if not fits(2):
        return 1, seen
    bracket = _Bracket(lo=2)
    for _ in range(_MAX_ROUNDS):
        if bracket.hi is not None and bracket.hi - bracket.lo <= 1:
            return bracket.lo, seen
        if bracket.lo >= limit:
            raise UserInputError(f"even {limit:,} fits the budget: the peak barely grows with this "
                                 "dimension; is the symbol in the right place?")
        guess, slope = bracket.next_guess(seen, cap_bytes, limit)
        bracket.update(guess, fits(guess))
        # the line says the answer is next to the guess: analyse the neighbour to confirm it
        neighbour = guess + 1 if bracket.lo == guess else guess - 1
        if slope > 0 and abs(seen[guess] - cap_bytes) <= slope and bracket.inside(neighbour):
            bracket.update(neighbour, fits(neighbour))
    raise AssertionError(f"find_largest_fit: no answer after {_MAX_ROUNDS} rounds ({bracket})")


@dataclass(slots=True)
class _Bracket:
    """find_largest_fit's state: ``lo`` fits, ``hi`` does not (None: not found yet).

    Guesses are where the chord between the ends meets the cap (regula falsi), with the
    Illinois rule (an end kept twice in a row counts half as far from the cap, so the chord
    turns towards it) and a bisection when two rounds did not halve the bracket.
    """

    lo: int
    hi: int | None = None
    kept: str = ""                # the end kept by the last update: "lo" or "hi"
    weight_lo: float = 1.0
    weight_hi: float = 1.0
    widths: list[int] = field(default_factory=list)
    rounds: int = 0

    def inside(self, value: int) -> bool:
        return self.lo < value and (self.hi is None or value < self.hi)

    def update(self, value: int, fits: bool) -> None:
        keeps = "hi" if fits else "lo"
        if keeps == self.kept:  # Illinois: the end kept twice in a row pulls the chord half as hard
            self.weight_hi, self.weight_lo = (self.weight_hi / 2, self.weight_lo) if fits else \
                (self.weight_hi, self.weight_lo / 2)
        else:
            self.weight_lo = self.weight_hi = 1.0
        self.kept = keeps
        self.lo, self.hi = (value, self.hi) if fits else (self.lo, value)

    def next_guess(self, seen: Mapping[int, int], cap: int, limit: int) -> tuple[int, float]:
        """The next value to analyse, and the bytes-per-unit slope it was extrapolated with."""
        self.rounds += 1
        if self.hi is None:  # extrapolate the widest chord; grow geometrically once it undershot
            left = min(seen)
            slope = (seen[self.lo] - seen[left]) / (self.lo - left)
            guess = self.lo + int((cap - seen[self.lo]) / slope) if slope > 0 else 2 * self.lo
            return min(max(guess, self.lo + 1, 2 * self.lo if self.rounds > 1 else 0), limit), slope
        self.widths.append(self.hi - self.lo)
        if len(self.widths) > 2 and 2 * self.widths[-1] > self.widths[-3]:
            return _split(self.lo, self.hi), 0.0
        below = (cap - seen[self.lo]) * self.weight_lo  # >= 0
        above = (seen[self.hi] - cap) * self.weight_hi  # > 0
        guess = self.lo + int((self.hi - self.lo) * below / (below + above))
        slope = (seen[self.hi] - seen[self.lo]) / (self.hi - self.lo)
        return max(self.lo + 1, min(guess, self.hi - 1)), slope


def _split(lo: int, hi: int) -> int:
    """Bisection, in log space while the bracket spans more than a factor of 4."""
    return math.isqrt(lo * hi) if hi > 4 * lo else (lo + hi) // 2


def fit_line(points: Mapping[int, int]) -> tuple[float, float, float]:
    """Least-squares line through (value, bytes) points: (slope, intercept, max relative residual)."""
    n = len(points)
    mean_x, mean_y = sum(points) / n, sum(points.values()) / n
    var = sum((x - mean_x) ** 2 for x in points)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in points.items()) / var if var else 0.0
    intercept = mean_y - slope * mean_x
    worst = max(abs(y - (intercept + slope * x)) / max(y, 1) for x, y in points.items())
    return slope, intercept, worst


def search_largest(job: Job, budget: Budget, *, limit: int = 2**31 - 1) -> SearchResult:
    """The largest value of the job's symbolic dimension whose predicted peak fits ``budget``.

    Returns:
        A SearchResult; the answer and the next value are both analysed.
    """
    symbol = validate_inputs(job.inputs.specs, symbolic=True)
    assert symbol is not None, "search_largest: validate_inputs returned no symbol"
    cap = sequence_limit(job, symbol)
    if cap is not None and cap[0] < limit:
        limit = cap[0]
        at_cap = predict(job, limit).peak_bytes
        if budget.fits(at_cap):  # the model's own limit comes before the budget's
            return SearchResult(symbol=symbol, max_value=limit, peak_bytes_at_max=at_cap, peak_bytes_at_next=None,
                                budget=budget, bytes_per_unit=None, fixed_bytes=None, affine=False,
                                evaluated=((limit, at_cap),), limited_by=cap[1], recorded=(limit,))
    curves = _Curves(job, symbol)
    best, seen = find_largest_fit(curves.peak_at, budget.cap_bytes, limit=limit)
    near = {v: b for v, b in seen.items() if best // 2 <= v <= 2 * best + 2} if best > 1 else seen
    slope, intercept, _ = fit_line(near if len(near) > 1 else seen)
    worst = max(abs(b - (intercept + slope * v)) / b for v, b in seen.items())
    fitted = len(seen) > 1
    return SearchResult(symbol=symbol, max_value=best, peak_bytes_at_max=seen.get(best),
                        peak_bytes_at_next=seen[best + 1], budget=budget,
                        bytes_per_unit=round(slope) if fitted else None,
                        fixed_bytes=round(intercept) if fitted else None, affine=fitted and worst <= 1e-3,
                        evaluated=tuple(sorted(seen.items())), recorded=tuple(curves.recorded),
                        report_at_max=curves.report_at(best) if best else None)


class _Curves:
    """The peak at any value of the job's size symbol, recording as little as it can: batch 1
    (sizes of 1 are special cases) with numbers, then one recording with the size as a symbol
    (graphmem.api.analyze_curve) for every value where its guards hold; a value outside them
    is recorded again there.  A recording that keeps no formula (it read input values, or a
    kernel needed numbers) holds at its own value only: the rest are recorded with numbers."""

    def __init__(self, job: Job, symbol: str) -> None:
        self.job, self.symbol = job, symbol
        self.curves: list[PeakCurve] = []
        self.recorded: list[int] = []  # the values recorded at, in order
        # False once a recording kept no formula; GRAPHMEM_SIZE_SYMBOLS=0 records every value
        # with numbers (the search as it was before, for comparisons)
        self.formula = os.environ.get("GRAPHMEM_SIZE_SYMBOLS", "1") != "0"
        self.recorded_reports: dict[int, MemoryReport] = {}  # the values recorded with numbers

    def peak_at(self, value: int) -> int:
        return peak_of(self.report_at(value), self.job.mode)

    def report_at(self, value: int) -> MemoryReport:
        for curve in self.curves:
            if curve.holds(value):
                return curve.at(value)
        if value in self.recorded_reports:
            return self.recorded_reports[value]
        self.recorded.append(value)
        with progress.labelled(f"analysis {len(self.recorded)}: {self.symbol}={value}"):
            return self._record(value)

    def _record(self, value: int) -> MemoryReport:
        if value < 2 or not self.formula:  # analyze, not predict: a sweep may ask for both modes
            job = self.job.with_inputs(tuple(substitute(t, self.symbol, value) for t in self.job.inputs.specs))
            self.recorded_reports[value] = analyze(job)
            return self.recorded_reports[value]
        curve = analyze_curve(self.job, hint=value)
        self.curves.append(curve)
        self.formula = curve.exact and any(curve.holds(v) for v in (value - 1, value + 1) if v >= 2)
        return curve.at(value)


@dataclass(frozen=True, slots=True)
class SweepPoint:
    """The peaks at one value of the swept dimension (None: the mode was not analysed): the
    analysis's own (CUDA: allocated), and what a budget is compared with (``needed_bytes``:
    the higher mode's, graphmem/preflight/footprint.py)."""

    value: int
    inference_peak_bytes: int | None
    train_peak_bytes: int | None
    needed_bytes: int = 0


@dataclass(frozen=True, slots=True)
class Sweep:
    """``analyze --sweep``: the peaks against one dimension, from as few recordings as the
    guards allow (``recorded``); ``budget``: the GPU's memory when one was named."""

    symbol: str
    points: tuple[SweepPoint, ...]
    recorded: tuple[int, ...]
    budget: Budget | None
    report: MemoryReport  # at the last value: the header's facts


def sweep(job: Job, values: Sequence[int], budget: Budget | None = None) -> Sweep:
    """The peaks of ``job`` (inputs with one size symbol) at each of ``values``.

    Raises:
        UserInputError: the inputs have no size symbol, or no values.
    """
    symbol = validate_inputs(job.inputs.specs, symbolic=True)
    assert symbol is not None, "sweep: validate_inputs returned no symbol"
    if not values:
        raise UserInputError("--sweep names no value")
    curves = _Curves(job, symbol)
    points, report = [], None
    for value in values:
        report = curves.report_at(value)
        modes = [m for m, found in (("inference", report.inference), ("train", report.train)) if found]
        points.append(SweepPoint(value, report.inference.budget_peak_bytes if report.inference else None,
                                 report.train.budget_peak_bytes if report.train else None,
                                 max(peak_of(report, m) for m in modes)))
    assert report is not None
    return Sweep(symbol=symbol, points=tuple(points), recorded=tuple(curves.recorded), budget=budget, report=report)
