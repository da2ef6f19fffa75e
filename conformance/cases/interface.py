"""Cases of the rest of FSDP2's interface: what makes an implementation a drop-in for torch's.

torch's ``FSDPModule`` type and ``register_fsdp_forward_method``, an ``unshard`` before the
first forward, the list form, a ``ModuleList`` with ``forward``, picklable sharded parameters,
post-accumulate-grad hooks, a parameter used on some ranks only, communication hooks, the
other ``FSDPModule`` methods and recovery from an aborted step, mixed dtypes in a group, and no
collectives at all on one rank. Each compares training with the plain model, as elsewhere.
"""

from __future__ import annotations

import io
import pickle
from dataclasses import replace

import torch
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule
from torch.distributed.fsdp import register_fsdp_forward_method as torch_register

from .. import models as M
from ..compare import Checker
from ..driver import compare, run_plain, run_sharded
from .core import case, torch_cannot, train_case
from .errors import expect_error
from .state_dict import dsd


def _is_twinshard(ctx) -> bool:
    return getattr(ctx.impl, "__name__", "").startswith("twinshard")


@case("interface")
def case_torch_fsdp_module(ctx):
    """A sharded module is an instance of torch's FSDPModule, and torch's own
    register_fsdp_forward_method works on it."""

    def wrap(impl, model, mesh):
        impl.fully_shard(model, mesh=mesh)
        torch_register(model, "score")

    recipe = M.mlp_recipe(ctx.world, wrap=wrap, loss=lambda m, b: m.score(*b))
    checker = train_case(ctx, replace(recipe, build=lambda: M.ScoreMLP()))
    model = M.MLPStack()
    M.shard_blocks(ctx.impl, model, ctx.mesh)
    checker.count += 1
    if not all(isinstance(m, TorchFSDPModule) for m in (model, *model.blocks)):
        checker.fail("a sharded module is not an instance of torch.distributed.fsdp.FSDPModule")
    return checker


@case("interface")
def case_unshard_before_forward(ctx):
    """unshard() and unshard(async_op=True) of blocks before the first forward: the blocks stay
    children of the root, and training is unchanged."""

    def wrap(impl, model, mesh):
        M.shard_blocks(impl, model, mesh)
        model.blocks[1].unshard()
        handle = model.blocks[2].unshard(async_op=True)
        if handle is not None:
            handle.wait()
        for block in model.blocks[1:]:
            block.reshard()  # the optimizer that the driver builds next takes the DTensors

    return train_case(ctx, M.mlp_recipe(ctx.world, wrap=wrap))


@case("interface")
def case_list_form(ctx):
    """fully_shard([norm, head]): two modules, one group, gathered once per pass."""

    def wrap(impl, model, mesh):
        for block in model.blocks:
            impl.fully_shard(block, mesh=mesh)
        impl.fully_shard([model.norm, model.head], mesh=mesh)
        impl.fully_shard(model, mesh=mesh)

    return train_case(ctx, M.mlp_recipe(ctx.world, wrap=wrap))


@case("interface")
def case_torchtitan_grouping(ctx):
    """torchtitan's grouping of a Llama: the token embedding alone (a group of one parameter),
    each block, [norm, output] together, then the root, which holds no parameter of its own."""

    def wrap(impl, model, mesh):
        impl.fully_shard(model.tok_embeddings, mesh=mesh)
        for block in model.blocks:
            impl.fully_shard(block, mesh=mesh)
        impl.fully_shard([model.norm, model.output], mesh=mesh)
        impl.fully_shard(model, mesh=mesh)

    return train_case(ctx, M.llama_recipe(ctx.world, wrap=wrap))


@case("interface")
def case_module_list_with_forward(ctx):
    """A ModuleList subclass that defines forward is sharded as one group."""

    def wrap(impl, model, mesh):
        impl.fully_shard(model.blocks, mesh=mesh)
        impl.fully_shard(model, mesh=mesh)

    recipe = M.mlp_recipe(ctx.world, wrap=wrap, build=lambda: M.ListMLP())
    # asked of a list holding no parameter, which sharding leaves as it was
    refused = torch_cannot(shard=M.SequentialList([torch.nn.Identity()]), mesh=ctx.mesh)
    return train_case(ctx, recipe, no_oracle=refused)


@case("interface")
def case_pickle(ctx):
    """Sharded parameters pickle (torch.save), and so does a full state dict after a load with
    broadcast_from_rank0."""
    checker = Checker("fp32")
    recipe = M.mlp_recipe(ctx.world, steps=1)
    _, model = run_sharded(recipe, ctx.impl, ctx.mesh)
    for what, value in (
        ("parameters", list(model.parameters())),
        ("state_dict", model.state_dict()),
    ):
        checker.count += 1
        try:
            torch.save(value, io.BytesIO())
        except Exception as error:  # noqa: BLE001 - the message is the finding
            checker.fail(f"torch.save of the sharded {what} fails: {error}")
    full = dsd().get_model_state_dict(
        model, options=dsd().StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    fresh = recipe.build()
    recipe.wrap(ctx.impl, fresh, ctx.mesh)
    options = dsd().StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    given = dict(full) if ctx.rank == 0 else {}
    dsd().set_model_state_dict(fresh, given, options=options)
    checker.count += 1
    try:
        pickle.dumps(given)
    except Exception as error:  # noqa: BLE001
        checker.fail(f"the dict given to set_model_state_dict no longer pickles: {error}")
    return checker


@case("interface")
def case_post_accumulate_grad_hooks(ctx):
    """Hooks registered with register_post_accumulate_grad_hook on the sharded parameters run
    once per parameter and backward, and see the final sharded gradient."""
    checker = Checker("fp32")
    model = M.MLPStack()
    M.shard_blocks(ctx.impl, model, ctx.mesh)
    seen: dict[str, list] = {}
    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(
            lambda q, name=name: seen.setdefault(name, []).append(q.grad.to_local().clone())
        )
    x, y = M.mlp_data()(0)
    per = x.shape[0] // ctx.world
    batch = tuple(t[ctx.rank * per : (ctx.rank + 1) * per].to(ctx.device) for t in (x, y))
    for step in range(2):
        seen.clear()
        M.mse(model, batch).backward()
        for name, p in model.named_parameters():
            checker.count += 1
            if len(seen.get(name, [])) != 1:
                checker.fail(
                    f"step {step}: the hook of '{name}' ran {len(seen.get(name, []))} times"
                )
            else:
                checker.close(f"step {step} hook's grad '{name}'", seen[name][0], p.grad.to_local())
        model.zero_grad(set_to_none=True)
    return checker


@case(
    "interface", needs=lambda ctx: ctx.world > 1, why="on one rank no parameter is used elsewhere"
)
def case_unused_on_some_ranks(ctx):
    """Each rank routes its rows to one expert (rank r to expert r % 2): with
    set_reduce_scatter_unused_params(True) every expert's gradient is the exact sum."""

    def wrap(impl, model, mesh):
        M.shard_blocks(impl, model, mesh)
        model.set_reduce_scatter_unused_params(True)

    return train_case(ctx, M.routed_recipe(ctx.world, wrap=wrap))


@case("interface", needs=lambda ctx: ctx.world > 1, why="one rank uses every parameter it has")
def case_unused_reported(ctx):
    """Without set_reduce_scatter_unused_params, a parameter used on some ranks only is named
    in a clear error at the next optimizer step (twinshard tallies over the store; torch
    aborts inside gloo instead)."""
    checker = Checker("fp32")
    if not _is_twinshard(ctx):
        checker.notes.append("skipped: the error is twinshard's behaviour, torch aborts")
        checker.count += 1
        return checker
    recipe = M.routed_recipe(ctx.world)
    with expect_error(
        checker, "unused on some ranks", "experts.", "set_reduce_scatter_unused_params"
    ):
        run_sharded(recipe, ctx.impl, ctx.mesh)
    return checker


@case("interface", needs=lambda ctx: ctx.world > 1, why="one rank uses every parameter it has")
def case_unused_consistent(ctx):
    """Without set_reduce_scatter_unused_params, after the backward every rank still holds the
    exact gradient of each expert (the plain model's on the global batch), so a clipping norm
    over the gradients completes; the optimizer step then names the experts."""
    import torch.distributed as dist

    checker = Checker("fp32")
    if not _is_twinshard(ctx):
        checker.notes.append("skipped: torch's reductions do not match across ranks here")
        checker.count += 1
        return checker
    grads = {}

    def capture(model):  # after the backward, before the clipping norm and the step
        has = {n: p.grad is not None for n, p in model.named_parameters()}
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, has)
        if any(h != has for h in every):
            raise AssertionError(f"ranks hold gradients of different parameters: {every}")
        grads.update({n: p.grad.full_tensor() for n, p in model.named_parameters() if has[n]})

    recipe = M.routed_recipe(ctx.world, steps=1, clip=1e6, before_step=capture)
    truth = run_plain(recipe).grads[0]
    with expect_error(checker, "the step after routing", "experts.", "set_reduce_scatter_unused"):
        run_sharded(recipe, ctx.impl, ctx.mesh)
    for name, expected in truth.items():  # None where no rank made one, as the plain model
        checker.close(f"grad '{name}' after the backward", grads.get(name), expected)
    return checker


@case("interface")
def case_summon_full_params(ctx):
    """twinshard.summon_full_params: whole parameters inside (equal to the plain model's), and
    edits made inside are written back to the shards: training goes on from the edited model."""
    from twinshard.summon import summon_full_params

    checker = Checker("fp32")
    recipe = M.mlp_recipe(ctx.world, steps=1)
    truth = run_plain(recipe)
    trace, model = run_sharded(recipe, ctx.impl, ctx.mesh)
    plain = dict(truth.model.named_parameters())
    with summon_full_params(model, with_grads=True):
        for name, p in model.named_parameters():
            checker.close(f"summoned '{name}'", p, plain[name])
            with torch.no_grad():
                p.mul_(0.5).add_(0.01)
    with torch.no_grad():
        for p in truth.model.parameters():
            p.mul_(0.5).add_(0.01)
    more = replace(recipe, steps=1, start=1)
    mine, _ = run_sharded(more, ctx.impl, ctx.mesh, model=model, opt=trace.optimizer)
    compare(
        checker, "after writeback", mine, run_plain(more, model=truth.model, opt=truth.optimizer)
    )
    return checker


@case("interface")
def case_compile(ctx):
    """torch.compile of each sharded block (the aot_eager backend: autograd traced and
    replayed, no code generation): FSDP's hooks stay outside the graphs, results unchanged."""

    def wrap(impl, model, mesh):
        M.shard_blocks(impl, model, mesh)
        for block in model.blocks:
            block.compile(backend="aot_eager")

    return train_case(ctx, M.mlp_recipe(ctx.world, wrap=wrap))


@case(
    "interface",
    needs=lambda ctx: ctx.world == 4 and not ctx.hsdp,
    why="tensor parallel x FSDP runs on 4 ranks: a (dp=2, tp=2) mesh",
)
def case_tensor_parallel(ctx):
    """FSDP over tensor parallelism: each block's w1 column-parallel and w2 row-parallel on the
    tp dim of a (dp, tp) mesh, then fully_shard on the dp dim; the sharded parameters are 2-D
    DTensors (a strided shard on dp where TP also cut dim 0)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh(ctx.device_type, (2, 2), mesh_dim_names=("dp", "tp"))
    plan = {"w1": ColwiseParallel(), "w2": RowwiseParallel()}

    def wrap(impl, model, _):
        for block in model.blocks:
            parallelize_module(block, mesh["tp"], plan)
            impl.fully_shard(block, mesh=mesh["dp"])
        impl.fully_shard(model, mesh=mesh["dp"])

    recipe = M.mlp_recipe(
        ctx.world,
        wrap=wrap,
        build=lambda: M.MLPStack(dim=16, hidden=32, n_blocks=2),
        data=M.mlp_data(dim=16),
        data_rank=lambda: (mesh["dp"].get_local_rank(), 2),
    )
    checker = train_case(ctx, recipe)
    _, model = run_sharded(replace(recipe, steps=1), ctx.impl, ctx.mesh)
    checker.count += 1
    if model.blocks[0].w1.weight.device_mesh.mesh_dim_names != ("dp", "tp"):
        checker.fail(
            "a tensor-parallel weight is not a DTensor on the (dp, tp) mesh after fully_shard"
        )
    return checker


@case(
    "interface",
    needs=lambda ctx: ctx.hsdp or (ctx.world > 1 and ctx.world % 2 == 0),
    why="a mesh of its own for some parameters needs an even number of ranks (HSDP 2 x W/2)",
)
def case_per_param_mesh(ctx):
    """shard_placement_fn answers ShardPlacementResult for each block's w1 (torch 2.13's
    per-parameter mesh, as experts get theirs): on a 1D mesh of W ranks, w1 goes on an HSDP
    (2, W/2) mesh of the same ranks; on an HSDP mesh, on a 1D mesh of all of them. Each is the
    mean over every rank, so training equals the plain model's; w1's shards are DTensors on its
    own mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp._fully_shard._fsdp_common import (
        FSDPMeshInfo,
        HSDPMeshInfo,
        ShardPlacementResult,
    )

    if ctx.hsdp:
        own = init_device_mesh(ctx.device_type, (ctx.world,), mesh_dim_names=("dp",))
        info = FSDPMeshInfo(mesh=own, shard_mesh_dim=0)
    else:
        shape, names = (2, ctx.world // 2), ("replicate", "shard")
        own = init_device_mesh(ctx.device_type, shape, mesh_dim_names=names)
        info = HSDPMeshInfo(mesh=own, shard_mesh_dim=1, replicate_mesh_dim=0)

    def wrap(impl, model, mesh):
        first = {p for block in model.blocks for p in block.w1.parameters()}

        def placement(p):
            return ShardPlacementResult(placement=None, mesh_info=info) if p in first else None

        M.shard_blocks(impl, model, mesh, shard_placement_fn=placement)

    recipe = M.mlp_recipe(ctx.world, wrap=wrap)
    checker = train_case(ctx, recipe)
    _, model = run_sharded(replace(recipe, steps=1), ctx.impl, ctx.mesh)
    checker.count += 1
    meshes = {n: p.device_mesh for n, p in model.named_parameters()}
    if meshes["blocks.0.w1.weight"] != own or meshes["blocks.0.w2.weight"] != ctx.mesh:
        checker.fail(f"the parameters are not on the meshes shard_placement_fn gave: {meshes}")
    return checker
