"""twinshard.measure.bench: where the time and the memory go (the ``twinshard bench`` command).

One concept per file:

    runner.py    one run in processes of its own; many runs interleaved
    stats.py     medians, spread, ratios, overlap efficiency
    report.py    tables, JSON, the comparison plot
    hooks.py     the hooks' CPU time per group and step, and where it goes (cProfile)
    sweep.py     model size, groups, world size: how cost grows
    progress.py  the progress bar
    compare.py   the job of a command line (the mode's defaults), its checks, the side-by-side run
    cli.py       the command

What one run is comes from ``twinshard.measure.job``; the memory probe, the memory predictor and
the simulated network it runs on are layers below it (``twinshard/measure/probe.py``,
``memory.py``, ``simnet.py``). See ``docs/benchmarks.md`` for how to read the results.
"""
