"""Why a PyTorch FSDP2 test that passes with torch's ``fully_shard`` fails with twinshard's.

One entry per test name: (class, reason). The classes:

- ``internals``: the test reads or patches torch's private FSDP machinery (``FSDPParamGroup``,
  ``fully_shard.state``, ``_fsdp_param_group``, ``foreach_reduce``...). It cannot pass without
  copying those internals; the public behaviour it is after is checked by our own tests.
- ``by design``: twinshard behaves differently on purpose, and says why (the reference's one
  collective per parameter, a misuse torch refuses that twinshard trains correctly...).
- ``missing``: a public feature twinshard does not have (yet).
- ``difference``: a real difference in public behaviour: a bug to fix.
"""

_STATE = "reads torch's FSDP state (fully_shard.state(module), _lazy_init, _fsdp_param_group)"
_MANAGED = (
    "calls torch's private _get_managed_modules/_get_managed_states, which find nested groups "
    "through torch's own FSDP state; twinshard's groups are invisible to them"
)
_PATCHED_GROUP = (
    "records the order of unshards and post-backwards by patching FSDPParamGroup.unshard / "
    "post_backward (patch_unshard, patch_post_backward); twinshard's groups are not "
    "FSDPParamGroups, so the record stays empty"
)
_EXTENSION = (
    "the fsdp_pre_all_gather / fsdp_post_all_gather tensor-subclass extension; twinshard "
    "refused such parameters by name before 8a97b7a, where both implementations gained it"
)
_PER_PARAM = (
    "counts collectives with CommDebugMode expecting one all-gather / reduce-scatter per group; "
    "the reference issues one per parameter, on purpose (one collective at a time to read), and "
    "the optimized path on gloo exchanges the packed shards without all_gather_into_tensor (its "
    "measured CPU shortcut, optimized/collectives.py), which CommDebugMode does not count"
)
_USAGE = (
    "twinshard's usage guard reports a parameter used on 1 of 2 ranks that every rank used: "
    "under a FileStore (init_method='file://', as PyTorch's tests run) one of the ranks' "
    "appended lists is lost; one key per rank fixes it (twinshard/guard/usage.py, not changed "
    "in this round)"
)

CLASSIFICATION: dict[str, tuple[str, str]] = {
    # test_fully_shard_init.py
    "test_fully_shard_is_root": ("internals", _STATE),
    "test_fully_shard_module_and_param_fqns": ("internals", _STATE),
    "test_fully_shard_double_lazy_init": ("internals", _STATE),
    "test_fully_shard_multi_module_root": ("internals", _STATE),
    "test_managed_modules_nested": ("internals", _MANAGED),
    "test_managed_modules_nested_fully_shard_and_replicate": ("internals", _MANAGED),
    "test_managed_states_nested_fully_shard": ("internals", _MANAGED),
    "test_init_1d_uneven_shard_largest_dim": (
        "by design",
        "torch refuses Shard(dim > 0) on a dim the shard group does not divide "
        "(NotImplementedError); twinshard pads it as it pads dim 0 and trains it (conformance "
        "case shard_dim_1_uneven): ours is the better behaviour",
    ),
    "test_raise_noncontiguous_parameter": (
        "by design",
        "torch refuses a non-contiguous parameter (a channels_last Conv2d weight) with "
        "NotImplementedError; twinshard shards a contiguous copy and trains it equal to the "
        "plain model: ours is the better behaviour",
    ),
    "test_custom_hook_custom_stream": (
        "by design",
        "compares the whole message with assertEqual; twinshard's says the same and names the "
        "method (set_all_reduce_hook: stream cannot be set with HSDP)",
    ),
    "test_invalid_meta_device_init": (
        "difference",
        "wording: torch lists every parameter of the group still on meta in one message; "
        "twinshard named the first before e713cf2, which says what torch says",
    ),
    # test_fully_shard_comm.py
    "test_fully_shard_communication_count": ("by design", _PER_PARAM),
    "test_manual_reshard_with_reshard_after_forward_false": ("by design", _PER_PARAM),
    "test_set_reshard_after_forward": ("by design", _PER_PARAM),
    "test_set_modules_to_forward_prefetch": ("internals", _PATCHED_GROUP),
    "test_set_modules_to_backward_prefetch": ("internals", _PATCHED_GROUP),
    "test_fully_shard_multi_module_unused_module": ("internals", _PATCHED_GROUP),
    "test_backward_misprefetch": ("internals", _PATCHED_GROUP),
    "test_size1_reduceop": ("internals", "reads state._fsdp_param_group of torch's FSDP state"),
    # test_fully_shard_training.py
    "test_partial_group_forward_grad_accum_chunked": ("difference", _USAGE),
    "test_partial_group_forward_then_standalone": ("difference", _USAGE),
    "test_train_parity_with_activation_checkpointing": ("difference", _USAGE),
    "test_gradient_accumulation": ("by design", _PER_PARAM),
    "test_partial_group_reshard_toggle": ("internals", "reads _fsdp_param_group of torch's state"),
    "test_modules_to_run_forward_empty_for_single_module": (
        "internals",
        "reads _modules_to_run_forward of torch's FSDP state",
    ),
    "test_shared_params_separate_fsdp_groups_error": (
        "by design",
        "a tied weight split over two fully_shard calls is refused at the second call, naming "
        "both modules, one step earlier than torch (at the first forward), so the test's "
        "assertRaises around the forward sees nothing",
    ),
    # test_fully_shard_extensions.py
    "test_all_gather_extension_hsdp_mesh": ("missing", _EXTENSION),
    "test_all_gather_extension_outer_size_stride": ("missing", _EXTENSION),
    "test_all_gather_extensions_end_to_end": ("missing", _EXTENSION),
    "test_all_gather_extensions_monkey_patch": ("missing", _EXTENSION),
}
