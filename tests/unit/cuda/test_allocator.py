"""The caching allocator model, one rule per test, on hand-derived alloc/free sequences.

Each expected number is derived in the comment beside it from the rule in PyTorch's
c10/cuda/CUDACachingAllocator.cpp that the test names (constants: kMinBlockSize 512 B,
kSmallSize 1 MiB, kSmallBuffer 2 MiB, kLargeBuffer 20 MiB, kMinLargeAlloc 10 MiB,
kRoundLarge 2 MiB, c10/core/AllocatorConfig.h).
"""

from __future__ import annotations

import random
import time

import pytest

from graphmem.cuda.alloc_conf import AllocatorConfig, parse_alloc_conf
from graphmem.cuda.allocator import MemoryEvent, replay, round_size
from graphmem.errors import UserInputError
from graphmem.memory.mode_report import memory_events
from graphmem.memory.results import Category, Lifetime

MiB = 1 << 20
DEFAULT = AllocatorConfig()


def alloc(sid: int, nbytes: int, step: int = 0) -> MemoryEvent:
    return MemoryEvent("alloc", sid, nbytes, step)


def free(sid: int, nbytes: int = 0, step: int = 0) -> MemoryEvent:
    return MemoryEvent("free", sid, nbytes, step)


def test_one_byte_gets_a_512_byte_block_in_a_2_mib_segment() -> None:
    # round_size: 1 < kMinBlockSize -> 512; get_pool: 512 <= 1 MiB -> small pool;
    # get_allocation_size: small -> cudaMalloc(kSmallBuffer = 2 MiB)
    stats = replay([alloc(1, 1)])
    assert (stats.allocated_peak_bytes, stats.reserved_peak_bytes) == (512, 2 * MiB)
    assert stats.requested_peak_bytes == 1
    assert stats.num_segments == 1


def test_sizes_round_up_to_multiples_of_512() -> None:
    # round_size: kMinBlockSize * ceil(size / kMinBlockSize)
    assert [round_size(n, DEFAULT) for n in (512, 513, 1024, 1025, 1_200_000)] == [512, 1024, 1024, 1536, 1_200_128]


def test_one_mib_is_still_small() -> None:
    # get_pool: size <= kSmallSize (1 MiB = 1,048,576) -> small pool -> 2 MiB segment;
    # should_split (small): remaining 1 MiB >= 512 -> split, only 1 MiB is allocated
    stats = replay([alloc(1, MiB)])
    assert (stats.allocated_peak_bytes, stats.reserved_peak_bytes) == (MiB, 2 * MiB)


def test_two_small_blocks_share_one_segment() -> None:
    # the second 1 MiB request takes the 1 MiB remainder split off the first segment
    stats = replay([alloc(1, MiB), alloc(2, MiB)])
    assert stats.reserved_timeline == (2 * MiB, 2 * MiB)
    assert stats.allocated_timeline == (MiB, 2 * MiB)
    assert stats.num_segments == 1


def test_just_over_one_mib_goes_to_a_20_mib_large_segment() -> None:
    # round_size: 1,048,577 -> 2049 * 512 = 1,049,088; > kSmallSize -> large pool;
    # get_allocation_size: < kMinLargeAlloc -> kLargeBuffer (20 MiB);
    # should_split (large): remaining 20 MiB - 1,049,088 = 19,922,432 > kSmallSize -> split
    stats = replay([alloc(1, MiB + 1)])
    assert (stats.allocated_peak_bytes, stats.reserved_peak_bytes) == (1_049_088, 20 * MiB)


def test_just_over_ten_mib_gets_its_own_segment_rounded_to_2_mib() -> None:
    # round_size: 10,485,761 -> 10,486,272; >= kMinLargeAlloc -> kRoundLarge multiple:
    # ceil(10,486,272 / 2 MiB) = 6 -> 12 MiB; remaining 12,582,912 - 10,486,272 = 2,096,640
    # > kSmallSize -> split, so allocated is the rounded request only
    stats = replay([alloc(1, 10 * MiB + 1)])
    assert (stats.allocated_peak_bytes, stats.reserved_peak_bytes) == (10_486_272, 12 * MiB)


def test_rounding_happens_before_the_segment_size_is_chosen() -> None:
    # 10 MiB - 1 rounds (512) to exactly 10 MiB, which is not < kMinLargeAlloc: the
    # segment is 10 MiB (kRoundLarge multiple), not a 20 MiB kLargeBuffer
    stats = replay([alloc(1, 10 * MiB - 1)])
    assert (stats.allocated_peak_bytes, stats.reserved_peak_bytes) == (10 * MiB, 10 * MiB)


def test_large_block_is_not_split_when_the_rest_is_at_most_one_mib() -> None:
    # 11 MiB -> 12 MiB segment; remaining exactly 1 MiB is not > kSmallSize (should_split),
    # so the whole 12 MiB block is allocated: max_memory_allocated counts block->size
    stats = replay([alloc(1, 11 * MiB)])
    assert (stats.allocated_peak_bytes, stats.reserved_peak_bytes) == (12 * MiB, 12 * MiB)
    assert stats.requested_peak_bytes == 11 * MiB


def test_free_then_alloc_reuses_the_cached_block() -> None:
    # free_block returns the 1024 B block to the small pool; get_free_block finds it again
    stats = replay([alloc(1, 1000), free(1), alloc(2, 1000)])
    assert stats.allocated_timeline == (1024, 0, 1024)
    assert stats.reserved_timeline == (2 * MiB,) * 3
    assert stats.num_segments == 1 and stats.num_device_allocs == 1


def test_best_fit_takes_the_smallest_block_that_fits() -> None:
    # segments of 12 MiB and 14 MiB (each a whole block, no remainder); both freed.
    # get_free_block (lower_bound by size): 11 MiB -> the 12 MiB block (remainder 1 MiB: no
    # split), then 13 MiB -> the 14 MiB block.  Taking 14 MiB for the first would force a
    # new segment for the second.
    events = [alloc(1, 12 * MiB), alloc(2, 14 * MiB), free(1), free(2), alloc(3, 11 * MiB), alloc(4, 13 * MiB)]
    stats = replay(events)
    assert stats.allocated_timeline[-2:] == (12 * MiB, 26 * MiB)
    assert stats.reserved_peak_bytes == 26 * MiB and stats.num_segments == 2


def test_freed_neighbours_merge_within_a_segment() -> None:
    # 2 MiB requests are large-pool: the first cudaMallocs 20 MiB and splits (rest 18 MiB),
    # the second splits the rest (2 MiB + 16 MiB).  Freeing both merges 2 + 2 + 16 back to
    # 20 MiB (free_block -> try_merge_blocks), so a 19 MiB request (rounded: 19 MiB, no split
    # as the 1 MiB rest is not > kSmallSize) fits without a new segment.
    events = [alloc(1, 2 * MiB), alloc(2, 2 * MiB), free(1), free(2), alloc(3, 19 * MiB)]
    stats = replay(events)
    assert stats.allocated_timeline == (2 * MiB, 4 * MiB, 2 * MiB, 0, 20 * MiB)
    assert stats.reserved_peak_bytes == 20 * MiB


def test_blocks_of_different_segments_never_merge() -> None:
    # two 12 MiB segments, both freed: two 12 MiB free blocks, not one of 24 MiB (blocks are
    # linked only within the cudaMalloc they were split from), so 24 MiB needs a new segment
    events = [alloc(1, 12 * MiB), alloc(2, 12 * MiB), free(1), free(2), alloc(3, 24 * MiB)]
    stats = replay(events)
    assert stats.reserved_peak_bytes == 48 * MiB and stats.num_segments == 3


def test_without_max_split_size_a_big_free_block_is_split_for_a_small_request() -> None:
    # default max_split_size is unlimited: 12 MiB takes the free 30 MiB block and splits it
    # (remaining 18 MiB > kSmallSize)
    stats = replay([alloc(1, 30 * MiB), free(1), alloc(2, 12 * MiB)])
    assert stats.reserved_peak_bytes == 30 * MiB
    assert stats.allocated_timeline[-1] == 12 * MiB


def test_max_split_size_keeps_oversize_blocks_from_small_requests() -> None:
    # max_split_size_mb:20: get_free_block refuses a block >= 20 MiB for a request < 20 MiB
    # ("Do not return an oversized block for a large request"): 12 MiB gets a new segment
    config = parse_alloc_conf("max_split_size_mb:20")
    stats = replay([alloc(1, 30 * MiB), free(1), alloc(2, 12 * MiB)], config)
    assert stats.reserved_peak_bytes == 42 * MiB
    assert stats.allocated_timeline[-1] == 12 * MiB


def test_max_split_size_reuses_an_oversize_block_whole_within_20_mib() -> None:
    # request 32 MiB >= max_split_size (20 MiB): a free block is taken only if it is
    # < request + max_non_split_rounding (20 MiB) = 52 MiB, and then not split
    # (should_split: size < max_split_size is false).  50 MiB: reused whole.  60 MiB: refused.
    config = parse_alloc_conf("max_split_size_mb:20")
    reused = replay([alloc(1, 50 * MiB), free(1), alloc(2, 32 * MiB)], config)
    assert reused.allocated_timeline[-1] == 50 * MiB and reused.reserved_peak_bytes == 50 * MiB
    refused = replay([alloc(1, 60 * MiB), free(1), alloc(2, 32 * MiB)], config)
    assert refused.allocated_timeline[-1] == 32 * MiB and refused.reserved_peak_bytes == 92 * MiB


def test_large_segment_size_changes_the_segment_of_mid_sized_requests() -> None:
    # get_allocation_size: 1-10 MiB requests get AcceleratorAllocatorConfig::large_segment_size()
    stats = replay([alloc(1, 2 * MiB)], parse_alloc_conf("large_segment_size_mb:64"))
    assert (stats.allocated_peak_bytes, stats.reserved_peak_bytes) == (2 * MiB, 64 * MiB)


def test_roundup_power2_divisions() -> None:
    # roundup_power2_divisions:4 applies when size > 512 * 4 = 2048.
    # 1200 B: not > 2048 -> 512 rounding -> 1536.
    # 1,200,000 B: power-of-2 floor 1 MiB, four divisions of [1 MiB, 2 MiB) step 256 KiB:
    # 1,048,576 + 262,144 = 1,310,720 (roundup_power2_next_division)
    config = parse_alloc_conf("roundup_power2_divisions:4")
    assert round_size(1200, config) == 1536
    assert round_size(1_200_000, config) == 1_310_720
    assert round_size(MiB, config) == MiB  # powers of two stay
    stats = replay([alloc(1, 1_200_000)], config)
    assert stats.allocated_peak_bytes == 1_310_720  # > 1 MiB: large pool, 20 MiB segment, split


def test_roundup_power2_divisions_per_interval() -> None:
    # [1:1,>:4]: interval 0 (below 2 MiB) keeps 512 rounding, intervals 1.. use 4 divisions.
    # 3 MiB + 1 is in [2 MiB, 4 MiB): step 512 KiB -> 3.5 MiB = 3,670,016
    config = parse_alloc_conf("roundup_power2_divisions:[1:1,>:4]")
    assert round_size(1_200_000, config) == 1_200_128
    assert round_size(3 * MiB + 1, config) == 3_670_016


def test_expandable_segments_map_2_mib_pages_in_the_small_pool() -> None:
    # try_allocate_expandable_block -> map_block: the small pool's page is kSmallBuffer
    stats = replay([alloc(1, 1)], parse_alloc_conf("expandable_segments:True"))
    assert (stats.allocated_peak_bytes, stats.reserved_peak_bytes) == (512, 2 * MiB)


def test_expandable_segments_map_20_mib_pages_in_the_large_pool() -> None:
    # 30 MiB maps ceil(30 / 20) = 2 pages = 40 MiB; should_split (expandable): 10 MiB left
    # >= 512 -> split, so 30 MiB allocated.  Non-expandable: one 30 MiB cudaMalloc.
    config = parse_alloc_conf("expandable_segments:True")
    stats = replay([alloc(1, 30 * MiB)], config)
    assert (stats.allocated_peak_bytes, stats.reserved_peak_bytes) == (30 * MiB, 40 * MiB)


def test_expandable_segment_grows_from_its_free_tail() -> None:
    # a = 30 MiB maps 40 MiB (10 MiB free tail).  b = 25 MiB: no free block >= 25 MiB, so
    # find_expandable_block starts at the free tail (10 MiB) and maps ceil(15 / 20) = 1 more
    # page: reserved 60 MiB; b splits the 30 MiB block, leaving 5 MiB free.
    config = parse_alloc_conf("expandable_segments:True")
    stats = replay([alloc(1, 30 * MiB), alloc(2, 25 * MiB)], config)
    assert stats.reserved_timeline == (40 * MiB, 60 * MiB)
    assert stats.allocated_timeline == (30 * MiB, 55 * MiB)
    assert stats.num_segments == 1 and stats.num_device_allocs == 2


def test_expandable_segment_reuses_the_whole_mapped_range() -> None:
    # after a 30 MiB block is freed the segment holds one free 40 MiB mapped block, so 35 MiB
    # fits without mapping.  Without expandable segments the free 30 MiB segment is too small
    # and 35 MiB needs its own 36 MiB segment: 66 MiB reserved.
    events = [alloc(1, 30 * MiB), free(1), alloc(2, 35 * MiB)]
    assert replay(events, parse_alloc_conf("expandable_segments:True")).reserved_peak_bytes == 40 * MiB
    assert replay(events).reserved_peak_bytes == 66 * MiB


def test_blocks_are_reused_only_on_their_own_stream() -> None:
    # pools are per stream (BlockComparatorSize orders by stream first): a block freed on
    # stream 0 is not found by an allocation on stream 1, which gets a second segment
    stats = replay([alloc(1, 1000), free(1), alloc(2, 1000)], streams={2: 1})
    assert stats.reserved_peak_bytes == 4 * MiB and stats.num_segments == 2


def test_empty_storages_get_no_block() -> None:
    # NativeCachingAllocator::allocate calls malloc only `if (size != 0)`
    stats = replay([alloc(1, 0), free(1), alloc(2, 0)])
    assert stats.allocated_timeline == (0, 0, 0) and stats.reserved_peak_bytes == 0


def test_peak_positions() -> None:
    events = [alloc(1, 3000, step=0), alloc(2, 3000, step=1), free(1, 3000, step=1), alloc(3, 100, step=2)]
    stats = replay(events)
    # allocated: 3072, 6144, 3072, 3584 -> peak 6144 at event 1 (step 1)
    assert stats.allocated_timeline == (3072, 6144, 3072, 3584)
    assert (stats.allocated_peak_event, stats.allocated_peak_step) == (1, 1)
    # reserved: 2 MiB from the first event on -> first peak at event 0
    assert (stats.reserved_peak_event, stats.reserved_peak_step) == (0, 0)
    assert (stats.allocated_end_bytes, stats.reserved_end_bytes) == (3584, 2 * MiB)


def test_empty_sequence() -> None:
    stats = replay([])
    assert (stats.allocated_peak_bytes, stats.reserved_peak_bytes, stats.allocated_peak_event) == (0, 0, -1)
    assert stats.allocated_peak_step is None and stats.allocated_timeline == ()


@pytest.mark.parametrize("events, fragment", [
    ([free(1)], "frees sid 1"),
    ([alloc(1, 10), alloc(1, 10)], "allocates sid 1"),
    ([MemoryEvent("grow", 1, 10, 0)], "kind 'grow'"),
])
def test_bad_sequences_name_the_event(events: list[MemoryEvent], fragment: str) -> None:
    with pytest.raises(UserInputError, match=fragment):
        replay(events)


def _random_events(count: int, seed: int) -> list[MemoryEvent]:
    rng = random.Random(seed)
    events: list[MemoryEvent] = []
    live: list[tuple[int, int]] = []
    sid = 0
    for step in range(count):
        if live and rng.random() < 0.5:
            victim = live.pop(rng.randrange(len(live)))
            events.append(free(victim[0], victim[1], step))
        else:
            sid += 1
            nbytes = rng.choice([rng.randint(0, MiB), rng.randint(MiB, 40 * MiB)])
            live.append((sid, nbytes))
            events.append(alloc(sid, nbytes, step))
    return events + [free(s, n, count) for s, n in live]


@pytest.mark.parametrize("conf", ["", "expandable_segments:True", "max_split_size_mb:24",
                                  "roundup_power2_divisions:[64:8,>:2]"])
def test_invariants_on_random_sequences(conf: str) -> None:
    events = _random_events(3000, seed=len(conf))
    stats = replay(events, parse_alloc_conf(conf))
    pairs = list(zip(stats.allocated_timeline, stats.reserved_timeline))
    assert all(0 <= allocated <= reserved for allocated, reserved in pairs)
    # nothing is ever returned to CUDA (no OOM, no empty_cache): reserved never shrinks
    assert all(a <= b for a, b in zip(stats.reserved_timeline, stats.reserved_timeline[1:]))
    assert stats.allocated_end_bytes == 0  # everything was freed
    assert stats.requested_peak_bytes <= stats.allocated_peak_bytes <= stats.reserved_peak_bytes


def test_requested_peak_matches_the_liveness_peak() -> None:
    # hand-built lifetimes (op indices): a 100 B parameter for the whole run, 3000 B live in
    # ops 0-1, 5000 B in op 1 only, 7 B from op 2 on.  Peak of requested bytes:
    # op 1 = 100 + 3000 + 5000 = 8100.  Rounded: 512 + 3072 + 5120 = 8704, all in one 2 MiB segment.
    lifetimes = (Lifetime(0, 100, -1, 2, Category.PARAMETER), Lifetime(1, 3000, 0, 1, Category.ACTIVATION),
                 Lifetime(2, 5000, 1, 1, Category.TEMPORARY), Lifetime(3, 7, 2, 2, Category.OUTPUT))
    stats = replay(memory_events(lifetimes, num_ops=3))
    assert stats.requested_peak_bytes == 8100
    assert stats.allocated_peak_bytes == 8704 and stats.reserved_peak_bytes == 2 * MiB
    assert stats.allocated_peak_step == 1


def test_100k_events_replay_quickly() -> None:
    events = _random_events(100_000, seed=1)
    start = time.perf_counter()
    replay(events)
    assert time.perf_counter() - start < 5.0
