"""What makes PyTorch's FSDP2 test files run on CPU ranks, against a chosen implementation.

PyTorch's tests of ``fully_shard`` (``test/distributed/_composable/fsdp/``) are written for
GPUs: each test class asks the accelerator how many devices there are, decorators skip a test
below some number of GPUs, and the test base class refuses to start its ranks when there are
fewer accelerators than ranks. None of that says anything about FSDP itself, so ``install``
neutralises it, and nothing else:

- the ranks of a multi-process test join a gloo group and run the test (``run_rank``), with no
  accelerator count checked first; a fake-process-group test joins PyTorch's fake group;
- ``torch.cpu.device_count()`` (what the tests' ``world_size`` asks on a CPU machine) answers
  ``max_world_size``, and every test class's ``world_size`` is capped at it;
- ``skip_if_lt_x_gpu(x)`` lets a test run when ``x <= max_world_size`` (CPU ranks stand in for
  GPUs); tests gated on CUDA itself (``TEST_CUDA``, NCCL, Triton) stay skipped;
- a private torch name that a file imports but the installed torch lacks gets a stand-in that
  raises when called (``MISSING_PRIVATE_NAMES``), so that the file imports.

``swap(impl)`` replaces ``fully_shard`` (and ``register_fsdp_forward_method``,
``share_comm_ctx``) where the test files and PyTorch's test helpers import them from, before
they are imported: ``torch.distributed.fsdp``, the older ``torch.distributed._composable.fsdp``
and ``torch.testing._internal.common_fsdp``. ``FSDPModule`` and the policies stay torch's: a
twinshard module is an instance of torch's ``FSDPModule`` and twinshard accepts torch's policies.

Both run at import of ``run_file.py``, in the parent process and in every rank it spawns (a
spawned rank imports the main module again), configured by the environment variables below.
"""

from __future__ import annotations

import importlib
import os

IMPL_ENV = "TWINSHARD_TORCH_TESTS_IMPL"  # torch | reference | optimized | a module path
WORLD_ENV = "TWINSHARD_TORCH_TESTS_MAX_WORLD"  # the most ranks a test may use
IMPLEMENTATIONS = {
    "torch": "torch.distributed.fsdp",
    "reference": "twinshard.reference",
    "optimized": "twinshard.optimized",
}
SWAPPED_NAMES = ("fully_shard", "register_fsdp_forward_method", "share_comm_ctx")


# Private names a test file imports that the installed torch does not have (the files are read
# from PyTorch's repository at commits near, not at, the installed release). Each gets a stand-in
# that raises when called, so that the file imports; a test that calls one fails under every
# implementation, torch's included, and so never counts against twinshard.
MISSING_PRIVATE_NAMES = {
    "torch.distributed.fsdp._fully_shard._fsdp_collectives": ("_default_reduce_scatter_input_fn",),
}


def install_from_env() -> None:
    """``install`` and ``swap`` as the environment says (a no-op when it says nothing)."""
    impl = os.environ.get(IMPL_ENV)
    if impl is None:
        return
    install(int(os.environ.get(WORLD_ENV, "4")))
    swap(impl)


def install(max_world_size: int) -> None:
    """Neutralise the accelerator gates (see the module docstring)."""
    import torch
    import torch.testing._internal.common_distributed as common_distributed

    torch.cpu.device_count = lambda: max_world_size
    gate = common_distributed.skip_if_lt_x_gpu

    def skip_if_more_than_available(x, *, allow_cpu=False):
        return gate(x, allow_cpu=allow_cpu or x <= max_world_size)

    common_distributed.skip_if_lt_x_gpu = skip_if_more_than_available
    cap_world_size(common_distributed.MultiProcessTestCase, max_world_size)
    cap_world_size(common_distributed.MultiThreadedTestCase, max_world_size)
    import torch.testing._internal.common_fsdp as common_fsdp

    run_rank.__name__ = "_run"  # a spawned rank finds the method again by this name
    common_fsdp.FSDPTest._run = classmethod(run_rank)
    stand_in_missing_names()


def stand_in_missing_names() -> None:
    """Give each of ``MISSING_PRIVATE_NAMES`` that the installed torch lacks a stand-in that
    raises ``NotImplementedError`` naming it."""
    for module_name, names in MISSING_PRIVATE_NAMES.items():
        module = importlib.import_module(module_name)
        for name in names:
            if not hasattr(module, name):

                def missing(*args, _name=f"{module_name}.{name}", **kwargs):
                    raise NotImplementedError(f"{_name} is not in this torch (a stand-in)")

                setattr(module, name, missing)


def cap_world_size(base: type, cap: int) -> None:
    """Every subclass of ``base`` defined from now on runs at most ``cap`` ranks."""
    previous = base.__dict__.get("__init_subclass__")

    def capped(cls, **kwargs):
        if previous is not None:
            previous.__func__(cls, **kwargs)
        else:
            super(base, cls).__init_subclass__(**kwargs)
        size = cls.__dict__.get("world_size")
        if isinstance(size, property):
            cls.world_size = property(lambda self, get=size.fget: min(cap, get(self)))

    base.__init_subclass__ = classmethod(capped)


def run_rank(cls, rank: int, test_name: str, file_name: str, pipe, **kwargs) -> None:
    """One rank of a multi-process test: join the group on gloo (or PyTorch's fake group, when
    the test asks for it), run the test, leave. Replaces the test base class's own start,
    which first exits when there are fewer accelerators than ranks."""
    import torch
    import torch.distributed as dist
    from torch.testing._internal.common_utils import set_rng_seed

    test = cls(test_name)
    test.rank, test.file_name = rank, file_name
    world = int(test.world_size)
    if kwargs.get("fake_pg"):
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", world_size=world, rank=rank, store=FakeStore())
    else:
        init = getattr(test, "init_method", f"file://{file_name}")
        dist.init_process_group("gloo", init_method=init, world_size=world, rank=rank)
    dist.barrier()
    torch._dynamo.reset()
    set_rng_seed()
    test.run_test(test_name, pipe)
    torch._dynamo.reset()
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def swap(impl: str) -> None:
    """Make ``fully_shard`` and its companions, as the test files import them, ``impl``'s."""
    if impl == "torch":
        return
    source = importlib.import_module(IMPLEMENTATIONS.get(impl, impl))
    targets = ["torch.distributed.fsdp", "torch.testing._internal.common_fsdp"]
    targets.append("torch.distributed._composable.fsdp")  # the older import path
    for name in targets:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        for attr in SWAPPED_NAMES:
            if hasattr(module, attr) and hasattr(source, attr):
                setattr(module, attr, getattr(source, attr))
