"""One recording for every batch size or sequence length (graphmem.trace.symbolic): the trace
recorded with the size as a symbol, evaluated at a value, is the trace recorded at that value,
storage by storage and op by op; where the recording's guards do not hold, it says so and the
search records again.  The searches answer as the one-recording-per-value search did, with at
most two recordings, and max-batch agrees with real execution (test_preflight_oracle)."""

from __future__ import annotations

from dataclasses import replace
from fractions import Fraction
from typing import Any

import pytest
import torch
from torch import nn

import graphmem
from graphmem.job.job import make_job
from graphmem.preflight.budget import Budget
from graphmem.preflight.search import find_largest_fit, predict, search_largest
from graphmem.records import OpRecord
from graphmem.trace.symbolic import trace_at
from tests.models import ZOO
from tests.optional import installed

VALUES = (2, 3, 5, 9)
# zoo models whose every size decision holds for any batch: one recording covers them all
WHOLE_RANGE = ("mlp", "transformer_encoder", "gpt", "tied_autoencoder", "bf16_mlp", "checkpointed_mlp")


def _symbolic(spec: str, symbol: str = "B", position: int = 0) -> str:
    name, eq, rest = spec.rpartition("=")
    dims, colon, dtype = rest.partition(":")
    parts = dims.split("x")
    parts[position] = symbol
    return f"{name}{eq}{'x'.join(parts)}{colon}{dtype}"


def _memory_fields(op: OpRecord) -> OpRecord:
    """An op without its name: where sizes are symbols, a view can be named otherwise (a full
    slice stays ``slice`` rather than ``alias``) with the same storages."""
    return replace(op, op="")


def _assert_same(report: graphmem.MemoryReport, recorded: graphmem.MemoryReport) -> None:
    for mode in ("inference", "train"):
        a, b = getattr(report, mode), getattr(recorded, mode)
        assert (a is None) == (b is None)
        if a is None:
            continue
        assert a.trace.storages == b.trace.storages
        assert [_memory_fields(o) for o in a.trace.ops] == [_memory_fields(o) for o in b.trace.ops]
        assert (a.peak_bytes, a.timeline, a.phases, dict(a.breakdown)) == \
            (b.peak_bytes, b.timeline, b.phases, dict(b.breakdown))
        assert a.lifetimes == b.lifetimes and a.flops == b.flops
        assert (a.allocator is None) == (b.allocator is None)
        if a.allocator is not None:
            assert a.allocator == b.allocator


@pytest.mark.parametrize("model", ZOO, ids=lambda m: m.name)
def test_curve_equals_recording_at_each_value(model: Any) -> None:
    template = [_symbolic(model.inputs[0]), *model.inputs[1:]]
    curve = graphmem.analyze_curve(model.build, template, hint=3, loss=model.loss)
    held = [v for v in VALUES if curve.holds(v)]
    assert 3 in held
    for v in held:
        recorded = graphmem.analyze(model.build, [t.replace("B", str(v)) for t in template], loss=model.loss)
        _assert_same(curve.at(v), recorded)
    if model.name in WHOLE_RANGE:
        assert curve.exact and held == list(VALUES) and curve.holds(10_000)
    for v in set(VALUES) - set(held):
        with pytest.raises(ValueError, match="outside"):
            curve.at(v)


SMALL = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)


def build_llama() -> nn.Module:
    T = installed("transformers")
    return T.LlamaForCausalLM(T.LlamaConfig(num_key_value_heads=2, **SMALL))


def build_gpt2() -> nn.Module:
    T = installed("transformers")
    return T.GPT2LMHeadModel(T.GPT2Config(vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                                          bos_token_id=0, eos_token_id=0))


@pytest.mark.parametrize("build, template", [
    (build_llama, ["input_ids=Bx16:int64"]),
    (build_llama, ["input_ids=2xS:int64"]),
    (build_gpt2, ["input_ids=Bx16:int64", "labels=Bx16:int64"]),
], ids=["llama-batch", "llama-sequence", "gpt2-batch-labels"])
@pytest.mark.slow
def test_language_models_one_recording(build: Any, template: list[str]) -> None:
    """A causal LM trained on its input ids (labels made from them), its causal mask, rotary
    positions and padded labels: one recording holds for every batch and sequence length."""
    installed("transformers")  # imported before graphmem builds the model
    symbol = "S" if "xS" in template[0] else "B"
    curve = graphmem.analyze_curve(build, template, hint=4, optimizer="adamw")
    assert curve.exact
    for v in (2, 4, 11):
        assert curve.holds(v)
        recorded = graphmem.analyze(build, [t.replace(symbol, str(v)) for t in template], optimizer="adamw")
        _assert_same(curve.at(v), recorded)


def test_answers_read_from_inputs_hold_at_the_recorded_value_only() -> None:
    """A value read from the attention mask (answered from its assumed ones) is not a formula:
    the curve holds at its own value, where it equals the recording."""
    installed("transformers")  # imported before graphmem builds the model
    template = ["input_ids=Bx16:int64", "attention_mask=Bx16:int64"]
    curve = graphmem.analyze_curve(build_llama, template, hint=4, optimizer="adamw")
    assert not curve.exact and curve.holds(4) and not curve.holds(5)
    _assert_same(curve.at(4), graphmem.analyze(build_llama, [t.replace("B", "4") for t in template],
                                               optimizer="adamw"))


def test_cuda_target_allocator_from_one_recording() -> None:
    """On the CUDA target the caching allocator is replayed on the evaluated sizes."""
    model = next(m for m in ZOO if m.name == "gpt")
    keywords = dict(loss=model.loss, device="cuda", gpu="h100-80gb", mode="train")
    curve = graphmem.analyze_curve(model.build, ["Bx16:int64"], hint=2, **keywords)
    for v in (2, 6):
        assert curve.holds(v)
        _assert_same(curve.at(v), graphmem.analyze(model.build, [f"{v}x16:int64"], **keywords))


class Branchy(nn.Module):
    """Takes another path above batch 6: a size decision the recording keeps as a guard."""

    def __init__(self) -> None:
        super().__init__()
        self.small, self.large = nn.Linear(64, 64), nn.Linear(64, 256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.large(x) if x.shape[0] > 6 else self.small(x)


def _old_search(job: Any, cap: int) -> tuple[int, dict[int, int]]:
    """The search recording at every value it tries."""
    return find_largest_fit(lambda v: predict(job, v).peak_bytes, cap)


@pytest.mark.parametrize("build, template, loss, fraction", [
    (next(m for m in ZOO if m.name == "mlp").build, "Bx1000", "sum", 3),
    pytest.param(next(m for m in ZOO if m.name == "gpt").build, "Bx16:int64", "cross_entropy", 3,
                 marks=pytest.mark.slow),
    (next(m for m in ZOO if m.name == "simplenet").build, "Bx1x28x28", "nll", 9),
    (Branchy, "Bx64", "sum", 2),
], ids=["mlp", "gpt", "simplenet", "branchy"])
def test_search_answers_as_recording_every_value(build: Any, template: str, loss: str, fraction: int) -> None:
    job = make_job(build, (template,), mode="train", loss=loss)
    at_one = predict(job, 1).peak_bytes
    cap = at_one * fraction * 4  # an answer well past the first recordings (and across Branchy's switch)
    result = search_largest(job, Budget(cap, Fraction(0), "test"))
    best, seen = _old_search(job, cap)
    assert result.max_value == best > 6
    assert dict(result.evaluated) == {v: seen[v] for v in dict(result.evaluated) if v in seen}
    assert (result.peak_bytes_at_max, result.peak_bytes_at_next) == (seen[best], seen[best + 1])
    simplenet_beyond_its_guard = template.startswith("Bx1x28") and best >= 16
    assert len(result.recorded) <= (3 if build is Branchy or simplenet_beyond_its_guard else 2)


def test_trace_at_refuses_outside_its_guards() -> None:
    curve = graphmem.analyze_curve(Branchy, ["Bx64"], hint=3, mode="inference")
    trace = curve.traces[0]
    assert trace.sizes is not None and trace.sizes.holds(6) and not trace.sizes.holds(7)
    with pytest.raises(ValueError, match="outside"):
        trace_at(trace, 7)
    assert not trace.sizes.holds(1)  # sizes of 1 are special cases: recorded with numbers


# --- analyze --sweep ---------------------------------------------------------------------

def _cli(*args: str) -> tuple[int, str]:
    from click.testing import CliRunner

    from graphmem.cli import main
    result = CliRunner().invoke(main, list(args))
    return result.exit_code, result.stdout if result.exit_code == 0 else result.output


def test_sweep_json_equals_an_analysis_at_each_value() -> None:
    code, out = _cli("analyze", "examples/mlp.py:MLP", "--input", "Bx1000", "--sweep", "B=1..5,", "--format", "json")
    assert code == 2  # malformed: a range takes no list
    code, out = _cli("analyze", "examples/mlp.py:MLP", "--input", "Bx1000", "--sweep", "B=1,3,40", "--format", "json",
                     "--device", "cuda", "--gpu", "t4")
    assert code == 0, out
    import json
    data = json.loads(out)
    assert [p["value"] for p in data["points"]] == [1, 3, 40] and data["recorded"] == [1, 3]
    for point in data["points"]:
        report = graphmem.analyze("examples/mlp.py:MLP", [f"{point['value']}x1000"], device="cuda", gpu="t4")
        assert report.train is not None and report.inference is not None
        assert point["train_peak_bytes"] == report.train.budget_peak_bytes
        assert point["inference_peak_bytes"] == report.inference.budget_peak_bytes
        assert point["fits"] is True


def test_sweep_table_and_its_refusals() -> None:
    code, out = _cli("analyze", "examples/mlp.py:MLP", "--input", "Bx1000", "--sweep", "B=1..4", "--mode", "train")
    assert code == 0, out
    assert [line.split()[:3] for line in out.splitlines() if line.startswith("B = ")] == \
        [["B", "=", str(v)] for v in (1, 2, 3, 4)]
    assert "2 recordings of the step (at B = 1, 2)" in out
    for args, words in ((["--sweep", "S=1..4"], "sweeps S, but the inputs use B"),
                        (["--sweep", "B=1..4", "--html", "page.html"], "--html draw one analysis"),
                        (["--sweep", "B=0..4"], "below 1")):
        code, out = _cli("analyze", "examples/mlp.py:MLP", "--input", "Bx1000", *args)
        assert code == 2 and words in out, out
