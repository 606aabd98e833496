"""graphmem.job.devices and the user's code in graphmem.job.load: CUDA calls on a CPU-only
torch, sys.argv and SystemExit while the target is imported and built."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import nn

import graphmem.api
from graphmem import UserInputError, analyze
from graphmem.job.devices import cuda_calls_on_cpu
from graphmem.job.load import build_model, resolve_target

CUDA_MODELS = """
import sys
import torch
from torch import nn

ARGV_SEEN = list(sys.argv)

class Plain(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.register_buffer("scale", torch.ones(8))

    def forward(self, x):
        return torch.relu(self.fc(x) * self.scale) + torch.zeros(x.shape)

class CudaInInit(nn.Module):
    def __init__(self):
        super().__init__()
        assert torch.cuda.device_count() == int(torch.cuda.is_available())
        device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(0)
        self.fc = nn.Linear(8, 8).cuda()
        self.register_buffer("scale", torch.ones(8, device="cuda"))
        self.to(device)
        self.available = torch.cuda.is_available()

    def forward(self, x):
        return torch.relu(self.fc(x) * self.scale) + torch.zeros(x.shape)

class CudaInForward(Plain):
    def forward(self, x):
        x = x.cuda().to("cuda")
        torch.cuda.synchronize()
        noise = torch.zeros(x.shape, device=torch.device("cuda", torch.cuda.current_device()))
        return torch.relu(self.fc(x) * self.scale.to(0)) + noise

class ExitsInInit(nn.Module):
    def __init__(self):
        super().__init__()
        sys.exit(0)

class SeesArgv(nn.Module):
    def __init__(self):
        super().__init__()
        self.argv = list(sys.argv)
"""


@pytest.fixture
def cuda_models(make_module: Callable[[str], str]) -> str:
    return make_module(CUDA_MODELS)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_cuda_calls_in_init_build_on_meta(cuda_models: str, device: str) -> None:
    model = build_model(resolve_target(f"{cuda_models}:CudaInInit"), device=device)
    assert model.available is (device == "cuda")
    assert {t.device.type for t in [*model.parameters(), *model.buffers()]} == {"meta"}
    # everything is put back: this torch has no CUDA
    assert torch.cuda.is_available() is False and torch.cuda.device_count() == 0
    assert "cuda" not in vars(torch.Tensor) and vars(nn.Module)["cuda"].__qualname__ == "Module.cuda"
    with pytest.raises((AssertionError, RuntimeError)):
        torch.zeros(1, device="cuda")


def test_nested_uses_restore_in_order() -> None:
    original = torch.cuda.is_available
    with cuda_calls_on_cpu("cuda"):
        assert torch.cuda.is_available()
        with cuda_calls_on_cpu("cpu", tensors_on="meta"):
            assert not torch.cuda.is_available()
            assert torch.ones(2).cuda().device.type == "meta"  # the innermost use decides
            assert torch.ones(2, device="cuda").device.type == "meta"
        assert torch.cuda.is_available() and torch.ones(2, device="cuda:0").device.type == "cpu"
    assert torch.cuda.is_available is original


@pytest.fixture
def traced_with_cuda_calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """record_step wrapped as graphmem.trace.recording must wrap it (see job/devices.py)."""
    traced = graphmem.api.record_step

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        with cuda_calls_on_cpu(kwargs.get("device", "cpu")):
            return traced(*args, **kwargs)

    monkeypatch.setattr(graphmem.api, "record_step", wrapped)
    yield


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.usefixtures("traced_with_cuda_calls")
def test_cuda_calls_in_forward_cost_what_the_same_math_costs(cuda_models: str, device: str) -> None:
    # differential: the same math with and without CUDA calls has the same peaks
    plain = analyze(f"{cuda_models}:Plain", ["4x8"], device=device)
    for name in ("CudaInInit", "CudaInForward"):
        report = analyze(f"{cuda_models}:{name}", ["4x8"], device=device)
        assert report.train and plain.train and report.inference and plain.inference
        assert report.train.peak_bytes == plain.train.peak_bytes, name
        assert report.inference.peak_bytes == plain.inference.peak_bytes, name


def test_import_and_construction_see_the_target_alone_as_argv(cuda_models: str) -> None:
    before = list(sys.argv)
    target = f"{cuda_models}:SeesArgv"
    source = resolve_target(target)
    assert sys.modules[cuda_models].ARGV_SEEN == [target]
    assert build_model(source).argv == [f"{cuda_models}:SeesArgv"]
    assert sys.argv == before


def test_exit_during_import_or_construction_is_an_error(make_module: Callable[[str], str],
                                                        cuda_models: str) -> None:
    quits = make_module("import sys\nsys.exit(0)\n")
    with pytest.raises(UserInputError, match=f"{quits}:Net exited during import: SystemExit\\(0\\)"):
        resolve_target(f"{quits}:Net")
    with pytest.raises(UserInputError, match="ExitsInInit exited during construction: SystemExit\\(0\\)"):
        build_model(resolve_target(f"{cuda_models}:ExitsInInit"))


def test_torch_dynamo_first_imported_while_cuda_calls_are_answered_keeps_torchs_own_functions() -> None:
    """torch._dynamo keeps torch.cuda's functions when first imported (its table of torch
    functions by name, its CUDA device interface's methods); imported inside (as a model's code
    may: any dispatch mode's first call imports it), it must keep torch's own functions, not the
    answers that stood in for them (a fresh interpreter: the import must be the first)."""
    import subprocess

    script = ("import torch\n"
              "from graphmem.job.devices import cuda_calls_on_cpu\n"
              "original = torch.cuda.current_device\n"
              "with cuda_calls_on_cpu('cuda'):\n"
              "    answer = torch.cuda.current_device\n"
              "    import torch._dynamo\n"
              "from torch._dynamo import device_interface, trace_rules\n"
              "table = trace_rules.get_torch_obj_rule_map()\n"
              "kept = device_interface.CudaInterface.current_device\n"
              "print(original is not answer, original in table, answer in table, kept is original)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.stdout.split() == ["True", "True", "False", "True"], done.stderr


@pytest.mark.parametrize("target", ["cpu", "cuda"])
def test_torch_accelerator_answers_without_asking_a_driver(target: str) -> None:
    """torch.accelerator agrees with torch.cuda, and the current stream captures no CUDA graph:
    torch's optimizers ask it (``_accelerator_graph_capture_health_check``) whenever CUDA is
    available, which in a CUDA build of torch on a machine with no GPU would ask the driver
    and fail ("Found no NVIDIA driver")."""
    with cuda_calls_on_cpu(target):
        expected = torch.device("cuda") if target == "cuda" else None
        assert torch.accelerator.current_accelerator(check_available=True) == expected
        assert torch.accelerator.is_available() is (target == "cuda")
        assert not torch.accelerator.current_stream().is_capturing()
        assert not torch.cuda.current_stream().is_capturing() and not torch.cuda.is_current_stream_capturing()
        param = nn.Parameter(torch.ones(2))
        param.grad = torch.ones(2)
        torch.optim.Adam([param]).step()  # the health check runs inside


@pytest.mark.parametrize("target", ["cpu", "cuda"])
def test_analyzes_answers_are_the_one_fake_gpus_core(target: str) -> None:
    """analyze answers from graphmem.job.fake_gpu's state, as graphmem run does: torch.cuda and
    torch.accelerator agree; whatever the code selects, device 0 is current (one device)."""
    from graphmem.job.fake_gpu import active_gpu

    with cuda_calls_on_cpu(target):
        gpu = active_gpu()
        assert gpu is not None and gpu.available is (target == "cuda")
        assert torch.cuda.device_count() == torch.accelerator.device_count() == int(target == "cuda")
        torch.cuda.set_device(1)
        assert torch.cuda.current_device() == torch.accelerator.current_device_index() == 0
    assert active_gpu() is None
