"""The job a ``twinshard bench`` command line describes, and the side-by-side run of it.

``job_of(args)`` fills what the flags left open with the defaults of the mode (compare,
hooks, sweep) and returns the base job and the implementations; ``problem`` says what is
wrong with them in one line (``Job.problem``, then what only the bench checks);
``side_by_side`` runs the implementations and summarizes them; ``add_memory_model`` puts the
memory predictor's figures (``measure.memory``) beside the measured ones.
"""

from __future__ import annotations

from dataclasses import replace

from twinshard.commandline import impls as implementations
from twinshard.measure import flags, simnet
from twinshard.measure.fakeaccel.runner import run as on_fake_accelerator
from twinshard.measure.job import BASELINES, SHARDED, Job, positive

from .runner import compare
from .stats import add_overlap, add_ratios, summarize

# What each mode runs unless told otherwise (the Job's defaults besides).
DEFAULTS = {
    "compare": dict(impls=",".join(BASELINES + SHARDED)),
    # tiny blocks, so that compute is negligible and the hooks' own CPU time shows; the
    # optimizer as on an accelerator, the setting this mode stands for: multi-tensor
    # operations, not the CPU's loop of DTensor dispatches per parameter
    "hooks": dict(
        preset="tiny", backend="fake", world=8, seq=8, per_rank=1, steps=40, foreach=True
    ),
    "sweep": dict(preset="tiny", backend="simnet", world=8, seq=32, per_rank=2, steps=8),
}
DEFAULTS["hooks"]["model"] = dict(n_layers=64, dim=32, n_heads=2, n_kv_heads=2, vocab_size=128)
for mode in ("hooks", "sweep"):
    DEFAULTS[mode]["impls"] = "plain,reference,optimized,torch"


def job_of(args) -> tuple[Job, list[str]]:
    """The base job of ``args`` (its mode's defaults where a flag is absent) and the
    implementations to run it with."""
    fixed = dict(DEFAULTS[args.mode])
    names = implementations.names(args.impls or fixed.pop("impls"))
    fixed.pop("impls", None)
    if args.backend or (args.device == "cuda" and "backend" not in fixed):
        fixed["backend"] = args.backend or "nccl"
    if args.foreach:
        fixed["foreach"] = {"auto": None, "on": True, "off": False}[args.foreach]
    own = dict(
        device=args.device,
        warmup=args.warmup,
        link=args.link,
        latency_us=args.latency_us,
        memory=not args.no_memory,
        profile=args.profile,
    )
    if args.steps is not None:
        own["steps"] = args.steps
    return flags.job(args, **{**fixed, **own}), names


def problem(args, base: Job, names: list[str]) -> str | None:
    """The first thing wrong with the bench's jobs or its own flags, or None."""
    wrong = positive("--repeat", args.repeat)
    if wrong or not names:
        return wrong or implementations.problem("", "--impls")
    if base.backend == "fakeaccel":  # runs the FSDP implementations among them only
        names = [name for name in names if name not in BASELINES]
        if not names:
            return "--backend fakeaccel runs FSDP implementations only (not plain or ddp)"
    wrong = flags.problem([replace(base, impl=name) for name in names], baselines=True)
    if wrong or base.backend != "simnet":
        return wrong
    try:
        simnet.parse_link(base.link, base.latency_us)
    except ValueError as error:
        return str(error)
    return None


def side_by_side(
    base: Job, impls: list[str], repeat: int, progress: bool = True, overlap: bool = True
) -> dict:
    """Run ``impls`` on ``base`` and summarize: figures, ratios, overlap (``simnet``: the same
    runs on an instant network too)."""
    configs = [replace(base, impl=i) for i in impls]
    instant = []
    if overlap and base.backend == "simnet" and base.link != "inf":
        instant = [replace(c, link="inf", memory=False) for c in configs]
    runs = compare(configs + instant, repeat, progress)
    tokens = base.per_rank * base.seq * base.world
    summary = {c.impl: summarize(r, tokens) for c, r in zip(configs, runs)}
    add_ratios(summary)
    if instant:
        fast = {c.impl: summarize(r, tokens) for c, r in zip(instant, runs[len(configs) :])}
        add_overlap(summary, fast)
    return {"summary": summary, "runs": {c.impl: r for c, r in zip(configs, runs)}}


def add_memory_model(summaries: list[tuple[dict, Job]]) -> None:
    """Beside each FSDP implementation's row of each (summary, its base job) pair, the memory
    predictor's figures for that job (``measure.memory``: ``model``, bytes by category at the
    peak, ``model_total``, ``model_reserved``, the caching allocator's reserved peak), from the
    fake accelerator's run of every such job in one spawned process. A baseline (plain, DDP),
    which the fake accelerator does not run, gets none; nor does a job whose step failed there."""
    rows = []
    for summary, base in summaries:
        rows += [(row, replace(base, impl=n)) for n, row in summary.items() if n not in BASELINES]
    for (row, _), result in zip(rows, on_fake_accelerator([job for _, job in rows], cpu=False)):
        if "memory" in result:
            predicted = result["memory"]
            row.update(model=predicted["categories"], model_total=predicted["fsdp_total"])
            row["model_reserved"] = predicted["reserved_peak"]
