"""One training step of a job: its model built and sharded, and each step driven.

Every measuring run trains the same way: ``build`` (a seeded model with values, wrapped by the
job's implementation, plain or DDP, and its optimizer: ``twinshard bench``, the fake process
group's CPU run, a lent GPU) or ``build_on_meta`` (built on ``meta``, sharded and given memory
inside the caller's ``FakeTensorMode``: the fake accelerator, ``twinshard plan``), then
``train_step`` on ``tokens``. ``job`` is the measuring job (``twinshard.measure.job.Job``).
Nothing here records: the observers watch from outside.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from twinshard import api
from twinshard.commandline import impls
from twinshard.models import Llama


def mesh(job, device: torch.device):
    """The 1D mesh of every rank on ``device``'s type (said explicitly: a simulated world has
    no NCCL backend from which to guess the device), or the 2D HSDP mesh."""
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    if job.replicas == 1:
        return init_device_mesh(device.type, (world,))
    shape = (job.replicas, world // job.replicas)
    return init_device_mesh(device.type, shape, mesh_dim_names=("replicate", "shard"))


def shard(model, job, device: torch.device, on=None) -> None:
    """``fully_shard`` every block of ``model``, then the root, with the implementation and
    policies of ``job``, on mesh ``on`` (default: ``mesh(job, device)``): the one place the
    project shards a model, for every measuring command and for ``twinshard train`` (whose
    seeded model ``twinshard.train.build`` hands in). An implementation without policy classes
    of its own (``twinshard train`` takes a module with ``fully_shard`` alone) gets
    ``twinshard.api``'s."""
    impl = impls.load(job.impl, "--impls")
    kwargs = {"mesh": on if on is not None else mesh(job, device)}
    if job.mixed_precision is not None:
        param, reduce = job.mixed_precision
        policy = getattr(impl, "MixedPrecisionPolicy", api.MixedPrecisionPolicy)
        kwargs["mp_policy"] = policy(param_dtype=param, reduce_dtype=reduce)
    if job.offload:  # pinned host memory where there is a device to copy to
        policy = getattr(impl, "CPUOffloadPolicy", api.CPUOffloadPolicy)
        kwargs["offload_policy"] = policy(pin_memory=device.type != "cpu")
    for block in model.blocks:
        impl.fully_shard(block, reshard_after_forward=job.reshard_after_forward, **kwargs)
    impl.fully_shard(model, **kwargs)
    if job.prefetch is not None:
        prefetch(model, job.prefetch)
    if job.variants:  # after fully_shard: each module's collectives replaced (docs/variants.md)
        from twinshard import variants

        variants.attach(model, variants.parse(job.variants), kwargs["mesh"])


def prefetch(model, depth: int) -> None:
    """Give the root and every block of a sharded ``model`` explicit prefetch lists of
    ``depth`` blocks, as tutorial 7's "two ahead" does: in forward, each issues the all-gathers
    of the next ``depth`` blocks right after its own (the root: the first ``depth``); in
    backward, those of the ``depth`` blocks before it (the root: the last ``depth``). The
    optimized path and torch's follow the lists; the reference accepts them and, single-stream,
    issues nothing early."""
    blocks = list(model.blocks)
    model.set_modules_to_forward_prefetch(blocks[:depth])
    model.set_modules_to_backward_prefetch(blocks[::-1][:depth])
    for i, block in enumerate(blocks):
        block.set_modules_to_forward_prefetch(blocks[i + 1 : i + 1 + depth])
        block.set_modules_to_backward_prefetch(blocks[max(0, i - depth) : i][::-1])


def build(job, device: torch.device, on=None, model=None):
    """The model of ``job`` from seed 0 (or ``model``, built by the caller: ``twinshard
    schedule``'s MLPStack), wrapped by its implementation, and its optimizer (``job.foreach``:
    torch's SGD steps ``DTensor`` parameters with a few multi-tensor operations on an
    accelerator, in a loop through ``DTensor``'s Python dispatch on the CPU; ``twinshard bench
    hooks`` takes the accelerator's)."""
    torch.manual_seed(0)
    model = Llama(job.llama()) if model is None else model
    low = job.low_precision
    if job.impl in ("plain", "ddp"):
        model = model.to(device)
        if low is not None:
            model = model.to(low)  # compute in bf16 like the sharded runs (no fp32 master)
        if job.impl == "ddp":
            model = _ddp(model, device, job.backend)
    else:  # an FSDP implementation: a short name or a module (impls.ImplError if neither)
        if device.type != "cpu" and not job.offload:
            model = model.to(device)
        shard(model, job, device, on)
    return model, optimizer(model, foreach=job.foreach)


def build_on_meta(job, device: torch.device, on, model=None):
    """The model of ``job`` built on ``meta`` (or ``model``, built there by the caller: the plan
    wraps it for activation checkpointing first), sharded on mesh ``on`` and given memory on
    ``device`` (the host with offload, as FSDP2 asks). Call it inside a ``FakeTensorMode``; make
    ``on`` outside it (``DeviceMesh`` computes with real tensors). With offload, twinshard's
    implementations get ``job``'s model built on the host, where a user keeps an offloaded one;
    torch's ``fully_shard`` first moves every parameter to the device by ``.data`` assignment,
    which fake tensors refuse across devices, so torch's takes the meta path."""
    torch_own = impls.module_name(job.impl) == impls.SHORT_NAMES["torch"]
    on_host = model is None and job.offload and not torch_own
    if model is None:
        with torch.device("cpu" if on_host else "meta"):
            model = Llama(job.llama())
    shard(model, job, device, on)
    if not on_host:  # one built on the host keeps its memory there
        model.to_empty(device="cpu" if job.offload else device)
    return model


def optimizer(model, kind: str = "sgd", foreach: bool | None = None) -> torch.optim.Optimizer:
    """SGD with momentum (``foreach``: None is torch's choice), or ``adamw``: fused, as
    torchtitan trains."""
    if kind == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    return torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9, foreach=foreach)


def _ddp(model, device, backend):
    from torch.nn.parallel import DistributedDataParallel

    ids = [device.index] if device.type == "cuda" else None
    ddp = DistributedDataParallel(model, device_ids=ids, broadcast_buffers=False)
    if backend == "fake":
        # The fake process group's all-reduce leaves the future empty; DDP wants the bucket.
        def all_reduce(state, bucket):
            work = dist.all_reduce(bucket.buffer(), async_op=True)
            return work.get_future().then(lambda _: bucket.buffer())

        ddp.register_comm_hook(None, all_reduce)
    return ddp


def tokens(job, vocab: int, rank: int | None = None, device=None) -> torch.Tensor:
    """One batch of (per_rank, seq + 1) token ids: inputs and the targets shifted by one.
    ``rank``: drawn from the rank's own seed (each rank its own data); None: from the global
    generator, as a run without values (the fake accelerator, the plan) may."""
    shape = (job.per_rank, job.seq + 1)
    if rank is None:
        return torch.randint(0, vocab, shape, device=device)
    g = torch.Generator().manual_seed(1000 + rank)
    return torch.randint(0, vocab, shape, generator=g).to(device or "cpu")


def loss(model, batch) -> torch.Tensor:
    """The loss of one forward: ``batch`` is a (B, T + 1) token tensor (the model is given
    the first T as inputs and the last T as targets) or the model's own inputs, whose output,
    unless it is a loss already, is reduced to the mean of its squares."""
    if isinstance(batch, torch.Tensor):
        return model(batch[:, :-1], batch[:, 1:])  # (B, T) inputs, (B, T) targets
    out = model(*batch)
    return out if out.dim() == 0 else out.square().mean()


def train_step(model, opt, batch, mark: Callable[[str], None] | None = None) -> torch.Tensor:
    """One training step of ``model`` on ``batch``; its loss. ``mark("backward")`` is called
    when the forward is done and ``mark("optimizer")`` when the backward is (for timers and
    labels)."""
    out = loss(model, batch)
    if mark is not None:
        mark("backward")
    out.backward()
    if mark is not None:
        mark("optimizer")
    opt.step()
    opt.zero_grad(set_to_none=True)
    return out
