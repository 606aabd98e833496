"""Blame where the memory is made: the optimizer step's bytes are the optimizer step's.

On the CUDA target AdamW runs as foreach kernels: ``_foreach_sqrt`` makes one temporary per
parameter in one op, and that op reads the first parameter first.  Its bytes, and the
optimizer state, belong to the row "(optimizer step)" of the per-module table (text and
JSON), the peak's "module" line, the HTML page and the DOT module graph; the forward and
backward keep their modules.  Expected bytes are derived by hand (float32: 4 bytes an
element) from examples/gpt.py's shapes.
"""

from __future__ import annotations

import json
from pathlib import Path

import networkx as nx
import pytest
from click.testing import CliRunner

from graphmem.cli import main
from tests.conftest import ROOT

GPT = f"{ROOT}/examples/gpt.py:GPT"
OPTIMIZER_STEP = "(optimizer step)"


def _block(dim: int) -> int:
    """float32 elements of one Block: two LayerNorms, qkv, proj, fc and out with their biases."""
    return 2 * 2 * dim + (dim * 3 * dim + 3 * dim) + (dim * dim + dim) + (dim * 4 * dim + 4 * dim) \
        + (4 * dim * dim + dim)


def _gpt_params_bytes(vocab: int, dim: int, layers: int, max_seq: int) -> int:
    """tok + pos embeddings, the blocks, ln_f (the head is tied to tok): bytes."""
    return 4 * (vocab * dim + max_seq * dim + layers * _block(dim) + 2 * dim)


def _analyze(tmp_path: Path, *args: str) -> tuple[dict[str, object], str]:
    json_run = CliRunner().invoke(main, ["analyze", GPT, "--loss", "cross_entropy", "--mode", "train",
                                         "--optimizer", "adamw", "--gpu", "h100-80gb", "--format", "json",
                                         "--html", str(tmp_path / "page.html"), *args])
    assert json_run.exit_code == 0, json_run.output
    text_run = CliRunner().invoke(main, ["analyze", GPT, "--loss", "cross_entropy", "--mode", "train",
                                         "--optimizer", "adamw", "--gpu", "h100-80gb", *args])
    assert text_run.exit_code == 0, text_run.output
    return json.loads(json_run.output)["train"], text_run.output


def _where_row(text: str, key: str) -> str:
    section = text.split("Where the peak happens\n", 1)[1].split("\n\n", 1)[0]
    return next(line for line in section.splitlines() if line.startswith(key + " "))[len(key):].strip()


# 1 sequence of 64 tokens, a wider GPT: its parameters, not its activations, make the peak
OPTIMIZER_PEAK = ("--input", "1x64:int64", "--kwargs", '{"dim": 512, "layers": 4, "heads": 8}')


@pytest.fixture(scope="module")
def optimizer_peak(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, object], str, Path]:
    folder = tmp_path_factory.mktemp("optimizer_peak")
    train, text = _analyze(folder, *OPTIMIZER_PEAK)
    return train, text, folder


def test_foreach_temporaries_and_state_are_the_optimizer_steps(optimizer_peak: tuple[dict[str, object], str, Path]
                                                               ) -> None:
    train, text, _ = optimizer_peak
    peak = train["peak"]
    assert isinstance(peak, dict)
    # the CUDA default for AdamW is foreach: one sqrt over every parameter's second moment
    assert peak["op"] == "aten._foreach_sqrt.default" and peak["phase"] == "optimizer"
    assert peak["module"] == OPTIMIZER_STEP
    assert _where_row(text, "module") == OPTIMIZER_STEP
    params = _gpt_params_bytes(vocab=1000, dim=512, layers=4, max_seq=1024)
    assert params == 54_587_392
    tensors = 2 + 4 * 12 + 2  # tok, pos; 6 weights and 6 biases a block; ln_f's weight and bias
    rows = {r["module"]: r for r in train["modules"]}  # type: ignore[attr-defined]
    # at the first step's sqrt: exp_avg and exp_avg_sq (2 x params), a float32 step per tensor,
    # and the sqrt's output for every parameter (1 x params)
    assert rows[OPTIMIZER_STEP]["peak_bytes"] == 3 * params + 4 * tensors
    assert rows[OPTIMIZER_STEP]["optimizer_state_bytes"] == 2 * params + 4 * tensors == train["optimizer_state_bytes"]
    assert max(rows.values(), key=lambda r: r["peak_bytes"])["module"] == OPTIMIZER_STEP
    # the embedding the foreach op reads first keeps only its own weight and its gradient
    assert rows["tok"]["peak_bytes"] == 2 * 4 * 1000 * 512
    assert all(r["optimizer_state_bytes"] == 0 for name, r in rows.items() if name != OPTIMIZER_STEP)
    per_module = text.split("Per module, train (adamw), depth 2\n", 1)[1]
    assert any(line.startswith(OPTIMIZER_STEP + " ") for line in per_module.splitlines())


def test_html_names_the_optimizer_step(optimizer_peak: tuple[dict[str, object], str, Path]) -> None:
    _, _, folder = optimizer_peak
    page = (folder / "page.html").read_text()
    assert f"<tr><td>module</td><td class=num>{OPTIMIZER_STEP}</td></tr>" in page  # where the peak happens
    assert f"_foreach_sqrt in {OPTIMIZER_STEP}" in page  # the timeline's peak marker
    assert f"<tr><td>{OPTIMIZER_STEP}</td>" in page  # the per-module table's row


@pytest.mark.filterwarnings("ignore:'.*' deprecated - use:DeprecationWarning")
def test_dot_module_graph_marks_the_optimizer_step(tmp_path: Path) -> None:
    pytest.importorskip("pydot", reason="pydot is not installed (pip install 'graphmem[viz]')")
    result = CliRunner().invoke(main, ["analyze", GPT, "--loss", "cross_entropy", "--mode", "train",
                                       "--optimizer", "adamw", "--gpu", "h100-80gb", *OPTIMIZER_PEAK,
                                       "--dot", str(tmp_path / "modules.dot"), "--collapse", "module"])
    assert result.exit_code == 0, result.output
    graph = nx.nx_pydot.read_dot(str(tmp_path / "modules.dot"))
    peak_nodes = [n.strip('"') for n, a in graph.nodes(data=True) if "peak_op" in str(a.get("class", ""))]
    assert peak_nodes == [OPTIMIZER_STEP]


def test_backward_peak_keeps_its_modules(tmp_path: Path) -> None:
    train, text = _analyze(tmp_path, "--input", "8x256:int64")
    peak = train["peak"]
    assert isinstance(peak, dict)
    assert peak["phase"] == "backward" and peak["module"] == ""  # the loss's backward runs outside every module
    assert _where_row(text, "module") == "(root GPT)"
    rows = {r["module"]: r for r in train["modules"]}  # type: ignore[attr-defined]
    params = _gpt_params_bytes(vocab=1000, dim=128, layers=2, max_seq=1024)
    tensors = 2 + 2 * 12 + 2
    # live at this peak (in the second step's backward, before any gradient): each module's
    # parameters and what it saved for backward; the optimizer state in the optimizer's row
    for name in ("blocks.0", "blocks.1"):
        assert rows[name]["params_bytes"] == 4 * _block(128) == 793_088
        assert rows[name]["peak_bytes"] == rows[name]["params_bytes"] + rows[name]["activations_bytes"]
    assert rows["tok"]["peak_bytes"] == 4 * 1000 * 128 and rows["pos"]["peak_bytes"] == 4 * 1024 * 128
    assert rows[OPTIMIZER_STEP]["peak_bytes"] == rows[OPTIMIZER_STEP]["optimizer_state_bytes"] \
        == 2 * params + 4 * tensors
