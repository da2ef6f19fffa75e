"""A group of one parameter is gathered straight into the parameter's own memory ([Note: one
parameter, no copy-out] in ``optimized/collectives.py``).

On 2 gloo ranks, torchtitan's grouping of a small Llama (the token embedding alone) makes no
copy-out for the embedding and one for each group of several parameters. On stand-in
streams, a Llama's output layer sharded alone (forward's last group, the root's prefetch at
the start of backward) makes backward's first copy-in wait for its reshard: the memory it
freed is the copy-in stream's, which that copy-in may allocate again ([Note: the first
all-gather of backward is copied out where it is used]). The stand-in sanitizer cannot see
that race itself (memory allocated again is a new buffer to it), so the test reads the log.
The values are checked by the conformance case ``torchtitan_grouping``.
"""

import torch

from twinshard.ranks.launch import launch


def _copy_out_sizes() -> list:
    """Two steps of torchtitan's grouping; the number of parameters of every copy-out."""
    import twinshard.optimized as O
    from twinshard.models import Llama, LlamaConfig

    sizes, split_copy = [], torch.split_with_sizes_copy

    def counted(gathered, split_sizes, dim=0, *, out):
        sizes.append(len(out))
        return split_copy(gathered, split_sizes, dim, out=out)

    torch.split_with_sizes_copy = counted
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=37, dim=16, n_layers=2, n_heads=2, max_seq_len=16)
    model = Llama(config)
    O.fully_shard(model.tok_embeddings)
    for block in model.blocks:
        O.fully_shard(block)
    O.fully_shard([model.norm, model.output])
    O.fully_shard(model)
    tokens = torch.randint(0, 37, (2, 9))
    for _ in range(2):
        model(tokens[:, :-1], tokens[:, 1:]).backward()
    return sizes


def test_a_group_of_one_parameter_is_not_copied_out():
    sizes = launch(_copy_out_sizes, 2)[0]
    assert 1 not in sizes, sizes  # the embedding, gathered in forward and in backward
    assert sizes.count(2) == 2 * 2, sizes  # [norm, output], in forward and backward, 2 steps
    assert sizes.count(9) == 2 * 2 * 2, sizes  # each block's nine parameters, likewise


def _output_alone_log():
    import twinshard.optimized as O
    from twinshard.dispatch.standin import standin_streams
    from twinshard.models import Llama, LlamaConfig

    streams = standin_streams()
    torch.manual_seed(0)
    model = Llama(LlamaConfig(vocab_size=37, dim=16, n_layers=2, n_heads=2, max_seq_len=16))
    for block in model.blocks:
        O.fully_shard(block)
    O.fully_shard(model.output)  # one parameter, last in forward, first gathered in backward
    O.fully_shard(model)  # the embedding and the norm: the loss is its output
    tokens = torch.randint(0, 37, (2, 9))
    marks = []
    with streams.checking():
        for _ in range(2):
            loss = model(tokens[:, :-1], tokens[:, 1:])
            marks.append(len(streams.log))
            loss.backward()
            marks.append(len(streams.log))
    return streams.log, marks


def test_the_first_copy_in_of_backward_waits_for_a_freed_own_output():
    log, marks = launch(_output_alone_log, 2, env={"TWINSHARD_STANDIN_STREAMS": "1"})[0]
    recorded_on = {e[2]: e[1] for e in log if e[0] == "record_event"}
    for start, end in zip(marks[::2], marks[1::2]):
        gather = next(
            i for i in range(start, end) if log[i] == ("wait_stream", "all_gather", "copy_in")
        )
        waits = [e for e in log[start:gather] if e[1] == "copy_in" and e[0].startswith("wait")]
        assert waits, log[start:gather]  # on the compute stream, or its event after the reshard
        assert waits[0][2] == "default" or recorded_on[waits[0][2]] == "default", waits
