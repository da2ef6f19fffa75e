"""Draw one training step of an FSDP implementation, hook by hook and collective by collective.

    twinshard schedule --impls reference --world 2 --out step.png --text step.txt
    twinshard schedule --impls reference,optimized --out both.png       # one picture, stacked
    twinshard schedule --impls torch --model mlp --layers 4 --compact
    twinshard schedule --impls optimized --world 64 --fake-accelerator   # no 64 ranks needed
    twinshard schedule --impls optimized --prefetch 2     # gather two blocks ahead

The example model (a tiny Llama from ``twinshard.models``, or ``--model mlp`` for the
MLPStack) is built, sharded block by block and then at the root, and stepped by
``twinshard.measure.step`` as every measuring command's is (``--param-dtype`` and
``--reduce-dtype`` are the job's mixed-precision dtypes, fp16 too; ``--prefetch N`` gives the
root and every block explicit prefetch lists of N blocks, ``step.prefetch``); it trains one
step so that an implementation that learns the order of its groups (the optimized path's
prefetch) knows it, and the second step is recorded on every rank; rank 0's record is printed
and drawn.
``--impls`` takes reference, optimized, torch, or any importable module with the
``fully_shard`` interface; the flags are those of every measuring command
(``twinshard.measure.flags``). ``--fake-accelerator`` records rank 0 of ``--world`` ranks in
one spawned process on the fake accelerator (``twinshard.measure.fakeaccel``): the accelerator's
schedule at any world size, with the sizes and memory of that world and no values.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.distributed as dist

from twinshard.commandline import impls
from twinshard.commandline.vocabulary import DTYPES
from twinshard.measure import flags, step
from twinshard.measure.job import Job
from twinshard.ranks import devices

from .record import Recorder
from .steps import Schedule
from .text import format_table

MODELS = ("tiny", "mlp")  # the tiny Llama (also "llama", its old name) and the MLPStack
EXAMPLE = dict(preset="tiny", seq=16, per_rank=2)  # the tiny Llama, 2 x 16 tokens per rank


def example(impl: str, world_size: int, layers: int = 3, **policies) -> Job:
    """The job of the example step: ``impl`` on ``world_size`` ranks, the tiny Llama with
    ``layers`` blocks (the MLPStack's count too), ``policies`` by ``Job``'s names
    (``reshard_after_forward``, ``prefetch``, ``param_dtype``, ``reduce_dtype``, ``backend``)."""
    return Job(impl=impl, world=world_size, model={"n_layers": layers}, **EXAMPLE, **policies)


def mlp(model: str, layers: int) -> torch.nn.Module | None:
    """The MLPStack for ``--model mlp`` (None for the Llama, which ``measure.step`` builds)."""
    from twinshard.models import MLPStack

    if model not in (*MODELS, "llama"):
        raise ValueError(f"unknown model {model!r}; use tiny or mlp")
    wanted = model == "mlp"
    return MLPStack(dim=15, hidden=37, n_blocks=layers, in_dim=8, out_dim=4) if wanted else None


def batch(job: Job, net, device: torch.device, rank: int | None = None):
    """One batch for ``net``: token ids for the Llama (``step.tokens``), a (B, in_dim) input
    for the MLPStack (``proj_in`` makes its blocks' inputs need grad)."""
    if hasattr(net, "config"):
        return step.tokens(job, net.config.vocab_size, rank, device)
    return (torch.randn(4, 8, device=device),)


def record_on_rank(impl: str, model: str = "tiny", layers: int = 3, **policies) -> Schedule:
    """Shard the example model with ``impl`` (``measure.step.build``), run one step, record
    the second one; ``policies``: ``example``'s."""
    job = example(impl, dist.get_world_size(), layers, **policies)
    device = devices.rank_device()
    net, opt = step.build(job, device, model=mlp(model, layers))
    return _record(job, net, opt, batch(job, net, device, dist.get_rank()))


def _record(job: Job, net, opt, batch) -> Schedule:
    step.train_step(net, opt, batch)  # the first step: lazy init, and the order of the groups
    recorder = Recorder(net, job.impl)
    with recorder:
        step.loss(net, batch).backward()
    recorder.remove()
    return recorder.schedule


def record_on_fake_accelerator(
    impls: list[str], world_size: int, model: str = "tiny", layers: int = 3, **policies
) -> list[Schedule]:
    """``record_on_rank`` for each of ``impls`` on the fake accelerator, as rank 0 of
    ``world_size`` ranks, in this process (which it makes an accelerator process for good:
    ``record_fake_steps`` spawns one), through the one recording loop (``measure.observe``)
    with no steps of its own: ``_record`` trains and records once the model is sharded. The
    model is built on ``meta`` and moved with ``to_empty`` (``measure.step.build_on_meta``):
    no values, so the recorder attributes collectives by size and context."""
    from twinshard.measure import observe

    schedules = []
    for impl in impls:
        job = example(impl, world_size, layers, backend="fakeaccel", **policies)
        with torch.device("meta"):
            net = mlp(model, layers)
        done = lambda *recorded: schedules.append(_record(*recorded))  # noqa: E731
        observe.record(job, None, 0, model=net, optimizer=("sgd", None), batch=batch, after=done)
    return schedules


def record_fake_steps(impls: list[str], world_size: int, **options) -> list[Schedule]:
    """``record_on_fake_accelerator`` in a freshly spawned process."""
    from twinshard.ranks import fresh_process

    return fresh_process.call(record_on_fake_accelerator, impls, world_size, timeout=600, **options)


def record_step(impl: str = "reference", world_size: int = 2, rank: int = 0, **options) -> Schedule:
    """Run ``record_on_rank`` on ``world_size`` local ranks; return ``rank``'s schedule."""
    from twinshard.ranks.launch import launch

    # Forking skips re-importing torch in every rank: a second or two each on a small machine.
    start = None if torch.cuda.is_available() else "fork"
    ranks = launch(record_on_rank, world_size, impl, start_method=start, timeout=120, **options)
    return ranks[rank]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = dict(impls="reference", model="tiny", world=2, layers=3, reshard="true")
    flags.add(parser, "impls", "model", "layers", "world", "reshard", "prefetch", **defaults)
    add, switch = parser.add_argument, "store_true"
    add("--param-dtype", choices=sorted(DTYPES), default=None)
    add("--reduce-dtype", choices=sorted(DTYPES), default=None)
    add("--out", default=None, help="write the timeline picture here (.png, .svg)")
    add("--text", default=None, help="write the text table here")
    add("--compact", action=switch, help="write a run of per-parameter collectives as one line")
    add("--quiet", action=switch, help="do not print the table")
    on_fake = "record rank 0 of --world ranks on the fake accelerator, in one process"
    add("--fake-accelerator", action=switch, help=on_fake)


def problem(args: argparse.Namespace) -> str | None:
    """What is wrong with the command line, in one line naming the flag, or None: said before
    any rank starts (as ``twinshard train`` does), not as a traceback from one of them."""
    model = "tiny" if args.model == "llama" else args.model
    if model not in MODELS:
        return f"--model {args.model!r}: twinshard schedule draws {' or '.join(MODELS)}"
    if args.world > 64 and not args.fake_accelerator:
        return f"--world {args.world}: too many processes here; add --fake-accelerator"
    backend = "fakeaccel" if args.fake_accelerator else "gloo"
    llama = argparse.Namespace(**{**vars(args), "model": "tiny"})  # the model is checked above
    return flags.problem(flags.jobs(llama, backend=backend))


def run(args: argparse.Namespace) -> int:
    wrong = problem(args)
    if wrong:
        print(f"twinshard schedule: error: {wrong}", file=sys.stderr)
        return 2
    job = flags.job(args)  # the example's policies, as ``record_on_rank`` takes them
    options = dict(model=args.model, layers=args.layers, param_dtype=args.param_dtype)
    options |= dict(reduce_dtype=args.reduce_dtype, reshard_after_forward=job.reshard_after_forward)
    options["prefetch"] = job.prefetch
    chosen = impls.names(args.impls)
    if args.fake_accelerator:
        schedules = record_fake_steps(chosen, job.world, **options)
    else:
        schedules = [record_step(impl, job.world, **options) for impl in chosen]
    text = "\n\n".join(format_table(s, compact=args.compact) for s in schedules)
    if not args.quiet:
        print(text)
    if args.text:
        with open(args.text, "w") as f:
            f.write(text + "\n")
    if args.out:
        from .timeline import plot_timeline

        plot_timeline(schedules, args.out)
        print(f"wrote {args.out}")
    return 0
