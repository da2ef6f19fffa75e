"""``twinshard plan --search``: the fastest setting of a job that fits its device, and why each
other one lost.

The settings searched are every combination of activation checkpointing (``AC``), sequences per
rank (``PER_RANK``), ``reshard_after_forward`` (True, False) and, on more than one node, HSDP
with one replica per node of 8 ranks beside plain FSDP. A setting fits when its reserved peak
(the caching allocator's model, ``measure/allocator.py``, plain segments: PyTorch's default) is
at most the device's capacity; the fastest is the one with the most tokens per second per rank.

Recording every setting at the model's depth would take an hour for an 8B model on this
machine. A model's blocks are alike: each adds the same compute, communication and memory, so
each setting is recorded at two small depths (``DEPTHS`` blocks, in ``WORKERS`` spawned
processes at once) and its step time and reserved peak are extrapolated in a straight line to
the model's depth. The line is a guess: the peak moves with depth (from the logits' buffers at
two blocks to the activations of every block at the start of backward), so the ``CONFIRM``
fastest guesses that fit are recorded at full depth, and the fastest of those recordings that
fits wins; the table shows recorded figures where there are some, the guess beside them.
"""

from __future__ import annotations

from twinshard.measure import grid
from twinshard.measure.job import Job
from twinshard.measure.units import GiB, markdown_table

AC = ("none", "selective", "layer:2", "block")
PER_RANK = (1, 2, 4)
DEPTHS = (2, 4)  # blocks recorded per setting (even: layer:2 checkpoints half of each)
CONFIRM = 3  # the fastest settings that fit, recorded at full depth; the best of them wins
WORKERS = 2  # processes recording at once (one per core here)


def settings(base: Job) -> list[Job]:
    """Every setting searched for ``base`` (see the module docstring)."""
    replicas = [1] + ([base.world // 8] if base.world > 8 and base.world % 8 == 0 else [])
    axes = dict(ac=AC, per_rank=PER_RANK, reshard_after_forward=(True, False), replicas=replicas)
    return grid.jobs(base, axes)


def describe(job: Job) -> str:
    mesh = f"HSDP {job.replicas}x{job.world // job.replicas}" if job.replicas > 1 else "FSDP"
    after = "reshard" if job.reshard_after_forward is True else "keep"
    return f"ac {job.ac}, {job.per_rank} x {job.seq} tokens, {after} after forward, {mesh}"


def at_depth(job: Job, blocks: int) -> Job:
    return grid.at(job, {"n_layers": blocks})


def extrapolate(shallow: list[dict], depths: tuple, blocks: int) -> dict:
    """Step seconds and reserved bytes at ``blocks`` from the rows recorded at ``depths``."""
    (a, b), (ra, rb) = depths, shallow
    line = lambda va, vb: va + (vb - va) * (blocks - a) / (b - a)  # noqa: E731
    step = line(ra["time"]["step_s"], rb["time"]["step_s"])
    reserved = line(ra["memory"]["reserved_bytes"], rb["memory"]["reserved_bytes"])
    return {"step_s": step, "reserved_bytes": reserved}


def in_parallel(plan_fn, jobs: list, progress: bool) -> list[dict]:
    """``plan_fn(jobs)`` split over ``WORKERS`` processes recording at once, rows in order."""
    from concurrent.futures import ThreadPoolExecutor

    parts = [jobs[i::WORKERS] for i in range(WORKERS)]
    with ThreadPoolExecutor(WORKERS) as pool:
        done = list(pool.map(lambda part: plan_fn(part, progress, ideal=False), parts))
    rows = [None] * len(jobs)
    for i, part_rows in enumerate(done):
        rows[i::WORKERS] = part_rows
    return rows


def search(base: Job, blocks: int, plan_fn, progress: bool = True) -> dict:
    """Search ``base``'s settings for a model of ``blocks`` blocks (``plan_fn``: ``cli.plan``,
    which records and summarizes a list of jobs); the ranked settings, the winner (the fastest
    of the ``CONFIRM`` best guesses that fit, recorded at full depth) and the device's
    capacity."""
    from .profiles import DEVICES

    capacity = DEVICES[base.device].capacity
    jobs = settings(base)
    shallow = in_parallel(plan_fn, [at_depth(j, d) for j in jobs for d in DEPTHS], progress)
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
    guesses = [r for r in ranked if r.get("fits")][:CONFIRM]
    full = in_parallel(plan_fn, [at_depth(r["job"], blocks) for r in guesses], progress)
    for r, row in zip(guesses, full):
        if "error" not in row:
            r["guess"] = {k: r[k] for k in ("step_s", "reserved_bytes", "tokens_per_s")}
            r["step_s"], r["reserved_bytes"] = (
                row["time"]["step_s"],
                row["memory"]["reserved_bytes"],
            )
            r["tokens_per_s"] = r["job"].per_rank * r["job"].seq / r["step_s"]
            r["fits"], r["row"] = r["reserved_bytes"] <= capacity, row
    ranked.sort(key=lambda r: (not r.get("fits", False), "row" not in r, -r.get("tokens_per_s", 0)))
    best = ranked[0] if ranked and ranked[0].get("fits") and "row" in ranked[0] else None
    confirmed = best["row"] if best is not None else None
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
    share = r["tokens_per_s"] / best["tokens_per_s"]
    if "row" not in r:
        return f"guessed {share:.3f} of the fastest; not among the {CONFIRM} recorded in full"
    return f"slower: {share:.3f} of the fastest"


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
            f"{best['guess']['tokens_per_s']:,.0f} tokens/s, "
            f"{best['guess']['reserved_bytes'] / GiB:.1f} GiB)"
        )
    rows = [
        [
            describe(r["job"]),
            f"{r['tokens_per_s']:,.0f}" if "tokens_per_s" in r else "-",
            f"{r['reserved_bytes'] / GiB:.1f}" if "reserved_bytes" in r else "-",
            "recorded" if "row" in r else "extrapolated",
            r["why"],
        ]
        for r in found["ranked"][:shown]
    ]
    header = ["setting", "tokens/s per rank", "reserved GiB", "from", "why"]
    return "\n".join([*lines, "", markdown_table(header, rows, "lrrll")])


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
