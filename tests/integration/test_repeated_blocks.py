"""Repeated blocks recorded once (graphmem.trace.repeat.place) give the recording of the whole
model, op for op, storage for storage, node for node, and the same report to the byte; models
whose blocks do not repeat fall back to the whole recording."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest
import torch
from torch import nn

import graphmem
import graphmem.trace.repeat as record
from graphmem.trace.repeat.blocks import find_stack
from graphmem.trace.repeat.place import KEEP, same_trace
from tests.optional import extended, installed

LAYERS = 6
SMALL = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS, num_attention_heads=4)
IDS = "input_ids=2x16:int64"


def _hf(cls_name: str, config_name: str, **config: Any) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        T = installed("transformers")
        return getattr(T, cls_name)(getattr(T, config_name)(**config))
    return build


LLAMA = _hf("LlamaForCausalLM", "LlamaConfig", num_key_value_heads=2, **SMALL)
HF = ("transformers",)  # what a case needs installed
CASES: list[tuple[str, Callable[[], nn.Module], list[str], dict[str, Any], tuple[str, ...]]] = [
    ("llama adamw", LLAMA, [IDS, "labels=2x16:int64"], dict(optimizer="adamw"), HF),
    ("llama adamw foreach", LLAMA, [IDS, "labels=2x16:int64"], dict(optimizer="adamw", optimizer_impl="foreach"),
     HF),
    ("llama adam fused", LLAMA, [IDS, "labels=2x16:int64"], dict(optimizer="adam", optimizer_impl="fused"), HF),
    ("llama inference", LLAMA, [IDS], dict(mode="inference"), HF),
    ("llama 8-bit adamw", _hf("LlamaForCausalLM", "LlamaConfig", num_key_value_heads=2,
                              **{**SMALL, "hidden_size": 128, "intermediate_size": 256}),
     [IDS, "labels=2x16:int64"], dict(optimizer="adamw8bit", dtype="bf16"), HF),
    ("llama checkpointing every second block", _hf("LlamaForCausalLM", "LlamaConfig", num_key_value_heads=2,
                                                   **{**SMALL, "num_hidden_layers": 10}),
     [IDS, "labels=2x16:int64"], dict(optimizer="adamw", checkpoint=["LlamaDecoderLayer"], checkpoint_every=2), HF),
    ("llama bf16 autocast", LLAMA, [IDS, "labels=2x16:int64"], dict(optimizer="adamw", amp="bf16"), HF),
    ("llama on an H100", LLAMA, [IDS, "labels=2x16:int64"], dict(optimizer="adamw", device="cuda", gpu="h100-80gb"),
     HF),
    ("llama lora", LLAMA, [IDS, "labels=2x16:int64"], dict(optimizer="adamw", lora="r=4,alpha=8,target=q_proj,v_proj"),
     ("transformers", "peft")),
    ("llama pruned", lambda: _pruned(LLAMA()), [IDS, "labels=2x16:int64"], dict(optimizer="adamw"), HF),
    ("gpt2", _hf("GPT2LMHeadModel", "GPT2Config", vocab_size=256, n_embd=64, n_layer=LAYERS, n_head=4, n_positions=64,
                 bos_token_id=0, eos_token_id=0), [IDS, "labels=2x16:int64"], dict(optimizer="adamw"), HF),
    ("bert", _hf("BertForSequenceClassification", "BertConfig", **SMALL),
     [IDS, "attention_mask=2x16:int64", "labels=2:int64"], dict(optimizer="adamw"), HF),
    ("vit", _hf("ViTForImageClassification", "ViTConfig", hidden_size=64, num_hidden_layers=LAYERS,
                num_attention_heads=4, intermediate_size=128, image_size=32, patch_size=8, num_labels=10),
     ["pixel_values=2x3x32x32", "labels=2:int64"], dict(optimizer="adamw"), HF),
    ("mixtral", _hf("MixtralForCausalLM", "MixtralConfig", num_key_value_heads=2, num_local_experts=4,
                    num_experts_per_tok=2, **SMALL), [IDS, "labels=2x16:int64"], dict(optimizer="adamw"), HF),
    ("the model itself a Sequential", lambda: nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.GELU())
                                                              for _ in range(8)]), ["4x32"], dict(optimizer="adam"),
     ()),
    ("resnet-style stage", lambda: ResNetStage(), ["2x16x8x8"], dict(optimizer="sgd"), ()),
    ("torch transformer encoder", lambda: nn.TransformerEncoder(nn.TransformerEncoderLayer(64, 4, 128,
                                                                                           batch_first=True), LAYERS),
     ["2x16x64"], dict(optimizer="adamw"), ()),
]


def _pruned(model: nn.Module) -> nn.Module:
    """torch.nn.utils.prune on every Linear (its forward pre-hooks recompute each weight)."""
    for module in list(model.modules()):
        if isinstance(module, nn.Linear):
            torch.nn.utils.prune.l1_unstructured(module, "weight", amount=0.5)
    return model


class _Bottleneck(nn.Module):
    def __init__(self, width: int, downsample: bool) -> None:
        super().__init__()
        self.conv = nn.Conv2d(width // 2 if downsample else width, width, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(width)
        self.down = nn.Conv2d(width // 2, width, 1, bias=False) if downsample else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.bn(self.conv(x)) + (self.down(x) if self.down is not None else x))


class ResNetStage(nn.Module):
    """A stage whose first block differs (it widens and downsamples), then alike blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.stage = nn.Sequential(_Bottleneck(32, True), *[_Bottleneck(32, False) for _ in range(LAYERS)])
        self.head = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.stage(x).mean((2, 3)))


def _analyses(monkeypatch: pytest.MonkeyPatch, build: Callable[[], nn.Module], inputs: list[str],
              keywords: dict[str, Any]) -> tuple[Any, Any, int]:
    """(the report with repeated blocks, the report recording every block, traces placed)."""
    placed = []
    repeat = record.repeat_blocks

    def spy(trace: Any, prefix: str, length: int, **kw: Any) -> Any:
        if length != KEEP:
            placed.append(length)
        return repeat(trace, prefix, length, **kw)
    monkeypatch.setattr(record, "repeat_blocks", spy)
    keywords = {"mode": "train", **keywords}
    monkeypatch.setenv("GRAPHMEM_REPEATED_BLOCKS", "1")
    fast = graphmem.analyze(build, inputs, **keywords)
    monkeypatch.setenv("GRAPHMEM_REPEATED_BLOCKS", "0")
    whole = graphmem.analyze(build, inputs, **keywords)
    return fast, whole, len(placed)


def _graph(trace: Any) -> list[tuple[str, ...]]:
    return [(n.name, n.op, str(n.target), str(torch.fx.node.map_arg((n.args, n.kwargs), lambda x: x.name)),
             str(n.meta.get("graphmem"))) for n in trace.graph.nodes]


def _same_reports(fast: Any, whole: Any) -> None:
    for a, b in ((fast.inference, whole.inference), (fast.train, whole.train)):
        assert (a is None) == (b is None)
        if a is None:
            continue
        assert same_trace(a.trace, b.trace)
        assert _graph(a.trace) == _graph(b.trace)
        assert replace(a, trace=None) == replace(b, trace=None)


SLOW = {"gpt2"}  # cases over 10 s here
# the same check on more variants of the Llama's step (its plain AdamW, foreach AdamW, inference,
# LoRA and H100 steps run by default) and of a PyTorch encoder (BERT's runs): GRAPHMEM_EXTENDED=1
MORE = {"llama checkpointing every second block", "llama bf16 autocast", "llama pruned", "llama 8-bit adamw",
        "llama adam fused", "torch transformer encoder"}


def _marks(name: str) -> list[pytest.MarkDecorator]:
    more = extended("the Llama's AdamW, foreach, inference, LoRA and H100 steps run by default")
    return [*([pytest.mark.slow] if name in SLOW else []), *([more] if name in MORE else [])]


@pytest.mark.parametrize("name, build, inputs, keywords, packages",
                         [pytest.param(*c, id=c[0], marks=_marks(c[0])) for c in CASES])
def test_repeated_blocks_give_the_whole_recording(monkeypatch: pytest.MonkeyPatch, name: str, build: Any,
                                                  inputs: list[str], keywords: dict[str, Any],
                                                  packages: tuple[str, ...]) -> None:
    for package in packages:  # imported before graphmem builds the model
        installed(package)
    fast, whole, placed = _analyses(monkeypatch, build, inputs, keywords)
    assert placed, "the blocks were recorded whole: the placed trace was not used"
    _same_reports(fast, whole)


def test_the_curve_of_sizes_is_placed_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """A recording with the batch as a size symbol keeps each placed storage's formula."""
    installed("transformers")  # imported before graphmem builds the model
    curves = []
    for flag in ("1", "0"):
        monkeypatch.setenv("GRAPHMEM_REPEATED_BLOCKS", flag)
        curve = graphmem.analyze_curve(LLAMA, ["input_ids=Bx16:int64"], mode="inference")
        curves.append([curve.at(b).inference.peak_bytes for b in (2, 3, 8)])
    assert curves[0] == curves[1]


class _ByParity(nn.Module):
    """Alike blocks whose ops differ with their position: odd blocks run one more op."""

    def __init__(self, index: int) -> None:
        super().__init__()
        self.index = index
        self.linear = nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.linear(x)
        return torch.relu(x) * 2 if self.index % 2 else torch.relu(x)


class ParityStack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_ByParity(i) for i in range(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


class Summed(nn.Module):
    """Every block's output is kept and summed at the end: an op outside the stack reads them all."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(32, 32) for _ in range(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        outs = []
        for block in self.blocks:
            x = block(x)
            outs.append(x)
        return torch.stack(outs).sum(0)


class FirstBlockBias(nn.Module):
    """Every block adds what the first block made (as T5's blocks add the first block's position
    bias): a block reads a block two away."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(32, 32) for _ in range(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        first = x = self.blocks[0](x)
        for block in self.blocks[1:]:
            x = block(x) + first
        return x


WHOLE = [(ParityStack, ["4x32"]), (Summed, ["4x32"]), (FirstBlockBias, ["4x32"])]


@pytest.mark.parametrize("build, inputs", WHOLE, ids=["ops differ by parity", "outputs summed",
                                                      "every block reads the first block's output"])
def test_blocks_that_do_not_repeat_are_recorded_whole(monkeypatch: pytest.MonkeyPatch, build: Any,
                                                      inputs: list[str]) -> None:
    assert find_stack(build()) is not None, "the stack looks alike: only the recording's own check can tell"
    fast, whole, placed = _analyses(monkeypatch, build, inputs, dict(optimizer="adamw"))
    assert not placed
    _same_reports(fast, whole)


def test_stacks_that_are_not_alike_are_not_found() -> None:
    shared = nn.Linear(8, 8)
    assert find_stack(nn.Sequential(*[shared] * 8)) is None  # one block run eight times
    assert find_stack(nn.Sequential(*[nn.Linear(8, 8) for _ in range(5)])) is None  # too short to gain
    assert find_stack(nn.Sequential(*[nn.Linear(8, 8 if i != 3 else 9) for i in range(8)])) is None
    mixed = nn.Sequential(*[nn.Dropout(0.1 if i % 3 else 0.2) for i in range(8)])
    assert find_stack(mixed) is None  # a plain attribute differs (a sliding-window size, a rate)
    pruned = [nn.Linear(8, 8) for _ in range(8)]
    for i, layer in enumerate(pruned):
        torch.nn.utils.prune.l1_unstructured(layer, "weight", amount=0.5 if i != 5 else 0.25)
    assert find_stack(nn.Sequential(*pruned)) is None  # one block pruned by another amount
    hooked = [nn.Linear(8, 8) for _ in range(8)]
    hooked[2].register_forward_pre_hook(lambda module, args: None)
    assert find_stack(nn.Sequential(*hooked)) is None  # a hook of the user's: it may differ
    stack = find_stack(nn.Sequential(nn.Linear(8, 8), nn.Sequential(*[nn.Linear(8, 8) for _ in range(6)])))
    assert stack is not None and stack.path == "1" and stack.length == 6


class _Rotary(nn.Module):
    """A parameterless wrapper of a function, as kernels' ``use_kernelized_func`` gives each block."""

    def __init__(self, scale: float) -> None:
        super().__init__()
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


class _Holding(nn.Module):
    """A block holding its own module as a plain attribute, not a submodule (transformers 5's
    attention classes hold ``_kernel_funcs = {"apply_rotary_pos_emb": Func()}`` so)."""

    def __init__(self, scale: float) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.__dict__["_kernel_funcs"] = {"rotary": _Rotary(scale)}  # (nn.Module.__setattr__ would register it)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._kernel_funcs["rotary"](self.linear(x))


def test_modules_held_as_plain_attributes_are_compared_as_blocks_are() -> None:
    assert [name for name, _ in _Holding(1.0).named_children()] == ["linear"], "the wrapper is no submodule"
    assert find_stack(nn.Sequential(*[_Holding(1.0) for _ in range(8)])) is not None  # each block's own, alike
    assert find_stack(nn.Sequential(*[_Holding(1.0 if i != 4 else 2.0) for i in range(8)])) is None
    looped = [_Holding(1.0) for _ in range(8)]
    for block in looped:
        block.__dict__["me"] = block  # a block holding itself: the comparison ends, unlike
    assert find_stack(nn.Sequential(*looped)) is None


@pytest.mark.parametrize("parallel", ["fsdp=4"])
def test_sharded_blocks_are_placed_too(monkeypatch: pytest.MonkeyPatch, parallel: str) -> None:
    """FSDP2 shards each block's own parameters: every rank's recording is placed by offset."""
    installed("transformers")  # imported before graphmem builds the model
    fast, whole, placed = _analyses(monkeypatch, LLAMA, [IDS, "labels=2x16:int64"],
                                    dict(optimizer="adamw", parallel=parallel))
    assert placed
    for a, b in ((fast.train, whole.train),):
        assert [r.rank for r in a.ranks] == [r.rank for r in b.ranks]
        for x, y in zip(a.ranks, b.ranks, strict=True):
            assert same_trace(x.report.trace, y.report.trace)
            assert replace(x.report, trace=None) == replace(y.report, trace=None)


def test_ddp_is_recorded_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    """DDP's gradient buckets span the whole model: no block stands for another."""
    installed("transformers")  # imported before graphmem builds the model
    fast, whole, placed = _analyses(monkeypatch, LLAMA, [IDS, "labels=2x16:int64"],
                                    dict(optimizer="adamw", parallel="ddp=2"))
    assert not placed and fast.train.peak_bytes == whole.train.peak_bytes


def test_a_cut_recording_leaves_every_block_in_the_same_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    """Inference (eval) cut to four blocks, then training of the same built model: the blocks the
    cut left out are put in eval mode too, so the stack is still found alike and both are placed."""
    installed("transformers")  # imported before graphmem builds the model
    fast, whole, placed = _analyses(monkeypatch, LLAMA, [IDS, "labels=2x16:int64"],
                                    dict(mode="both", optimizer="adamw"))
    assert placed == 2
    _same_reports(fast, whole)


def test_a_config_naming_some_layers_makes_the_stack_unlike() -> None:
    """Molmo2 picks each layer's rotary table by ``layer_idx in config.rope_scaling_layers``; no
    block attribute shows it, and the four recorded blocks may all be in the list."""
    build = _hf("LlamaForCausalLM", "LlamaConfig", num_key_value_heads=2, **SMALL)
    model = build()
    assert find_stack(model) is not None
    model.config.rope_scaling_layers = [0, 1, 2, 3]
    assert find_stack(model) is None
    model.config.rope_scaling_layers = None
    model.config.layer_types = ["full_attention"] * (LAYERS - 1) + ["sliding_attention"]
    assert find_stack(model) is None
