"""The parameters of a parent of sharded modules, in pieces gathered and reduced where they
are used.

[Note: the root's parameters in pieces]
``fully_shard(model)`` on a Llama whose blocks are sharded makes one group of what is left: the
token embedding, the final norm and the output projection. Gathered as one, the output layer
(half of that group's bytes at Llama 3 70B's vocabulary) crosses the network before the
first block can start; reduced as one, its gradient, which backward makes first, waits until
backward has finished, when the embedding's is made. Both ends of the step then carry the whole
group (4.2 GB gathered and 8.5 GB reduced at Llama 3 70B), and on a network-bound job those two
collectives are the step's exposed time.

``twinshard.optimized.in_pieces`` (the optimized path, as an implementation of its own) cuts
such a group where the module's sharded children cut it. The module's children are read in
the order they were registered; a child that holds sharded modules separates two runs, and each
run of children holding the group's parameters becomes a piece. The first piece stays the
module's own group, gathered at its pre-forward as before; every later run is sharded as one
group of its own (``fully_shard([norm, output])``, as torchtitan users write by hand):
gathered when its first module starts forward (prefetched by the group that runs before it),
and reduced as soon as its backward ends. A piece of the root keeps its parameters from forward
to backward, as the root does. At Llama 3 70B on 1,024 H100s the first gather then carries the
embedding alone and the output layer's gradient is reduced while the blocks compute their
backward (``benchmarks/floors.py``).

Nothing is cut where cutting could change what a user sees: a list of modules, a group with
one piece, a parameter shared by two pieces (tied embeddings), or a child that holds both
sharded modules and parameters of the group. The pieces are FSDP modules (they answer
``isinstance(m, FSDPModule)``), and the parent's methods that act on its own group act on its
pieces too (``unshard``, ``reshard``, the custom collectives, ...). A piece's parameters must
be used through its modules' forwards, as every sharded module's are: a parent whose forward
reads ``self.output.weight`` without calling ``self.output`` needs ``twinshard.optimized``
(DTensor then refuses the sharded weight, and a warning names the pieces and says so).

What the cut changes in the numbers: nothing at one or two ranks. At more ranks a collective
that sums sums each element in an order that depends on where it sits in the buffer (gloo's
ring, NCCL's channels), so a piece's gradients agree with those of torch's one flat
reduce-scatter to rounding, not to the bit, as under any other grouping of the same model.
That is why ``twinshard.optimized`` keeps torch's groups and this is a choice.

[Note: the first block in two pieces]
With the root in pieces, each end of the step still carries a whole block: the first block
computes only once all its parameters have arrived (after the embedding), and its gradients,
made last in backward with the embedding's, are reduced only once its whole backward is done.
At Llama 3 70B on 1,024 H100s that is 45 ms of the first block's all-gather and 83 ms of its
reduce-scatter exposed a step. So ``in_pieces``, when it shards a parent of sharded modules,
also cuts the first sharded module below it that has no sharded module below it and two or
more children holding parameters (in registration order; a Llama's ``blocks.0``, past an
embedding sharded alone): its last child holding parameters (the feed-forward; read through a
wrapper with one child, activation checkpointing's, but not through a compiled module nor a
container without a forward, a ``ModuleList`` of experts that a router calls on some ranks
only) becomes a piece of its own, unless a parameter is shared across the cut.
In forward the block gathers the rest and the piece's all-gather goes out while the attention
computes; in backward the piece's gradients are reduced while the attention's backward runs.
A block's piece is needed with the block in backward (by its own backward, which comes
first, and by a recompute of the whole block), so whatever prefetches a group in backward
prefetches its pieces with it (``FSDPState.prefetch``), as does an explicit prefetch list in
either pass. Planned at that job with full activation checkpointing: the first block's exposed
all-gather 45.1 -> 12.5 ms, the exposed time at the end of backward 187.2 -> 122.8 ms, the
FSDP overhead 293.0 -> 196.0 ms (torch's 467.6). Only the first block is cut: at 1,024 ranks
each collective costs about 8 ms of latency on the link, which cutting every block would pay
three times a block (0.16 s of link time a step at 8 blocks, hidden there by the compute, not
on a network-bound job), for nothing in the middle of the step, where prefetching hides a
whole block's collectives. The block's group is cut after both were sharded, when the
parent is (``cut_first_block`` in ``fully_shard.py``): which block is first is known only then.
"""

from __future__ import annotations

import functools
import sys
import warnings

import torch.nn as nn

from twinshard.reference.state import get_state


def pieces_of(module, ignored: set) -> list[list[nn.Module]]:
    """The runs of ``module``'s children to shard as groups of their own before ``module``
    (see [Note: the root's parameters in pieces]); empty where the group stays whole."""
    if isinstance(module, (list, tuple)):
        return []
    runs: list[list[nn.Module]] = [[]]
    for child in module.children():
        if any(get_state(m) is not None for _, m in child.named_modules()):
            if free_params(child, ignored):
                return []  # sharded modules and the group's parameters under one child
            runs.append([])  # a sharded child ends a run
        elif any(p not in ignored for p in child.parameters()):
            runs[-1].append(child)
    runs = [run for run in runs if run]
    if len(runs) < 2 or shared_between(module, runs, ignored):
        return []
    return runs[1:]


def first_cut(module) -> tuple | None:
    """Where ``in_pieces`` cuts the first block below ``module`` ([Note: the first block in two
    pieces]): the block's state, the child that becomes a piece and the block's parameters
    (``ShardedParam``s) it takes; None where nothing is cut (no such block, a block already in
    pieces or of several modules, a container, a tie across the cut)."""
    found = first_block(module)
    if found is None:
        return None
    block, child = found
    state = get_state(block)
    if state.group is None or state.pieces or len(state.modules) > 1:
        return None
    if type(child).forward is nn.Module.forward:  # a container: no forward, no hooks
        return None
    taken = held_only_by(state.group, child)
    if not taken or len(taken) == len(state.group.params):
        return None
    return state, child, taken


def first_block(module) -> tuple[nn.Module, nn.Module] | None:
    """The first sharded module below ``module`` in registration order (a Llama's first block;
    one sharded alone without children, torchtitan's embedding, is passed over) that has no
    sharded module below it and a child to cut, with that child (``last_child``); else None."""
    if isinstance(module, (list, tuple)):
        return None
    for m in module.modules():
        if m is module or get_state(m) is None:
            continue
        if any(get_state(x) is not None for x in m.modules() if x is not m):
            return None  # sharded modules nested below: not a block
        child = last_child(m)
        if child is not None:
            return m, child
    return None


def last_child(block: nn.Module) -> nn.Module | None:
    """The last child of ``block`` that holds parameters, where two or more of its children
    hold them; a module whose one child holds everything (activation checkpointing's wrapper)
    is read through that child, a compiled one is not, nor a container without a forward of
    its own (a ``ModuleList`` of experts, which a router may call on some ranks only)."""
    holders = [c for c in block.children() if any(True for _ in c.parameters())]
    own = any(True for _ in block.parameters(recurse=False))
    if len(holders) == 1 and not own and not hasattr(block, "_orig_mod"):
        inner = holders[0]  # a container (a ModuleList of experts) may skip some: not read
        return None if type(inner).forward is nn.Module.forward else last_child(inner)
    return holders[-1] if len(holders) >= 2 else None


def held_only_by(group, module: nn.Module) -> list | None:
    """The parameters of ``group`` (``ShardedParam``s) that only modules under ``module`` hold;
    None where one is held there and elsewhere too (a tie across the cut)."""
    inside = {id(m) for m in module.modules()}
    taken = []
    for p in group.params:
        held = [id(owner) in inside for owner, _ in p.owners]
        if all(held):
            taken.append(p)
        elif any(held):
            return None
    return taken


def free_params(module: nn.Module, ignored: set) -> bool:
    """Whether ``module`` holds parameters outside every sharded module below it."""
    if get_state(module) is not None:
        return False
    own = any(p not in ignored for p in module.parameters(recurse=False))
    return own or any(free_params(child, ignored) for child in module.children())


def shared_between(module: nn.Module, runs: list[list[nn.Module]], ignored: set) -> bool:
    """Whether a parameter sits in two runs, or in a run and ``module`` itself."""
    seen = {id(p) for p in module.parameters(recurse=False) if p not in ignored}
    for run in runs:
        mine = {id(p) for child in run for p in child.parameters() if p not in ignored}
        if seen & mine:
            return True
        seen |= mine
    return False


def also_on_pieces(method):
    """``method`` of an ``FSDPModule`` that acts on its own group, made to act on the groups of
    its pieces too: called on the module, then on the first module of each piece."""

    @functools.wraps(method)
    def on_module_and_pieces(self, *args, **kwargs):
        result = method(self, *args, **kwargs)
        for piece in get_state(self).pieces:
            method(piece.module, *args, **kwargs)
        return result

    return on_module_and_pieces


def explain_a_failed_forward(module: nn.Module, pieces: list) -> None:
    """Warn, when ``module``'s forward fails on a sharded parameter (DTensor refusing to mix
    with plain tensors), that its pieces are gathered only by their own forwards."""
    names = {id(m): n for n, m in module.named_modules()}
    shown = ", ".join("+".join(names[id(m)] for m in piece.modules) for piece in pieces)

    def after_forward(module, args, output):  # always called, inside the failure's except
        error = sys.exc_info()[1]
        if error is not None and "DTensor" in str(error):
            warnings.warn(
                f"twinshard.optimized.in_pieces: the forward of {type(module).__name__} failed on "
                f"a sharded parameter. Its pieces ({shown}) are gathered only when their own "
                "forward runs: call those modules instead of reading their parameters, or shard "
                "with twinshard.optimized, which keeps the parent's group whole",
                stacklevel=2,
            )

    module.register_forward_hook(after_forward, always_call=True)
