"""Models that cannot be built on the meta device: the prediction still equals the real-execution
oracle to the byte, and the command line says how the model was built, with docs/exit-codes.md's
codes for the model's own errors (2) and for graphmem's limit on real builds (3)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import pytest

import graphmem
from tests import fallback_models as fm
from tests.conftest import ROOT
from tests.oracles import OPTIMIZERS, measure_inference, measure_training, real_inputs

# model, inputs, integer inputs' upper bound, how it is built
MODELS = [
    (fm.RegNetLike, ["2x3x16x16"], 0, "fake tensors"),
    (fm.DropPathNet, ["4x8x32"], 0, "real tensors on the CPU"),
    (fm.UniqueWidths, ["4x12:int64"], 50, "real tensors on the CPU"),
]


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("cls, inputs, high, how", MODELS, ids=lambda v: getattr(v, "__name__", ""))
def test_training_peak_matches_real_execution(cls: type, inputs: list[str], high: int, how: str,
                                              optimizer: str) -> None:
    measured = measure_training(cls, real_inputs(inputs, high), OPTIMIZERS[optimizer], "sum")
    predicted = graphmem.analyze(cls, inputs, mode="train", optimizer=optimizer, loss="sum")
    assert predicted.train is not None
    assert predicted.train.peak_bytes == measured.peak_bytes
    assert {p.phase: p.peak_bytes for p in predicted.train.phases} == measured.phase_peaks
    assert any(how in note for note in predicted.train.assumptions)


@pytest.mark.parametrize("cls, inputs, high, how", MODELS, ids=lambda v: getattr(v, "__name__", ""))
def test_inference_peak_matches_real_execution(cls: type, inputs: list[str], high: int, how: str) -> None:
    measured = measure_inference(cls, real_inputs(inputs, high))
    predicted = graphmem.analyze(cls, inputs, mode="inference")
    assert predicted.inference is not None and predicted.inference.peak_bytes == measured.peak_bytes


# --- the command line ---------------------------------------------------------------------------

class Run(NamedTuple):
    code: int
    out: str
    err: str


FILE = "tests/fallback_models.py"
CALLS = {
    "regnet": ["analyze", f"{FILE}:RegNetLike", "--input", "2x3x16x16"],
    "drop_path_json": ["analyze", f"{FILE}:DropPathNet", "--input", "4x8x32", "--format", "json"],
    "buggy": ["analyze", f"{FILE}:BuggyConfig", "--input", "2x8"],
    "buggy_kwargs": ["analyze", f"{FILE}:BuggyConfig", "--input", "2x8", "--kwargs", '{"levels": 2}'],
    "huge_json": ["analyze", f"{FILE}:HugeAfterRead", "--input", "2x40000", "--format", "json"],
    "exits": ["analyze", f"{FILE}:ExitsAfterRead", "--input", "2x4"],
}


def _run(args: list[str]) -> Run:
    done = subprocess.run([sys.executable, "-m", "graphmem", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=180, env={**os.environ, "PYTHONPATH": str(ROOT)})
    return Run(done.returncode, done.stdout, done.stderr)


@pytest.fixture(scope="module")
def runs() -> dict[str, Run]:
    with ThreadPoolExecutor(max_workers=2) as pool:  # each run spends its time importing torch
        futures = {name: pool.submit(_run, args) for name, args in CALLS.items()}
        return {name: future.result() for name, future in futures.items()}


def _failure(run: Run, code: int, fragment: str) -> None:
    assert run.code == code, run
    assert fragment in run.err and "Error: " in run.err and "Traceback" not in run.err, run.err


def test_the_report_says_how_the_model_was_built(runs: dict[str, Run]) -> None:
    run = runs["regnet"]
    assert run.code == 0, run
    assert ("Assumed: tests/fallback_models.py:RegNetLike reads tensor values while it is built, which the "
            "meta device cannot answer (Tensor.item() cannot be called on meta tensors); it was built with fake "
            "tensors instead (sizes without values, no memory taken)") in run.out
    run = runs["drop_path_json"]
    assert run.code == 0, run
    notes = json.loads(run.out)["train"]["assumptions"]
    assert any("it was built once with real tensors on the CPU (67.80 KiB created, the limit is 2.00 GiB), "
               "then moved to the meta device" in note for note in notes), notes


def test_the_models_own_error_is_a_usage_error(runs: dict[str, Run]) -> None:
    _failure(runs["buggy"], 2, "tests/fallback_models.py:BuggyConfig could not be built: KeyError: 'classes'")
    assert "--kwargs" not in runs["buggy"].err
    _failure(runs["buggy_kwargs"], 2, "could not be built: KeyError: 'classes'; check --kwargs")
    _failure(runs["exits"], 2, "tests/fallback_models.py:ExitsAfterRead exited during construction: SystemExit(3)")


def test_a_real_build_past_the_limit_is_an_analysis_failure(runs: dict[str, Run]) -> None:
    run = runs["huge_json"]
    assert run.code == 3, run
    error = json.loads(run.out)["error"]
    assert error["kind"] == "analysis" and error["exit_code"] == 3
    assert "past graphmem's limit of 2.00 GiB" in error["message"]
