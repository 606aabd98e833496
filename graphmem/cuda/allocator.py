"""Stage 3c: the CUDA caching allocator.  Alloc/free events -> allocated and reserved bytes (pure).

Input: an alloc/free sequence (``graphmem.memory.memory_events``, optionally with extra
scratch/workspace allocations from ``graphmem.memory.alloc_events.with_extra_allocations``) and an ``AllocatorConfig``
(``graphmem.cuda.alloc_conf.parse_alloc_conf``).  Output: ``AllocatorStats``: what
``torch.cuda.max_memory_allocated()`` and ``torch.cuda.max_memory_reserved()`` would report
after the run, both timelines and where their peaks happen.

The model replays PyTorch's native caching allocator, ``DeviceCachingAllocator`` in
c10/cuda/CUDACachingAllocator.cpp (constants in c10/core/AllocatorConfig.h, torch 2.13);
each rule below names the function it comes from.  Not modeled: freeing cached blocks when
cudaMalloc fails (``release_cached_blocks``: the model never runs out of memory, so
reserved can exceed a GPU's capacity where PyTorch would flush its cache and retry),
``empty_cache()``, garbage collection, cross-stream ``record_stream`` events, CUDA graph
pools.  cudaMalloc addresses are modeled as increasing with each new segment, which only
matters for best-fit ties between equal-sized free blocks.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from graphmem.cuda.alloc_conf import ROUNDUP_INTERVALS, AllocatorConfig, MiB
from graphmem.errors import UserInputError

__all__ = [
    "MemoryEvent",
    "K_MIN_BLOCK_SIZE",
    "K_MIN_LARGE_ALLOC",
    "K_ROUND_LARGE",
    "K_SMALL_BUFFER",
    "K_SMALL_SIZE",
    "AllocatorStats",
    "allocation_size",
    "replay",
    "round_size",
]

# c10/core/AllocatorConfig.h (torch 2.13), also at the top of CUDACachingAllocator.cpp:
K_MIN_BLOCK_SIZE = 512          # kMinBlockSize: all sizes are rounded to at least 512 bytes
K_SMALL_SIZE = 1 * MiB          # kSmallSize: largest "small" allocation
K_SMALL_BUFFER = 2 * MiB        # kSmallBuffer: "small" allocations are packed in 2 MiB blocks
K_MIN_LARGE_ALLOC = 10 * MiB    # kMinLargeAlloc: allocations between 1 and 10 MiB may use kLargeBuffer
K_ROUND_LARGE = 2 * MiB         # kRoundLarge: round up large allocations to 2 MiB
# An expandable segment reserves 1 1/8 x the GPU's memory of address space
# (ExpandableSegment::init); only its order relative to block sizes matters here.
_VIRTUAL_SPACE = 1 << 50



@dataclass(frozen=True, slots=True)
class MemoryEvent:
    """One allocation or release, in the order a real run performs them.

    ``step`` is the op that allocates (-1: before the first op) or the op after which the
    storage is released (frees come before the next op's allocations).
    """

    kind: str  # "alloc" | "free"
    sid: int
    nbytes: int
    step: int


@dataclass(frozen=True, slots=True)
class AllocatorStats:
    """What the caching allocator reports after replaying a run (bytes; positions are event
    indices into the replayed sequence, -1 / None when it is empty)."""

    allocated_peak_bytes: int   # torch.cuda.max_memory_allocated(): rounded blocks in use
    reserved_peak_bytes: int    # torch.cuda.max_memory_reserved(): segments (mapped pages)
    requested_peak_bytes: int   # the peak of bytes asked for, before rounding
    allocated_peak_event: int
    reserved_peak_event: int
    allocated_peak_step: int | None
    reserved_peak_step: int | None
    allocated_timeline: tuple[int, ...]  # after each event
    reserved_timeline: tuple[int, ...]
    allocated_end_bytes: int
    reserved_end_bytes: int
    num_segments: int           # cudaMalloc'd segments, or expandable segments created
    num_device_allocs: int      # cudaMalloc + cuMemMap calls (DeviceStats.num_device_alloc)
    config: AllocatorConfig
    # Not the allocator's: what NCCL cudaMallocs for itself on the same GPU (graphmem.cuda.nccl),
    # in neither allocated nor reserved; 0 unless the run is parallel
    nccl_buffer_bytes: int = 0
    event_steps: tuple[int, ...] = ()  # each replayed event's ``step``

    @property
    def active_peak_bytes(self) -> int:
        """``memory_stats()["active_bytes.all.peak"]`` (torchtune's "peak memory active"):
        allocated blocks plus freed ones still waiting for another stream's event before the
        allocator may reuse them.  ``free`` lowers allocated_bytes at once but active_bytes only
        in ``free_block``, which waits for the block's ``stream_uses`` (``record_stream``); the
        replay models no such wait (see the module docstring), so it equals the allocated peak."""
        return self.allocated_peak_bytes

    def peaks_from(self, step: int) -> tuple[int, int]:
        """(allocated, reserved) peaks from op ``step`` on: the counters as they stood before it and
        their highest after (``torch.cuda.reset_peak_memory_stats`` just before op ``step``)."""
        first = next((i for i, s in enumerate(self.event_steps) if s >= step), len(self.event_steps))
        allocated, reserved = self.allocated_timeline, self.reserved_timeline
        before = (allocated[first - 1], reserved[first - 1]) if first else (0, 0)
        return max((before[0], *allocated[first:])), max((before[1], *reserved[first:]))


def round_size(nbytes: int, config: AllocatorConfig) -> int:
    """Block size for a request (``round_size``): at least kMinBlockSize, a multiple of it, or
    the next power-of-two division when ``roundup_power2_divisions`` applies to the size."""
    if nbytes < K_MIN_BLOCK_SIZE:
        return K_MIN_BLOCK_SIZE
    divisions = config.roundup_power2_divisions[_interval(nbytes)]
    if divisions > 1 and nbytes > K_MIN_BLOCK_SIZE * divisions:
        return _next_power2_division(nbytes, divisions)
    return -(-nbytes // K_MIN_BLOCK_SIZE) * K_MIN_BLOCK_SIZE


def _interval(nbytes: int) -> int:
    # AcceleratorAllocatorConfig::roundup_power2_divisions(size): intervals start at 1 MiB
    log_size = nbytes.bit_length() - 1
    return min(max(log_size - 20, 0), ROUNDUP_INTERVALS - 1)


def _next_power2_division(nbytes: int, divisions: int) -> int:
    # roundup_power2_next_division: e.g. 1200 with 4 divisions of [1024, 2048) -> 1280
    if nbytes & (nbytes - 1) == 0:
        return nbytes
    floor = 1 << (nbytes.bit_length() - 1)
    step = floor >> (divisions.bit_length() - 1)
    if step == 0:
        return floor << 1
    rounded = nbytes & ~(step - 1)
    return nbytes if rounded == nbytes else rounded + step


def allocation_size(size: int, config: AllocatorConfig) -> int:
    """cudaMalloc size for a rounded request with no cached block (``get_allocation_size``)."""
    if size <= K_SMALL_SIZE:
        return K_SMALL_BUFFER
    if size < K_MIN_LARGE_ALLOC:
        return config.large_segment_size_bytes
    return -(-size // K_ROUND_LARGE) * K_ROUND_LARGE


class _Block:
    """A block of a segment: allocated, free (in a pool) or, in an expandable segment, the
    unmapped tail.  ``prev``/``next`` link blocks of the same segment only."""

    __slots__ = ("addr", "allocated", "mapped", "next", "prev", "size", "small", "stream")

    def __init__(self, addr: int, size: int, stream: int, small: bool, mapped: bool = True) -> None:
        self.addr, self.size, self.stream, self.small = addr, size, stream, small
        self.allocated, self.mapped = False, mapped
        self.prev: _Block | None = None
        self.next: _Block | None = None


class _Pool:
    """Free mapped blocks of one stream and size class, ordered by (size, address) as
    ``BlockComparatorSize`` orders them."""

    __slots__ = ("blocks", "keys")

    def __init__(self) -> None:
        self.keys: list[tuple[int, int]] = []
        self.blocks: dict[int, _Block] = {}

    def add(self, block: _Block) -> None:
        insort(self.keys, (block.size, block.addr))
        self.blocks[block.addr] = block

    def remove(self, block: _Block) -> None:
        del self.keys[bisect_left(self.keys, (block.size, block.addr))]
        del self.blocks[block.addr]

    def at(self, index: int) -> _Block:
        return self.blocks[self.keys[index][1]]


class _State:
    """The allocator's mutable state during one replay (private to ``replay``)."""

    def __init__(self, config: AllocatorConfig) -> None:
        self.config = config
        self.pools: dict[tuple[int, bool], _Pool] = {}
        self.tails: dict[tuple[int, bool], _Block] = {}  # unmapped tail of each expandable segment
        self.live: dict[int, tuple[_Block | None, int]] = {}  # sid -> (block, bytes requested)
        self.next_addr = 1 << 40
        self.allocated = self.reserved = self.requested = 0
        self.segments = self.device_allocs = 0

    def pool(self, stream: int, small: bool) -> _Pool:
        return self.pools.setdefault((stream, small), _Pool())


def replay(events: Iterable[MemoryEvent], config: AllocatorConfig | None = None, *,
           streams: Mapping[int, int] | None = None) -> AllocatorStats:
    """Replay an alloc/free sequence through the caching allocator model.

    Args:
        events: allocations and frees in execution order; each alloc's ``sid`` must be unique
            among live allocations and each free must name a live ``sid``.
        config: allocator settings (default: PyTorch's defaults).
        streams: stream id per ``sid`` (default: every allocation on stream 0).  Freed blocks
            are reused only by allocations on the same stream.

    Returns:
        AllocatorStats; bytes, timelines indexed by event.

    Raises:
        UserInputError: an unknown event kind, a second alloc of a live sid, a free of an
            unknown sid, or a negative size.
    """
    state = _State(config or AllocatorConfig())
    events = tuple(events)
    allocated: list[int] = []
    reserved: list[int] = []
    requested_peak = 0
    # apply each event, recording both counters after it
    for index, event in enumerate(events):
        _apply(state, event, index, 0 if streams is None else streams.get(event.sid, 0))
        allocated.append(state.allocated)
        reserved.append(state.reserved)
        requested_peak = max(requested_peak, state.requested)
    return _stats(state, events, allocated, reserved, requested_peak)


def _apply(state: _State, event: MemoryEvent, index: int, stream: int) -> None:
    if event.kind == "alloc":
        if event.sid in state.live or event.nbytes < 0:
            raise UserInputError(f"replay: event {index} allocates sid {event.sid} ({event.nbytes} B), which is "
                                 "already live or negative; expected each live sid once and sizes >= 0.")
        # NativeCachingAllocator::allocate: `if (size != 0) malloc(...)`: empty storages get no block
        state.live[event.sid] = (_malloc(state, event.nbytes, stream) if event.nbytes else None, event.nbytes)
        state.requested += event.nbytes
    elif event.kind == "free":
        if event.sid not in state.live:
            raise UserInputError(f"replay: event {index} frees sid {event.sid}, which is not live; "
                                 "expected a free after its alloc.")
        block, nbytes = state.live.pop(event.sid)
        state.requested -= nbytes
        if block is not None:
            _free(state, block)
    else:
        raise UserInputError(f"replay: event {index} has kind {event.kind!r}; expected 'alloc' or 'free'.")


def _stats(state: _State, events: Sequence[MemoryEvent], allocated: list[int], reserved: list[int],
           requested_peak: int) -> AllocatorStats:
    a_at = max(range(len(allocated)), key=allocated.__getitem__, default=-1)
    r_at = max(range(len(reserved)), key=reserved.__getitem__, default=-1)
    return AllocatorStats(
        allocated_peak_bytes=allocated[a_at] if a_at >= 0 else 0,
        reserved_peak_bytes=reserved[r_at] if r_at >= 0 else 0,
        requested_peak_bytes=requested_peak, allocated_peak_event=a_at, reserved_peak_event=r_at,
        allocated_peak_step=events[a_at].step if a_at >= 0 else None,
        reserved_peak_step=events[r_at].step if r_at >= 0 else None,
        allocated_timeline=tuple(allocated), reserved_timeline=tuple(reserved),
        allocated_end_bytes=state.allocated, reserved_end_bytes=state.reserved,
        num_segments=state.segments, num_device_allocs=state.device_allocs, config=state.config,
        event_steps=tuple(event.step for event in events))


def _malloc(state: _State, nbytes: int, stream: int) -> _Block:
    """DeviceCachingAllocator::malloc: round, pick the pool, reuse or get a new block, split."""
    config = state.config
    size = round_size(nbytes, config)
    small = size <= K_SMALL_SIZE  # get_pool: small pool for sizes <= kSmallSize
    pool = state.pool(stream, small)
    block = _free_block(pool, size, config)
    if block is None and config.expandable_segments:
        block = _grow_expandable(state, pool, size, stream, small)
    elif block is None:
        block = _new_segment(state, allocation_size(size, config), stream, small)
    if _should_split(block, size, config):
        block = _split(pool, block, size)
    block.allocated = True
    state.allocated += block.size  # allocated_bytes counts the whole block (alloc_found_block)
    return block


def _free_block(pool: _Pool, size: int, config: AllocatorConfig) -> _Block | None:
    """get_free_block: the smallest cached block >= size (ties: lowest address), or None."""
    index = bisect_left(pool.keys, (size, -1))
    if index == len(pool.keys):
        return None
    if config.expandable_segments:
        # best fit by the size a block can grow to: skip the free block at a segment's tail
        while index + 1 < len(pool.keys) and _growable(pool.at(index + 1)) < _growable(pool.at(index)):
            index += 1
    block = pool.at(index)
    limit = config.max_split_size_bytes
    # "Do not return an oversized block for a large request"
    if size < limit <= block.size:
        return None
    # "Allow oversized block size to be rounded up but within a limit"
    if size >= limit and block.size >= size + config.max_non_split_rounding_bytes:
        return None
    pool.remove(block)
    return block


def _growable(block: _Block) -> int:
    # expandable_size in get_free_block: a block followed by unmapped space can grow into it
    following = block.next
    return block.size + (following.size if following is not None and not following.mapped else 0)


def _should_split(block: _Block, size: int, config: AllocatorConfig) -> bool:
    """should_split: the small pool (and every expandable segment) splits off >= 512 B; the
    large pool splits only requests below max_split_size leaving more than kSmallSize."""
    remaining = block.size - size
    if block.small or config.expandable_segments:
        return remaining >= K_MIN_BLOCK_SIZE
    return size < config.max_split_size_bytes and remaining > K_SMALL_SIZE


def _split(pool: _Pool, block: _Block, size: int) -> _Block:
    """alloc_found_block with split_remainder: the front ``size`` bytes become the new block;
    the remainder stays linked after it and goes back to the pool."""
    front = _Block(block.addr, size, block.stream, block.small)
    front.prev, front.next = block.prev, block
    if block.prev is not None:
        block.prev.next = front
    block.prev = front
    block.addr += size
    block.size -= size
    pool.add(block)
    return front


def _new_segment(state: _State, nbytes: int, stream: int, small: bool) -> _Block:
    """alloc_block: one cudaMalloc of ``get_allocation_size`` bytes, a segment of its own."""
    block = _Block(state.next_addr, nbytes, stream, small)
    state.next_addr += nbytes
    state.reserved += nbytes
    state.segments += 1
    state.device_allocs += 1
    return block


def _grow_expandable(state: _State, pool: _Pool, size: int, stream: int, small: bool) -> _Block:
    """try_allocate_expandable_block: the free block at the segment's tail (if any) plus new
    pages mapped after it; pages are 2 MiB (kSmallBuffer) in the small pool and
    large_segment_size (20 MiB) in the large pool (find_expandable_block, map_block)."""
    tail = state.tails.get((stream, small))
    if tail is None:  # find_expandable_block: a new segment of unmapped address space
        tail = state.tails[(stream, small)] = _Block(state.next_addr, _VIRTUAL_SPACE, stream, small, mapped=False)
        state.next_addr += _VIRTUAL_SPACE
        state.segments += 1
    block = tail.prev
    if block is not None and not block.allocated:  # the free block before the unmapped space
        pool.remove(block)
        if block.size >= size:
            return block
    else:  # an empty block at the start of the unmapped space
        block = _Block(tail.addr, 0, stream, small)
        block.prev, block.next = tail.prev, tail
        if tail.prev is not None:
            tail.prev.next = block
        tail.prev = block
    page = K_SMALL_BUFFER if small else state.config.large_segment_size_bytes
    mapped = -(-(size - block.size) // page) * page
    block.size += mapped  # map_block, then try_merge with the free block before it
    tail.addr += mapped
    tail.size -= mapped
    state.reserved += mapped
    state.device_allocs += 1
    return block


def _free(state: _State, block: _Block) -> None:
    """free / free_block: the block merges with free neighbours of its own segment (never
    across segments: they are not linked) and returns to its pool."""
    state.allocated -= block.size
    block.allocated = False
    pool = state.pool(block.stream, block.small)
    for neighbour in (block.prev, block.next):
        # try_merge_blocks: only free blocks in the same mapped state
        if neighbour is None or neighbour.allocated or not neighbour.mapped:
            continue
        pool.remove(neighbour)
        if neighbour is block.prev:
            block.addr, block.prev = neighbour.addr, neighbour.prev
            if neighbour.prev is not None:
                neighbour.prev.next = block
        else:
            block.next = neighbour.next
            if neighbour.next is not None:
                neighbour.next.prev = block
        block.size += neighbour.size
    pool.add(block)
