"""graphmem run records a program's model with four of its stack of alike blocks and places the
others (graphmem.trace.program.stacks, graphmem.trace.repeat.place.repeat_program): the same
recording, op for op and storage for storage, as the whole model's; where that cannot be
shown the model is recorded whole."""

from __future__ import annotations

import pytest

from graphmem import run_program
from graphmem.job.program import make_program
from graphmem.trace.program.run import trace_program
from tests.conftest import ROOT

STACKED = str(ROOT / "tests" / "programs" / "stacked.py")


def _both(monkeypatch: pytest.MonkeyPatch, argv: list[str], **kwargs: object) -> tuple[object, object]:
    runs = []
    for repeated in ("1", "0"):
        monkeypatch.setenv("GRAPHMEM_REPEATED_BLOCKS", repeated)
        runs.append(run_program(STACKED, argv, **kwargs).train)  # type: ignore[arg-type]
    return runs[0], runs[1]


@pytest.mark.parametrize(("argv", "kwargs"), [
    ([], {}),
    (["--device", "cuda", "--checkpoint"], {"gpu": "h100-80gb"}),
    pytest.param(["--device", "cuda"], {"gpu": "h100-80gb", "nproc_per_node": 2}, marks=pytest.mark.slow),  # ~20 s
], ids=["cpu", "gpu-checkpointed", "gpu-fsdp-2-ranks"])
def test_a_stack_recorded_once_gives_the_whole_recording(monkeypatch: pytest.MonkeyPatch, argv: list[str],
                                                          kwargs: dict[str, object]) -> None:
    cut, whole = _both(monkeypatch, argv, **kwargs)
    assert cut is not None and whole is not None
    assert cut.trace.ops == whole.trace.ops and cut.trace.storages == whole.trace.storages  # type: ignore[attr-defined]
    assert cut.peak_bytes == whole.peak_bytes and cut.iteration_peaks == whole.iteration_peaks  # type: ignore[attr-defined]
    if "gpu" in kwargs:
        assert cut.allocator == whole.allocator  # type: ignore[attr-defined]


def test_the_stack_is_cut_as_the_model_is_built() -> None:
    """Blocks added to a ModuleDict one by one: four recorded, the twelve placed."""
    traced = trace_program(make_program(STACKED, ("--layers", "12")), cut=True)
    assert traced.cut == ("layers", 12)
    assert sum(1 for op in traced.trace.ops if op.module.startswith("layers.11.")) > 0


def test_blocks_built_before_their_container_are_recorded_whole() -> None:
    """Every block made before the ModuleDict that holds them: their construction is recorded,
    so nothing is cut."""
    traced = trace_program(make_program(STACKED, ("--built-first",)), cut=True)
    assert traced.cut is None
