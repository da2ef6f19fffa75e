"""The reference's second reading: what FSDP2 does beyond sharding a plain parameter.

Read it after the core, in this order:

    fsdp_module.py      the FSDPModule methods and torch's hooks into an implementation
    devices.py          the device of the default mesh, from the accelerator API
    replaced.py         to_empty, load_state_dict(assign=True) and meta parameters
    usage.py            parameters used on some ranks only
    comm_hooks.py       the user's own all-gather and reduce-scatter
    layouts.py          a parameter's layout, chosen from the features below
    shard_dim.py        Shard(dim): blocks cut along another dim
    partial_sum.py      HSDP without an all-reduce at every backward
    offload.py          shards and gradients in host memory
    tensor_parallel.py  FSDP over tensor parallelism
    spmd_dims.py        dp_mesh_dims: flattened dims, HSDP and DDP on a whole SPMD mesh
    extension.py        parameters that gather themselves (float8 weights)

The core (the modules of ``twinshard.reference`` itself) reads without any of this. Each
feature here is reached from the core at the lines that name it, through the seams below, and
the core imports nothing else of this package (``tests/engine/test_reference_rules.py`` checks it):

    default_device_type,  devices.py          the device of the mesh fully_shard builds itself,
    rows_mesh                                 and rows of N ranks (reshard_after_forward=N)
    choose_layout,        layouts.py          a parameter's layout, chosen once from its
    layout_for_shard                          features (fully_shard), and again where its shard
                                              gathers itself or was replaced (ShardedParam)
    data_parallel_mesh,   spmd_dims.py        dp_mesh_dims: the data-parallel part of an SPMD
    check_spmd_params                         mesh, every parameter a DTensor on it (fully_shard)
    wait_for_grad_copies  offload.py          CPU offload: gradient copies waited for once (root)
    check_materialized    replaced.py         parameters left on meta (the root's lazy init)
    user_all_gather,      comm_hooks.py       the user's collectives, set_custom_all_gather and
    user_reduce_scatter                       set_custom_reduce_scatter (collectives.py)
    check_usage           usage.py            parameters used on some ranks only (the root)

and one seam module of its own, ``fsdp_module.py``: ``FSDPModule``, the methods of torch's
interface that ``fully_shard`` gives a module, with the rest of torch's compatibility
(``register_fsdp_forward_method``, ``share_comm_ctx``).
"""

from .comm_hooks import user_all_gather, user_reduce_scatter
from .devices import default_device_type, rows_mesh
from .layouts import choose_layout, layout_for_shard
from .offload import wait_for_grad_copies
from .replaced import check_materialized
from .spmd_dims import check_spmd_params, data_parallel_mesh
from .usage import check_usage

__all__ = ["check_materialized", "check_spmd_params", "check_usage", "choose_layout",
           "data_parallel_mesh", "default_device_type", "layout_for_shard", "rows_mesh",
           "user_all_gather", "user_reduce_scatter", "wait_for_grad_copies"]  # fmt: skip
