"""max-batch's text: "1 analysis" (not "1 analyses"); sizes that would read the same are
written with more digits, so the answer and one past it never show the same number."""

from __future__ import annotations

from fractions import Fraction

from graphmem.preflight.budget import Budget
from graphmem.preflight.search import SearchResult
from graphmem.report.preflight_text import Context, render_search_table, told_apart
from graphmem.units import format_bytes

GIB = 2**30


def _result(at_max: int | None, at_next: int, evaluated: tuple[tuple[int, int], ...]) -> SearchResult:
    budget = Budget(total_bytes=24 * GIB, margin=Fraction(0), source="24GiB")
    return SearchResult(symbol="B", max_value=17 if at_max else 0, peak_bytes_at_max=at_max,
                        peak_bytes_at_next=at_next, budget=budget, bytes_per_unit=None, fixed_bytes=None,
                        affine=False, evaluated=evaluated, recorded=tuple(v for v, _ in evaluated))


def _table(result: SearchResult) -> str:
    return render_search_table(result, Context(target="m:M", inputs=("Bx8",), device="cpu", mode="train"))


def test_one_analysis_is_singular() -> None:
    text = _table(_result(None, 30 * GIB, ((1, 30 * GIB),)))
    assert "1 analysis, at B = 1" in text and "analyses" not in text


def test_two_sizes_that_round_alike_get_more_digits() -> None:
    # 23,685,471,518 B / 2**30 = 22.05881 GiB; + 1 MiB (1/1024 GiB = 0.00098) = 22.05979 GiB:
    # "22.06 GiB" both at 2 digits, 22.059 and 22.060 at 3
    at_max = 23_685_471_518
    at_next = at_max + 2**20
    assert format_bytes(at_max) == format_bytes(at_next) == "22.06 GiB"
    text = _table(_result(at_max, at_next, ((17, at_max), (18, at_next))))
    assert "22.059 GiB" in text and "22.060 GiB" in text, text
    assert "22.06 GiB" not in text, text
    assert "peaks up to 24.00 GiB fit" in text  # the cap reads apart from both: as it was


def test_sizes_that_read_apart_stay_as_they_are() -> None:
    assert told_apart([GIB, 2 * GIB], format_bytes) == {GIB: "1.00 GiB", 2 * GIB: "2.00 GiB"}


def test_sizes_a_byte_apart_are_written_in_bytes() -> None:
    assert told_apart([GIB, GIB + 1], format_bytes) == {GIB: "1,073,741,824 B", GIB + 1: "1,073,741,825 B"}


def test_only_the_sizes_that_collide_change() -> None:
    assert told_apart([GIB, GIB + 2**20, 2 * GIB], format_bytes) == {
        GIB: "1.000 GiB", GIB + 2**20: "1.001 GiB", 2 * GIB: "2.00 GiB"}  # 1 + 1/1024 = 1.00098
