"""twinshard: fully sharded data parallel (FSDP, ZeRO-3) for PyTorch, written twice.

The engine, one interface written twice, and the suite that checks it:

- ``twinshard.reference``: the readable, single-stream specification.
- ``twinshard.optimized``: the overlapped production path (same interface).
- ``twinshard.variants``: communication variants that change the numbers on purpose.
- ``twinshard.conformance``: checks any implementation against the truth.

The interface, and the switch that puts it under code written for torch's:

- ``api/``: the interface itself, what a user imports from ``twinshard.api`` (policies, the
  ``FSDPModule`` contract, errors), with its pieces: what ``fully_shard`` refuses, in torch's
  words; torch 2.13's mesh types for older releases; where the collectives' buffers come from
  (torch's two switches).
- ``summon.py``: FSDP1's ``summon_full_params`` for any FSDP2-style module.
- ``local_step.py``: the user's optimizer stepping the local shards of any FSDP2-style
  module's ``DTensor`` parameters: the same bits without ``DTensor``'s dispatch.
- ``clip_grad.py``: torch's ``clip_grad_norm_`` on the local shards of such gradients, the same
  bits with one all-reduce and no host read.
- ``switch.py``, ``run.py``: torch's ``fully_shard`` switched to twinshard's (a function, a
  context manager, ``python -m twinshard.run``).

Running ranks and observing them:

- ``ranks/``: launch, shared worlds, a rank's device, the watchdog.
- ``dispatch/``: the collectives, memory and stream order as the dispatcher shows them.
- ``guard/``: checks across ranks (same model, same collectives, parameters used).
- ``measure/``: bench, schedule, plan and the fake accelerator.

The applications:

- ``cli.py``: the ``twinshard`` command (``python -m twinshard.cli``), one subcommand per job.
- ``commandline/``: what every command shares: the words it spells alike, which
  implementation it runs (a short name or any module), how a report ends.
- ``train/``: ``twinshard train`` and ``twinshard export``.
- ``models.py``: small example models, and ``hf_config.py``: a Hugging Face ``config.json``
  as their config (a job's ``--model``); ``example.py``: a first run
  (``python -m twinshard.example``).
- ``fakeaccel/``: the fake accelerator's old command name (``python -m twinshard.fakeaccel``).
"""

# The one place the version is written; pyproject.toml reads it from here.
__version__ = "0.1.0"
