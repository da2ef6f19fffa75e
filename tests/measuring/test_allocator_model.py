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
    assert a.stats.reserved == 144 * MiB and a.stats.allocated == 84 * MiB  # 60 MiB unused


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
    # expandable: 20 MiB mapped for a, one page more for b (its free 20 MiB hold 20 of 30),
    # one more for c: 60 MiB, under 64
    assert out["expandable"]["reserved_peak"] == 60 * MiB
    roomy = {"fits": True, "releases": 0, "oom_at": [], "fits_expandable": True}
    assert out["fits"]["roomy"] == roomy and out["max_split_size_mb"] is None
    tight = replay(log, 40 * MiB).stats
    assert tight.oom and tight.releases >= 1
    assert replay(log, 40 * MiB, expandable=True).stats.oom  # c finds no free page to unmap
    assert out["fits"]["tight"] == {
        "fits": False,
        "releases": tight.releases,
        "oom_at": tight.oom[:1],
        "fits_expandable": False,
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


def test_max_split_size_keeps_oversize_blocks_whole_and_for_their_own_sizes():
    """``max_split_size_mb:64``: a cached block of 64 MiB or more serves no smaller request,
    and a request of 64 MiB or more takes a cached block only within 20 MiB of its size,
    whole (unset, the 100 MiB block would serve all three requests, split)."""
    a = CachingAllocator(max_split=64 * MiB)
    a.malloc("a", 100 * MiB)
    a.free("a")
    a.malloc("b", 30 * MiB)  # 30 < 64, and the free block is oversize: a new segment
    assert a.stats.reserved == 130 * MiB and a.stats.segments == 2
    a.malloc("c", 90 * MiB)  # 100 < 90 + 20: taken whole, not split
    assert a.stats.allocated == 130 * MiB and a.stats.requested == 120 * MiB
    a.free("c")
    a.malloc("d", 70 * MiB)  # 100 >= 70 + 20: refused, a segment of its own
    assert a.stats.reserved == 200 * MiB
    unset = CachingAllocator()
    unset.malloc("a", 100 * MiB)
    unset.free("a")
    unset.malloc("b", 30 * MiB)  # split off the 100 MiB block: 70 MiB rest
    unset.malloc("c", 60 * MiB)  # split off the rest
    assert unset.stats.reserved == 100 * MiB and unset.stats.segments == 1


def test_max_split_size_gives_back_oversize_segments_before_everything():
    """Over the limit, the request's pool gives back the smallest free oversize segment that
    covers it, and keeps the rest cached; where the oversize ones do not cover it, everything
    cached goes back."""
    a = CachingAllocator(limit=200 * MiB, max_split=64 * MiB)
    for key, size in (("x", 100), ("y", 70), ("s", 30)):  # y and s: oversize blocks refused
        a.malloc(key, size * MiB)
    for key in "xys":
        a.free(key)
    assert a.stats.reserved == 200 * MiB
    a.malloc("z", 80 * MiB)  # 200 + 80 > 200: the 100 MiB segment covers 80 and goes back
    assert a.stats.reserved == 180 * MiB and a.stats.segments == 3 and not a.stats.oom
    a.malloc("w", 90 * MiB)  # only 70 MiB oversize left, short of 90: all cached goes back
    assert a.stats.reserved == 170 * MiB and a.stats.segments == 2 and not a.stats.oom
    assert a.stats.releases == 2


def test_expandable_segments_unmap_free_pages_inside_and_map_them_again():
    """Under the limit, a free block inside an expandable segment gives back its whole pages
    (here page 0, [0, 20) MiB, of a freed [0, 30) MiB block): a request of another stream then
    fits; taking the block again maps the page again, which has another free page given back."""
    a = CachingAllocator(limit=100 * MiB, expandable=True)
    for key, size in (("a", 30), ("b", 30), ("c", 10)):  # 80 MiB mapped: a, b, c, 10 free
        a.malloc(key, size * MiB)
    (main,) = a.segments
    a.free("a")
    a.malloc("d", 15 * MiB, stream="other")  # one page: 100 MiB
    a.malloc("e", 25 * MiB, stream="other")  # one page more: over; page 0 of main goes
    assert a.stats.reserved == 100 * MiB and not a.stats.oom and main.unmapped == {0}
    other = a.segments[1]
    a.free("e")  # [15, 40) MiB of other, its free end: its page 1, [20, 40), is whole
    a.malloc("f", 20 * MiB)  # best fit: [0, 30) of main; page 0 mapped again, over the limit
    assert a.stats.reserved == 100 * MiB and not a.stats.oom and a.stats.releases == 2
    assert main.unmapped == set() and main.size == 80 * MiB
    assert other.size == 20 * MiB and other.unmapped == set()  # the end's page cut off
    assert a.stats.peak_reserved == 100 * MiB


def test_a_segment_grown_while_memory_is_short_counts_its_free_end_after_the_release():
    # Stream s1's segment ends in a free 40 MiB, s2 caches 20 MiB: 60 MiB reserved of 70. A
    # 50 MiB request on s1 would map one more 20 MiB page over its free end; 80 MiB is over
    # the limit, so the release unmaps every free page (s1's end is cut off), and the request
    # then maps three pages of its own: 60 MiB reserved, nothing out of memory.
    a = CachingAllocator(limit=70 * MiB, expandable=True)
    a.malloc("x", 40 * MiB, "s1")
    a.malloc("y", 20 * MiB, "s2")
    a.free("x")
    a.free("y")
    a.malloc("z", 50 * MiB, "s1")
    assert a.stats.reserved == 60 * MiB and a.stats.oom == [], a.stats
    assert a.stats.allocated == 50 * MiB
    a.free("z")
    a.malloc("w", 60 * MiB, "s1")  # the whole segment again, from its free end
    assert a.stats.reserved == 60 * MiB and a.stats.oom == []


def test_the_plan_takes_max_split_size_from_the_users_alloc_conf():
    from twinshard.measure.allocator import max_split_of, summary

    conf = "PYTORCH_CUDA_ALLOC_CONF"
    assert max_split_of({conf: "expandable_segments:True,max_split_size_mb:128"}) == 128 * MiB
    assert max_split_of({}) is None and max_split_of({conf: "expandable_segments:True"}) is None
    for bad in ("max_split_size_mb:big", "max_split_size_mb:20"):
        with pytest.raises(ValueError, match="max_split_size_mb is .*above 20"):
            max_split_of({conf: bad})
    log = [("alloc", "a", 100 * MiB, 0), ("free", "a"), ("alloc", "b", 30 * MiB, 0)]
    assert summary(log, {})["segments"]["reserved_peak"] == 100 * MiB  # b split off a's block
    limited = summary(log, {}, 64 * MiB)
    assert limited["segments"]["reserved_peak"] == 130 * MiB  # the oversize block refused
    assert limited["max_split_size_mb"] == 64
