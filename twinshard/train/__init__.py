"""twinshard.train: the training application behind ``twinshard train`` and ``twinshard export``.

What a run does. Every rank builds the same model (``twinshard.models.Llama``, initialized from
``--seed``), shards each transformer block and then the root with the chosen ``fully_shard``
(``--impls``, one name: optimized by default, reference, torch or any importable module), and
trains it with AdamW, a linear warmup and a cosine decay. The global batch of ``--batch-size``
sequences is split evenly: each rank reads its own contiguous part of it, in ``--grad-accum``
micro-batches whose gradients are reduced only after the last one. Rank 0 shows a progress line
(loss, tokens/s, memory) and writes ``train.log``, ``loss.csv`` and ``loss.png`` into the run
directory (``--out``). Checkpoints are written every ``--checkpoint-every`` steps and at the
end; ``--resume`` continues one, at any number of ranks, and ends with the same parameters as a
run that was never interrupted.

One concept per file, in the order a run meets them:

    __main__.py    ``python -m twinshard.train``, the same as ``twinshard train``
    cli.py         the entry point: start the ranks (locally or under torchrun), report errors
    flags.py       the command line: every flag, its help and its default
    config.py      TrainConfig and resolve: the checks that run before any rank starts
    runlock.py     one run, one writer: the run directory locked by the run that writes it
    data.py        the built-in corpus or a file as bytes, and which window each rank reads
    build.py       the seeded model sharded by ``twinshard.measure.step``, AdamW and its
                   schedule, per-rank RNG seeding
    loop.py        what every rank runs: steps, checkpoints, resume, evaluation, a sample
    stop.py        stopping cleanly on SIGINT or SIGTERM, after the step, with a checkpoint
    report.py      rank 0's log, progress bar, loss curve and summary
    checkpoint.py  atomic, reshardable DCP checkpoints and their validation
    verify.py      finding checkpoints and checking that they are intact before loading one
    export.py      ``twinshard export``: a checkpoint as one safetensors file for the plain model
"""
