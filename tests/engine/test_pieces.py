"""A parent of sharded modules sharded in pieces by ``twinshard.optimized.in_pieces`` ([Note:
the root's parameters in pieces] in ``optimized/pieces.py``).

Which children make a piece is decided from the module tree alone (checked on made-up trees);
on 2 gloo ranks a Llama of two blocks, sharded block by block and then at the root:

- the step's first all-gather carries the embedding alone, the ``[norm, output]`` piece is
  gathered once the blocks have started forward, and its gradients are reduced before any
  block's while the root's (the embedding's) are reduced last;
- the first block is cut before its feed-forward ([Note: the first block in two pieces]): the
  piece is gathered by the block's pre-forward, gathered with its block in backward, and
  reduced before the block's attention; the second block stays whole;
- three AdamW steps give the reference's parameters to the bit (2 ranks: a sum of two is the
  same in any order);
- the root's own-group methods reach the pieces: ``unshard`` and ``reshard``, an asynchronous
  ``unshard``, and a setting with ``recurse=False``;
- ``twinshard.optimized`` keeps the root one group, as torch's does, and trains a parent whose
  forward reads a child's weight without calling the child, which ``in_pieces`` refuses with a
  warning that names the piece and the way out.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn

from twinshard.models import Llama, LlamaConfig
from twinshard.ranks.launch import launch

CONFIG = LlamaConfig(vocab_size=64, dim=16, n_layers=2, n_heads=2, max_seq_len=16)


def _tokens(step: int) -> torch.Tensor:
    rank = torch.distributed.get_rank()
    return torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(10 * step + rank))


def _sharded(impl):
    torch.manual_seed(0)
    model = Llama(CONFIG)
    for block in model.blocks:
        impl.fully_shard(block)
    impl.fully_shard(model)
    return model


def _train(impl, steps: int = 3) -> list[torch.Tensor]:
    model = _sharded(impl)
    optim = torch.optim.AdamW(model.parameters(), lr=0.01)
    for step in range(steps):
        model(_tokens(step), _tokens(step)).backward()
        optim.step()
        optim.zero_grad()
    return [p.full_tensor() for p in model.parameters()]


def _schedule() -> dict:
    """One step after a warm-up one (the prefetch order is known), recorded from outside."""
    import twinshard.optimized.in_pieces as O
    from twinshard.measure.schedule.record import Recorder

    model = _sharded(O)
    model(_tokens(0), _tokens(0)).backward()
    with Recorder(model, "optimized") as recorder:
        model(_tokens(1), _tokens(1)).backward()
    schedule = recorder.schedule
    calls = [(c.op, c.group, c.event, c.params) for c in schedule.collectives]
    events = [(e.group, e.hook) for e in schedule.events]
    return {"calls": calls, "events": events}


def _methods() -> dict:
    import twinshard.optimized as whole
    import twinshard.optimized.in_pieces as O
    from twinshard.reference.state import get_state

    model = _sharded(O)
    out = {"piece": type(model.output).__name__, "norm": type(model.norm).__name__}
    model.unshard()
    out["unsharded"] = [type(p).__name__ for p in (model.output.weight, model.norm.weight)]
    model.reshard()
    out["resharded"] = [type(p).__name__ for p in (model.output.weight, model.norm.weight)]
    model.unshard(async_op=True).wait()
    out["async"] = type(model.output.weight).__name__
    model.reshard()
    model.set_requires_gradient_sync(False, recurse=False)
    out["sync"] = [get_state(m).group.reduce_grads for m in (model, model.output, model.blocks[0])]
    fails = ReadsTheHead()
    for block in fails.blocks:
        O.fully_shard(block)
    O.fully_shard(fails)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            fails(torch.randn(3, 4))
        except RuntimeError as error:
            out["refused"] = "DTensor" in str(error)
    out["warned"] = [str(w.message) for w in caught if "in_pieces" in str(w.message)]
    kept = _sharded(whole)
    out["whole"] = type(kept.output).__name__, len(get_state(kept).group.params)
    reads = ReadsTheHead()
    for block in reads.blocks:
        whole.fully_shard(block)
    whole.fully_shard(reads)
    reads(torch.randn(3, 4)).sum().backward()
    out["reads"] = reads.head.weight.grad is not None
    return out


def _run() -> dict:
    import twinshard.optimized.in_pieces as O
    import twinshard.reference as R

    return {
        "same": all(torch.equal(a, b) for a, b in zip(_train(O), _train(R), strict=True)),
        "schedule": _schedule(),
        "methods": _methods(),
    }


class ReadsTheHead(nn.Module):
    """A parent whose forward uses a child's weight without calling the child."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(4, 4)
        self.blocks = nn.ModuleList([nn.Linear(4, 4)])
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        x = self.blocks[0](self.embed(x))
        return x @ self.head.weight.t()


_results: list = []


def results() -> dict:
    if not _results:
        _results.extend(launch(_run, 2))
    return _results[0]


def test_the_first_gather_carries_the_embedding_and_the_output_is_reduced_first():
    calls = results()["schedule"]["calls"]
    gathers = [c for c in calls if c[0] == "all_gather"]
    reductions = [c for c in calls if c[0] in ("reduce_scatter", "all_reduce") and c[1] is not None]
    assert gathers[0][1] == "" and gathers[0][3] == ("tok_embeddings.weight",), gathers
    pieces = {"blocks.0.feed_forward"}  # [Note: the first block in two pieces]
    assert {c[1] for c in gathers} == {"", "blocks.0", "blocks.1", "norm+output"} | pieces
    order = [c[1] for c in gathers]
    assert order.index("blocks.0") < order.index("norm+output"), order  # after a block
    assert reductions[0][1] == "norm+output", reductions  # made first, reduced first
    assert reductions[-1][1] == "", reductions  # the embedding's, made last


def test_the_first_block_is_cut_before_its_feed_forward_gathered_with_it_in_backward():
    schedule = results()["schedule"]
    events, calls = schedule["events"], schedule["calls"]
    hooks = {c[1]: [] for c in calls}
    for op, group, event, _ in calls:
        hooks[group].append((op, events[event]))
    piece = "blocks.0.feed_forward"
    gathers = [c for c in calls if c[1] == piece and c[0] == "all_gather"]
    assert gathers[0][3] == ("w1.weight", "w2.weight", "w3.weight"), gathers
    forward, backward = [h for op, h in hooks[piece] if op == "all_gather"]
    assert forward == ("blocks.0", "pre_forward"), hooks[piece]  # while the attention computes
    assert ("all_gather", backward) in hooks["blocks.0"], (hooks["blocks.0"], backward)
    order = [c[1] for c in calls if c[0] != "all_gather"]
    assert order.index(piece) < order.index("blocks.0"), order  # reduced before the attention's
    assert "blocks.1.feed_forward" not in hooks  # the rest of the blocks stay whole


def test_pieces_train_as_the_reference():
    assert results()["same"]


def test_the_roots_methods_reach_its_pieces():
    out = results()["methods"]
    assert out["piece"] == "FSDPLinear" and out["norm"] == "FSDPRMSNorm"
    assert out["unsharded"] == ["Parameter", "Parameter"]
    assert out["resharded"] == ["DTensor", "DTensor"]
    assert out["async"] == "Parameter"
    assert out["sync"] == [False, False, True]  # the root and its piece, not the block


def test_reading_a_pieces_weight_in_the_parents_forward_is_explained():
    out = results()["methods"]
    assert out["refused"]  # DTensor refuses the sharded weight
    (warning,) = out["warned"]
    assert "ReadsTheHead" in warning and "(head)" in warning and "twinshard.optimized" in warning


def test_the_optimized_path_keeps_torchs_groups():
    out = results()["methods"]
    assert out["whole"] == ("Linear", 3)  # embedding, norm, output: torch's root group
    assert out["reads"]


# --- which children make a piece: the module tree alone ---------------------------------------
class _Tree(nn.Module):
    def __init__(self, *children: nn.Module):
        super().__init__()
        for i, child in enumerate(children):
            self.add_module(f"c{i}", child)


class _Called(_Tree):
    """A module that runs its children in turn: it has a forward of its own."""

    def forward(self, x):
        for child in self.children():
            x = child(x)
        return x


def _mark(module: nn.Module) -> nn.Module:
    module.__dict__["_twinshard_state"] = object()  # what get_state looks for: sharded
    return module


@pytest.mark.parametrize(
    "tree, expected",
    [
        # embedding, sharded blocks, norm, output: one piece after the blocks
        (lambda: _Tree(nn.Linear(2, 2), _mark(nn.Linear(2, 2)), nn.LayerNorm(2), nn.Linear(2, 2)), [["c2", "c3"]]),
        # two sharded children cut three runs
        (lambda: _Tree(nn.Linear(2, 2), _mark(nn.Linear(2, 2)), nn.Linear(2, 2), _mark(nn.Linear(2, 2)), nn.Linear(2, 2)), [["c2"], ["c4"]]),
        # nothing before the blocks: one run, nothing to cut
        (lambda: _Tree(_mark(nn.Linear(2, 2)), nn.LayerNorm(2), nn.Linear(2, 2)), []),
        # no sharded child: one group
        (lambda: _Tree(nn.Linear(2, 2), nn.Linear(2, 2)), []),
        # a child holding a sharded module and parameters of the group: kept whole
        (lambda: _Tree(nn.Linear(2, 2), nn.Sequential(_mark(nn.Linear(2, 2)), nn.Linear(2, 2)), nn.Linear(2, 2)), []),
        # a child without parameters between two runs does not cut them
        (lambda: _Tree(nn.Linear(2, 2), _mark(nn.Linear(2, 2)), nn.ReLU(), nn.Linear(2, 2)), [["c3"]]),
    ],
)  # fmt: skip
def test_which_children_make_a_piece(tree, expected):
    from twinshard.optimized.pieces import pieces_of

    module = tree()
    names = {id(m): n for n, m in module.named_modules()}
    assert [[names[id(m)] for m in run] for run in pieces_of(module, set())] == expected


def test_a_tie_across_pieces_or_a_list_keeps_the_group_whole():
    from twinshard.optimized.pieces import pieces_of

    embed, head = nn.Embedding(4, 2), nn.Linear(2, 4, bias=False)
    head.weight = embed.weight
    tied = _Tree(embed, _mark(nn.Linear(2, 2)), head)
    assert pieces_of(tied, set()) == []
    untied = _Tree(nn.Embedding(4, 2), _mark(nn.Linear(2, 2)), nn.Linear(2, 4, bias=False))
    assert len(pieces_of(untied, set())) == 1
    assert pieces_of(untied, set(untied.c2.parameters())) == []  # ignored: no second run
    assert pieces_of([untied.c0, untied.c2], set()) == []


@pytest.mark.parametrize(
    "tree, expected",
    [
        # a block: cut before its last child holding parameters
        (lambda: _Tree(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2), nn.ReLU()), "c2"),
        # a wrapper whose one child holds everything: read through it
        (lambda: _Tree(_Called(nn.LayerNorm(2), nn.Linear(2, 2))), "c0.c1"),
        # a container without a forward (experts a router picks from): not read through
        (lambda: _Tree(nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)])), None),
        # one layer: nothing to cut
        (lambda: _Tree(nn.Linear(2, 2), nn.ReLU()), None),
    ],
)  # fmt: skip
def test_which_child_of_the_first_block_is_cut(tree, expected):
    from twinshard.optimized.pieces import last_child

    module = tree()
    names = {id(m): n for n, m in module.named_modules()}
    found = last_child(module)
    assert (names[id(found)] if found is not None else None) == expected


def test_the_first_block_is_the_first_sharded_module_with_none_below():
    from twinshard.optimized.pieces import first_block

    def block():
        return _mark(_Called(nn.Linear(2, 2), nn.Linear(2, 2)))

    root = _Tree(_mark(nn.Embedding(4, 2)), nn.ModuleList([block(), block()]))
    first, child = first_block(root)
    assert first is root.c1[0]  # the embedding sharded alone is passed over
    assert child is first.c1  # with the child that becomes a piece
    nested = _Tree(_mark(_Tree(block())), block())
    assert first_block(nested) is None  # a sharded module below it: not a block
    assert first_block(_Tree(nn.Linear(2, 2))) is None
    assert first_block([root.c0, root.c1]) is None


def test_a_tie_across_the_cut_keeps_the_block_whole():
    from types import SimpleNamespace as Param

    from twinshard.optimized.pieces import held_only_by

    first, last = nn.Linear(2, 2), nn.Linear(2, 2)
    mine, theirs = Param(owners=[(last, "bias")]), Param(owners=[(first, "bias")])
    tied = Param(owners=[(first, "weight"), (last, "weight")])
    assert held_only_by(Param(params=[theirs, mine]), last) == [mine]
    assert held_only_by(Param(params=[theirs, tied, mine]), last) is None


def test_what_keeps_the_first_block_whole():
    from types import SimpleNamespace as State

    from twinshard.optimized.pieces import first_cut

    def sharded(*children, pieces=(), owned=None):
        block = _Called(*children)
        first, last = block.c0, getattr(block, f"c{len(children) - 1}")
        owned = owned or [[(first, "weight")], [(last, "weight")]]
        params = [State(owners=owners) for owners in owned]
        state = State(group=State(params=params), pieces=list(pieces), modules=[block])
        block.__dict__["_twinshard_state"] = state  # what get_state looks for
        return _Tree(block), state, params

    root, state, params = sharded(nn.Linear(2, 2), nn.Linear(2, 2))
    assert first_cut(root) == (state, root.c0.c1, [params[1]])
    assert first_cut(sharded(nn.Linear(2, 2), nn.Linear(2, 2), pieces=[1])[0]) is None
    assert first_cut(sharded(nn.Linear(2, 2), nn.ModuleList([nn.Linear(2, 2)]))[0]) is None
    first, last = nn.Linear(2, 2), nn.Linear(2, 2)
    tied = [[(first, "weight"), (last, "weight")], [(last, "bias")]]
    assert first_cut(sharded(first, last, owned=tied)[0]) is None  # a tie across the cut
    alone = [[(last, "weight")]]
    assert first_cut(sharded(nn.Linear(2, 2), last, owned=alone)[0]) is None  # all in the child
    assert first_cut(_Tree(nn.Linear(2, 2))) is None  # no sharded block
