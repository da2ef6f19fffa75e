"""The fake-accelerator run: one process plays one rank of a W-rank accelerator job.

``check(config)`` runs a ``measure.job.Job`` in this process twice: on the fake accelerator,
recorded as the memory predictor records it (``memory.record``: built on ``meta`` inside
``FakeTensorMode``, trained with SGD with momentum and ``foreach``, which reads no scalar on
the host), and on the CPU through the same loop with real tensors (no values) and PyTorch's
fake process group at the same world size (``twinshard bench --backend fake``'s code path),
for its collectives. It returns a plain dict (``report`` prints it): per step the host syncs
and explicit synchronizations with where they come from, the collectives with host tensors,
the collectives and whether they equal the CPU run's, the accelerator's peak bytes, and the
memory predictor's figures of the last step (``memory.prediction``).

``run(configs)`` spawns one fresh process for many configurations (the registration cannot
be undone, and a test session must not get an accelerator); ``plant(model)`` is called on
every model before its steps: the checks' own tests plant a hazard with it
(``tests/support/fake_accelerator_hazards.py``).
"""

from __future__ import annotations

import contextlib
import traceback
from collections import Counter
from dataclasses import replace

import torch
import torch.distributed as dist

from twinshard.measure import memory, observe, step
from twinshard.measure.fakedevice import backend_name
from twinshard.measure.job import Job
from twinshard.measure.monitor import Phase
from twinshard.ranks import fresh_process

STEPS = 2  # the first step initializes lazily; the second is the steady state


def check(
    config: Job,
    steps: int = STEPS,
    cpu: bool = True,
    plant=None,
    on: str = "fake",
) -> dict:
    """Both runs of ``config`` in this process (see the module docstring); a failure of the
    implementation is reported under "error" with its traceback, not raised. ``on``: "fake"
    (the fake accelerator) or a real device type, for the same checks on a lent GPU
    (``device_run``)."""
    config = replace(config, foreach=True)
    result = {"config": config.as_dict(), "on": on}
    try:
        if on == "fake":
            monitor, phases = memory.record(config, steps, plant)
        else:
            monitor, phases = device_run(config, steps, on, plant)
    except Exception:  # the implementation failed on the device: that is the finding
        result["error"] = traceback.format_exc(limit=-40)
        return result
    result["steps"] = [_summary(p) for p in phases[1:]]
    result["setup"] = _summary(phases[0])
    result["memory"] = memory.prediction(monitor, phases)
    if cpu:
        try:
            reference = cpu_run(config, steps, plant)
        except Exception:
            result["cpu_error"] = traceback.format_exc(limit=-40)
            return result
        mine = [[c.key() for c in p.collectives] for p in phases[1:]]
        result["cpu_collectives"] = [len(calls) for calls in reference]
        result["collective_difference"] = first_difference(mine, reference)
    return result


def check_all(configs: list, **options) -> list[dict]:
    """``check`` each of ``configs`` in this process with ``options``; an item may also be a
    pair (config, options of its own), such as ``(config, {"plant": planter("item")})``."""
    results = []
    for item in configs:
        config, own = item if isinstance(item, tuple) else (item, {})
        results.append(check(config, **{**options, **own}))
    return results


def run(configs: list, timeout: float = 900, **options) -> list[dict]:
    """``check_all`` in one freshly spawned process; the results in order."""
    return fresh_process.call(check_all, list(configs), timeout=timeout, **options)


# --- the runs besides -----------------------------------------------------------------------------
def device_run(config: Job, steps: int, device_type: str, plant=None) -> tuple:
    """The same checks on a real accelerator, for the day one is lent (``benchmarks/gpu.sh``):
    real tensors on ``device_type`` and the fake process group registered for it alone
    (``measure.world``'s ``lent``), so that one GPU plays rank 0 of W and a host tensor in a
    collective fails as on NCCL. The model is built from the seed on the host and moved to the
    device before sharding, as ``twinshard bench`` does (with offload it stays on the host).
    The steps run under the device module's sync debug mode ("error": the device's own check,
    which raises at the first operator that waits for the device), so a sync the monitor
    cannot see (inside a C++ kernel) still fails the run. The monitor and its phases, setup
    first."""
    module = torch.get_device_module(device_type)
    if device_type == "cpu" or not module.is_available():
        raise RuntimeError(
            f"twinshard.measure.fakeaccel: no {device_type!r} device here; run the checks on "
            "the fake accelerator instead (on='fake', or --device fake)"
        )
    debug = getattr(module, "set_sync_debug_mode", lambda mode: None)

    @contextlib.contextmanager
    def checked(device):  # the steps under the device's own check
        debug("error")
        try:
            yield
        finally:
            debug(0)
            module.synchronize()

    named = replace(config, backend=backend_name(device_type))
    build = lambda device, mesh: step.build(named, device, on=mesh)  # noqa: E731
    where = dict(backend="lent", device_type=device_type, real=True, build=build, steps_in=checked)
    return memory.record(config, steps, plant, **where)


def cpu_run(config: Job, steps: int, plant=None) -> list[list[tuple]]:
    """The collectives of each step of the same configuration on the CPU (real tensors, the
    fake process group: the same loop, ``observe.record``, joined there), as
    ``Collective.key()`` tuples."""
    ready = (lambda monitor, model, opt: plant(model)) if plant is not None else None
    cpu = replace(config, backend="fake")
    _, phases = observe.record(cpu, None, steps, backend="fake", real=True, ready=ready)
    dist.destroy_process_group()
    return [[c.key() for c in p.collectives] for p in phases[1:]]


# --- summaries -----------------------------------------------------------------------------------
def _sites(items) -> list[dict]:
    """Identical (what, stack) pairs counted once, most frequent first."""
    counts = Counter(items)
    return [{"what": w, "stack": list(s), "count": n} for (w, s), n in counts.most_common()]


def _summary(phase: Phase) -> dict:
    by_op: dict[str, list[int]] = {}
    for c in phase.collectives:
        entry = by_op.setdefault(c.op, [0, 0])
        entry[0] += 1
        entry[1] += c.numel
    return {
        "name": phase.name,
        "host_syncs": len(phase.syncs),
        "sync_sites": _sites((f"{s.kind}: {s.op}", s.stack) for s in phase.syncs),
        "explicit_syncs": len(phase.explicit_syncs),
        "explicit_sites": _sites((w, tuple(s)) for w, s in phase.explicit_syncs),
        "host_collectives": len(phase.host_collectives),
        "host_collective_sites": _sites(
            (f"{c.op} of {c.dtype} x{c.numel}", s) for c, s in phase.host_collectives
        ),
        "collectives": len(phase.collectives),
        "collectives_by_op": {op: {"count": n, "numel": e} for op, (n, e) in by_op.items()},
        "peak_bytes": phase.peak_bytes,
        "peak_host_bytes": phase.peak_host_bytes,
        "categories": phase.categories,
    }


def first_difference(mine: list[list], theirs: list[list]) -> str | None:
    """None if every step issued the same collectives in both runs, else the first that
    differs, named as (op, dtype, elements, group size, ranks)."""
    for number, (a, b) in enumerate(zip(mine, theirs), 1):
        if a == b:
            continue
        i = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        first = a[i][:4] if i < len(a) else "nothing"
        other = b[i][:4] if i < len(b) else "nothing"
        return (
            f"step {number}, collective #{i}: {first} on the fake accelerator, {other} on the "
            f"CPU ({len(a)} against {len(b)} collectives)"
        )
    if len(mine) != len(theirs):
        return f"{len(mine)} steps on the fake accelerator, {len(theirs)} on the CPU"
    return None
