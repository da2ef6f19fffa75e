"""The command line of ``twinshard train``: every flag, its help text and its default.

A flag left out is ``None`` after parsing, never its default: ``config.resolve`` fills it in
from ``DEFAULTS`` for a new run, or from the checkpoint on ``--resume``, so that a resumed run
keeps the settings it was started with unless the command line changes them.

[Note: train speaks the measuring commands' vocabulary]
A concept that ``twinshard train`` shares with ``twinshard bench``, ``schedule``, ``plan`` and
the fake accelerator is spelled as ``twinshard.commandline.vocabulary.VOCABULARY`` spells it
(``SHARED`` says which), with that help text where the meaning is the same; train takes its
words from there, not from the measuring package. The argparse dest stays the one
train always had (``impl``, ``nproc``, ``preset``, ``n_layers``, ``n_heads``, ``seq_len``,
``cpu_offload``), so ``DEFAULTS``, ``FIXED``, the checkpoint's remembered settings and resume
are unchanged, and a checkpoint written under the old spellings resumes. The old spellings still
parse and print ``note: OLD is now NEW`` on stderr. Four concepts keep train's own meaning:
``--impls`` names exactly one implementation (train trains one), ``--model`` only a preset
(train cannot build a published model or a config.json), ``--world`` is the ranks started
locally (torchrun's world wins under torchrun), and ``--hsdp`` is a switch (the replicas are
the nodes; the measuring commands take their count). ``--batch-size`` is the global batch,
not the vocabulary's ``--per-rank``, and ``--param-dtype``/``--reduce-dtype`` set what the
vocabulary's one ``--dtype`` couples, so they stay train's own.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from twinshard.commandline import impls
from twinshard.commandline.vocabulary import DTYPES, VOCABULARY, Renamed
from twinshard.models import PRESETS
from twinshard.ranks.watchdog import DEFAULT_HANG_TIMEOUT

from .data import BUILTIN

DEFAULT_LR = {"tiny": 3e-3, "small": 1e-3, "medium": 6e-4, "1b": 3e-4}
# Defaults of the options that a resumed run otherwise takes from its checkpoint.
DEFAULTS: dict[str, Any] = dict(
    impl="optimized",
    preset="tiny",
    dim=None,
    n_layers=None,
    n_heads=None,
    data=BUILTIN,
    seq_len=128,
    batch_size=32,
    grad_accum=1,
    steps=500,
    lr=None,
    min_lr=None,
    warmup=None,
    weight_decay=0.1,
    clip_norm=1.0,
    param_dtype="fp32",
    reduce_dtype=None,
    cpu_offload=False,
    variants="",
    seed=0,
    checkpoint_every=100,
    keep=2,
    log_every=25,
    sample_length=160,
    eval_batches=4,
)
# Options that define the run: a resumed run must keep them (its checkpoint would not fit).
FIXED = ("seq_len", "seed", "lr", "min_lr", "warmup", "weight_decay")
# A concept of the measuring commands' VOCABULARY -> (train's dest, train's old spellings);
# see [Note: train speaks the measuring commands' vocabulary].
SHARED = {
    "impls": ("impl", ("--impl",)),
    "world": ("nproc", ("--nproc",)),
    "model": ("preset", ("--preset",)),
    "dim": ("dim", ()),
    "layers": ("n_layers", ("--n-layers",)),
    "heads": ("n_heads", ("--n-heads",)),
    "seq": ("seq_len", ("--seq-len",)),
    "offload": ("cpu_offload", ("--cpu-offload",)),
    "hsdp": ("hsdp", ()),
    "variants": ("variants", ()),
}
_SPELLING = {dest: VOCABULARY[concept][0] for concept, (dest, _) in SHARED.items()}


def flag(dest: str) -> str:
    """How the command line spells the option stored in ``dest`` (for messages)."""
    return _SPELLING.get(dest, "--" + dest.replace("_", "-"))


class RenamedSwitch(argparse.BooleanOptionalAction):
    """A switch with its ``--no-`` form whose old spellings (``--no-`` ones too) still work and
    say on stderr what replaces them, as ``Renamed`` does for a flag with a value."""

    def __call__(self, parser, namespace, values, option_string=None):
        new = self.option_strings[1 if option_string.startswith("--no-") else 0]
        if option_string != new:
            print(f"note: {option_string} is now {new}", file=sys.stderr)
        super().__call__(parser, namespace, values, option_string)


def _one_impl(text: str) -> str:
    """``--impls`` of train: one name; a list is refused, naming the flag."""
    names = impls.names(text)
    if len(names) > 1:
        raise argparse.ArgumentTypeError(
            f"train takes one implementation, got {len(names)} ({text}); name one "
            "(twinshard bench --impls compares several)"
        )
    return text.strip()


def _trainable(name: str) -> str:
    """``--model`` of train: one of its presets, the models it can build and train."""
    if name not in PRESETS:
        raise argparse.ArgumentTypeError(
            f"train builds one of its presets ({', '.join(PRESETS)}), not {name!r}: a "
            "published model or a config.json can be planned (twinshard plan --model), "
            "not trained"
        )
    return name


def _shared(group, concept: str, text: str, **kwargs) -> None:
    """Add the flag of ``concept`` under the vocabulary's spelling, train's dest and train's old
    spellings (which print a note), with ``text`` as its help."""
    spelling = VOCABULARY[concept][0]
    dest, old = SHARED[concept]
    if kwargs.get("action") is None and "type" in kwargs:
        kwargs |= {"action": Renamed, "metavar": spelling[2:].replace("-", "_").upper()}
    group.add_argument(spelling, *old, dest=dest, help=text, **kwargs)


def _same(concept: str, more: str = "") -> str:
    """The vocabulary's help text of ``concept`` (the meaning is the same), with ``more``."""
    return VOCABULARY[concept][3] + more


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Add the flags of ``twinshard train`` to ``p``, in four groups."""
    d = DEFAULTS
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = "Options left out on --resume are taken from the checkpoint."
    g = p.add_argument_group("parallelism")
    _shared(
        g,
        "impls",
        "the one fully_shard to train with: optimized is the fast path, reference the readable "
        "spec, torch torch.distributed.fsdp, or an importable module with fully_shard "
        f"(my_pkg.my_fsdp); one name, not the measuring commands' list (default {d['impl']})",
        type=_one_impl,
    )
    _shared(
        g,
        "world",
        _same("world", ", started here as local processes (default: one per GPU, else 2); ")
        + "ignored under torchrun, which sets the world",
        type=int,
    )
    _shared(
        g,
        "hsdp",
        "hybrid sharding: replicate across nodes and shard within each (a mesh of nodes "
        "x ranks per node; under torchrun a node is an agent's LOCAL_WORLD_SIZE ranks, a local "
        "launch is one node); a switch here, where the measuring commands' --hsdp R counts the "
        "replicas; not remembered by checkpoints: a resumed run may change it",
        action="store_true",
    )
    g.add_argument(
        "--param-dtype",
        choices=DTYPES,
        help=f"dtype of the unsharded parameters and of the compute (default {d['param_dtype']})",
    )
    g.add_argument(
        "--reduce-dtype",
        choices=DTYPES,
        help="dtype of the gradient reduction (default: the param dtype)",
    )
    _shared(
        g,
        "offload",
        _same("offload", ", and the optimizer state with them; --no-offload turns off a ")
        + "resumed run's (default off)",
        action=RenamedSwitch,
    )
    _shared(
        g,
        "variants",
        _same("variants", "; each sharded module's all-gather or reduce-scatter replaced, ")
        + "docs/variants.md (default: none, FSDP's exact collectives)",
        type=str,
    )
    g.add_argument(
        "--debug",
        action="store_true",
        help="check every collective across ranks before it is issued (TWINSHARD_DEBUG=1): "
        "ranks that disagree are named, with the parameter and the step, instead of hanging",
    )
    g.add_argument(
        "--hang-timeout",
        type=float,
        metavar="SECONDS",
        help="stop the run when no rank makes progress for this long, dump every rank's "
        f"stack and name the stalled rank (default {DEFAULT_HANG_TIMEOUT:g}; 0 = off)",
    )
    g = p.add_argument_group("model and data")
    _shared(
        g,
        "model",
        f"a preset: {', '.join(PRESETS)}; the measuring commands' published models and "
        f"config.json files cannot be trained here (default {d['preset']})",
        type=_trainable,
    )
    _shared(g, "dim", _same("dim"), type=int)
    _shared(g, "layers", _same("layers"), type=int)
    _shared(g, "heads", _same("heads"), type=int)
    g.add_argument(
        "--data",
        metavar="FILE",
        help="any file, read as bytes (default: the built-in generated corpus)",
    )
    _shared(g, "seq", _same("seq", f"; a token is a byte (default {d['seq_len']})"), type=int)
    g = p.add_argument_group("optimization")
    g.add_argument(
        "--steps", type=int, help=f"optimizer steps in the whole run (default {d['steps']})"
    )
    g.add_argument(
        "--batch-size",
        type=int,
        help="sequences per step over all ranks, the global batch: not the measuring "
        f"commands' --per-rank (default {d['batch_size']})",
    )
    g.add_argument(
        "--grad-accum",
        type=int,
        help=f"micro-batches per step on each rank (default {d['grad_accum']})",
    )
    g.add_argument(
        "--lr",
        type=float,
        help="peak learning rate (default by --model: "
        + ", ".join(f"{k} {v:g}" for k, v in DEFAULT_LR.items())
        + ")",
    )
    g.add_argument("--min-lr", type=float, help="final learning rate of the cosine (default lr/10)")
    g.add_argument("--warmup", type=int, help="linear warmup steps (default 5%% of --steps)")
    g.add_argument(
        "--weight-decay",
        type=float,
        help=f"AdamW weight decay of matrices (default {d['weight_decay']})",
    )
    g.add_argument(
        "--clip-norm",
        type=float,
        help=f"clip the gradient norm to this, 0 = off (default {d['clip_norm']})",
    )
    g.add_argument("--seed", type=int, help=f"model init, data order, RNGs (default {d['seed']})")
    g = p.add_argument_group("output and checkpoints")
    g.add_argument(
        "--out",
        metavar="DIR",
        help="run directory (default: runs/<date>-<time>; "
        "with --resume: the resumed run's directory)",
    )
    g.add_argument(
        "--resume",
        nargs="?",
        const="",
        metavar="PATH",
        help="continue the latest complete checkpoint of PATH (a run directory or one "
        "checkpoint); without PATH: of --out, else of the newest run under runs/",
    )
    g.add_argument(
        "--checkpoint-every",
        type=int,
        metavar="N",
        help="save every N steps and at "
        f"the end; 0 = only at the end (default {d['checkpoint_every']})",
    )
    g.add_argument(
        "--keep", type=int, metavar="N", help=f"complete checkpoints to keep (default {d['keep']})"
    )
    g.add_argument(
        "--stop-at",
        type=int,
        metavar="STEP",
        help="stop after STEP steps with a "
        "checkpoint, as if interrupted (the schedule still runs to --steps)",
    )
    g.add_argument(
        "--log-every",
        type=int,
        metavar="N",
        help=f"log a line every N steps (default {d['log_every']})",
    )
    g.add_argument(
        "--eval-batches",
        type=int,
        metavar="N",
        help="global batches of held-out "
        f"data for the final validation loss (default {d['eval_batches']})",
    )
    g.add_argument(
        "--sample-length",
        type=int,
        metavar="N",
        help=f"bytes of text to generate at the end, 0 = none (default {d['sample_length']})",
    )
