"""Run a script or a module with torch's ``fully_shard`` switched to twinshard's.

    python -m twinshard.run script.py ARGS...             # TWINSHARD_FSDP, default optimized
    python -m twinshard.run --impls reference script.py ARGS...
    python -m twinshard.run -m package.module ARGS...     # like python -m
    python -m twinshard.run --impls torch --variants qwz+qgz:node=8 train.py ARGS...
    torchrun --nproc-per-node 8 -m twinshard.run train.py ARGS...

The switch (``twinshard.switch.use_from_env``) happens before the script imports anything,
so the script and every library it imports see twinshard's ``fully_shard`` wherever they
import torch's. ``--impls`` (one name; ``--impl`` is its old spelling) wins over the ``TWINSHARD_FSDP`` environment variable and is
passed on to it, so processes the script starts with this launcher switch the same way;
``--variants`` (communication variants, as every command spells them) wins over and is passed
on to ``TWINSHARD_VARIANTS`` the same way, and ``fully_shard`` sets them on every module it
shards.
The script then runs as ``python script.py`` would run it: as ``__main__``, with
``sys.argv`` = ``[script.py, ARGS...]`` and its folder first on ``sys.path``.
"""

from __future__ import annotations

import os
import runpy
import sys
from typing import NamedTuple

from twinshard import switch

USAGE = "python -m twinshard.run [--impls NAME] [--variants SPEC] (script.py | -m module) [ARGS...]"


class Command(NamedTuple):
    impl: str | None  # --impls, or None to read TWINSHARD_FSDP
    variants: str | None  # --variants, or None to read TWINSHARD_VARIANTS
    module: str | None  # -m MODULE, or None to run a script
    target: list[str]  # [script.py, ARGS...] or the module's ARGS


def parse(argv: list[str]) -> Command:
    """The launcher's own options come first; everything from the script (or ``-m module``)
    on belongs to the script, as with ``python``."""
    values, rest = {"impl": None, "variants": None}, list(argv)
    own = ("--impl", "--variants")
    while rest and (rest[0] in ("-h", "--help") or rest[0].startswith(own)):
        flag = rest.pop(0)
        if flag in ("-h", "--help"):
            print(__doc__)
            raise SystemExit(0)
        if flag.split("=", 1)[0] == "--impl":
            print("note: --impl is now --impls", file=sys.stderr)
        key = "variants" if flag.startswith("--variants") else "impl"
        if "=" in flag:
            values[key] = flag.split("=", 1)[1]
        elif rest:
            values[key] = rest.pop(0)
        else:
            raise SystemExit(f"python -m twinshard.run: {flag} needs a value; usage: {USAGE}")
    impl, chosen = values["impl"], values["variants"]
    if rest[:1] == ["-m"]:
        if len(rest) < 2:
            raise SystemExit(f"python -m twinshard.run: -m needs a module name; usage: {USAGE}")
        return Command(impl, chosen, rest[1], rest[2:])
    if not rest:
        raise SystemExit(f"python -m twinshard.run: name a script or -m module; usage: {USAGE}")
    return Command(impl, chosen, None, rest)


def main(argv: list[str] | None = None) -> None:
    args = parse(sys.argv[1:] if argv is None else argv)
    if args.impl is not None:
        os.environ[switch.ENV_VAR] = args.impl
    if args.variants is not None:
        os.environ[switch.VARIANTS_ENV_VAR] = args.variants
    try:
        switch.use_from_env()
    except switch.SwitchError as error:
        raise SystemExit(f"python -m twinshard.run: {error}") from None
    if args.module is not None:
        sys.argv = [args.module, *args.target]
        runpy.run_module(args.module, run_name="__main__", alter_sys=True)
        return
    script, *rest = args.target
    if not os.path.isfile(script):
        raise SystemExit(f"python -m twinshard.run: no script at {script!r}; usage: {USAGE}")
    sys.argv = [script, *rest]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
