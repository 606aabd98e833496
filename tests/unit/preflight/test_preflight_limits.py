"""Limits the model declares, and --generate in pre-flight."""

from __future__ import annotations

import json

from click.testing import CliRunner

import graphmem
from graphmem.cli import main
from graphmem.job import make_job
from graphmem.job.job import edited
from graphmem.preflight import check, parse_budget, resolve_budget, search_largest
from tests.conftest import ROOT

GPT = str(ROOT / "examples" / "gpt.py") + ":GPT"


def test_max_seq_stops_at_the_position_table() -> None:
    """The example GPT's position table has max_seq rows: a longer sequence is refused by the
    model, however large the budget."""
    from examples.gpt import GPT as Net

    rows = Net(layers=1, dim=32).pos.num_embeddings
    job = make_job(GPT, "1xS:int64", mode="train", loss="cross_entropy", kwargs={"layers": 1, "dim": 32})
    result = search_largest(job, resolve_budget(parse_budget("1TiB"), None))
    assert result.max_value == rows and result.peak_bytes_at_next is None
    assert result.limited_by is not None and str(rows) in result.limited_by


def test_max_seq_is_the_budgets_answer_below_the_limit() -> None:
    job = make_job(GPT, "1xS:int64", mode="train", loss="cross_entropy", kwargs={"layers": 1, "dim": 32})
    at_64 = graphmem.analyze(edited(job, inputs=["1x64:int64"]))
    assert at_64.train is not None
    result = search_largest(job, resolve_budget(parse_budget(f"{at_64.train.peak_bytes}B"), None))
    assert result.max_value == 64 and result.limited_by is None


def test_a_batch_dimension_has_no_model_limit() -> None:
    job = make_job(GPT, "Bx16:int64", mode="train", loss="cross_entropy", kwargs={"layers": 1, "dim": 32})
    at_3 = graphmem.analyze(edited(job, inputs=["3x16:int64"]))
    assert at_3.train is not None
    result = search_largest(job, resolve_budget(parse_budget(f"{at_3.train.peak_bytes}B"), None))
    assert result.max_value == 3 and result.limited_by is None


def test_check_with_generate_compares_the_higher_step() -> None:
    config = {"n_layer": 1, "n_embd": 32, "n_head": 2, "vocab_size": 64, "n_positions": 64, "bos_token_id": 0,
              "eos_token_id": 0}
    job = make_job("transformers:GPT2LMHeadModel", hf_config=config, generate="16+8", batch=2)
    report = graphmem.analyze(job)
    assert report.generate is not None
    higher = max(report.generate.prefill_peak_bytes, report.generate.decode_peak_bytes)
    assert check(job, resolve_budget(parse_budget(f"{higher}B"), None)).fits
    assert not check(job, resolve_budget(parse_budget(f"{higher - 1}B"), None)).fits
    args = ["check", "transformers:GPT2LMHeadModel", "--hf-config-kwargs", json.dumps(config), "--generate", "16+8",
            "--batch", "2", "--format", "json"]
    assert CliRunner().invoke(main, [*args, "--budget", f"{higher}B"]).exit_code == 0
    assert CliRunner().invoke(main, [*args, "--budget", f"{higher - 1}B"]).exit_code == 1


def test_analyze_generate_on_a_gpu_says_whether_it_fits() -> None:
    config = {"n_layer": 1, "n_embd": 32, "n_head": 2, "vocab_size": 64, "n_positions": 64, "bos_token_id": 0,
              "eos_token_id": 0}
    args = ["analyze", "transformers:GPT2LMHeadModel", "--hf-config-kwargs", json.dumps(config), "--generate", "16+8"]
    small = CliRunner().invoke(main, [*args, "--gpu", "h100-80gb"])
    assert small.exit_code == 0 and "Fits the h100-80gb" in small.stdout
    big = CliRunner().invoke(main, [*args, "--batch", "400000", "--gpu", "t4"])
    assert big.exit_code == 0, big.output
    assert "DOES NOT FIT the t4" in big.stdout
