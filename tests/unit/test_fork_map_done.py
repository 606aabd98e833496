"""fork_map's ``done`` callback: called in the calling process once per item as it ends, with
the same results fork_map returns in order."""

from __future__ import annotations

import pytest

from graphmem.process.workers import fork_map


def _square(n: int) -> int:
    return n * n


@pytest.mark.parametrize("processes", ["1", "3"])
def test_done_sees_every_result_once(monkeypatch: pytest.MonkeyPatch, processes: str) -> None:
    monkeypatch.setenv("GRAPHMEM_PROCESSES", processes)
    seen: list[tuple[int, int]] = []
    results = fork_map(_square, [1, 2, 3, 4, 5], what="squaring", done=lambda i, r: seen.append((i, r)))
    assert results == [1, 4, 9, 16, 25]
    assert sorted(seen) == [(0, 1), (1, 4), (2, 9), (3, 16), (4, 25)]


def test_without_done_nothing_changes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GRAPHMEM_PROCESSES", "2")
    assert fork_map(_square, [3, 4], what="squaring") == [9, 16]
