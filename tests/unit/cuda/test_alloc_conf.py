"""PYTORCH_CUDA_ALLOC_CONF parsing: values by hand, and the same accept/reject decisions as
PyTorch's own parser (c10 AcceleratorAllocatorConfig, callable on a CPU build)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from graphmem.cuda.alloc_conf import AllocatorConfig, alloc_conf_from_environment, parse_alloc_conf
from graphmem.errors import UnsupportedError, UserInputError

MiB = 1 << 20


def test_empty_string_gives_pytorch_defaults() -> None:
    # AllocatorConfig.h: max_split_size_ = SIZE_MAX, large_segment_size_ = 20 MiB,
    # max_non_split_rounding_size_ = large_segment_size_, no roundup, no expandable segments
    config = parse_alloc_conf("")
    assert config == AllocatorConfig()
    assert config.max_split_size_bytes == 2**64 - 1
    assert config.large_segment_size_bytes == config.max_non_split_rounding_bytes == 20 * MiB
    assert config.roundup_power2_divisions == (0,) * 16 and not config.expandable_segments


def test_every_modeled_key() -> None:
    config = parse_alloc_conf(" max_split_size_mb : 128 , max_non_split_rounding_mb:64,"
                              "large_segment_size_mb:32,expandable_segments:True,backend:native,")
    assert config.max_split_size_bytes == 128 * MiB
    assert config.max_non_split_rounding_bytes == 64 * MiB
    assert config.large_segment_size_bytes == 32 * MiB
    assert config.expandable_segments


def test_roundup_list_fills_intervals_like_pytorch() -> None:
    # [256:1,512:2,>:8]: 256 MB is interval log2(256) = 8; the first entry also fills 0..7;
    # 512 -> interval 9; '>' fills every interval after the last one named (10..15)
    config = parse_alloc_conf("roundup_power2_divisions:[256:1,512:2,>:8]")
    assert config.roundup_power2_divisions == (1,) * 9 + (2,) + (8,) * 6


def test_roundup_single_value_fills_every_interval() -> None:
    assert parse_alloc_conf("roundup_power2_divisions:4").roundup_power2_divisions == (4,) * 16


def test_ignored_keys_are_listed() -> None:
    config = parse_alloc_conf("garbage_collection_threshold:0.6,pinned_use_cuda_host_register:True")
    assert config.ignored == ("garbage_collection_threshold:0.6", "pinned_use_cuda_host_register:True")
    assert config.max_split_size_bytes == AllocatorConfig().max_split_size_bytes


@pytest.mark.parametrize("text, fragment", [
    ("max_split_sise_mb:128", "unknown key 'max_split_sise_mb'"),
    ("expandable_segments:true", "expected True or False"),
    ("max_split_size_mb:19", "too small"),
    ("max_split_size_mb:40,large_segment_size_mb:64", "max_split_size_mb:40 is too small"),
    ("max_split_size_mb:20.5", "not a whole number"),
    ("roundup_power2_divisions:3", "power of 2"),
    ("roundup_power2_divisions:[300:2]", "interval 300"),
    ("roundup_power2_divisions:[256:2", "no closing"),
    ("large_segment_size_mb:10", "must be > 10"),
    ("garbage_collection_threshold:1", r"\(0.0, 1.0\)"),
    ("expandable_segments", "malformed"),
    ("expandable_segments:True;max_split_size_mb:40", "expected ',' after expandable_segments"),
    ("backend:magic", "backend 'magic'"),
])
def test_bad_settings_are_user_errors(text: str, fragment: str) -> None:
    with pytest.raises(UserInputError, match=fragment):
        parse_alloc_conf(text)


def test_cuda_malloc_async_is_unsupported() -> None:
    with pytest.raises(UnsupportedError, match="cudaMallocAsync"):
        parse_alloc_conf("backend:cudaMallocAsync")


_TORCH_SET = getattr(torch._C, "_accelerator_setAllocatorSettings", None)


@pytest.fixture
def torch_parser() -> Iterator[None]:
    if _TORCH_SET is None:
        pytest.skip("this torch has no torch._C._accelerator_setAllocatorSettings")
    yield
    # large_segment_size and expandable_segments persist across calls in c10: restore defaults
    _TORCH_SET("large_segment_size_mb:20,expandable_segments:False")


@pytest.mark.parametrize("text", [
    "", "max_split_size_mb:20", "max_split_size_mb:40,", " expandable_segments : True ",
    "roundup_power2_divisions:[256:1,512:2,>:8]", "roundup_power2_divisions:[]", "roundup_power2_divisions:1",
    "roundup_power2_divisions:[256:0,>:4]", "large_segment_size_mb:11", "garbage_collection_threshold:0.6",
    "max_non_split_rounding_mb:20",
    # rejected by PyTorch too:
    "max_split_size_mb:19", "large_segment_size_mb:10", "expandable_segments:true", "roundup_power2_divisions:3",
    "roundup_power2_divisions:0", "roundup_power2_divisions:[256:3]", "roundup_power2_divisions:[300:2]",
    "garbage_collection_threshold:1", "max_split_size_mb:40,large_segment_size_mb:64",
    "max_non_split_rounding_mb:19", "expandable_segments",
])
def test_accepts_and_rejects_what_pytorch_does(torch_parser: None, text: str) -> None:
    assert _TORCH_SET is not None
    _TORCH_SET("large_segment_size_mb:20,expandable_segments:False")
    try:
        _TORCH_SET(text)
        torch_accepts = True
    except (ValueError, RuntimeError):
        torch_accepts = False
    try:
        parse_alloc_conf(text)
        ours = True
    except UserInputError:
        ours = False
    assert ours == torch_accepts


@pytest.mark.parametrize(("new", "old", "read"), [
    (None, None, ""),
    (None, "expandable_segments:True", "expandable_segments:True"),
    ("max_split_size_mb:64", "expandable_segments:True", "max_split_size_mb:64"),
])
def test_the_environment_is_read_as_torch_reads_it(monkeypatch: pytest.MonkeyPatch, new: str | None,
                                                   old: str | None, read: str) -> None:
    """PYTORCH_ALLOC_CONF first, the older PYTORCH_CUDA_ALLOC_CONF when it is unset (torch 2.13's
    c10/core/AllocatorConfig.h: "PYTORCH_CUDA_ALLOC_CONF is also supported with lower priority")."""
    for name, value in (("PYTORCH_ALLOC_CONF", new), ("PYTORCH_CUDA_ALLOC_CONF", old)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    assert alloc_conf_from_environment() == read
