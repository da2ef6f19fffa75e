# The answer to tutorial 13's exercise for SEED "2026": the notebook runs with this in place of
# the cell tagged "exercise" (docs/hooks/notebooks.py, [Note: exercises run with their answer]).
# The suite's report names cost_no_sync: a reduce-scatter in micro-batch 1 of 3, although
# gradient sync is off there. The hook that decides whether to reduce is post_backward, and its
# second test reads reshard_after_backward where it should read reduce_grads.
from twinshard.reference.param_group import *  # noqa: F403 - the names the hooks use

FOUND = "post_backward"


class Fixed(Mystery):  # noqa: F405 - the notebook's mystery group
    def post_backward(self):
        """Take the gradients, free the weights, and reduce unless gradient sync is off."""
        self.state = TrainingState.POST_BACKWARD  # noqa: F405
        for p, dtype in zip(self.params, self.reduce_dtypes(self.params)):
            p.take_grad(dtype)
        if self.reshard_after_backward:
            self.reshard()
        if self.reduce_grads:  # the planted line read reshard_after_backward here
            self.reduce_grads_now()
