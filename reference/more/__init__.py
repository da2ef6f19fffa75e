"""The reference's second reading: what FSDP2 does beyond sharding a plain parameter, read
after the core in the order ``reference/__init__.py`` gives.

The core (the modules of ``twinshard.reference`` itself) reads without any of this. Each
feature here is reached from the core at the lines that name it, through the seams below, and
the core imports nothing else of this package (``tests/engine/test_reference_rules.py`` checks it):

    default_device_type,  devices.py          the device of the mesh fully_shard builds itself,
    rows_mesh                                 and rows of N ranks (reshard_after_forward=N)
    choose_layout,        layouts.py          a parameter's layout, chosen once from its
    layout_for_shard                          features (fully_shard), and again where its shard
                                              gathers itself or was replaced (ShardedParam)
    data_parallel_mesh,   tensor_parallel.py       dp_mesh_dims: the data-parallel part of an SPMD
    check_spmd_params                         mesh, every parameter a DTensor on it (fully_shard)
    wait_for_grad_copies  offload.py          CPU offload: gradient copies waited for once (root)
    check_materialized    layouts.py          parameters left on meta (the root's lazy init)
    user_all_gather,      comm_hooks.py       the user's collectives, set_custom_all_gather and
    user_reduce_scatter                       set_custom_reduce_scatter (collectives.py)
    check_usage           usage.py            parameters used on some ranks only (the root)

and one seam module of its own, ``fsdp_module.py``: ``FSDPModule``, the methods of torch's
interface that ``fully_shard`` gives a module, with the rest of torch's compatibility
(``share_comm_ctx``; ``check_module`` and ``raise_split_tie``, fully_shard's refusals in
torch's words: a module it cannot shard, a tie split over two groups).
"""

from .comm_hooks import user_all_gather, user_reduce_scatter
from .devices import default_device_type, rows_mesh
from .layouts import check_materialized, choose_layout, layout_for_shard
from .offload import wait_for_grad_copies
from .tensor_parallel import check_spmd_params, data_parallel_mesh
from .usage import check_usage

__all__ = ["check_materialized", "check_spmd_params", "check_usage",
           "choose_layout", "data_parallel_mesh", "default_device_type", "layout_for_shard",
           "rows_mesh", "user_all_gather", "user_reduce_scatter",
           "wait_for_grad_copies"]  # fmt: skip
