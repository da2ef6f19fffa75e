"""A model of PyTorch's CUDA caching allocator: the memory a step reserves, not only allocates.

What decides an out-of-memory error on a GPU, and what training logs publish
(``torch.cuda.max_memory_reserved``), is the caching allocator's reserved memory: the segments it
took from the driver, whose free parts it keeps for later requests of the same stream. A plan
records the step's allocations and frees (``trace.StepTrace.alloc_log``); ``CachingAllocator``
replays them and reports the allocated, requested and reserved peaks. The rules, as
``c10/cuda/CUDACachingAllocator.cpp`` has them (read there; written here anew):

- **sizes**: a request is rounded up to a multiple of 512 bytes (at least 512);
- **pools**: requests of at most 1 MiB come from the small pool, the rest from the large one;
  each stream has its own of each, and a freed block serves only its own stream again;
- **best fit**: the smallest free block of the pool that holds the request;
- **segments**: when none does, a new segment is taken: 2 MiB for a small request, 20 MiB for
  one under 10 MiB, else the request rounded up to 2 MiB;
- **splitting**: the rest of a block stays free behind the request if it is at least 512 bytes
  (small pool) or more than 1 MiB (large pool); otherwise the request takes the whole block,
  and counts as allocated with it;
- **freeing** merges a block with free neighbours of its segment; segments are given back to the
  driver only when a new one would not fit under the device's limit, and then every whole free
  segment of every stream is (``release_cached_blocks``); only then is it out of memory;
- **expandable segments** (``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``): one segment per
  stream and pool that grows at its end in pages (2 MiB small, 20 MiB large), any split of 512
  bytes or more is kept, and when memory runs short every whole page of a free block is unmapped,
  inside the segment as at its end, to be mapped again when a request takes it;
- **max_split_size_mb** (``max_split``, in bytes; unset by default): a request of at least that
  size is never split off a larger block and takes a cached block only within 20 MiB of its
  size; a smaller request takes no block of at least that size; and when memory runs short, the
  pool's free oversize segments are given back first (the smallest that covers the request, else
  from the largest down), everything cached only if that is not enough.

Left out: power-of-two rounding and garbage collection (off by default) and CUDA graph pools.
Frees are at once: neither FSDP2 nor twinshard calls ``record_stream``, and ProcessGroupNCCL
records its streams on a tensor only for a collective issued with ``async_op=True`` (it keeps a
blocking one's tensors alive instead), which on an accelerator neither issues. A free block whose
pages were unmapped is chosen by best fit as if they were mapped.
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass, field

MiB = 1 << 20
MIN_BLOCK = 512  # every size is a multiple of this
SMALL_SIZE = 1 * MiB  # the largest request of the small pool
SMALL_SEGMENT = 2 * MiB  # a small pool's segment (and its page, expandable)
LARGE_SEGMENT = 20 * MiB  # the segment of a request under MIN_LARGE_ALLOC (and a large page)
MIN_LARGE_ALLOC = 10 * MiB
ROUND_LARGE = 2 * MiB


def round_size(nbytes: int) -> int:
    """A request's size in the allocator: a multiple of 512 bytes, at least 512."""
    return max(MIN_BLOCK, -(-nbytes // MIN_BLOCK) * MIN_BLOCK)


def segment_size(size: int) -> int:
    """The segment taken from the driver for a (rounded) request no free block holds."""
    if size <= SMALL_SIZE:
        return SMALL_SEGMENT
    if size < MIN_LARGE_ALLOC:
        return LARGE_SEGMENT
    return -(-size // ROUND_LARGE) * ROUND_LARGE


def page_size(pool: tuple) -> int:
    """The page of an expandable segment of ``pool`` (stream, small)."""
    return SMALL_SEGMENT if pool[1] else LARGE_SEGMENT


@dataclass(eq=False)
class Block:
    """A piece of a segment, free or given to a request."""

    segment: Segment
    offset: int
    size: int
    free: bool = True
    prev: Block | None = None
    next: Block | None = None

    def key(self) -> tuple:  # the pool's order: best fit, then the lowest address
        return (self.size, self.segment.serial, self.offset)


@dataclass(eq=False)
class Segment:
    """Memory taken from the driver: ``size`` bytes (expandable: mapped, but ``unmapped``)."""

    serial: int
    pool: tuple  # (stream, small)
    size: int
    first: Block | None = None
    expandable: bool = False
    unmapped: set = field(default_factory=set)  # expandable: indexes of pages given back inside


@dataclass
class Stats:
    allocated: int = 0  # block bytes given to requests (rounded, with unsplit rests)
    requested: int = 0  # bytes the requests asked for
    reserved: int = 0  # segment bytes taken from the driver
    peak_allocated: int = 0
    peak_requested: int = 0
    peak_reserved: int = 0
    segments: int = 0
    driver_allocs: int = 0  # segments (or pages) taken
    releases: int = 0  # times cached memory was given back to fit a request
    oom: list = field(default_factory=list)  # (request bytes, reserved then) that did not fit


class CachingAllocator:
    """Replays allocations and frees as the caching allocator serves them; ``limit``: the device's
    usable bytes (None: no limit), ``expandable``: expandable segments, ``max_split``:
    ``max_split_size_mb`` in bytes (None: unset)."""

    def __init__(self, limit: int | None = None, expandable: bool = False, max_split=None):
        self.limit, self.expandable, self.max_split = limit, expandable, max_split
        self.pools: dict[tuple, list] = {}  # (stream, small) -> free blocks, sorted by key()
        self.segments: list[Segment] = []
        self.grown: dict[tuple, Segment] = {}  # expandable: the one segment of each pool
        self.live: dict = {}  # request key -> (its block, bytes asked)
        self.stats = Stats()
        self._serial = itertools.count()

    # --- requests ---------------------------------------------------------------------------------
    def malloc(self, key, nbytes: int, stream: str = "default") -> None:
        """Serve a request of ``nbytes`` for ``key`` on ``stream`` (freed by ``free(key)``)."""
        size = round_size(nbytes)
        pool = (stream, size <= SMALL_SIZE)
        block = self._best_fit(pool, size)
        if block is None:
            block = self._grow(pool, size) if self.expandable else self._new_segment(pool, size)
        self._take(block, size)
        self.live[key] = (block, nbytes)
        s = self.stats
        s.allocated += block.size
        s.requested += nbytes
        s.peak_allocated = max(s.peak_allocated, s.allocated)
        s.peak_requested = max(s.peak_requested, s.requested)

    def free(self, key) -> None:
        """Give ``key``'s block back to its pool, merged with its free neighbours."""
        block, nbytes = self.live.pop(key)
        self.stats.allocated -= block.size
        self.stats.requested -= nbytes
        block.free = True
        for other in (block.prev, block.next):
            if other is not None and other.free:
                self._unlist(other)
                block = self._merge(block, other)
        self._list(block)

    # --- the pools --------------------------------------------------------------------------------
    def _list(self, block: Block) -> None:
        bisect.insort(self.pools.setdefault(block.segment.pool, []), block, key=Block.key)

    def _unlist(self, block: Block) -> None:
        blocks = self.pools[block.segment.pool]
        i = bisect.bisect_left(blocks, block.key(), key=Block.key)
        assert blocks[i] is block
        del blocks[i]

    def _best_fit(self, pool: tuple, size: int) -> Block | None:
        """The smallest free block of ``pool`` that holds ``size`` (expandable: not the free end
        of the segment, which is grown instead, as if it were as large as it can grow)."""
        blocks = self.pools.get(pool, [])
        i = bisect.bisect_left(blocks, (size, -1, -1), key=Block.key)
        for block in blocks[i:]:
            if self.expandable and block.next is None:
                continue
            if self._oversize(size, block):
                return None  # every later block is larger, and as oversize
            self._unlist(block)
            return block
        return None

    def _oversize(self, size: int, block: Block) -> bool:
        """``max_split_size_mb``: whether ``block`` is too large to serve a request of ``size``."""
        m = self.max_split
        return m is not None and block.size >= (m if size < m else size + LARGE_SEGMENT)

    def _take(self, block: Block, size: int) -> None:
        """Give ``block`` to a request of ``size``, splitting off a free rest where the rules
        say so."""
        rest = block.size - size
        small = block.segment.pool[1]
        whole = self.max_split is not None and size >= self.max_split
        split = rest >= MIN_BLOCK if small or self.expandable else rest > SMALL_SIZE and not whole
        if split:
            tail = Block(block.segment, block.offset + size, rest, True, block, block.next)
            if block.next is not None:
                block.next.prev = tail
            block.next, block.size = tail, size
            self._list(tail)
        block.free = False
        segment, page = block.segment, page_size(block.segment.pool)
        start, end = block.offset, block.offset + size  # its pages: those overlapping these
        for index in [i for i in segment.unmapped if start < (i + 1) * page and i * page < end]:
            self._reserve(page, size)
            segment.unmapped.discard(index)

    @staticmethod
    def _merge(a: Block, b: Block) -> Block:
        first, second = (a, b) if a.offset < b.offset else (b, a)
        first.size += second.size
        first.next = second.next
        if second.next is not None:
            second.next.prev = first
        first.free = True
        return first

    # --- memory from the driver -------------------------------------------------------------------
    def _reserve(self, nbytes: int, request: int, pool: tuple | None = None) -> None:
        """Count ``nbytes`` more reserved, first giving cached memory back where the limit
        says so (``pool``'s oversize segments first); a request that still does not fit is
        recorded as out of memory."""
        s = self.stats
        if self.limit is not None and s.reserved + nbytes > self.limit:
            s.releases += 1
            if not self._release_oversize(pool, request, nbytes):
                self._release()
            if s.reserved + nbytes > self.limit:
                s.oom.append((request, s.reserved))
        s.reserved += nbytes
        s.driver_allocs += 1
        s.peak_reserved = max(s.peak_reserved, s.reserved)

    def _new_segment(self, pool: tuple, size: int) -> Block:
        nbytes = segment_size(size)
        self._reserve(nbytes, size, pool)
        segment = Segment(next(self._serial), pool, nbytes)
        segment.first = Block(segment, 0, nbytes)
        self.segments.append(segment)
        self.stats.segments += 1
        return segment.first

    def _grow(self, pool: tuple, size: int) -> Block:
        """Expandable: map pages at the end of the pool's segment until its free end holds
        ``size``; returns that end, out of its pool."""
        page = page_size(pool)
        segment = self.grown.get(pool)
        if segment is None:
            segment = self.grown[pool] = Segment(next(self._serial), pool, 0, expandable=True)
            self.segments.append(segment)
            self.stats.segments += 1
        nbytes = 0  # pages taken for this request so far; a release may cut the free end
        while True:
            end = self._last(segment)
            have = end.size if end is not None and end.free else 0
            need = -(-max(0, size - have) // page) * page  # whole pages, none if it holds it
            if need <= nbytes:
                break
            self._reserve(need - nbytes, size)
            nbytes = need
        segment.size += nbytes
        if end is not None and end.free:
            self._unlist(end)
            end.size += nbytes
            return end
        block = Block(segment, segment.size - nbytes, nbytes, True, end)
        if end is None:
            segment.first = block
        else:
            end.next = block
        return block

    @staticmethod
    def _last(segment: Segment) -> Block | None:
        block = segment.first
        while block is not None and block.next is not None:
            block = block.next
        return block

    def _release(self) -> None:
        """Give cached memory back to the driver: every whole free segment of every pool (with
        ``max_split_size_mb`` unset, PyTorch's default, nothing is given back alone first);
        expandable: the whole pages of every free block."""
        for segment in list(self.segments):
            if self.expandable:
                self._unmap_free(segment)
            elif segment.first.free and segment.first.next is None:  # a whole free segment
                self._give_back(segment)

    def _release_oversize(self, pool: tuple | None, size: int, nbytes: int) -> bool:
        """``max_split_size_mb``: give back ``pool``'s free oversize segments, the smallest that
        covers ``size`` (at least the limit), else from the largest down until they do; whether
        they did and ``nbytes`` more then fit (else everything cached is given back)."""
        m = self.max_split
        if m is None or pool is None:
            return False
        oversize = [b for b in self.pools.get(pool, []) if b.size >= m and b.prev is b.next is None]
        freed, need = 0, max(size, m)
        covering = [b for b in oversize if b.size >= need]
        for block in covering[:1] or oversize[::-1]:
            if freed >= need:
                break
            freed += block.size
            self._give_back(block.segment)
        return freed >= need and self.stats.reserved + nbytes <= self.limit

    def _give_back(self, segment: Segment) -> None:
        self._unlist(segment.first)
        self.segments.remove(segment)
        self.stats.reserved -= segment.size
        self.stats.segments -= 1

    def _unmap_free(self, segment: Segment) -> None:
        """Unmap the whole pages of ``segment``'s free blocks (its ``unmapped`` pages); those of
        a free end are cut off the segment."""
        page, block = page_size(segment.pool), segment.first
        while block is not None:
            if block.free:
                first, end = -(-block.offset // page), (block.offset + block.size) // page
                pages = set(range(first, end)) - segment.unmapped
                segment.unmapped |= pages
                self.stats.reserved -= len(pages) * page
            block = block.next
        end = self._last(segment)
        if end is None or not end.free:
            return
        cut = (end.size - (-end.offset % page)) // page * page  # whole pages of the free end
        if cut <= 0:
            return
        segment.unmapped -= set(range((segment.size - cut) // page, segment.size // page))
        self._unlist(end)
        end.size -= cut
        segment.size -= cut
        if end.size:
            self._list(end)
        elif end.prev is not None:
            end.prev.next = None
        else:
            segment.first = None


def replay(log, limit: int | None = None, expandable: bool = False, max_split=None):
    """Replay ``log`` (("alloc", key, bytes, stream) and ("free", key) entries, in order) on a
    new ``CachingAllocator``; returns it, with its ``stats``."""
    allocator = CachingAllocator(limit, expandable, max_split)
    for entry in log:
        if entry[0] == "alloc":
            allocator.malloc(entry[1], entry[2], entry[3])
        else:
            allocator.free(entry[1])
    return allocator


def max_split_of(environ) -> int | None:
    """``max_split_size_mb`` of ``PYTORCH_CUDA_ALLOC_CONF`` in ``environ``, in bytes (None: unset)."""
    for option in environ.get("PYTORCH_CUDA_ALLOC_CONF", "").split(","):
        key, _, value = option.partition(":")
        if key.strip() == "max_split_size_mb":
            if not value.strip().isdigit() or int(value) <= LARGE_SEGMENT // MiB:
                raise ValueError(
                    f"PYTORCH_CUDA_ALLOC_CONF: max_split_size_mb is {value!r}; PyTorch takes a "
                    "whole number of MiB above 20: set one, or leave it out (no limit)"
                )
            return int(value) * MiB
    return None


def summary(log, limits: dict[str, int], max_split: int | None = None) -> dict:
    """What a plan reports of ``log`` (``replay``'s entries): the peaks of bytes requested,
    allocated (blocks) and reserved, how many segments (or pages) were taken, and the reserved
    peak over the allocated one, with plain segments and with expandable ones; and per device of
    ``limits`` (its usable bytes), whether the step fits (no request out of memory, cached
    memory given back first), with plain segments and with expandable ones
    (``fits_expandable``), and how often cached memory had to be given back (plain)."""
    out: dict = {"max_split_size_mb": max_split // MiB if max_split else None, "fits": {}}
    for mode, expandable in (("segments", False), ("expandable", True)):
        s = replay(log, None, expandable, max_split).stats
        out[mode] = {
            "requested_peak": s.peak_requested,
            "allocated_peak": s.peak_allocated,
            "reserved_peak": s.peak_reserved,
            "driver_allocs": s.driver_allocs,
            "reserved_per_allocated": s.peak_reserved / s.peak_allocated if s.peak_allocated else 1,
        }
        for name, limit in limits.items():
            # never reaching the limit, a replay against it does what the free one did
            t = (
                replay(log, limit, expandable, max_split).stats
                if s.peak_reserved > limit
                else Stats()
            )
            if expandable:
                out["fits"][name]["fits_expandable"] = not t.oom
            else:
                out["fits"][name] = {"fits": not t.oom, "releases": t.releases, "oom_at": t.oom[:1]}
    return out
