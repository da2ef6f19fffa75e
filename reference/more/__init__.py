"""The reference's second reading: what FSDP2 does beyond sharding a plain parameter, read
after the core, in this order:

    fsdp_module.py      the FSDPModule methods and torch's hooks into an implementation
    post_forward.py     what a group keeps after forward: reshard_after_forward=N
    fp16.py             an fp16 mean, divided around its sum
    usage.py            parameters used on some ranks only
    comm_hooks.py       the user's own all-gather and reduce-scatter
    layouts.py          a parameter's layout from its features; HSDP's partial sums;
                        parameters replaced (to_empty, assign=True loads)
    offload.py          shards and gradients in host memory
    tensor_parallel.py  FSDP over tensor parallelism and dp_mesh_dims, and Shard(dim)
    extension.py        parameters that gather themselves (float8 weights)
    group.py            the contract's group-level methods: a group's parameters in one call

The core (the modules of ``twinshard.reference`` itself) reads without any of this. Each
feature here is reached from the core at the lines that name it, through the seams below, and
the core imports nothing else of this package (``tests/engine/test_reference_rules.py`` checks it):

    post_forward_mesh_info  post_forward.py  what backward gathers a parameter over after
                                             forward resharded it (fully_shard)
    fp16_divisors           fp16.py          an fp16 mean divided around its sum (ParamGroup)
    choose_layout,          layouts.py       a parameter's layout, chosen once from its
    layout_for_shard                         features (fully_shard), and again where its shard
                                             gathers itself or was replaced (ShardedParam)
    wait_for_grad_copies    offload.py       CPU offload: gradient copies waited for once (root)
    user_all_gather,        comm_hooks.py    the user's collectives, set_custom_all_gather and
    user_reduce_scatter                      set_custom_reduce_scatter (collectives.py)
    check_usage             usage.py         parameters used on some ranks only (the root)
    GroupMethods            group.py         what ``ShardedParam`` does for a whole group

and one seam module of its own, ``fsdp_module.py``: ``FSDPModule``, the methods of torch's
interface that ``fully_shard`` gives a module, with the rest of torch's compatibility
(``share_comm_ctx``; ``make_fsdp_modules``, the marks torch's tools look for).
"""

from .comm_hooks import user_all_gather, user_reduce_scatter
from .fp16 import fp16_divisors
from .group import GroupMethods
from .layouts import choose_layout, layout_for_shard
from .offload import wait_for_grad_copies
from .post_forward import post_forward_mesh_info
from .usage import check_usage

__all__ = ["GroupMethods", "check_usage", "choose_layout", "fp16_divisors", "layout_for_shard",
           "post_forward_mesh_info", "user_all_gather", "user_reduce_scatter",
           "wait_for_grad_copies"]  # fmt: skip
