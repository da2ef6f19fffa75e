# The answer to tutorial 12's exercise: the notebook runs with this in place of the cell tagged
# "exercise" (docs/hooks/notebooks.py, [Note: exercises run with their answer]).
from twinshard.reference.collectives import all_gather_rows, all_reduce_sum, reduce_scatter_rows
from twinshard.reference.param_group import ParamGroup, TrainingState
from twinshard.reference.sharded_param import ParamState


class MyGroup(ParamGroup):
    """The reference's parameter group with its four hooks written again."""

    def unshard_param(self, p, dtype):
        """All-gather p into its unsharded parameter, in ``dtype``, and put it on the module."""
        if p.state is ParamState.UNSHARDED:
            return  # kept from forward (reshard_after_forward=False): nothing to gather
        group = p.all_gather_mesh(self.post_forward_info).shard_group  # the kept piece's ranks
        for block, out in zip(p.all_gather_inputs(dtype), p.all_gather_outputs(dtype)):
            all_gather_rows(out, block, group)  # (chunk, *rest) -> (S * chunk, *rest)
        p.finish_unshard()

    def reshard(self, after_forward=False):
        """Free every unsharded parameter; after forward, keep post_forward_info's piece."""
        for p in self.params:
            keep = self.post_forward_info if after_forward and p.info is self.info else None
            p.reshard(keep)

    def reduce_param(self, p, dtype):
        """Reduce p's waiting gradient into its sharded gradient, as the mean over all ranks.
        Returns whether this rank had a gradient (None: a frozen parameter)."""
        used = p.has_grad_to_reduce
        grad = p.reduce_scatter_input(dtype)  # (S * chunk, *rest), zeros if unused here
        if grad is None:
            return None
        block = reduce_scatter_rows(grad.to(dtype), p.info.shard_group)  # (chunk, *rest)
        if p.info.replicate_group is not None:  # HSDP: then across the replicas
            block = p.combine_partial_sum(block, self.all_reduce_grads)
            if block is None:
                return used  # a partial sum, kept for a later micro-batch
            all_reduce_sum(block, p.info.replicate_group)
        _, after = self.gradient_divisors(dtype, p.info)  # the number of ranks: a mean
        p.accumulate_grad(block / after)
        return used

    def post_backward(self):
        """Take the gradients, free the weights, and reduce unless gradient sync is off."""
        self.state = TrainingState.POST_BACKWARD
        for p, dtype in zip(self.params, self.reduce_dtypes(self.params)):
            p.take_grad(dtype)
        if self.reshard_after_backward:
            self.reshard()
        if self.reduce_grads:
            self.reduce_grads_now()
