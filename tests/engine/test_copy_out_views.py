"""The optimized copy-out keeps its views of the all-gather outputs from step to step
([Note: the copy-out views are kept] in ``optimized/collectives.py``).

A view kept from one copy-out must still show the parameter's memory after a reshard freed it
and an unshard allocated it again, and the views must be made anew for other outputs or
another number of ranks. The parameters here are stand-ins with the one contract method the
function calls, ``all_gather_outputs``, which behaves like ``ShardedParam``'s for a plain
parameter: one tensor for the whole run, its storage resized to nothing and back.
"""

import torch

from twinshard.optimized.collectives import AllGatherResult, gathered_views, own_output


class StandInParam:
    layout = None  # not the plain layout: the group-level method asks all_gather_outputs

    def __init__(self, rows: int, cols: int):
        self.buffer = torch.zeros(rows, cols)

    def all_gather_outputs(self, dtype):
        storage = self.buffer.untyped_storage()
        storage.resize_(self.buffer.numel() * self.buffer.element_size())
        return [self.buffer]

    def reshard(self):
        self.buffer.untyped_storage().resize_(0)


def _result(params, ranks, dtypes=None, as_bytes=False):
    dtypes = dtypes or [torch.float32] * len(params)
    return AllGatherResult(None, None, None, ranks, params, dtypes, as_bytes)


def test_views_are_kept_and_still_see_the_memory_after_a_reshard():
    params = [StandInParam(4, 3), StandInParam(2, 5)]
    cache: dict = {}
    first, sizes = gathered_views(_result(params, 2), cache)
    assert [tuple(v.shape) for v in first] == [(2, 6), (2, 5)]
    assert sizes == [6, 5]  # the split sizes of the copy-out
    for p in params:
        p.reshard()
        assert p.buffer.untyped_storage().nbytes() == 0
    again, _ = gathered_views(_result(params, 2), cache)
    assert all(a is b for a, b in zip(again, first, strict=True))  # the same view objects
    for p, view in zip(params, again, strict=True):
        view.copy_(torch.arange(view.numel(), dtype=view.dtype).view(view.shape))
        # the kept view writes into the memory the parameter reads
        assert torch.equal(p.buffer.view(-1), torch.arange(p.buffer.numel(), dtype=view.dtype))


def test_views_are_made_again_for_other_outputs_or_another_number_of_ranks():
    params = [StandInParam(4, 3), StandInParam(2, 5)]
    cache: dict = {}
    first, _ = gathered_views(_result(params, 2), cache)
    halves, sizes = gathered_views(_result(params, 1), cache)  # a post-forward mesh of one rank
    assert [tuple(v.shape) for v in halves] == [(1, 12), (1, 10)] and sizes == [12, 10]
    other = [params[0], StandInParam(2, 5)]
    mixed, _ = gathered_views(_result(other, 2), cache)
    assert mixed[0] is not first[0] and mixed[1].data_ptr() == other[1].buffer.data_ptr()
    as_bytes, sizes = gathered_views(_result(params, 2, as_bytes=True), cache)
    assert [(v.dtype, tuple(v.shape)) for v in as_bytes] == [
        (torch.uint8, (2, 24)),
        (torch.uint8, (2, 20)),
    ]
    assert sizes == [24, 20]  # bytes per rank
    fewer, _ = gathered_views(_result(params[:1], 2), cache)
    assert len(fewer) == 1 and fewer[0].shape == (2, 6)


def test_a_lone_parameter_is_gathered_into_its_output_only_where_it_fits():
    """``own_output`` ([Note: one parameter, no copy-out]): the parameter's output, flat, where
    it is the group's all-gather output; None where its dtype or size is not."""
    param = StandInParam(4, 3)  # 2 ranks of 6 elements each
    flat = own_output(param, torch.float32, (12,), torch.float32)
    assert flat is not None and flat.data_ptr() == param.buffer.data_ptr()
    assert flat.shape == (12,)
    assert own_output(param, torch.float32, (12,), torch.bfloat16) is None  # kept in fp32
    assert own_output(param, torch.float32, (18,), torch.float32) is None  # 3 ranks' worth


def test_an_output_of_two_tensors_is_not_taken():
    class TwoOutputs(StandInParam):
        def all_gather_outputs(self, dtype):
            return super().all_gather_outputs(dtype) + [torch.zeros(2)]

    assert own_output(TwoOutputs(4, 3), torch.float32, (12,), torch.float32) is None
