from __future__ import annotations

import json
import socket
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

from graphmem.errors import UserInputError
from graphmem.job.hf_config import _is_hub_id
from graphmem.job.load import build_model, construct_model, load_hf_config, resolve_target
from tests.conftest import ROOT

SOURCE = """
import torch
from torch import nn

class Net(nn.Module):
    def __init__(self, hidden=8):
        super().__init__()
        self.fc = nn.Linear(4, hidden)
    def forward(self, x):
        return self.fc(x)

def factory(hidden=8):
    return Net(hidden)

instance = nn.Linear(2, 2)
not_a_model = 42

def returns_int():
    return 3

class Raises(nn.Module):
    def __init__(self):
        super().__init__()
        raise ValueError("constructor exploded")
"""


def test_resolves_dotted_module(make_module: Callable[[str], str]) -> None:
    name = make_module(SOURCE)
    assert resolve_target(f"{name}:Net").__name__ == "Net"


def test_resolves_file_path() -> None:
    cls = resolve_target(str(ROOT / "examples" / "mlp.py") + ":MLP")
    assert issubclass(cls, nn.Module)


def test_builds_on_meta_with_kwargs(make_module: Callable[[str], str]) -> None:
    name = make_module(SOURCE)
    for attr in ("Net", "factory"):
        model = build_model(resolve_target(f"{name}:{attr}"), {"hidden": 16})
        assert model.fc.weight.shape == (16, 4)
        assert model.fc.weight.device.type == "meta"


def test_instance_is_used_as_is(make_module: Callable[[str], str]) -> None:
    name = make_module(SOURCE)
    source = resolve_target(f"{name}:instance")
    assert build_model(source) is source


@pytest.mark.parametrize("target, fragment", [
    ("no_colon", "malformed target"),
    ("definitely_missing_pkg:Net", "cannot import module 'definitely_missing_pkg'"),
    ("{mod}:Missing", "has no attribute 'Missing'"),
    ("{mod}:not_a_model", "is a int, not an nn.Module"),
    ("missing_file.py:Net", "file not found"),
])
def test_bad_targets(make_module: Callable[[str], str], target: str, fragment: str) -> None:
    name = make_module(SOURCE)
    with pytest.raises(UserInputError) as info:
        resolve_target(target.format(mod=name))
    assert fragment in str(info.value)


@pytest.mark.parametrize("attr, kwargs, fragment", [
    ("Raises", {}, "constructor exploded"),
    ("returns_int", {}, "returned a int, not an nn.Module"),
    ("Net", {"nope": 1}, "unexpected keyword argument 'nope'"),
])
def test_bad_constructions(make_module: Callable[[str], str], attr: str, kwargs: dict[str, int],
                           fragment: str) -> None:
    name = make_module(SOURCE)
    with pytest.raises(UserInputError) as info:
        build_model(resolve_target(f"{name}:{attr}"), kwargs)
    assert fragment in str(info.value)


def test_big_model_allocates_nothing() -> None:
    # 4 x (32768 x 32768) fp32 = 16 GiB if it were real; on meta it costs nothing.
    model = build_model(lambda: nn.Sequential(*[nn.Linear(32768, 32768, bias=False) for _ in range(4)]))
    assert all(p.is_meta for p in model.parameters())
    assert sum(p.numel() for p in model.parameters()) == 4 * 32768 * 32768
    assert torch.empty(0).device.type == "cpu"  # the default device was restored


# --- --hf-config: a file, or a Hub id read from the local cache only ---------------------------

@pytest.mark.parametrize("text, is_id", [
    ("meta-llama/Llama-3.1-8B", True), ("acme/tiny", True),
    ("conf/config.json", False), ("acme/tiny.JSON", False), ("a/b/c", False), ("config.json", False),
    ("gpt2", False), ("./tiny", False), ("org\\name", False), ("/abs/path", False), ("org/", False),
])
def test_only_org_slash_name_is_a_hub_id(text: str, is_id: bool) -> None:
    assert _is_hub_id(text) is is_id


@pytest.fixture
def no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any name lookup or connection fails the test."""
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"network used: {args}")

    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    monkeypatch.setattr(socket.socket, "connect", refuse)


def _hub_cache(root: Path, repo: str, config: dict[str, object]) -> Path:
    """A cache laid out as huggingface_hub writes it: refs/main names a snapshot."""
    folder = root / f"models--{repo.replace('/', '--')}"
    (folder / "refs").mkdir(parents=True)
    (folder / "refs" / "main").write_text("0" * 40)
    (folder / "snapshots" / ("0" * 40)).mkdir(parents=True)
    (folder / "snapshots" / ("0" * 40) / "config.json").write_text(json.dumps(config))
    return root


def test_a_missing_file_is_never_looked_up_on_the_hub(no_network: None, tmp_path: Path) -> None:
    for path in ("conf/config.json", str(tmp_path / "config.json"), "a/b/c"):
        with pytest.raises(UserInputError, match=f"no such file {path!r}; give a local config.json"):
            load_hf_config(path)


def test_a_hub_id_is_read_from_the_local_cache_only(no_network: None, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    constants = pytest.importorskip("huggingface_hub.constants", reason="huggingface_hub is not installed")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(_hub_cache(tmp_path, "acme/tiny", {"hidden": 16})))
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")  # even where downloads are allowed, none is tried
    assert load_hf_config("acme/tiny", {"layers": 2}) == {"hidden": 16, "layers": 2}
    with pytest.raises(UserInputError, match="'acme/other' is not in the Hugging Face cache"):
        load_hf_config("acme/other")


@pytest.mark.parametrize("content, fragment", [
    ("[" * 50_000 + "]" * 50_000, "nested too deeply"),
    ('{"hidden": ' + "1" * 5000 + "}", "not a JSON file graphmem can read"),
    ("[1, 2]", "holds no JSON object"),
])
def test_an_unreadable_config_file_is_a_user_error(tmp_path: Path, content: str, fragment: str) -> None:
    (tmp_path / "config.json").write_text(content)
    with pytest.raises(UserInputError, match=fragment):
        load_hf_config(str(tmp_path / "config.json"))


CONFIGURED = """
from torch import nn

class TinyConfig:
    def __init__(self, hidden=8, layers=1, dropout=0.1, tie=True):
        if not isinstance(layers, int):
            raise ValueError(f"layers must be an int, got {layers!r}")
        self.hidden, self.layers, self.dropout, self.tie = hidden, layers, dropout, tie

class Tiny(nn.Module):
    config_class = TinyConfig

    def __init__(self, config):
        super().__init__()
        self.fc = nn.Linear(4, config.hidden)
"""


@pytest.mark.parametrize("values, fragment", [
    # the config class refuses the value: was an internal error
    ({"layers": "two"}, "TinyConfig refused the config values: layers must be an int, got 'two' "
                        "\\(layers='two' where TinyConfig's default is the int 1\\)"),
    # the config takes it, the model's constructor does not; dropout=0 (an int for a float) is no suspect
    ({"hidden": "big", "dropout": 0}, "could not be built: TypeError: .*; check --hf-config "
                                      "\\(hidden='big' where TinyConfig's default is the int 8\\)$"),
    ({"tie": 1}, "tie=1 where TinyConfig's default is the bool True"),
])
def test_a_config_value_of_the_wrong_type_is_named(make_module: Callable[[str], str], values: dict[str, object],
                                                  fragment: str) -> None:
    source = resolve_target(f"{make_module(CONFIGURED)}:Tiny")
    if "tie" in values:
        values = {**values, "hidden": "big"}  # a failure to explain: tie=1 alone builds
    with pytest.raises(UserInputError, match=fragment):
        construct_model(source, None, values)
