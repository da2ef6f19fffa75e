"""Draw one training step of an FSDP implementation, hook by hook and collective by collective.

    twinshard schedule --impls reference --world 2 --out step.png --text step.txt
    twinshard schedule --impls reference,optimized --out both.png       # one picture, stacked
    twinshard schedule --impls torch --model mlp --layers 4 --compact
    twinshard schedule --impls optimized --world 64 --fake-accelerator   # no 64 ranks needed

The example model (a tiny Llama from ``twinshard.models``, or ``--model mlp`` for the
MLPStack) is sharded block by block and then at the root, trained for one step so that an
implementation that learns the order of its groups (the optimized path's prefetch) knows it,
and the second step is recorded on every rank; rank 0's record is printed and drawn.
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

from twinshard import impls
from twinshard.measure import flags, step, world
from twinshard.measure.job import DTYPES

from .record import Recorder
from .steps import Schedule
from .text import format_table

MODELS = ("tiny", "mlp")  # the tiny Llama (also "llama", its old name) and the MLPStack


def build_model(model: str, layers: int) -> tuple[torch.nn.Module, tuple]:
    """The example model and one batch for it (the same on every rank: seeded)."""
    from twinshard.models import Llama, LlamaConfig, MLPStack

    torch.manual_seed(0)
    if model in ("tiny", "llama"):
        net = Llama(LlamaConfig.preset("tiny", n_layers=layers))
        tokens = torch.randint(0, net.config.vocab_size, (2, 16))  # (B, T)
        return net, (tokens, tokens.roll(-1, dims=1))
    if model == "mlp":
        net = MLPStack(dim=15, hidden=37, n_blocks=layers, in_dim=8, out_dim=4)
        return net, (torch.randn(4, 8),)  # (B, in_dim): proj_in makes the blocks' inputs need grad
    raise ValueError(f"unknown model {model!r}; use tiny or mlp")


def record_on_rank(
    impl: str,
    model: str = "llama",
    layers: int = 3,
    reshard_after_forward: bool | int = True,
    param_dtype: str | None = None,
    reduce_dtype: str | None = None,
) -> Schedule:
    """Shard the example model with ``impl``, run one step, record the second one."""
    net, batch = build_model(model, layers)
    _shard(impl, net, reshard_after_forward, param_dtype, reduce_dtype)
    return _record(impl, net, batch)


def _shard(impl: str, net, reshard_after_forward, param_dtype, reduce_dtype, mesh=None) -> None:
    module = impls.load(impl, "--impls", impls.MEASURED)
    mp = module.MixedPrecisionPolicy(
        param_dtype=DTYPES.get(param_dtype), reduce_dtype=DTYPES.get(reduce_dtype)
    )
    where = {} if mesh is None else {"mesh": mesh}
    for block in net.blocks:
        module.fully_shard(
            block, reshard_after_forward=reshard_after_forward, mp_policy=mp, **where
        )
    module.fully_shard(net, mp_policy=mp, **where)


def _record(impl: str, net, batch) -> Schedule:
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    step.loss(net, batch).backward()  # the first step: lazy init, and the order of the groups
    opt.step()
    opt.zero_grad()
    recorder = Recorder(net, impl)
    with recorder:
        step.loss(net, batch).backward()
    recorder.remove()
    return recorder.schedule


def record_on_fake_accelerator(impls: list[str], world_size: int, **options) -> list[Schedule]:
    """``record_on_rank`` for each of ``impls`` on the fake accelerator, as rank 0 of
    ``world_size`` ranks, in this process (which it makes an accelerator process for good:
    ``record_fake_steps`` spawns one). The model is built on ``meta`` and moved with
    ``to_empty``: no values, so the recorder attributes collectives by size and context."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.device_mesh import init_device_mesh

    from twinshard.measure.fakedevice import DEVICE_TYPE
    from twinshard.measure.monitor import Monitor

    world.join("fakeaccel", world_size)
    mesh = init_device_mesh(DEVICE_TYPE, (world_size,))
    schedules = []
    for impl in impls:
        with torch.device("meta"):
            net, batch = build_model(options.get("model", "llama"), options.get("layers", 3))
        shard_options = {k: options.get(k) for k in ("param_dtype", "reduce_dtype")}
        reshard = options.get("reshard_after_forward", True)
        # the monitor builds meshes on the host; see its [Note: meshes are built on the host]
        with FakeTensorMode(allow_non_fake_inputs=True), Monitor(DEVICE_TYPE):
            _shard(impl, net, reshard, mesh=mesh, **shard_options)
            net.to_empty(device=torch.device(DEVICE_TYPE, 0))
            batch = tuple(torch.empty_like(t, device=DEVICE_TYPE) for t in batch)
            schedules.append(_record(impl, net, batch))
    return schedules


def record_fake_steps(impls: list[str], world_size: int, **options) -> list[Schedule]:
    """``record_on_fake_accelerator`` in a freshly spawned process."""
    from twinshard import fresh_process

    return fresh_process.call(record_on_fake_accelerator, impls, world_size, timeout=600, **options)


def record_step(impl: str = "reference", world_size: int = 2, rank: int = 0, **options) -> Schedule:
    """Run ``record_on_rank`` on ``world_size`` local ranks; return ``rank``'s schedule."""
    from twinshard.launch import launch

    # Forking skips re-importing torch in every rank: a second or two each on a small machine.
    start = None if torch.cuda.is_available() else "fork"
    return launch(record_on_rank, world_size, impl, start_method=start, timeout=120, **options)[
        rank
    ]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = dict(impls="reference", model="tiny", world=2, layers=3, reshard="true")
    flags.add(parser, "impls", "model", "layers", "world", "reshard", **defaults)
    parser.add_argument("--param-dtype", choices=sorted(DTYPES), default=None)
    parser.add_argument("--reduce-dtype", choices=sorted(DTYPES), default=None)
    parser.add_argument("--out", default=None, help="write the timeline picture here (.png, .svg)")
    parser.add_argument("--text", default=None, help="write the text table here")
    parser.add_argument(
        "--compact",
        action="store_true",
        help="write a run of per-parameter collectives as one line",
    )
    parser.add_argument("--quiet", action="store_true", help="do not print the table")
    parser.add_argument(
        "--fake-accelerator",
        action="store_true",
        help="record rank 0 of --world ranks on the fake accelerator, in one process",
    )


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
    job = flags.job(args)
    options = dict(
        model=args.model,
        layers=args.layers,
        reshard_after_forward=job.reshard_after_forward,
        param_dtype=args.param_dtype,
        reduce_dtype=args.reduce_dtype,
    )
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
