"""One training step of the real code at the user's scale, recorded in a process of its own.

``record(config)`` plays rank 0 of ``config.world`` ranks (``config.hsdp`` replicas) through
the measuring layer's one loop (``measure.observe.record``) with ``trace.StepTrace`` plugged
in, and returns what it saw of the second step (the first initializes lazily and creates the
optimizer's state). On an accelerator profile that is the fake accelerator, where attention
runs PyTorch's flash-attention kernel, as a GPU's ``scaled_dot_product_attention`` picks for
these shapes, rather than the composite a CPU build falls back to (which keeps a T x T matrix
a GPU never holds); on the CPU profile, ``FakeTensor``s on the CPU and the fake process group
(``twinshard bench``'s code path on a CPU rank); with ``config.real``, real tensors without
values, to check the fake tensors' memory against. The model is a ``twinshard.models.Llama``
built on ``meta``, wrapped for activation checkpointing (``checkpointing.py``) and trained
with AdamW (fused, as torchtitan) or SGD with momentum (foreach); the implementation
``plain`` is the job's ideal step (``ideal.py``).

``record_many(configs)`` runs several in one spawned process (the fake accelerator's
registration is process-wide and for good); ``progress`` receives a line per stage.
"""

from __future__ import annotations

import contextlib
import os
import time
from unittest import mock

import torch
import torch.distributed as dist

from twinshard.measure import allocator, observe
from twinshard.measure.probe import Probe, sharded_modules
from twinshard.models import Llama
from twinshard.ranks import fresh_process

from . import checkpointing, ideal
from .labels import Labels
from .profiles import DEVICES
from .trace import StepTrace

aten = torch.ops.aten
MARKS = {"backward": ("backward", "root"), "optimizer": ("optimizer", "step")}  # phase labels
STEPS = 2  # the first initializes lazily and makes the optimizer's state; the second is timed
# and a third repeats it, for the parts of its peak (``trace.StepTrace.arm``)


def record(config, progress=print) -> dict:
    """The recorded second step of ``config`` (see the module docstring), as plain data."""
    started = time.perf_counter()
    cfg = config.llama()
    with torch.device("meta"):
        model = Llama(cfg)
    wrapped = checkpointing.apply(model, config.ac)
    params = sum(p.numel() for p in model.parameters())
    labels = Labels()
    progress(f"{config.impl}: sharding {params / 1e9:.2f}B parameters over {config.world}")

    def ready(trace, model, opt):
        labels.attach(model)
        trace.model, trace.optimizer = model, opt
        trace.modules = sharded_modules(model)

    def before(trace, k):
        progress(f"{config.impl}: step {k + 1} of {STEPS + 1}")
        if k == STEPS - 1:
            if config.probe:  # the recorded step's categories, not the first step's too
                trace.probe = Probe(trace.model, trace.optimizer, trace.modules)
            trace.start()
        elif k == STEPS:  # see StepTrace: the parts of the recorded step's peak
            trace.stop()
            trace.arm(trace.peak_operator)
            trace.probe = None

    trace, phases = observe.record(
        config,
        lambda device: StepTrace(device.type, labels),
        STEPS + 1,
        backend="fake" if config.cpu else "fakeaccel",
        real=config.real,
        watch=[_watch_waits],
        model=model,
        # the ideal step: the model without FSDP (ideal.py)
        build=(lambda d, _: ideal.build(config, d, model)) if config.impl == ideal.NAME else None,
        # foreach as twinshard bench leaves it: torch's choice (a CPU loop over parameters)
        optimizer=(config.optimizer, None if config.cpu else True),
        ready=ready,
        steps_in=lambda device: _steps_in(device, config.cpu),
        before=before,
        mark=lambda phase: labels.set(*MARKS[phase]),
    )
    limits = {name: d.capacity for name, d in DEVICES.items() if name != "cpu"}
    max_split = allocator.max_split_of(os.environ)  # the user's PYTORCH_CUDA_ALLOC_CONF
    log = trace.alloc_log
    reserved = allocator.summary(log, limits, max_split) if log is not None else None
    labels.remove()
    dist.destroy_process_group()
    recorded = phases[STEPS]
    return {
        "config": config.as_dict(),
        "model": {
            "params": params,
            "dim": cfg.dim,
            "layers": cfg.n_layers,
            "vocab": cfg.vocab_size,
            "checkpointed_blocks": wrapped,
        },
        "entries": trace.entries,
        "collectives": trace.collective_info,
        "flops": dict(trace.flops),
        "peak_bytes": recorded.peak_bytes,
        "start_bytes": recorded.start_bytes,
        "peak_host_bytes": recorded.peak_host_bytes,
        "parts": trace.parts_at_peak(),
        "allocator": reserved,  # the caching allocator's model over every step (None: CPU)
        "alloc_log": trace.alloc_log,  # what it replayed (``plan_published.py --fit`` again)
        "peak_label": getattr(trace, "peak_label", ""),
        "parts_step_bytes": trace.snapshot_bytes,  # the next step's at the same point
        "probe": dict(recorded.categories),
        "timeline": _thin(trace.timeline),
        "host_syncs": len(recorded.syncs),
        "explicit_syncs": len(recorded.explicit_syncs),
        "host_collectives": len(recorded.host_collectives),
        "record_s": time.perf_counter() - started,
    }


@contextlib.contextmanager
def _steps_in(device: torch.device, cpu: bool):
    """The flash-attention kernel while the steps run; the last step's graph let go after."""
    with _flash_attention(enabled=not cpu):
        yield
    _release_last_graph(device)


def _release_last_graph(device: torch.device) -> None:
    """A backward of nothing much, so that autograd's device thread lets go of the last
    step's graph: it holds it until its next one, and the implementations' end-of-backward
    callbacks in it are Python objects that the thread would otherwise free while the
    interpreter exits (which aborts the process)."""
    x = torch.ones(1, device=device, requires_grad=True)
    (x * 2).sum().backward()


def _watch_waits(trace: StepTrace):
    """Tell ``trace`` of every ``Work.wait()`` on the fake process group's work handles."""
    work_type = torch._C._distributed_c10d.FakeWork
    original = work_type.wait

    def wait(work, *args, **kwargs):
        trace.waited(work)
        return original(work, *args, **kwargs)

    return mock.patch.object(work_type, "wait", wait)


def _flash(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **kwargs):
    """``scaled_dot_product_attention`` as the flash-attention kernel (see the module
    docstring); the model passes no mask and no dropout."""
    if attn_mask is not None or dropout_p or kwargs:
        raise NotImplementedError("the plan's attention takes no mask, dropout or options")
    out = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, is_causal, False, scale=scale)
    return out[0]


def _flash_attention(enabled: bool):
    """``torch.nn.functional.scaled_dot_product_attention`` is ``_flash`` while the steps run.

    The function itself is swapped, in this process of the plan's own: a function mode would
    not do, as modes belong to a thread and activation checkpointing recomputes the forward
    in autograd's device thread, where the composite would run instead and the recomputed
    tensors would not match the saved ones."""
    if not enabled:
        return contextlib.nullcontext()
    return mock.patch.object(torch.nn.functional, "scaled_dot_product_attention", _flash)


def _thin(timeline: list, points: int = 4000) -> list:
    """At most about ``points`` samples of (entry, bytes, label), each bucket's highest kept."""
    if len(timeline) <= points:
        return timeline
    size = -(-len(timeline) // points)
    return [max(timeline[i : i + size], key=lambda s: s[1]) for i in range(0, len(timeline), size)]


def record_all(configs: list, progress: bool = True) -> list[dict]:
    """``record`` each of ``configs`` in this process; a failure is returned as its traceback."""
    import traceback

    say = (lambda line: print(f"plan: {line}", flush=True)) if progress else (lambda _: None)
    out = []
    for config in configs:
        try:
            out.append(record(config, say))
        except Exception:
            out.append({"config": config.as_dict(), "error": traceback.format_exc(limit=-30)})
        if dist.is_initialized():
            dist.destroy_process_group()
    return out


def record_many(configs: list, progress: bool = True, timeout: float = 3600) -> list[dict]:
    """``record_all`` in one freshly spawned process."""
    return fresh_process.call(record_all, list(configs), progress, timeout=timeout)
