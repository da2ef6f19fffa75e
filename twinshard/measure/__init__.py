"""twinshard.measure: every measuring command and what they share, in layers.

``twinshard bench``, ``twinshard schedule``, ``twinshard plan`` and ``python -m
twinshard.measure.fakeaccel`` describe a training job the same way, build and drive its step
the same way and join a world the same way. A module imports its own layer and those below it,
never one above (``tests/structure/test_layers.py`` checks it); bottom first:

    job.py flags.py            the job and its one validator, ``Job.problem()``; a job's flags
    grid.py units.py           added and read (their words, one spelling and help text per
                               concept, old spellings kept as aliases that name their
                               replacement, are ``twinshard/commandline/vocabulary.py``'s,
                               which train speaks too); a Hugging Face
                               ``config.json`` as a job's ``--model`` (read by
                               ``twinshard.hf_config``); the one grid of jobs
                               behind every sweep; how bytes, times, ratios, tables and
                               figures are written
    step.py                    one training step of a job: its model built and sharded (train
                               shards through it too), driven
    world.py                   joining a world of W ranks, and its backends: ``simnet.py`` (the
                               simulated network), ``fakedevice.py`` and ``fakecuda.py`` (the
                               fake accelerator and its device module)
    probe.py monitor.py        the observers of a step (memory by category; host syncs, host
    observe.py memory.py       collectives and device bytes); the one loop that records a job's
    allocator.py               steps on the fake accelerator with observers plugged in; the
                               memory predictor (that loop's recording and the caching
                               allocator's model replayed over it)
    fakeaccel/ schedule/       runs: a job on the fake accelerator (``python -m
                               twinshard.measure.fakeaccel``); one step recorded hook by hook
                               (``twinshard schedule``); neither imports the other
    bench/                     the implementations timed side by side (``twinshard bench``)
    plan/                      a job's memory and time at any scale, from a recorded step
                               (``twinshard plan``)
"""
