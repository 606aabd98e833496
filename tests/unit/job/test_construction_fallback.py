"""Models that cannot be built on the meta device: fake tensors, then a real CPU build under a
limit; the model's own errors name the model (graphmem/job/load.py, construct_model)."""

from __future__ import annotations

import resource
from collections.abc import Callable

import pytest
import torch
from torch import nn

import graphmem
import graphmem.job.load as load
from graphmem.errors import UnsupportedError, UserInputError
from graphmem.job.load import build_model, construct_model, resolve_target
from tests import fallback_models as fm

FAKE = "it was built with fake tensors instead"
REAL = "it was built once with real tensors on the CPU"


def _count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def test_a_model_that_builds_on_meta_has_no_note() -> None:
    built = construct_model(lambda: nn.Linear(4, 3))
    assert built.note is None and all(p.is_meta for p in built.module.parameters())


def test_regnet_like_widths_are_read_under_fake_tensors() -> None:
    built = construct_model(fm.RegNetLike)
    assert built.note is not None and FAKE in built.note
    assert "tests.fallback_models:RegNetLike reads tensor values while it is built" in built.note
    assert "Tensor.item() cannot be called on meta tensors" in built.note
    assert all(t.is_meta for t in [*built.module.parameters(), *built.module.buffers()])
    # widths 8, 16, 32 (32 twice): stem 3*8*9; convs 8*16*9 and 16*32*9; BN weight+bias 2*16 and 2*32;
    # head 32*10 + 10
    assert _count(built.module) == 216 + 1152 + 4608 + 32 + 64 + 330 == 6402
    assert built.module.scale == 2.0  # a constant fake tensors know


def test_drop_path_schedule_is_read_from_a_real_build() -> None:
    rng = torch.random.get_rng_state()
    built = construct_model(fm.DropPathNet)
    assert built.note is not None and REAL in built.note and "Cannot copy out of meta tensor" in built.note
    assert "the limit is 2.00 GiB" in built.note
    assert [round(b.drop_path, 4) for b in built.module.blocks] == [0.0, 0.0333, 0.0667, 0.1]
    assert all(p.is_meta for p in built.module.parameters())
    assert torch.equal(torch.random.get_rng_state(), rng)  # the user's random state is left as it was
    # 4 blocks of LayerNorm 2*32, fc1 32*64+64, fc2 64*32+32; head 32*10+10
    assert _count(built.module) == 4 * (64 + 2112 + 2080) + 330 == 17354


def test_a_real_build_keeps_tying_and_moves_tensor_attributes(make_module: Callable[[str], str]) -> None:
    name = make_module("""
        import torch
        from torch import nn
        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.table = torch.arange(4) * 2  # a plain tensor attribute
                self.fc = nn.Linear(4, 4)
                self.fc.weight.requires_grad_(False)
                self.register_buffer("steps", torch.zeros(3, dtype=torch.int64))
    """)
    built = construct_model(fm.UniqueWidths)
    assert built.note is not None and REAL in built.note
    assert built.module.head.weight is built.module.embed.weight and built.module.head.weight.is_meta
    assert _count(built.module) == 50 * 16 + (16 * 24 + 24) + (24 * 16 + 16) == 1608  # the tied one once
    assert built.module.up.weight.shape == (24, 16)
    model = build_model(_after_a_value_read(resolve_target(f"{name}:Net")))
    assert model.table.is_meta and model.table.shape == (4,) and model.table.dtype == torch.int64
    assert isinstance(model.fc.weight, nn.Parameter) and not model.fc.weight.requires_grad
    assert model.steps.is_meta and model.steps.dtype == torch.int64 and "steps" in dict(model.named_buffers())


def _after_a_value_read(cls: type[nn.Module]) -> Callable[[], nn.Module]:
    def factory() -> nn.Module:
        torch.arange(2).tolist()
        return cls()
    return factory


def test_the_models_own_error_names_the_model_and_not_kwargs() -> None:
    with pytest.raises(UserInputError) as info:
        build_model(fm.BuggyConfig)
    assert str(info.value) == "tests.fallback_models:BuggyConfig could not be built: KeyError: 'classes'"
    assert info.value.exit_code == 2
    with pytest.raises(UserInputError, match="could not be built: KeyError: 'classes'; check --kwargs$"):
        build_model(fm.BuggyConfig, {"levels": 2})


def test_an_error_unrelated_to_meta_is_reported_at_once(make_module: Callable[[str], str]) -> None:
    name = make_module("""
        from torch import nn
        CALLS = []
        class Net(nn.Module):
            def __init__(self, width=4):
                super().__init__()
                CALLS.append(width)
                raise ValueError(f"width {width} is not a multiple of 8")
    """)
    source = resolve_target(f"{name}:Net")
    with pytest.raises(UserInputError) as info:
        build_model(source)
    assert str(info.value) == f"{name}:Net could not be built: ValueError: width 4 is not a multiple of 8"
    assert __import__(name).CALLS == [4]  # built once: no fallback for the model's own error


def test_a_real_build_past_the_limit_stops_before_allocating() -> None:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    with pytest.raises(UnsupportedError) as info:
        build_model(fm.HugeAfterRead)
    assert info.value.exit_code == 3
    message = str(info.value)
    assert message.startswith("tests.fallback_models:HugeAfterRead reads tensor values while it is built")
    # 40000 * 40000 * 4 bytes = 5.96 GiB, refused from its size before torch.empty runs
    assert "would create 5.96 GiB or more, past graphmem's limit of 2.00 GiB" in message
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 2**20  # under 1 GiB more


def test_the_limit_counts_every_tensor_created(monkeypatch: pytest.MonkeyPatch) -> None:
    # DropPathNet creates 67.80 KiB of tensors while it is built (the note of the test above)
    monkeypatch.setattr(load, "REAL_BUILD_LIMIT_BYTES", 64 * 1024)
    with pytest.raises(UnsupportedError, match="past graphmem's limit of 64.00 KiB"):
        build_model(fm.DropPathNet)


def test_exits_during_a_fallback_build_are_usage_errors() -> None:
    with pytest.raises(UserInputError, match=r"ExitsAfterRead exited during construction: SystemExit\(3\)"):
        build_model(fm.ExitsAfterRead)
    model = build_model(fm.ArgvAfterRead)  # sys.argv is the target alone in every build
    assert model.argv == ["tests.fallback_models:ArgvAfterRead"]


def test_exit_during_import_sees_the_target_alone_as_argv(make_module: Callable[[str], str]) -> None:
    name = make_module("import sys\nsys.exit(repr(sys.argv))\n")
    with pytest.raises(UserInputError) as info:
        resolve_target(f"{name}:Net")
    assert f"{name}:Net exited during import: SystemExit(\"['{name}:Net']\")" in str(info.value)
    assert info.value.exit_code == 2


def test_the_note_reaches_the_report() -> None:
    report = graphmem.analyze(fm.RegNetLike, "2x3x16x16")
    assert report.train is not None and report.inference is not None
    for mode in (report.train, report.inference):
        assert sum(FAKE in note for note in mode.assumptions) == 1
