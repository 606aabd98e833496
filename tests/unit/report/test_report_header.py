"""The words a user reads: the report header, short op names, the scratch-memory note, and
iterations counted from 1 in text and JSON alike.

Expected parameter counts come from the real torch modules (``numel`` of each distinct
parameter), never from graphmem's helpers.
"""

from __future__ import annotations

import json
import re

import pytest
import torch

import graphmem
from graphmem.memory.results import PeakInfo
from graphmem.report import RENDERERS
from graphmem.report.header import optimizer_implementation, parameter_count
from graphmem.report.json import SCHEMA_VERSION
from graphmem.report.scratch_note import scratch_note, workspace_ops
from tests.models import TiedAutoencoder, bf16_mlp


def _numel_by_dtype(model: torch.nn.Module) -> dict[str, int]:
    counts: dict[str, int] = {}
    for p in model.parameters():  # parameters() yields a tied weight once
        name = str(p.dtype).removeprefix("torch.")
        counts[name] = counts.get(name, 0) + p.numel()
    return counts


@pytest.mark.parametrize("build, inputs", [(TiedAutoencoder, ["3x256"]), (bf16_mlp, ["4x256:bf16"])])
def test_parameter_count_is_the_models_own(build: object, inputs: list[str]) -> None:
    report = graphmem.analyze(build, inputs, optimizer="sgd", loss="sum")
    assert report.train is not None and report.inference is not None
    expected = _numel_by_dtype(build())  # type: ignore[operator]
    assert parameter_count(report.train) == expected
    assert parameter_count(report.inference) == expected


def test_header_names_model_parameters_inputs_optimizer_and_device() -> None:
    report = graphmem.analyze(TiedAutoencoder, ["3x256"], optimizer="adam", optimizer_impl="foreach", loss="sum")
    text = RENDERERS["table"](report)
    total = sum(_numel_by_dtype(TiedAutoencoder()).values())
    head = text.split("\n\n")[0].splitlines()
    assert head[0] == "graphmem analyze"
    assert re.match(rf"parameters +{total:,} float32 \(", head[2]), head
    assert any(re.fullmatch(r"inputs +3x256 float32", line) for line in head), head
    assert any(re.fullmatch(r"optimizer +adam \(foreach\)", line) for line in head), head
    assert any(re.fullmatch(r"device +cpu", line) for line in head), head


@pytest.mark.parametrize("impl", ["for-loop", "foreach"])
def test_optimizer_implementation_is_what_ran(impl: str) -> None:
    report = graphmem.analyze(TiedAutoencoder, ["3x256"], optimizer="adam", optimizer_impl=impl, mode="train")
    assert report.train is not None
    assert optimizer_implementation(report.train) == impl


def test_short_op_name_drops_namespace_and_overload() -> None:
    def name(op: str) -> str:
        return PeakInfo(step=0, op=op, module="", phase="forward", iteration=0).op_name

    assert name("aten.relu.default") == "relu"
    assert name("aten._log_softmax_backward_data.default") == "_log_softmax_backward_data"
    assert name("aten.div.Tensor") == "div"


def test_peak_shows_short_op_name_and_json_keeps_the_full_one() -> None:
    report = graphmem.analyze(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()), ["2x4"],
                              mode="inference")
    assert report.inference is not None and report.inference.peak.op.startswith("aten.")
    where = RENDERERS["table"](report).split("Where the peak happens\n")[1].splitlines()
    assert re.fullmatch(rf"op +{report.inference.peak.op.split('.')[1]}", where[2]), where
    assert json.loads(RENDERERS["json"](report))["inference"]["peak"]["op"] == report.inference.peak.op


def test_iteration_counts_from_one_in_text_and_json() -> None:
    report = graphmem.analyze(TiedAutoencoder, ["3x256"], optimizer="adam", mode="train")
    data = json.loads(RENDERERS["json"](report))
    assert data["schema_version"] == SCHEMA_VERSION == 2
    shown = re.search(r"phase +\w+ \(iteration (\d)\)", RENDERERS["table"](report))
    assert shown is not None and data["train"]["peak"]["iteration"] == int(shown.group(1))
    assert data["train"]["peak"]["iteration"] in (1, 2)  # the step runs two iterations


def test_no_scratch_note_for_plain_ops_on_cpu() -> None:
    report = graphmem.analyze(TiedAutoencoder, ["3x256"], loss="sum")
    assert "scratch" not in RENDERERS["table"](report)
    assert report.train is not None and report.train.unmodeled_ops  # JSON still lists them all
    assert json.loads(RENDERERS["json"](report))["train"]["unmodeled_ops"] == list(report.train.unmodeled_ops)


def test_scratch_note_names_only_ops_that_can_matter() -> None:
    ops = ["aten.relu.default", "aten.mm.default", "aten.convolution.default", "aten._cudnn_rnn.default"]
    assert scratch_note(ops, "cpu") is None
    found = workspace_ops(ops, "cuda")
    # mm's cuBLAS workspace is modelled; relu takes none
    assert set(found) == {"aten.convolution.default", "aten._cudnn_rnn.default"}
    note = scratch_note(ops, "cuda")
    assert note is not None and "- convolution: cuDNN" in note and "aten." not in note
    # a custom op's kernel is unknown on every device
    assert set(workspace_ops(["mylib.fused.default"], "cpu")) == {"mylib.fused.default"}
