"""The accelerator schedule on stand-in streams: the sanitizer's rules, then the optimized
path's ordering rules read off the stand-in log by name.

The sanitizer tests build small schedules by hand (one process, no process group) and check
that each kind of mistake is reported and each correct order is not. The schedule tests run
two training steps of the optimized path on 2 ranks with stand-in streams, under the checks,
and assert the rules a GPU needs: the copy-in waits for the compute that produced the shards
(or for the post-optimizer event instead), a buffer is released only after its streams waited
on an event recorded after its last use, and the end of backward waits for the last reduction.
"""

import pytest
import torch

from twinshard.dispatch.standin import StandInStreams, StreamOrderError
from twinshard.ranks.launch import launch


@pytest.fixture
def streams():
    s = StandInStreams()
    with s.checking():
        yield s


def test_read_of_another_streams_write_needs_a_wait(streams):
    side = streams.new_stream("side")
    with streams.use(side):
        filled = torch.ones(8) * 2  # written on "side"
    with pytest.raises(StreamOrderError, match="on stream 'side' used, without waiting"):
        filled.sum()  # the default stream reads it without waiting
    streams.current().wait_event(side.record_event())
    assert filled.sum().item() == 16.0


def test_write_after_another_streams_read_needs_a_wait(streams):
    side = streams.new_stream("side")
    data = torch.zeros(4)
    side.wait_stream(streams.current())
    with streams.use(side):
        data.sum()  # "side" reads it
    with pytest.raises(StreamOrderError, match="writes memory that aten.sum"):
        data.add_(1)  # the default stream overwrites it while "side" may still read it
    streams.current().wait_stream(side)
    data.add_(1)


def test_release_needs_the_allocating_stream_to_wait_for_every_use(streams):
    side = streams.new_stream("side")
    with streams.use(side):
        buffer = torch.zeros(4) + 1  # allocated on "side"
    streams.current().wait_stream(side)
    buffer.sum()  # last use, on the default stream
    with pytest.raises(StreamOrderError, match="released while aten.sum"):
        streams.release([buffer], "a test release")
    side.wait_event(streams.current().record_event())
    streams.release([buffer], "a test release")
    with pytest.raises(StreamOrderError, match="use after release"):
        buffer.sum()


def test_a_reused_address_is_a_new_buffer(streams):
    side = streams.new_stream("side")
    released, reused = set(), 0
    for _ in range(50):  # freed memory comes back at the addresses of released buffers
        with streams.use(side):
            buffer = torch.zeros(16) + 1
        side.wait_event(streams.current().record_event())
        streams.release([buffer], "a test release")
        released.add(buffer.data_ptr())
        del buffer
        fresh = torch.empty(16)
        reused += fresh.data_ptr() in released
        fresh.fill_(3.0)  # not a use after release: another buffer at an old address
        assert fresh.sum().item() == 48.0
    assert reused, "no buffer came back at a released address: the check saw no reuse"


def _two_steps(post_optim_event: bool):
    import twinshard.optimized as O
    from twinshard.dispatch.standin import standin_streams
    from twinshard.models import MLPStack

    streams = standin_streams()
    torch.manual_seed(0)
    model = MLPStack(dim=15, hidden=37, n_blocks=3)
    for block in model.blocks:
        O.fully_shard(block)
    O.fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    marks = {}
    with streams.checking():
        for step in range(2):
            marks[f"step {step}"] = len(streams.log)
            out = model(torch.randn(4, 15))
            marks[f"after forward {step}"] = len(streams.log)
            out.sum().backward()
            marks[f"after backward {step}"] = len(streams.log)
            opt.step()
            opt.zero_grad()
            if post_optim_event:
                event = streams.current().record_event()
                model.set_post_optim_event(event)
                marks[f"post-optim event {step}"] = event.id
    return streams.log, marks


def _recorded_on(log) -> dict:
    return {entry[2]: entry[1] for entry in log if entry[0] == "record_event"}


@pytest.mark.parametrize("post_optim_event", [False, True], ids=["compute", "post_optim_event"])
def test_optimized_schedule_orders_its_streams(post_optim_event):
    log, marks = launch(_two_steps, 2, post_optim_event, env={"TWINSHARD_STANDIN_STREAMS": "1"})[0]
    recorded_on = _recorded_on(log)
    # 1. before every copy-in, the copy-in stream waits for the compute stream; in the step
    # after set_post_optim_event, the first one waits for that event instead; in backward,
    # each waits for the compute stream's event after its latest reshard (see [Note: in
    # backward, a copy-in waits for the last reshard]), but the first, which waits for
    # nothing and is copied out on the compute stream (see [Note: the first all-gather of
    # backward is copied out where it is used])
    backward = [range(marks[f"after forward {s}"], marks[f"after backward {s}"]) for s in (0, 1)]
    gathers = [i for i, e in enumerate(log) if e == ("wait_stream", "all_gather", "copy_in")]
    assert len(gathers) >= 2 * 4, gathers  # every group in forward, two steps
    first_of_step_1 = min(g for g in gathers if g > marks["step 1"])
    releases = [i for i, e in enumerate(log) if e[0] == "release"]
    # the waits of a release (each copy-out releases its gather's buffers) are
    # about the buffers' last use, not about what the next copy-in reads
    release_waits = {i - 1 for i in releases if "all_gather" in log[i][2]}
    firsts_of_backward = [min(g for g in gathers if g in steps) for steps in backward]
    for previous, g in zip([-1] + gathers, gathers):
        first = next(
            e
            for j, e in enumerate(log[previous + 1 : g], previous + 1)
            if e[1] == "copy_in" and j not in release_waits
        )
        if post_optim_event and g == first_of_step_1:
            assert first == ("wait_event", "copy_in", marks["post-optim event 0"]), first
        elif g in firsts_of_backward:
            assert first[0] != "wait_event" and first[0] != "wait_stream", (g, first)
        elif any(g in steps for steps in backward):
            assert first[:2] == ("wait_event", "copy_in"), (g, first)
            assert recorded_on[first[2]] == "default", (g, first)
        else:
            assert first == ("wait_stream", "copy_in", "default"), (g, first)
    # 2. each release comes after the streams that allocated its buffers waited on an event
    # recorded after the buffers' last use: the all-gather's buffers after the copy out of
    # them, on the all-gather stream; the unreduced gradients (autograd's, on the compute
    # stream) once the compute stream waited for the reduction whose pack read them. The
    # packed gradients are the reduce-scatter stream's own, allocated and read only there: on
    # gloo's in-place path they go on that stream, after the copy of this rank's block
    assert any("all_gather" in log[i][2] for i in releases)
    assert any("reduce_scatter input" in log[i][2] for i in releases)
    assert any("unreduced" in log[i][2] for i in releases)
    copied_out_on_compute = []
    for i in releases:
        if "unreduced" in log[i][2]:
            assert log[i][1] == "default", log[i]
            assert log[i - 1][:2] == ("wait_event", "default"), log[i - 3 : i + 1]
            assert recorded_on[log[i - 1][2]] == "reduce_scatter", log[i - 3 : i + 1]
            continue
        if "reduce_scatter input" in log[i][2]:
            assert "copied out" in log[i][2], log[i]  # gloo, no HSDP: the in-place path
            assert log[i][1] == "reduce_scatter", log[i - 2 : i + 1]
            continue
        assert "all_gather" in log[i][2], log[i]
        kind, stream, event = log[i - 1]  # the copy-in stream allocated them
        # copied out on the copy-out stream, or, the first gather of backward, on the compute
        if recorded_on.get(event) == "default":
            assert (kind, stream) == ("wait_event", "copy_in"), log[i]
            copied_out_on_compute.append(i)
            continue
        assert (kind, stream, recorded_on[event]) == ("wait_event", "copy_in", "copy_out"), log[i]
    # one gather a backward, the first, was copied out on the compute stream
    assert [sum(i in steps for i in copied_out_on_compute) for steps in backward] == [1, 1]
    # in forward the wait is on an earlier copy-out than the one just queued, so that the next
    # copy-in is not ordered after this copy-out (see [Note: in forward, a gathered buffer goes
    # one all-gather later]); in backward on the one just queued
    deferred = [
        i
        for i in releases
        if "all_gather" in log[i][2]
        and log[i - 2][:2] == ("record_event", "copy_out")
        and log[i - 2][2] != log[i - 1][2]
    ]
    assert len(deferred) >= 2 * 3, deferred  # the groups after the root, in each forward
    # 3. the end of backward waits for the last reduction (reduce-scatter or all-reduce)
    for step in range(2):
        end = marks[f"after backward {step}"]
        last = max(
            i
            for i, e in enumerate(log[:end])
            if e[0] == "record_event" and e[1] in ("reduce_scatter", "all_reduce")
        )
        assert ("wait_event", "default", log[last][2]) in log[last:end], log[last:end]


def test_stand_in_events_answer_like_device_events(streams):
    side = streams.new_stream("side")
    event = side.record_event()
    assert event.query() is True  # the CPU has run everything already
    event.synchronize()
    assert repr(side) == "StandInStream('side')" and event.stream == "side"
    assert streams.new_stream("side").name == "side#2"  # names stay unique in the log


def _hsdp_partial_sums(shape: tuple):
    """Two steps on the HSDP mesh ``shape`` under the checks, the first micro-batch of
    each with ``set_requires_all_reduce(False)``: the partial sums are kept, added to on the
    reduce-scatter stream and read by the next reduction."""
    from torch.distributed.device_mesh import init_device_mesh

    import twinshard.optimized as O
    from twinshard.dispatch.standin import standin_streams
    from twinshard.models import MLPStack

    streams = standin_streams()
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    model = MLPStack(dim=15, hidden=37, n_blocks=2)
    for block in model.blocks:
        O.fully_shard(block, mesh=mesh)
    O.fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with streams.checking():
        for _ in range(2):
            for micro in range(2):
                model.set_requires_all_reduce(micro == 1)
                model(torch.randn(4, 15)).sum().backward()
            opt.step()
            opt.zero_grad()
    return [p.grad is None for p in model.parameters()]


@pytest.mark.parametrize("shape", [(2, 1), (1, 2)], ids=["one-shard", "one-replica"])
def test_hsdp_with_one_shard_or_one_replica_orders_its_partial_sums(shape):
    """Hazards of a shard group of one rank (mesh (2, 1): the partial sums were views of a
    buffer of the compute stream, freed while the reduce-scatter stream added to them) and of a
    replicate group of one rank (mesh (1, 2): the event the accumulation waited on was recorded
    before the partial sums were added on the reduce-scatter stream)."""
    env = {"TWINSHARD_STANDIN_STREAMS": "1"}
    cleared = launch(_hsdp_partial_sums, 2, shape, env=env)
    assert all(all(r) for r in cleared), cleared  # two full steps ran on both ranks


def _assign_load_after_post_optim_event(mixed: bool):
    """Steps with ``set_post_optim_event``, each followed by ``load_state_dict(assign=True)``:
    every parameter gets new memory after the event. ``mixed``: a group whose blocks cannot be
    kept in the group's storage (a frozen bf16 weight beside fp32 ones)."""
    import twinshard.optimized as O
    from twinshard.dispatch.standin import standin_streams
    from twinshard.models import MLPStack

    streams = standin_streams()
    torch.manual_seed(0)
    model = MLPStack(dim=15, hidden=37, n_blocks=2)
    if mixed:  # block 0 gains a frozen bf16 weight: its group is gathered as bytes
        frozen = torch.nn.Parameter(torch.randn(15, 15).bfloat16(), requires_grad=False)
        model.blocks[0].register_parameter("frozen", frozen)
        model.blocks[0].register_forward_pre_hook(lambda m, args: (args[0] @ m.frozen.float(),))
    for block in model.blocks:
        O.fully_shard(block)
    O.fully_shard(model)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    with streams.checking():
        for _ in range(3):
            model(torch.randn(4, 15)).sum().backward()
            opt.step()
            opt.zero_grad()
            model.set_post_optim_event(streams.current().record_event())
            state = {k: v.detach().clone() for k, v in model.state_dict().items()}
            model.load_state_dict(state, assign=True)  # new memory, after the event
            opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    return True


@pytest.mark.parametrize("mixed", [False, True], ids=["kept-blocks", "mixed-dtypes"])
def test_new_memory_after_the_post_optim_event_is_waited_for(mixed):
    """Parameters given new memory after ``set_post_optim_event`` were moved into the group's
    storage on the compute stream after the event while the copy-in waited only on the event."""
    env = {"TWINSHARD_STANDIN_STREAMS": "1"}
    assert launch(_assign_load_after_post_optim_event, 2, mixed, env=env) == [True, True]


def test_side_streams_are_created_with_priority(monkeypatch):
    """The copy-in, all-gather, copy-out and reduce-scatter streams run at priority -1 (above
    compute), as torch's FSDP2 makes its side streams; the HSDP all-reduce stream keeps the
    default."""
    from twinshard.optimized.comm import CommContext
    from twinshard.optimized.streams import DeviceStreams

    made = []

    class Module:  # a device module that records the streams it is asked for
        @staticmethod
        def Stream(priority=0):
            made.append(priority)
            return object()

    def device_streams(device):
        streams = DeviceStreams.__new__(DeviceStreams)  # as for an accelerator, with Module
        streams.module, streams.collectives_follow_streams = Module, True
        return streams

    monkeypatch.setattr("twinshard.optimized.comm.streams_for", device_streams)
    comm = CommContext(torch.device("cpu"))
    assert comm.copy_in_stream is not None and made == [-1, -1, -1, -1, 0]
    monkeypatch.undo()
    monkeypatch.setenv("TWINSHARD_STANDIN_STREAMS", "1")
    comm = CommContext(torch.device("cpu"))
    priorities = [s.priority for s in (comm.copy_in_stream, comm.all_gather_stream)]
    priorities += [comm.reduce_scatter_stream.priority, comm.all_reduce_stream.priority]
    assert priorities == [-1, -1, -1, 0], priorities
