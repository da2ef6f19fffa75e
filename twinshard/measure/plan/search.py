"""``twinshard plan --search``: the fastest setting of a job that fits its device, and why each
other one lost.

The settings searched are every combination of activation checkpointing (``AC``), sequences per
rank (``PER_RANK``), ``reshard_after_forward`` (True, False) and, on more than one node, HSDP
with one replica per node of 8 ranks beside plain FSDP. A setting fits when its reserved peak
(the caching allocator's model, ``measure/allocator.py``, plain segments: PyTorch's default) is
at most the device's capacity; the fastest is the one with the most tokens per second per rank.

Recording every setting at the model's depth would take an hour for an 8B model on this
machine. A model's blocks are alike: each adds the same compute, communication and memory, so
each setting is recorded at two small depths (``DEPTHS`` blocks, in one spawned process) and
its step time and reserved peak are extrapolated in a straight line to the model's depth; the
winner is then recorded at full depth, and that recording is what the answer reports (with the
extrapolation beside it, as a check of the method).
"""

from __future__ import annotations

import itertools
from dataclasses import replace

from twinshard.measure.job import Job
from twinshard.measure.units import GiB, markdown_table

AC = ("none", "selective", "layer:2", "block")
PER_RANK = (1, 2, 4)
DEPTHS = (2, 3)  # blocks recorded per setting, extrapolated to the model's depth


def settings(base: Job) -> list[Job]:
    """Every setting searched for ``base`` (see the module docstring)."""
    replicas = [1] + ([base.world // 8] if base.world > 8 and base.world % 8 == 0 else [])
    grid = itertools.product(AC, PER_RANK, (True, False), replicas)
    return [
        replace(base, ac=ac, per_rank=n, reshard_after_forward=after, replicas=r)
        for ac, n, after, r in grid
    ]


def describe(job: Job) -> str:
    mesh = f"HSDP {job.replicas}x{job.world // job.replicas}" if job.replicas > 1 else "FSDP"
    after = "reshard" if job.reshard_after_forward is True else "keep"
    return f"ac {job.ac}, {job.per_rank} x {job.seq} tokens, {after} after forward, {mesh}"


def at_depth(job: Job, blocks: int) -> Job:
    return replace(job, model={**job.model, "n_layers": blocks})


def extrapolate(shallow: list[dict], depths: tuple, blocks: int) -> dict:
    """Step seconds and reserved bytes at ``blocks`` from the rows recorded at ``depths``."""
    (a, b), (ra, rb) = depths, shallow
    line = lambda va, vb: va + (vb - va) * (blocks - a) / (b - a)  # noqa: E731
    step = line(ra["time"]["step_s"], rb["time"]["step_s"])
    reserved = line(ra["memory"]["reserved_bytes"], rb["memory"]["reserved_bytes"])
    return {"step_s": step, "reserved_bytes": reserved}


def search(base: Job, blocks: int, plan_fn, progress: bool = True) -> dict:
    """Search ``base``'s settings for a model of ``blocks`` blocks (``plan_fn``: ``cli.plan``,
    which records and summarizes a list of jobs); the ranked settings, the winner's full-depth
    row and the device's capacity."""
    from .profiles import DEVICES

    capacity = DEVICES[base.device].capacity
    jobs = settings(base)
    shallow = plan_fn([at_depth(j, d) for j in jobs for d in DEPTHS], progress, ideal=False)
    ranked = []
    for i, job in enumerate(jobs):
        rows = shallow[2 * i : 2 * i + 2]
        if any("error" in r for r in rows):
            error = next(r["error"] for r in rows if "error" in r).strip().splitlines()[-1]
            ranked.append({"job": job, "error": error})
            continue
        guess = extrapolate(rows, DEPTHS, blocks)
        tokens = job.per_rank * job.seq / guess["step_s"]
        fits = guess["reserved_bytes"] <= capacity
        ranked.append({"job": job, **guess, "tokens_per_s": tokens, "fits": fits})
    ranked.sort(key=lambda r: (not r.get("fits", False), -r.get("tokens_per_s", 0)))
    best = ranked[0] if ranked and ranked[0].get("fits") else None
    confirmed = None
    if best is not None:
        (confirmed,) = plan_fn([at_depth(best["job"], blocks)], progress, ideal=False)
    for r in ranked:
        r["why"] = _why(r, best, capacity)
    return {"ranked": ranked, "best": best, "confirmed": confirmed, "capacity": capacity}


def _why(r: dict, best: dict | None, capacity: int) -> str:
    if "error" in r:
        return f"failed: {r['error']}"
    if not r["fits"]:
        return f"does not fit: {r['reserved_bytes'] / GiB:.1f} GiB reserved > {capacity / GiB:.0f}"
    if r is best:
        return "fastest that fits"
    return f"slower: {r['tokens_per_s'] / best['tokens_per_s']:.3f} of the fastest"


def format_search(found: dict, base: Job, blocks: int, shown: int = 8) -> str:
    """The search's answer as markdown: the winner (confirmed at full depth), then the next
    settings and why each lost."""
    lines = [f"Search over {len(found['ranked'])} settings, {blocks} blocks (extrapolated from "
             f"{DEPTHS[0]} and {DEPTHS[1]}), {base.world} ranks, {base.device}:", ""]  # fmt: skip
    best, confirmed = found["best"], found["confirmed"]
    if best is None:
        lines.append("No setting fits the device.")
    elif confirmed is not None and "error" not in confirmed:
        step = confirmed["time"]["step_s"]
        reserved = confirmed["memory"]["reserved_bytes"]
        lines.append(
            f"**Fastest that fits: {describe(best['job'])}**: recorded at full depth, "
            f"{best['job'].per_rank * base.seq / step:,.0f} tokens/s per rank, step "
            f"{step * 1e3:.1f} ms, {reserved / GiB:.1f} GiB reserved (extrapolated: "
            f"{best['tokens_per_s']:,.0f} tokens/s, {best['reserved_bytes'] / GiB:.1f} GiB)"
        )
    rows = [
        [
            describe(r["job"]),
            f"{r['tokens_per_s']:,.0f}" if "tokens_per_s" in r else "-",
            f"{r['reserved_bytes'] / GiB:.1f}" if "reserved_bytes" in r else "-",
            r["why"],
        ]
        for r in found["ranked"][:shown]
    ]
    header = ["setting", "tokens/s per rank", "reserved GiB", "why"]
    return "\n".join([*lines, "", markdown_table(header, rows, "lrrl")])


def plot_search(found: dict, path: str) -> None:
    """Tokens per second against reserved memory, a point per setting, the device's capacity
    drawn, the winner marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    ok = [r for r in found["ranked"] if "error" not in r]
    for fits, colour in ((True, "tab:blue"), (False, "tab:red")):
        points = [r for r in ok if r["fits"] is fits]
        ax.scatter(
            [r["reserved_bytes"] / GiB for r in points],
            [r["tokens_per_s"] for r in points],
            c=colour,
            label="fits" if fits else "does not fit",
        )
    ax.axvline(found["capacity"] / GiB, color="black", linestyle="--", label="device capacity")
    if found["best"] is not None:
        b = found["best"]
        ax.scatter([b["reserved_bytes"] / GiB], [b["tokens_per_s"]], s=200, facecolors="none",
                   edgecolors="green", label="fastest that fits")  # fmt: skip
    ax.set_xlabel("reserved memory per rank (GiB)")
    ax.set_ylabel("tokens/s per rank")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
