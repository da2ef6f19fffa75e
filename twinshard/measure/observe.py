"""One recording loop: a job's steps on the fake accelerator (or the CPU's fake process group),
with observers plugged in.

``record(job, observer, steps)`` plays rank 0 of ``job.world`` ranks (``world.join``, with
``backend`` and ``device_type``: the fake accelerator, the CPU's fake process group, a lent
GPU), makes
the job's mesh, builds its model on ``meta`` and shards it inside ``FakeTensorMode``
(``step.build_on_meta``; with ``real``, real tensors without values), makes its optimizer and
one batch, and trains ``steps`` steps, each a phase of ``observer`` of its own. ``observer``
makes the observer for the device joined: a ``monitor.Monitor`` or one built on it (None: a
plain one of the device's type), entered around everything after the mesh. It returns the
observer and its phases, setup first. What a run adds plugs in:

- ``watch``: more contexts entered with the observer, given it (the plan's waits);
- ``model``: a model the caller built on ``meta`` (the plan's, wrapped for checkpointing);
  ``build(device, mesh)``: the model and optimizer instead (the plan's ideal step);
  ``optimizer``: ``step.optimizer``'s kind and ``foreach``;
- ``ready(observer, model, opt)``: once they and the batch exist (a probe, labels, a planted
  hazard);
- ``steps_in(device)``: a context around the steps (the plan's attention kernel);
- ``batch(job, model, device)``: the batch instead of ``step.tokens``'s (the schedule's MLP);
- ``before(observer, k)``: at the start of step k's phase; ``mark``: ``step.train_step``'s;
- ``after(job, model, opt, batch)``: once the steps are done, inside the same contexts (the
  schedule records its own step there, with ``steps`` 0).

The fake accelerator's run and its checks on a lent GPU (``fakeaccel/runner.py``), the plan
(``plan/runner.py``) and the schedule's fake-accelerator recording (``schedule/cli.py``) record
through it.
"""

from __future__ import annotations

import contextlib

from . import monitor, step, world


def record(
    job,
    observer,
    steps: int,
    *,
    backend: str = "fakeaccel",
    device_type: str = "cpu",
    real: bool = False,
    watch=(),
    model=None,
    build=None,
    optimizer: tuple = ("sgd", True),
    ready=None,
    steps_in=None,
    batch=None,
    before=None,
    mark=None,
    after=None,
) -> tuple:
    """The observer and its phases (see the module docstring)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    device = world.join(backend, job.world, device_type)
    mesh = step.mesh(job, device)  # outside the fake mode: DeviceMesh computes on the host
    seen = observer(device) if observer is not None else monitor.Monitor(device.type)
    fake = contextlib.nullcontext() if real else FakeTensorMode(allow_non_fake_inputs=True)
    with fake, seen, contextlib.ExitStack() as more:
        for context in watch:
            more.enter_context(context(seen))
        if build is not None:
            model, opt = build(device, mesh)
        else:
            model = step.build_on_meta(job, device, mesh, model)
            opt = step.optimizer(model, *optimizer)
        if batch is None:
            tokens = step.tokens(job, model.config.vocab_size, device=device)
        else:
            tokens = batch(job, model, device)
        if ready is not None:
            ready(seen, model, opt)
        with steps_in(device) if steps_in is not None else contextlib.nullcontext():
            for k in range(steps):
                seen.begin(f"step {k + 1}")
                if before is not None:
                    before(seen, k)
                step.train_step(model, opt, tokens, mark)
        if after is not None:
            after(job, model, opt, tokens)
    return seen, seen.finish()
