"""What one plan is: the measuring layer's job (``twinshard.measure.job.Job``) with a plan's
defaults, and the device and network whose constants price it.

``job(**fields)`` is a plan's job: bf16, AdamW, 8 ranks of one sequence of 2,048 tokens on an
H100, recorded on the fake accelerator (``backend`` fakeaccel) or, for ``device="cpu"``, on
the CPU's fake process group (``fake``); ``twinshard plan`` makes its jobs with it from the
flags (``flags.jobs(args, job)``). ``problem(job)`` checks what only a plan has (the device's
and network's names, real tensors only on the CPU, ``--ac``), then ``Job.problem``.
"""

from __future__ import annotations

from twinshard.measure.job import Job

from . import checkpointing
from .profiles import DEVICES, NETWORKS

DEVICE_CHOICES = (*DEVICES, "cpu")
DEFAULTS = dict(
    preset="small", world=8, per_rank=1, seq=2048, dtype="bf16", optimizer="adamw", device="h100"
)


def job(**fields) -> Job:
    """A plan's job: ``DEFAULTS``, then ``fields`` (``Job``'s names); the backend follows the
    device (see the module docstring)."""
    chosen = {**DEFAULTS, **fields}
    chosen.setdefault("backend", "fake" if chosen["device"] == "cpu" else "fakeaccel")
    return Job(**chosen)


def problem(plan: Job) -> str | None:
    """What is wrong with this plan, in one line naming the flag; None if nothing."""
    if plan.device not in DEVICE_CHOICES:
        return f"--device {plan.device!r} unknown; use {', '.join(DEVICE_CHOICES)}"
    if plan.real and not plan.cpu:
        return "real tensors (real=True) are for --device cpu only"
    if plan.network and not (plan.network in NETWORKS or plan.network.startswith("simnet:")):
        return f"--network {plan.network!r} unknown; use {', '.join(NETWORKS)} or simnet:<link>"
    try:
        checkpointing.parse(plan.ac)
    except ValueError as error:
        return str(error)
    return plan.problem()
