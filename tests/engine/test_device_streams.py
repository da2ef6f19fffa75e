"""The streams of a device (``optimized/streams.py``): on the CPU a block of work on a stream is
one shared context that does nothing; where streams order work (an accelerator), the block
enters the device module's own stream context."""

import torch

from twinshard.optimized.streams import DeviceStreams, streams_for


def test_cpu_stream_blocks_share_one_context_that_changes_nothing():
    streams = DeviceStreams(torch.device("cpu"))
    first, second = streams.new_stream("copy_in"), streams.new_stream("all_gather")
    before = streams.current()
    assert streams.use(first) is streams.use(second)  # built once, not per block
    with streams.use(first):
        assert streams.current() is before  # the CPU's streams order nothing
    assert not streams.collectives_follow_streams  # so collectives are waited on by handle


def test_where_streams_order_work_a_block_enters_the_device_modules_stream():
    # No accelerator here: the CPU's device module stands in, told that its streams matter.
    streams = DeviceStreams(torch.device("cpu"))
    streams.streams_do_nothing = False
    side = streams.new_stream("side")
    before = streams.current()
    with streams.use(side):
        assert streams.current() is side
    assert streams.current() is before


def test_streams_for_the_cpu_are_the_devices_own_unless_stand_ins_are_asked_for(monkeypatch):
    monkeypatch.delenv("TWINSHARD_STANDIN_STREAMS", raising=False)
    assert isinstance(streams_for(torch.device("cpu")), DeviceStreams)
    monkeypatch.setenv("TWINSHARD_STANDIN_STREAMS", "1")
    assert not isinstance(streams_for(torch.device("cpu")), DeviceStreams)
