"""PYTORCH_CUDA_ALLOC_CONF -> AllocatorConfig: the caching allocator's settings (pure parsing).

Input: the text of ``PYTORCH_CUDA_ALLOC_CONF`` / ``PYTORCH_ALLOC_CONF``, e.g.
``"expandable_segments:True,max_split_size_mb:128"``.  Output: a frozen ``AllocatorConfig``
that ``graphmem.cuda.allocator.replay`` runs under.

The grammar and every check follow PyTorch 2.13: ``c10/core/AllocatorConfig.{h,cpp}``
(``ConfigTokenizer``, ``AcceleratorAllocatorConfig::parseArgs`` and its ``parse*`` helpers) for
the device-generic keys, ``c10/cuda/CUDAAllocatorConfig.h`` (``getKeys``) for the CUDA-only
ones.  Differences, all stricter: sizes must be whole numbers (``std::stoull`` would read
``"20.5"`` as 20), unknown keys are errors (a CPU build of torch ignores them), and a value
list must be well formed.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from graphmem.errors import UnsupportedError, UserInputError

__all__ = [
    "IGNORED_KEYS",
    "K_LARGE_BUFFER",
    "MODELED_KEYS",
    "ROUNDUP_INTERVALS",
    "UNLIMITED",
    "AllocatorConfig",
    "MiB",
    "alloc_conf_from_environment",
    "parse_alloc_conf",
]

MiB = 1 << 20
# "large" allocations may be packed in 20 MiB blocks: kLargeBuffer, c10/core/AllocatorConfig.h;
# also the default of large_segment_size_ and max_non_split_rounding_size_ (the constructor
# copies large_segment_size_ into it, AllocatorConfig.cpp).
K_LARGE_BUFFER = 20 * MiB
# kRoundUpPowerOfTwoIntervals (AllocatorConfig.cpp): one divisions entry per power-of-two
# interval from 1 MiB (kRoundUpPowerOfTwoStart) to 64 GiB (kRoundUpPowerOfTwoEnd).
ROUNDUP_INTERVALS = 16
# max_split_size_ default: std::numeric_limits<size_t>::max() (AllocatorConfig.h).
UNLIMITED = (1 << 64) - 1
# large_segment_size_mb must be > kMinLargeAlloc / kMB (parseLargeSegmentSize).
_MIN_LARGE_SEGMENT_MB = 10

MODELED_KEYS = ("max_split_size_mb", "max_non_split_rounding_mb", "large_segment_size_mb",
                "roundup_power2_divisions", "expandable_segments", "backend")
# Accepted and validated loosely, but they do not change allocated/reserved bytes of a run
# that fits: garbage collection acts only under set_per_process_memory_fraction; the others
# are locking, OOM policy, or the pinned host allocator.
IGNORED_KEYS = ("garbage_collection_threshold", "release_lock_on_cudamalloc", "release_lock_on_hipmalloc",
                "per_process_memory_fraction", "throw_on_cudamalloc_oom", "graph_capture_record_stream_reuse",
                "pinned_use_cuda_host_register", "pinned_use_hip_host_register", "pinned_num_register_threads",
                "pinned_reserve_segment_size_mb", "pinned_free_catch_all", "pinned_use_background_threads",
                "pinned_max_round_threshold_mb", "pinned_max_cached_size_mb")


@dataclass(frozen=True, slots=True)
class AllocatorConfig:
    """The settings of the native caching allocator that change allocated/reserved bytes.

    Sizes are bytes.  ``roundup_power2_divisions`` has one entry per power-of-two size interval
    (index 0: below 2 MiB, index i: [2^(20+i), 2^(21+i)), index 15: 32 GiB and above); 0 or 1
    means plain 512-byte rounding.  ``ignored`` lists the ``key:value`` settings accepted but
    not modeled.
    """

    max_split_size_bytes: int = UNLIMITED
    max_non_split_rounding_bytes: int = K_LARGE_BUFFER
    large_segment_size_bytes: int = K_LARGE_BUFFER
    roundup_power2_divisions: tuple[int, ...] = (0,) * ROUNDUP_INTERVALS
    expandable_segments: bool = False
    ignored: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if len(self.roundup_power2_divisions) != ROUNDUP_INTERVALS:
            raise AssertionError(f"AllocatorConfig: roundup_power2_divisions needs {ROUNDUP_INTERVALS} "
                                 f"entries, got {len(self.roundup_power2_divisions)}")


def alloc_conf_from_environment() -> str:
    """The allocator settings a process started now would run with: ``PYTORCH_ALLOC_CONF``,
    or, when that is unset, the older ``PYTORCH_CUDA_ALLOC_CONF`` (torch 2.13's
    ``AcceleratorAllocatorConfig::parseEnv`` reads them in that order); ``""`` for neither."""
    text = os.environ.get("PYTORCH_ALLOC_CONF")
    return os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") if text is None else text


def parse_alloc_conf(text: str) -> AllocatorConfig:
    """Parse a ``PYTORCH_CUDA_ALLOC_CONF`` string.

    Args:
        text: comma-separated ``key:value`` pairs; ``""`` gives the defaults.

    Returns:
        The AllocatorConfig PyTorch 2.13 would run with.

    Raises:
        UserInputError: an unknown key, a malformed pair or a value PyTorch rejects.
        UnsupportedError: ``backend:cudaMallocAsync`` (a different allocator).
    """
    values: dict[str, object] = {}
    ignored: list[str] = []
    for key, value in _pairs(text):
        if key in IGNORED_KEYS:
            _check_ignored(key, value)
            ignored.append(f"{key}:{value if isinstance(value, str) else '[' + ','.join(value) + ']'}")
        elif key in MODELED_KEYS:
            values[key] = value
        else:
            raise UserInputError(f"PYTORCH_CUDA_ALLOC_CONF: unknown key {key!r} in {text!r}; expected one of "
                                 f"{', '.join(MODELED_KEYS + IGNORED_KEYS)}. Hint: check the spelling.")
    return _build(values, tuple(ignored))


def _build(values: dict[str, object], ignored: tuple[str, ...]) -> AllocatorConfig:
    backend = values.get("backend", "native")
    if backend == "cudaMallocAsync":
        raise UnsupportedError("PYTORCH_CUDA_ALLOC_CONF backend:cudaMallocAsync uses CUDA's stream-ordered "
                               "allocator, which graphmem does not model; expected backend:native.")
    if backend != "native":
        raise UserInputError(f"PYTORCH_CUDA_ALLOC_CONF: backend {backend!r}; expected native or cudaMallocAsync.")
    segment_mb = _whole("large_segment_size_mb", values.get("large_segment_size_mb", "20"))
    if segment_mb <= _MIN_LARGE_SEGMENT_MB:
        raise UserInputError(f"PYTORCH_CUDA_ALLOC_CONF: large_segment_size_mb:{segment_mb} must be > "
                             f"{_MIN_LARGE_SEGMENT_MB} (MiB), as PyTorch requires.")
    # max_split_size_mb and max_non_split_rounding_mb must be >= large_segment_size_mb
    # (parseMaxSplitSize / parseMaxNonSplitRoundingSize); values are capped at SIZE_MAX / 1 MiB.
    split = _at_least("max_split_size_mb", values.get("max_split_size_mb"), segment_mb)
    rounding = _at_least("max_non_split_rounding_mb", values.get("max_non_split_rounding_mb"), segment_mb)
    return AllocatorConfig(
        max_split_size_bytes=UNLIMITED if split is None else split,
        max_non_split_rounding_bytes=K_LARGE_BUFFER if rounding is None else rounding,
        large_segment_size_bytes=segment_mb * MiB,
        roundup_power2_divisions=_divisions(values.get("roundup_power2_divisions")),
        expandable_segments=_boolean("expandable_segments", values.get("expandable_segments", "False")),
        ignored=ignored)


def _tokens(text: str) -> list[str]:
    # ConfigTokenizer: ',', ':', '[' and ']' are tokens of their own; whitespace is dropped.
    return [t for t in re.split(r"([,:\[\]])", re.sub(r"\s+", "", text)) if t]


def _pairs(text: str) -> list[tuple[str, str | list[str]]]:
    """``key:value`` pairs in order; a bracketed value is returned as its inner tokens."""
    tokens, pairs, i = _tokens(text), [], 0
    while i < len(tokens):
        key = tokens[i]
        if key in ",:[]" or i + 2 >= len(tokens) or tokens[i + 1] != ":" or tokens[i + 2] in ",:]":
            raise UserInputError(f"PYTORCH_CUDA_ALLOC_CONF: malformed setting near {' '.join(tokens[i:i + 3])!r} "
                                 f"in {text!r}; expected key:value pairs separated by commas, "
                                 "e.g. 'expandable_segments:True,max_split_size_mb:128'.")
        value: str | list[str] = tokens[i + 2]
        i += 3
        if value == "[":
            if "]" not in tokens[i:]:
                raise UserInputError(f"PYTORCH_CUDA_ALLOC_CONF: {key} list has no closing ']' in {text!r}.")
            end = tokens.index("]", i)
            value, i = tokens[i:end], end + 1
        if i < len(tokens) and tokens[i] != ",":
            raise UserInputError(f"PYTORCH_CUDA_ALLOC_CONF: expected ',' after {key}, got {tokens[i]!r} in {text!r}.")
        pairs.append((key, value))
        i += 1
    return pairs


def _whole(key: str, value: object) -> int:
    if not isinstance(value, str) or not value.isdigit():
        raise UserInputError(f"PYTORCH_CUDA_ALLOC_CONF: {key}:{value!r} is not a whole number; "
                             f"expected e.g. {key}:128.")
    return int(value)


def _at_least(key: str, value: object, minimum_mb: int) -> int | None:
    if value is None:
        return None
    mb = _whole(key, value)
    if mb < minimum_mb:
        raise UserInputError(f"PYTORCH_CUDA_ALLOC_CONF: {key}:{mb} is too small; PyTorch requires >= "
                             f"{minimum_mb} (the large segment size in MiB).")
    return min(mb, UNLIMITED // MiB) * MiB


def _boolean(key: str, value: object) -> bool:
    # ConfigTokenizer::toBool accepts exactly "True" and "False".
    if value not in ("True", "False"):
        raise UserInputError(f"PYTORCH_CUDA_ALLOC_CONF: {key}:{value!r}; expected True or False "
                             "(capitalised, as PyTorch requires).")
    return value == "True"


def _power_of_two(value: int) -> bool:
    return value > 0 and value & (value - 1) == 0


def _divisions(value: object) -> tuple[int, ...]:
    """parseRoundUpPower2Divisions: one number for every interval, or ``[MB:N,...,>:N]``."""
    if value is None:
        return (0,) * ROUNDUP_INTERVALS
    if isinstance(value, str):
        divisions = _whole("roundup_power2_divisions", value)
        if not _power_of_two(divisions):
            raise UserInputError(f"PYTORCH_CUDA_ALLOC_CONF: roundup_power2_divisions:{divisions} must be a "
                                 "power of 2 (1, 2, 4, 8, ...).")
        return (divisions,) * ROUNDUP_INTERVALS
    return _division_list(value if isinstance(value, list) else [])


def _division_list(tokens: list[str]) -> tuple[int, ...]:
    table = [0] * ROUNDUP_INTERVALS
    first, last_index = True, 0
    for parts in _groups(tokens):
        if len(parts) != 3 or parts[1] != ":":
            raise UserInputError(f"PYTORCH_CUDA_ALLOC_CONF: roundup_power2_divisions entry {''.join(parts)!r}; "
                                 "expected MB:N or >:N, e.g. [256:1,512:2,>:4].")
        divisions = _whole("roundup_power2_divisions", parts[2])
        if divisions != 0 and not _power_of_two(divisions):
            raise UserInputError(f"PYTORCH_CUDA_ALLOC_CONF: roundup_power2_divisions value {divisions} must be "
                                 "0 or a power of 2.")
        if parts[0] == ">":
            table[last_index + 1:] = [divisions] * (ROUNDUP_INTERVALS - last_index - 1)
            continue
        boundary = _whole("roundup_power2_divisions", parts[0])
        if not _power_of_two(boundary):
            raise UserInputError(f"PYTORCH_CUDA_ALLOC_CONF: roundup_power2_divisions interval {boundary} (MB) "
                                 "must be a power of 2.")
        index = min(boundary.bit_length() - 1, ROUNDUP_INTERVALS - 1)
        if first:  # the first entry also covers every smaller interval
            table[:index] = [divisions] * index
            first = False
        table[index], last_index = divisions, index
    return tuple(table)


def _groups(tokens: list[str]) -> list[list[str]]:
    """The comma-separated entries of a bracketed list, each as its tokens."""
    groups: list[list[str]] = [[]]
    for token in tokens:
        if token == ",":
            groups.append([])
        else:
            groups[-1].append(token)
    return groups if tokens else []


def _check_ignored(key: str, value: str | list[str]) -> None:
    if key == "garbage_collection_threshold":
        try:
            threshold = float(value) if isinstance(value, str) else -1.0
        except ValueError:
            threshold = -1.0
        if not 0.0 < threshold < 1.0:
            raise UserInputError(f"PYTORCH_CUDA_ALLOC_CONF: garbage_collection_threshold:{value!r}; expected "
                                 "a number in (0.0, 1.0).")
