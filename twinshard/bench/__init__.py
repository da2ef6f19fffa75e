"""twinshard.bench: where the time and the memory go (the ``twinshard bench`` command).

One concept per file:

    config.py    what one run is (``RunConfig``: the measuring layer's job), the five compared
    runner.py    one run in processes of its own; many runs interleaved
    probe.py     memory by category and the collectives, observed from outside the implementation
    memmodel.py  the memory model: the peak predicted from sizes and the schedule
    simnet.py    the simulated network: a Python process group whose collectives take
                 latency + bytes / bandwidth, for one process standing in for rank 0 of W
    stats.py     medians, spread, ratios, overlap efficiency
    report.py    tables, JSON, the comparison plot
    hooks.py     the hooks' CPU time per group and step, and where it goes (cProfile)
    sweep.py     model size, groups, world size: how cost grows
    progress.py  the progress bar
    compare.py   the job of a command line (the mode's defaults), its checks, the side-by-side run
    cli.py       the command

See ``docs/benchmarks.md`` for how to read the results.
"""
