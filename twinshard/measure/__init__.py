"""twinshard.measure: what the measuring commands share, below all of them.

``twinshard bench``, ``twinshard schedule``, ``twinshard plan`` and ``python -m
twinshard.fakeaccel`` describe a training job the same way and import it from here; nothing
here imports a command.

    job.py    the job (implementation, model, world, batch, policies, optimizer) and its one
              validator, ``Job.problem()``; the dtype table; the published models' shapes
    flags.py  the flag vocabulary: one spelling and one help text per concept, the old
              spellings kept as aliases that name their replacement; the job from the flags
    hf.py     a Hugging Face ``config.json`` as a ``LlamaConfig`` (a job's ``--model``)
    step.py   one training step of a job: its model built and sharded, each step driven
    world.py  joining a world of W ranks (launched, fake, simulated, fake accelerator, lent)
"""
