"""torch.compile'd training under ``graphmem run`` against the same program compiled and run for
real on the CPU (inductor's C++ backend), counted by tests/allocator_oracle.py: every allocation
and free of the CPU allocator (inductor's wrapper allocates its buffers without passing through
the dispatcher, so tests/oracles.py's storage counter cannot see them).  That counter is first
checked against the storage counter on an eager step: equal."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from graphmem import run_program
from tests import oracles
from tests.allocator_oracle import measure_training
from tests.conftest import ROOT
from tests.oracles import Measured

PROGRAMS = ROOT / "tests" / "programs"


def _tiny_gpt() -> object:
    from examples.gpt import GPT

    return GPT(vocab=256, dim=64, layers=2, heads=4, max_seq=64)


def test_the_allocator_count_equals_the_storage_count_on_an_eager_step() -> None:
    """The same eager AdamW training step (a tiny GPT, 2 iterations), counted both ways."""
    import torch

    torch.manual_seed(0)
    ids = [torch.randint(0, 256, (2, 64))]
    by_allocator = measure_training(_tiny_gpt, ids, oracles.OPTIMIZERS["adamw"])  # type: ignore[arg-type]
    by_storages = oracles.measure_training(_tiny_gpt, ids, oracles.OPTIMIZERS["adamw"], "cross_entropy")  # type: ignore[arg-type]
    assert by_allocator.peak_bytes == by_storages.peak_bytes
    assert by_allocator.phase_peaks["backward"] == by_storages.phase_peaks["backward"]


def _real_run(script: Path, argv: list[str], steps: int) -> Measured:
    """The program run for real in a process of its own, as a user runs it (a run in this process
    would meet what earlier tests left in dynamo's and inductor's in-process state)."""
    code = ("import json, sys; from tests.allocator_oracle import measure_program; "
            "m = measure_program(sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])); "
            "print(json.dumps([m.peak_bytes, m.phase_peaks]))")
    done = subprocess.run([sys.executable, "-c", code, str(script), json.dumps(argv), str(steps)],
                          capture_output=True, text=True, cwd=ROOT, timeout=600, check=True)
    peak, phases = json.loads(done.stdout.strip().splitlines()[-1])
    return Measured(peak, phases)


def _equal(script: Path, argv: list[str], steps: int = 2) -> None:
    real = _real_run(script, argv, steps)
    predicted = run_program(str(script), argv, steps=steps).train
    assert predicted is not None
    assert predicted.peak_bytes == real.peak_bytes
    assert list(predicted.iteration_peaks) == [real.phase_peaks[f"step {k + 1}"] for k in range(steps)]


@pytest.mark.slow
@pytest.mark.parametrize("argv", [[], ["--graph-break"]], ids=["whole-graph", "graph-break"])
def test_a_compiled_gpt_equals_the_real_compiled_run(argv: list[str]) -> None:
    """``model = torch.compile(model)`` (default mode), AdamW: the partitioner's saved tensors,
    inductor's buffers in its wrapper's order, the compiled backward; with a print between the
    blocks, two compiled graphs and the eager code between them.  Each step's peak, to the byte."""
    _equal(PROGRAMS / "compiled_gpt.py", argv)


@pytest.mark.slow
def test_nanogpt_style_script(tmp_path: Path) -> None:
    """A numpy memmap of tokens, from_numpy batches, weight tying, SDPA, an evaluation before
    training (its own compiled inference graph), gradient accumulation, clipping, a GradScaler,
    torch.compile, checkpoint saves: as compiled."""
    _equal(PROGRAMS / "nanogpt_style.py", ["--out", str(tmp_path)])
