"""The words every command spells alike: its flags, and the names of the precisions.

``VOCABULARY`` holds one spelling and one help text per concept of a job, with the old
spellings that still parse: the measuring commands (``twinshard bench``, ``schedule``,
``plan``, the fake accelerator) add their flags from it (``twinshard.measure.flags``), and
``twinshard train`` spells the concepts it shares with them the same way
(``twinshard.train.flags``, [Note: train speaks the measuring commands' vocabulary]).
``Renamed`` is the argparse action of such a flag: given under an old spelling, it says on
stderr, in one line, what replaces it. ``DTYPES`` names the precisions every flag that takes
one accepts (``--dtype``, ``--param-dtype``, ``--reduce-dtype``).

Nothing here knows a job: this module sits below both train and the measuring package, so
neither imports the other for its words.
"""

from __future__ import annotations

import argparse
import sys

import torch

# a precision's name on the command line -> its torch dtype
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

# concept -> (spelling, old spellings, type (None: a switch), help)
VOCABULARY = {
    "impls": (
        "--impls",
        ("--impl",),
        str,
        "comma-separated: reference, optimized, torch or an importable module "
        "(my_pkg.my_fsdp); twinshard bench also takes plain and ddp",
    ),
    "model": (
        "--model",
        ("--preset",),
        str,
        "a preset (tiny, small, medium, 1b), a published model (llama3-8b, llama3-70b, "
        "llama3-405b, llama2-7b, llama2-13b, llama2-70b) or a Hugging Face config.json; "
        "twinshard schedule also takes mlp",
    ),
    "layers": ("--layers", (), int, "blocks (parameter groups), overriding the model's"),
    "dim": ("--dim", (), int, "model width, overriding the model's"),
    "heads": ("--heads", (), int, "attention heads, overriding the model's"),
    "vocab": ("--vocab", (), int, "vocabulary size, overriding the model's"),
    "world": ("--world", ("--world-size", "--nproc"), int, "ranks in the job (the world size)"),
    "hsdp": ("--hsdp", (), int, "replicas of a 2D (HSDP) mesh; 1 is FSDP"),
    "per_rank": ("--per-rank", ("--batch",), int, "sequences per rank per step"),
    "seq": ("--seq", (), int, "tokens per sequence"),
    "dtype": ("--dtype", (), str, "fp32, or bf16 compute with fp32 reduction"),
    "reshard": ("--reshard-after-forward", (), str, "of the blocks: true, false or a group size"),
    "prefetch": (
        "--prefetch",
        (),
        int,
        "all-gathers issued this many blocks ahead (explicit prefetch lists on the root and "
        "every block); unset, the implementation's own choice",
    ),
    "offload": ("--offload", (), None, "CPUOffloadPolicy: shards and their gradients on the host"),
    "variants": (
        "--variants",
        (),
        str,
        "communication variants (twinshard.variants) joined by +: qwz, qgz, bf16-wire, each "
        "with options after colons (qgz:bits=4:block=128:node=8)",
    ),
    "json": ("--json", (), str, "write every number here"),
    "markdown": ("--markdown", (), str, "write the tables here"),
    "no_progress": ("--no-progress", (), None, "print no progress lines"),
}


class Renamed(argparse.Action):
    """Stores the value; given under an old spelling, says on stderr what replaces it."""

    def __call__(self, parser, namespace, values, option_string=None):
        if option_string != self.option_strings[0]:
            print(f"note: {option_string} is now {self.option_strings[0]}", file=sys.stderr)
        setattr(namespace, self.dest, values)
