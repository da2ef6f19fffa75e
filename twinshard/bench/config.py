"""What one benchmark run is: the implementation, the model, the world and the policies.

``RunConfig`` is everything a process needs to build the model and train it (it travels to
the ranks by pickle); ``build(config, device)`` returns the model, wrapped by the chosen
implementation, and its optimizer. Five implementations are compared by default:

    plain      the model without any wrapper: each rank trains a full replica on its own slice
               and nothing is communicated (the compute floor)
    ddp        torch's DistributedDataParallel (the data-parallel baseline)
    reference  twinshard.reference.fully_shard (the readable spec)
    optimized  twinshard.optimized.fully_shard (the fast path)
    torch      torch.distributed.fsdp.fully_shard (FSDP2)

and any importable module with the ``fully_shard`` interface runs as the last three do
(``twinshard.impls`` resolves the name, as for every command).

Every block of ``model.blocks`` is one parameter group, then the root; all runs start from
the same seed and see the same batches.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist

from twinshard import impls
from twinshard.models import Llama, LlamaConfig

BASELINES = ("plain", "ddp")  # run by the bench itself, without FSDP
SHARDED = tuple(impls.SHORT_NAMES)  # FSDP by short name (and the memory model's coverage)
IMPLS = BASELINES + SHARDED  # the five compared by default
FAKEACCEL_RUNS = "--backend fakeaccel runs FSDP implementations only (not plain or ddp)"
# fake, simnet and fakeaccel: one process stands in for W (fakeaccel: twinshard.fakeaccel's
# checks of an accelerator job, on the CPU)
BACKENDS = ("gloo", "nccl", "fake", "simnet", "fakeaccel")
DTYPES = {"fp32": None, "bf16": torch.bfloat16}


@dataclass
class RunConfig:
    impl: str = "optimized"
    preset: str = "small"
    model: dict = field(default_factory=dict)  # LlamaConfig overrides (n_layers, dim, ...)
    dtype: str = "fp32"  # fp32, or bf16 compute with fp32 reduction and fp32 master weights
    seq: int = 128
    per_rank: int = 4  # sequences per rank per step
    warmup: int = 2
    steps: int = 10
    device: str = "cpu"
    backend: str = "gloo"
    world: int = 2  # world size; for fake and simnet, simulated by one process
    replicas: int = 1  # HSDP: a (replicas, world // replicas) mesh; 1 is plain FSDP
    link: str = "ib"  # simnet: nvlink, ib, or GB/s
    latency_us: float | None = None  # simnet: overrides the link's latency
    memory: bool = True  # one more (untimed) step that tracks memory by category
    profile: str | None = None  # a directory: write a cProfile of the timed steps there
    # the optimizer's ``foreach``: None is torch's own choice, multi-tensor operations over all
    # parameters on an accelerator and a loop over the parameters on the CPU (see ``build``)
    foreach: bool | None = None
    offload: bool = False  # CPUOffloadPolicy (pinned): shards and sharded gradients on the host
    reshard_after_forward: bool | int = True  # of the blocks (the root keeps torch's default)

    @property
    def simulated(self) -> bool:
        return self.backend in ("fake", "simnet")

    @property
    def nproc(self) -> int:
        return 1 if self.simulated else self.world

    def llama(self) -> LlamaConfig:
        return LlamaConfig.preset(self.preset, **{"max_seq_len": max(self.seq, 16), **self.model})

    def as_dict(self) -> dict:
        return asdict(self)


def mesh_for(config: RunConfig, device: torch.device):
    """The 1D mesh of every rank on ``device``'s type (said explicitly: a simulated world has
    no NCCL backend from which to guess the device), or the 2D HSDP mesh."""
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    if config.replicas == 1:
        return init_device_mesh(device.type, (world,))
    shape = (config.replicas, world // config.replicas)
    return init_device_mesh(device.type, shape, mesh_dim_names=("replicate", "shard"))


def build(config: RunConfig, device: torch.device):
    """The model of ``config``, wrapped by its implementation, and an SGD optimizer.

    The optimizer steps ``DTensor`` parameters under the sharded implementations. On an
    accelerator torch's SGD does that with a few multi-tensor (``foreach``) operations over all
    parameters; on the CPU it loops over the parameters, and each ``DTensor`` operation in the
    loop goes through ``DTensor``'s Python dispatch. ``config.foreach`` chooses between the two
    on any device (``twinshard bench hooks`` takes the accelerator's)."""
    torch.manual_seed(0)
    model = Llama(config.llama())
    low = DTYPES[config.dtype]
    if config.impl in ("plain", "ddp"):
        model = model.to(device)
        if low is not None:
            model = model.to(low)  # compute in bf16 like the sharded runs (no fp32 master)
        if config.impl == "ddp":
            model = _ddp(model, device, config.backend)
    else:  # an FSDP implementation: a short name or a module (impls.ImplError if neither)
        if device.type != "cpu" and not config.offload:
            model = model.to(device)
        shard(model, config, device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9, foreach=config.foreach)
    return model, opt


def shard(model, config: RunConfig, device: torch.device, mesh=None) -> None:
    """``fully_shard`` every block of ``model``, then the root, with the implementation,
    policies and (unless ``mesh`` is given) mesh of ``config``."""
    impl = impls.load(config.impl, "--impls", impls.MEASURED)
    kwargs = {"mesh": mesh if mesh is not None else mesh_for(config, device)}
    if DTYPES[config.dtype] is not None:
        kwargs["mp_policy"] = impl.MixedPrecisionPolicy(
            param_dtype=DTYPES[config.dtype], reduce_dtype=torch.float32
        )
    if config.offload:  # pinned host memory where there is a device to copy to
        kwargs["offload_policy"] = impl.CPUOffloadPolicy(pin_memory=device.type != "cpu")
    for block in model.blocks:
        impl.fully_shard(block, reshard_after_forward=config.reshard_after_forward, **kwargs)
    impl.fully_shard(model, **kwargs)


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


def forward_backward(model, tokens: torch.Tensor) -> torch.Tensor:
    loss = model(tokens[:, :-1], tokens[:, 1:])
    loss.backward()
    return loss
