"""The reference's second reading: what FSDP2 does beyond sharding a plain parameter.

Read it after the core, in this order:

    fsdp_module.py      the FSDPModule methods and torch's hooks into an implementation
    devices.py          the device of the default mesh, from the accelerator API
    replaced.py         to_empty, load_state_dict(assign=True) and meta parameters
    partial_sum.py      HSDP without an all-reduce at every backward
    usage.py            parameters used on some ranks only
    comm_hooks.py       the user's own all-gather and reduce-scatter
    offload.py          shards and gradients in host memory
    tensor_parallel.py  FSDP over tensor parallelism
    spmd_dims.py        dp_mesh_dims: flattened dims, HSDP and DDP on a whole SPMD mesh
    extension.py        parameters that gather themselves (float8 weights)
    kept_shards.py      a shard in storage the optimized path owns

The core (the modules of ``twinshard.reference`` itself) reads without any of this. Each
feature here is reached from the core at the lines that name it, through the seams below, and
the core imports nothing else of this package (``tests/engine/test_reference_rules.py`` checks it):

    default_device_type,  devices.py          the device of the mesh fully_shard builds itself,
    rows_mesh                                 and rows of N ranks (reshard_after_forward=N)
    tp_layout             tensor_parallel.py  a DTensor parameter's TP layout (ShardedParam)
    data_parallel_mesh,   spmd_dims.py        dp_mesh_dims: the data-parallel part of an SPMD
    check_spmd_params                         mesh, every parameter a DTensor on it (fully_shard)
    gathers_itself,       extension.py        the all-gather extension: a shard that gathers
    Extension                                 itself (ShardedParam's unshard and reshard)
    grad_to_host,         offload.py          CPU offload: gradients copied to host memory
    wait_for_grad_copies                      (accumulate_grad), waited for once (the root)
    adopt_replaced,       replaced.py         parameters the user replaced or left on meta
    check_materialized                        (ShardedParam.refresh, the root's lazy init)
    user_all_gather,      comm_hooks.py       the user's collectives, set_custom_all_gather and
    user_reduce_scatter                       set_custom_reduce_scatter (collectives.py)
    combine_partial_sum   partial_sum.py      HSDP partial sums (ShardedParam)
    check_usage           usage.py            parameters used on some ranks only (the root)

and one seam module of its own, ``fsdp_module.py``: ``FSDPModule``, the methods of torch's
interface that ``fully_shard`` gives a module, with the rest of torch's compatibility
(``register_fsdp_forward_method``, ``share_comm_ctx``). ``kept_shards.py`` serves the optimized
path alone (a shard in storage of its own); the reference does not call it.
"""

from .comm_hooks import user_all_gather, user_reduce_scatter
from .devices import default_device_type, rows_mesh
from .extension import Extension, gathers_itself
from .offload import grad_to_host, wait_for_grad_copies
from .partial_sum import combine_partial_sum
from .replaced import adopt_replaced, check_materialized
from .spmd_dims import check_spmd_params, data_parallel_mesh
from .tensor_parallel import tp_layout
from .usage import check_usage

__all__ = ["Extension", "adopt_replaced", "check_materialized", "check_spmd_params",
           "check_usage", "combine_partial_sum", "default_device_type", "data_parallel_mesh", "gathers_itself",
           "grad_to_host", "rows_mesh", "tp_layout", "user_all_gather", "user_reduce_scatter",
           "wait_for_grad_copies"]  # fmt: skip
