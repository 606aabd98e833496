"""Issue 33, through the CLI: on the CUDA target the verdict is the reserved peak plus what lives
outside the allocator (and names expandable segments when only the allocator's segments stand
in the way); every option that changes the numbers is in the header and the JSON; ``plan``
analyses the job given (sharding rows only with a world size); ``--parallel`` names the rank
shown."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from click.testing import CliRunner

from graphmem.cli import main
from tests.conftest import ROOT

MiB = 1 << 20
MLP = str(ROOT / "examples" / "mlp.py") + ":MLP"
SMALL_MLP = "tests.models:MLP"
H100 = ["--gpu", "h100-80gb"]
# the CUDA context graphmem assumes on a Hopper GPU (graphmem/cuda/gpus.py, CUDA_CONTEXT_BYTES)
H100_CONTEXT = 500 * MiB
EXPANDABLE = "expandable_segments:True"


def _run(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, list(args))
    return result.exit_code, result.output


def _json(*args: str) -> dict[str, Any]:
    code, out = _run(*args, "--format", "json")
    assert code in (0, 1), out
    data: dict[str, Any] = json.loads(out)
    return data


@pytest.fixture(scope="module")
def gap() -> dict[str, int]:
    """The MLP's peaks on an H100, as given and with expandable segments, and a budget between
    them: the reserved peak + context does not fit it, the allocated peak + context and the
    expandable run's reserved peak + context do."""
    given = _json("check", MLP, "--input", "32x1000", *H100)
    grown = _json("check", MLP, "--input", "32x1000", *H100, "--alloc-conf", EXPANDABLE)
    allocated, reserved = given["allocated_peak_bytes"], given["reserved_peak_bytes"]
    assert given["compared_bytes"] == reserved + H100_CONTEXT  # one GPU: no NCCL buffers
    expandable = grown["reserved_peak_bytes"]
    assert allocated <= expandable < reserved, (allocated, expandable, reserved)
    return {"allocated": allocated, "reserved": reserved, "expandable": expandable,
            "budget": H100_CONTEXT + (expandable + reserved) // 2}


# --- 1. the verdict is the reserved peak + what lives outside the allocator -------------------

def test_reserved_over_the_budget_does_not_fit_and_names_expandable_segments(gap: dict[str, int]) -> None:
    args = ["check", MLP, "--input", "32x1000", *H100, "--budget", f"{gap['budget']}B"]
    code, text = _run(*args)
    assert code == 1, text
    flat = " ".join(text.split())  # the verdict is wrapped at 100 columns
    assert "DOES NOT FIT: the reserved peak + CUDA context is short by" in flat
    assert "though the allocated peak fits" in flat
    assert f"Remedy: PYTORCH_CUDA_ALLOC_CONF={EXPANDABLE} (--alloc-conf {EXPANDABLE}), analysed:" in flat
    assert ": fits with" in flat.split("Remedy:")[1]
    # allocated and reserved, each with its headroom: the allocated one positive, the reserved one not
    allocated_line = re.search(r"^allocated \+ CUDA context +(\S+ \S+) +(\S+ \S+)$", text, re.M)
    reserved_line = re.search(r"^reserved \+ CUDA context +(\S+ \S+) +(\S+ \S+)$", text, re.M)
    assert allocated_line and reserved_line, text
    assert not allocated_line[2].startswith("-") and reserved_line[2].startswith("-")
    data = _json(*args)
    assert data["fits"] is False and data["allocated_fits"] is True
    assert data["shortfall_bytes"] == gap["reserved"] + H100_CONTEXT - gap["budget"]
    assert data["allocated_headroom_bytes"] == gap["budget"] - gap["allocated"] - H100_CONTEXT
    again = data["expandable_segments"]
    assert again["alloc_conf"] == EXPANDABLE and again["fits"] is True
    assert again["reserved_peak_bytes"] == gap["expandable"]  # as analysed with --alloc-conf itself
    # the remedy applied: it fits, exit 0
    code, text = _run(*args, "--alloc-conf", EXPANDABLE)
    assert code == 0 and "FITS" in text and "Remedy" not in text, text


def test_when_the_tensors_do_not_fit_no_allocator_remedy_is_offered(gap: dict[str, int]) -> None:
    budget = gap["allocated"] + H100_CONTEXT - 1
    data = _json("check", MLP, "--input", "32x1000", *H100, "--budget", f"{budget}B")
    assert data["fits"] is False and data["allocated_fits"] is False and data["expandable_segments"] is None


def test_plan_offers_expandable_segments_as_an_analysed_row(gap: dict[str, int]) -> None:
    data = _json("plan", MLP, "--input", "32x1000", *H100, "--budget", f"{gap['budget']}B")
    assert data["baseline"]["peak_bytes"] == gap["reserved"] + H100_CONTEXT  # the rule check uses
    assert data["baseline"]["fits"] is False and data["metric"] == "reserved_peak_bytes"
    row = next(r for r in data["rows"] if r["changes"] == {"alloc_conf": EXPANDABLE})
    assert row["fits"] is True and row["source"] == "analysis"
    assert row["peak_bytes"] == gap["expandable"] + H100_CONTEXT
    assert data["rows"][0] == row  # the same math, a setting, no extra compute: first
    code, text = _run("plan", MLP, "--input", "32x1000", *H100, "--budget", f"{gap['budget']}B")
    assert code == 0 and re.search(r"^  1  expandable segments \[(\d+)\] ", text, re.M), text
    assert f"PYTORCH_CUDA_ALLOC_CONF={EXPANDABLE} in the job's environment" in text


def test_metric_chooses_the_number_compared_with_the_budget(gap: dict[str, int]) -> None:
    """At a budget between the allocated and the reserved peak (each with the CUDA context):
    --metric allocated fits, reserved (the default) and nvidia-smi do not; nvidia-smi's estimate
    is the reserved peak plus the context, so it gives the same verdict."""
    args = ["check", MLP, "--input", "32x1000", *H100, "--budget", f"{gap['budget']}B"]
    default, reserved = _json(*args), _json(*args, "--metric", "reserved")
    assert default == reserved and default["metric"] == "reserved_peak_bytes"
    allocated = _json(*args, "--metric", "allocated")
    assert allocated["fits"] is True and allocated["metric"] == "allocated_peak_bytes"
    assert allocated["compared_bytes"] == gap["allocated"] + H100_CONTEXT
    assert allocated["expandable_segments"] is None  # no allocator remedy for the tensors themselves
    smi = _json(*args, "--metric", "nvidia-smi")
    assert smi["fits"] is False and smi["metric"] == "nvidia_smi_estimate_bytes"
    assert smi["compared_bytes"] == smi["nvidia_smi_estimate_bytes"] == gap["reserved"] + H100_CONTEXT
    assert smi["active_peak_bytes"] == smi["allocated_peak_bytes"]  # no block waits on another stream
    assert _run(*args, "--metric", "allocated")[0] == 0 and _run(*args, "--metric", "nvidia-smi")[0] == 1
    code, text = _run(*args, "--metric", "nvidia-smi")
    assert "(the verdict compares the nvidia-smi estimate, --metric nvidia-smi" in text
    assert re.search(r"^peak active +\S+ \S+ +memory_stats\(\)\['active_bytes.all.peak'\]", text, re.M), text


def test_metric_on_the_cpu_target_is_a_usage_error() -> None:
    code, text = _run("check", MLP, "--input", "32x1000", "--budget", "1GiB", "--metric", "allocated")
    assert code == 2 and "--metric allocated names one of a GPU's numbers" in text


def test_max_batch_answers_what_check_says() -> None:
    common = ["--input", "Bx1000", *H100, "--budget", "700MiB"]
    found = _json("max-batch", MLP, *common)
    n = found["max_batch"]
    assert n > 1 and found["metric"] == "reserved_peak_bytes"
    at_n = _json("check", MLP, *[a.replace("B", str(n), 1) if a == "Bx1000" else a for a in common])
    beyond = _json("check", MLP, *[f"{n + 1}x1000" if a == "Bx1000" else a for a in common])
    assert at_n["fits"] is True and beyond["fits"] is False
    assert at_n["compared_bytes"] == found["peak_bytes_at_max"]
    assert beyond["compared_bytes"] == found["peak_bytes_at_next"]


# --- 2. every option that changes the numbers: in the header and in the JSON ------------------

OPTIONS = ["--optimizer", "sgd", "--optimizer-impl", "foreach", "--optimizer-kwargs", '{"momentum": 0.9}',
           "--dtype", "bfloat16", "--amp", "bf16", "--checkpoint", "Linear", "--checkpoint-every", "2",
           "--grad-accum", "2", *H100, "--alloc-conf", "max_split_size_mb:128", "--assume", "input_0=ones",
           "--budget", "1GiB"]
HEADER = ["optimizer      sgd (foreach); momentum=0.9", "weights dtype  bfloat16 (model.to)",
          "autocast       bf16 (torch.autocast)", "checkpointing  every 2nd Linear",
          "accumulation   2 micro-batches per optimizer step", "device         cuda, h100-80gb",
          "allocator      PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb:128 (from --alloc-conf)",
          "assumed        input_0=ones"]


@pytest.mark.parametrize("command, spec", [("check", "4x1000:bfloat16"), ("max-batch", "Bx1000:bfloat16"),
                                           ("plan", "4x1000:bfloat16")])
def test_the_header_and_the_json_carry_every_option(command: str, spec: str) -> None:
    code, text = _run(command, MLP, "--input", spec, *OPTIONS)
    assert code == 0, text
    lines = text.splitlines()
    for row in HEADER:
        assert any(re.sub(r" {2,}", "  ", line) == re.sub(r" {2,}", "  ", row) for line in lines), (row, text)
    data = _json(command, MLP, "--input", spec, *OPTIONS)
    assert (data["optimizer"], data["optimizer_impl"], data["optimizer_kwargs"]) == ("sgd", "foreach",
                                                                                      {"momentum": 0.9})
    assert (data["dtype"], data["amp"], data["grad_accum"]) == ("bfloat16", "bf16", 2)
    assert data["checkpoint"] == {"classes": ["Linear"], "every": 2, "save": []}
    assert (data["gpu"], data["alloc_conf"], data["assume"]) == ("h100-80gb", "max_split_size_mb:128",
                                                                 {"input_0": "ones"})
    assert data["parallel"] is None and data["device"] == "cuda"


# --- 3. plan analyses the job given -----------------------------------------------------------

@pytest.mark.slow
def test_plan_without_a_world_size_has_no_sharding_rows_and_says_so() -> None:
    args = ["plan", MLP, "--input", "32x1000", "--budget", "8MiB"]
    code, text = _run(*args)
    assert code == 0 and "processes: one, as given (--world-size N adds ZeRO-1 and FSDP2 rows" in text
    assert "ZeRO" not in text.split("Ranked:")[0].split("as given:")[1] and "FSDP2 over" not in text
    data = _json(*args)
    assert data["world_size"] is None and not [r for r in data["rows"] if "parallel" in r["changes"]]
    assert all(r["saving_bytes"] != 0 for r in data["rows"])  # a row that saves nothing is no remedy
    wide = _json(*args, "--world-size", "2")
    assert (wide["world_size"], wide["world_source"]) == (2, "--world-size")
    sharded = [r for r in wide["rows"] if "parallel" in r["changes"]]
    assert sharded and all(r["source"] == "analysis" for r in sharded)
    assert "--world-size 2" in _run(*args, "--world-size", "2")[1]


@pytest.mark.slow
def test_a_parallel_job_gets_only_rows_that_shard_more_over_its_own_gpus() -> None:
    args = ["plan", SMALL_MLP, "--input", "8x1000", "--optimizer", "adam", "--budget", "1MiB"]
    ddp = _json(*args, "--parallel", "ddp=2")
    assert ddp["world_size"] == 2 and ddp["world_source"] == "--parallel"
    assert {r["changes"]["parallel"] for r in ddp["rows"] if "parallel" in r["changes"]} >= {"zero1=2", "fsdp=2"}
    fsdp = _json(*args, "--parallel", "fsdp=2")
    assert not [r for r in fsdp["rows"] if "parallel" in r["changes"]]  # nothing shards more than FSDP2


def test_a_job_that_fits_hears_so_first() -> None:
    args = ["plan", MLP, "--input", "32x1000", "--budget", "16MiB"]
    code, text = _run(*args)
    assert code == 0
    flat = " ".join(text.split())
    assert "as given: 12.35 MiB: fits as given with 3.65 MiB headroom (22.8% of the budget)" in flat
    assert flat.index("fits as given") < flat.index(" 1 ")  # before the first row
    data = _json(*args)
    assert data["fits_as_given"] is True and data["headroom_bytes"] == 16 * MiB - data["baseline"]["peak_bytes"]


def test_rows_are_labelled_as_they_are_computed() -> None:
    data = _json("plan", MLP, "--input", "32x1000", "--budget", "8MiB", "--world-size", "2")
    for row in data["rows"]:
        by_formula = bool({"shrink", "quantize", "sparse", "kv_cache"} & set(row["changes"]))
        eight_bit = "8bit" in str(row["changes"].get("optimizer", ""))
        expected = "formula" if by_formula else "analysis + formula" if eight_bit else "analysis"
        assert row["source"] == expected, row
    helped = " ".join(_run("plan", "--help")[1].split())
    assert "sharding over up to N of them (analysed)" in helped and "formula rows)" not in helped.split("--prune")[0]


# --- 4. --parallel: which rank the numbers are ------------------------------------------------

def test_check_with_parallel_names_the_rank_shown() -> None:
    args = ["check", SMALL_MLP, "--input", "8x1000", "--optimizer", "sgd", "--budget", "1GiB", "--parallel", "fsdp=3"]
    code, text = _run(*args)
    assert code == 0, text
    # FSDP2 over 3 shards 184,201 parameters unevenly: ranks 0 and 1 hold the larger shards
    assert "parallel    fsdp=3 over 3 GPUs; the numbers are rank 0's, the highest peak (ranks 0, 1 alike)" in text
    assert re.search(r"^parameters .* \(on rank 0\)$", text, re.M), text
    data = _json(*args)
    assert data["parallel"] == {"spec": "fsdp=3", "world_size": 3, "rank_shown": 0, "ranks_alike": [0, 1]}
