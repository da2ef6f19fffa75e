"""A recorded step as the plan's answer: memory, communication and time, per rank.

``summarize(recorded, device, network)`` turns one ``runner.record`` result into plain data:
memory from ``trace.StepTrace.parts_at_peak``, the caching allocator's model
(``measure.allocator``: reserved bytes) and ``profiles.DEVICES`` (whether it fits),
communication from ``replay.per_link``, time and MFU from ``replay.replay``.
``add_ideal(row, ideal_s)`` adds the job's ideal step (``ideal.py``) and the FSDP overhead,
the planned step minus the ideal; ``add_ratios(rows)`` adds each implementation's step time,
peak and overhead against torch's.

What each figure is: docs/plan.md, "What it reports, per rank".
"""

from __future__ import annotations

from .profiles import BF16, DEVICES, FP32
from .replay import per_link, replay


def summarize(recorded: dict, device, network) -> dict:
    """The plan of one recorded step (see the module docstring)."""
    config = recorded["config"]
    cpu = config["device"] == "cpu"
    timed = replay(recorded, device, network, cpu)
    tokens = config["per_rank"] * config["seq"]
    flops = recorded["flops"]
    useful = flops.get("forward", 0) + flops.get("backward", 0)
    dtype = BF16 if config["dtype"] == "bf16" else FP32
    step = timed["step_s"]
    peak = recorded["peak_bytes"]
    allocator = recorded.get("allocator")  # the caching allocator's model; None on the CPU
    fits = {name: peak <= d.capacity for name, d in DEVICES.items()}
    if allocator is not None:  # by reserved bytes, as an out-of-memory error decides
        fits = {
            name: allocator["fits"].get(name, {"fits": ok})["fits"] for name, ok in fits.items()
        }
    return {
        "config": config,
        "model": recorded["model"],
        "memory": {
            "peak_bytes": peak,
            "parts": recorded["parts"],
            "peak_at": recorded["peak_label"],
            "host_peak_bytes": recorded["peak_host_bytes"],
            "reserved_bytes": allocator["segments"]["reserved_peak"] if allocator else None,
            "allocator": allocator,
            "fits": fits,
            "probe": recorded["probe"],
        },
        "communication": per_link(recorded, network),
        "time": {
            **timed,
            "tokens_per_s": tokens / step if step else 0.0,
            "flops": dict(flops),
            "mfu": useful / step / device.peak(dtype) if step and not cpu else None,
        },
        "network": network.name,
        "device": device.name,
        "record_s": recorded["record_s"],
        "host_syncs": recorded["host_syncs"],
    }


def add_ideal(row: dict, ideal_s: float) -> None:
    """The ideal step of ``row``'s job (seconds) and ``row``'s FSDP overhead over it."""
    row["time"]["ideal_s"] = ideal_s
    row["time"]["overhead_s"] = row["time"]["step_s"] - ideal_s


def add_ratios(rows: dict) -> None:
    """Step time, peak memory and (where the ideal is known) FSDP overhead of each
    implementation over torch's (if torch ran)."""
    base = rows.get("torch")
    if base is None or "error" in base:
        return
    for row in rows.values():
        if "error" in row:
            continue
        row["vs_torch"] = {
            "step_time": row["time"]["step_s"] / base["time"]["step_s"],
            "peak_memory": row["memory"]["peak_bytes"] / base["memory"]["peak_bytes"],
        }
        overhead, base_overhead = row["time"].get("overhead_s"), base["time"].get("overhead_s")
        if overhead is not None and base_overhead:
            row["vs_torch"]["fsdp_overhead"] = overhead / base_overhead
