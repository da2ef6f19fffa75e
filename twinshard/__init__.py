"""twinshard: fully sharded data parallel (FSDP, ZeRO-3) for PyTorch, written twice.

- ``twinshard.reference``: the readable, single-stream specification.
- ``twinshard.optimized``: the overlapped production path (same interface).
- ``twinshard.conformance``: checks any implementation against the truth.
- ``twinshard.api``: the shared types (policies, the ``FSDPModule`` contract, errors).
- ``twinshard.impls``: which implementation a command runs (a short name or any module).
- ``twinshard.launch``: run a function on N local ranks.
- ``twinshard.storages``: what identifies a tensor's memory, for the observers.
- ``twinshard.standin``: stand-in streams and their sanitizer (the accelerator schedule on the
  CPU), imported by the optimized path and the suite alike.
- ``twinshard.models``: small example models with adjustable (uneven) sizes.
- ``twinshard.train``: the training application (``twinshard train``, ``twinshard export``).
- ``twinshard.cli``: the ``twinshard`` command.
"""

# The one place the version is written; pyproject.toml reads it from here.
__version__ = "0.1.0"
