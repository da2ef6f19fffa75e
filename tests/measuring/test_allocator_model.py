"""The caching allocator's model (``twinshard/measure/allocator.py``) on allocation sequences
whose result follows from the allocator's rules by hand; each test says how."""

from __future__ import annotations

import pytest

from twinshard.measure.allocator import CachingAllocator, replay, round_size, segment_size

KiB, MiB = 1 << 10, 1 << 20


def test_sizes_round_to_512_bytes_and_segments_follow_the_request():
    assert [round_size(n) for n in (1, 512, 513, 1000)] == [512, 512, 1024, 1024]
    # small: 2 MiB; under 10 MiB: 20 MiB; else rounded up to 2 MiB
    assert segment_size(512) == segment_size(MiB) == 2 * MiB
    assert segment_size(MiB + 512) == segment_size(10 * MiB - 512) == 20 * MiB
    assert segment_size(10 * MiB) == 10 * MiB and segment_size(11 * MiB) == 12 * MiB


def test_small_requests_pack_into_2_mib_segments():
    a = CachingAllocator()
    for i in range(3):  # 700 KiB each: two share a 2 MiB segment (648 KiB left), the third not
        a.malloc(i, 700 * KiB)
    assert a.stats.reserved == 4 * MiB and a.stats.segments == 2
    assert a.stats.allocated == a.stats.requested == 2100 * KiB
    a.malloc("byte", 1)  # rounded to 512 bytes, into the 648 KiB rest
    assert a.stats.allocated == 2100 * KiB + 512 and a.stats.requested == 2100 * KiB + 1
    assert a.stats.reserved == 4 * MiB


def test_a_large_rest_is_split_off_a_small_one_is_not():
    a = CachingAllocator()
    a.malloc("a", 3 * MiB)  # a 20 MiB segment; the 17 MiB rest is more than 1 MiB: split
    a.malloc("b", 18 * MiB + 512 * KiB)  # 17 MiB is too small: a 20 MiB segment, 1.5 MiB rest
    assert a.stats.reserved == 40 * MiB and a.stats.allocated == 21.5 * MiB
    a.malloc("c", 1.2 * MiB)  # best fit: the 1.5 MiB rest; 0.3 MiB is not split off
    assert a.stats.allocated == 23 * MiB and a.stats.requested == 22.7 * MiB
    assert a.stats.reserved == 40 * MiB


def test_freed_blocks_merge_and_serve_the_same_stream_only():
    a = CachingAllocator()
    a.malloc("x", 12 * MiB)
    a.malloc("y", 12 * MiB)
    a.free("x")
    a.free("y")
    a.malloc("z", 12 * MiB, stream="side")  # the cached 12 MiB blocks are the default stream's
    assert a.stats.reserved == 36 * MiB
    a.free("z")
    a.malloc("big", 24 * MiB)  # two free 12 MiB segments are not one 24 MiB block
    assert a.stats.reserved == 60 * MiB and a.stats.peak_reserved == 60 * MiB
    a.free("big")
    a.malloc("again", 3 * MiB)  # best fit: a free 12 MiB segment, its 9 MiB rest split off
    block, _ = a.live["again"]
    assert a.stats.reserved == 60 * MiB and block.segment.size == 12 * MiB
    assert block.next.free and block.next.size == 9 * MiB


def test_best_fit_takes_the_smallest_free_block_that_holds_the_request():
    a = CachingAllocator()
    for key, size in (("a", 30 * MiB), ("b", 12 * MiB), ("c", 16 * MiB)):
        a.malloc(key, size)
    for key in "abc":
        a.free(key)
    a.malloc("d", 15.5 * MiB)  # 16 MiB is the smallest that holds it; 0.5 MiB is not split
    block, _ = a.live["d"]
    assert block.segment.size == 16 * MiB and a.stats.allocated == 16 * MiB
    a.malloc("e", 14 * MiB)  # the 30 MiB block now; its 16 MiB rest is split off
    assert a.stats.allocated == 30 * MiB and a.stats.reserved == 58 * MiB


def test_fragmentation_keeps_free_memory_that_no_request_fits():
    a = CachingAllocator()
    for i in range(10):
        a.malloc(i, 12 * MiB)  # ten 12 MiB segments
    for i in range(0, 10, 2):
        a.free(i)  # 60 MiB free, in 12 MiB pieces
    a.malloc("wide", 24 * MiB)
    assert a.stats.reserved == 144 * MiB and a.stats.allocated == 84 * MiB
    assert a.fragmentation() == pytest.approx(1 - 84 / 144)


def test_the_limit_gives_cached_segments_back_before_running_out():
    a = CachingAllocator(limit=40 * MiB)
    a.malloc("a", 20 * MiB)
    a.free("a")  # cached: still reserved
    a.malloc("b", 30 * MiB)  # 20 + 30 > 40: the free 20 MiB segment goes back first
    assert a.stats.reserved == 30 * MiB and a.stats.releases == 1 and not a.stats.oom
    a.malloc("c", 20 * MiB)  # nothing cached to give back: out of memory at 30 MiB reserved
    assert a.stats.oom == [(20 * MiB, 30 * MiB)]


def test_expandable_segments_grow_in_pages_and_reuse_their_free_end():
    log = [("alloc", "a", 3 * MiB, "s"), ("alloc", "b", 25 * MiB, "s")]
    log += [("free", "a"), ("free", "b"), ("alloc", "c", 40 * MiB, "s")]
    # segments: 20 MiB (a) and 26 MiB (b), both free, neither holds 40 MiB: a third one
    assert replay(log).stats.peak_reserved == 86 * MiB
    # one segment: 20 MiB mapped for a (17 free at its end), 20 more for b (25 - 17 = 8 MiB
    # short: a page); freed, the 40 MiB mapped are one free end, which holds c
    grown = replay(log, expandable=True)
    assert grown.stats.peak_reserved == 40 * MiB and grown.stats.segments == 1


def test_expandable_segments_unmap_their_free_end_under_the_limit():
    a = CachingAllocator(limit=60 * MiB, expandable=True)
    a.malloc("a", 50 * MiB)  # 3 pages: 60 MiB mapped
    a.free("a")
    a.malloc("small", 100 * KiB, stream="other")  # a small pool's page: 2 MiB over the limit
    assert a.stats.reserved == 2 * MiB and not a.stats.oom  # the large pages were unmapped


def test_the_summary_replays_against_a_device_only_where_the_limit_matters():
    """The log of the test above: 20 MiB freed, then 30 and 20 MiB (50 reserved at the peak
    without a limit). Against 64 MiB the step never reaches the limit (fits, nothing given
    back, no replay needed); against 40 it runs out, having given cached memory back, exactly
    as the limited replay says."""
    from twinshard.measure.allocator import summary

    log = [("alloc", "a", 20 * MiB, 0), ("free", "a"), ("alloc", "b", 30 * MiB, 0)]
    log += [("alloc", "c", 20 * MiB, 0)]
    out = summary(log, {"roomy": 64 * MiB, "tight": 40 * MiB})
    assert out["segments"]["reserved_peak"] == 50 * MiB
    assert out["fits"]["roomy"] == {"fits": True, "releases": 0, "oom_at": []}
    tight = replay(log, 40 * MiB).stats
    assert tight.oom and tight.releases >= 1
    assert out["fits"]["tight"] == {
        "fits": False,
        "releases": tight.releases,
        "oom_at": tight.oom[:1],
    }


def test_the_limit_gives_back_every_cached_segment_of_every_stream():
    """As PyTorch's allocator does with ``max_split_size_mb`` unset: a request over the limit has
    every whole free segment given back, the other streams' included, not only as many as it
    needs (the 30 MiB segment alone would have been enough here, leaving 52 MiB reserved)."""
    log = [("alloc", "a", 30 * MiB, "main"), ("free", "a")]  # 30 MiB cached for "main"
    log += [("alloc", "s", 20 * MiB, "side"), ("free", "s")]  # 20 MiB cached for "side"
    log += [("alloc", "b", 32 * MiB, "main")]  # neither holds it: 50 + 32 > 64
    stats = replay(log, 64 * MiB).stats
    assert stats.reserved == 32 * MiB and stats.releases == 1 and not stats.oom
