"""The switch: make code that calls torch's ``fully_shard`` run twinshard's instead.

accelerate, Lightning, the HF Trainer and torchtitan-style scripts call
``torch.distributed.fsdp.fully_shard`` themselves, so "change one import" does not reach
them. The switch rebinds the FSDP2 functions that torch exports, in every module that
exports them, to an implementation's:

    torch.distributed.fsdp                      fully_shard, register_fsdp_forward_method,
    torch.distributed.fsdp._fully_shard           share_comm_ctx
    torch.distributed._composable.fsdp
    torch.distributed._composable.fsdp.fully_shard

A client that looks the name up when it shards (``from torch.distributed.fsdp import
fully_shard`` inside a function, as accelerate does, or in a user's ``configure_model``, as
Lightning has it) gets twinshard's. A module that imported the name before the switch keeps
torch's: the switch names such modules in a warning, and the launcher (``python -m
twinshard.run``, which switches before the script imports anything) avoids them.

The types stay torch's (``FSDPModule``, ``MixedPrecisionPolicy``, ``OffloadPolicy``,
``CPUOffloadPolicy``, ``UnshardHandle``): twinshard's ``fully_shard`` takes torch's policy
objects as they are, and a module it shards is an instance of torch's ``FSDPModule``, so a
client's ``isinstance`` checks and the policies it built before the switch all keep working.

Three forms, one mechanism:

- ``use("optimized")`` switches until ``restore()``; it returns what was active before;
- ``with using("reference"): ...`` switches for a block and puts back what was active;
- ``TWINSHARD_FSDP=optimized python -m twinshard.run script.py`` (``use_from_env``).

Each form also takes communication variants (``use("torch", variants="qwz+qgz:node=8")``,
``TWINSHARD_VARIANTS``, ``python -m twinshard.run --variants``), spelled as every command's
``--variants``: ``fully_shard`` then sets them on every module it shards
(``twinshard.variants.switched``), under any implementation, torch's own included.

``active()`` says which implementation the names point to (``"torch"`` when none is switched
in). Each switch logs one line on rank 0 (``RANK`` unset counts as rank 0) on the
``twinshard.switch`` logger, which writes to stderr unless logging is configured otherwise.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import sys
import types
import warnings
from collections.abc import Iterator

from twinshard.commandline import impls
from twinshard.variants import switched
from twinshard.variants.attach import parse as parse_variants
from twinshard.variants.attach import refuse_unusable

__all__ = ["ENV_VAR", "SwitchError", "active", "active_variants", "restore", "use"]
__all__ += ["use_from_env", "using"]

# The environment variables the launcher reads (python -m twinshard.run).
ENV_VAR = "TWINSHARD_FSDP"
VARIANTS_ENV_VAR = "TWINSHARD_VARIANTS"
# The modules of torch that export FSDP2's functions (public and legacy paths).
TORCH_MODULES = (
    "torch.distributed.fsdp",
    "torch.distributed.fsdp._fully_shard",
    "torch.distributed._composable.fsdp",
    "torch.distributed._composable.fsdp.fully_shard",
)
# The functions the switch rebinds; an implementation must provide the first.
FUNCTIONS = ("fully_shard", "register_fsdp_forward_method", "share_comm_ctx")
# Short names for the implementations people switch between (one table for every command).
SHORT_NAMES = impls.SHORT_NAMES

log = logging.getLogger(__name__)


class SwitchError(ValueError):
    """The switch was asked for an implementation it cannot switch in."""


# torch's own functions, read once, before anything is rebound: (module, name) -> function.
_torch_functions: dict[tuple[str, str], object] = {}
# The implementation module the names point to now, or None for torch's.
_active: str | None = None
# The communication variants fully_shard sets on what it shards now ("" for none).
_variants: str = ""


def _torch_originals() -> dict[tuple[str, str], object]:
    if not _torch_functions:
        for module_name in TORCH_MODULES:
            module = importlib.import_module(module_name)
            for name in FUNCTIONS:
                if hasattr(module, name):
                    _torch_functions[module_name, name] = getattr(module, name)
    return _torch_functions


def _resolve(impl: str | types.ModuleType) -> tuple[str, types.ModuleType]:
    """The module name and the module of ``impl`` (a short name, a module name or a module),
    by ``twinshard.commandline.impls``, as every command resolves one."""
    if not isinstance(impl, (str, types.ModuleType)) or not impl:
        raise SwitchError(
            f"twinshard.switch: the implementation must be a module or its name "
            f"({', '.join(SHORT_NAMES)} or e.g. my_pkg.my_fsdp), got {impl!r}"
        )
    try:
        module = impls.load(impl)
    except impls.ImplError as error:
        raise SwitchError(f"twinshard.switch: {error}") from error
    return module.__name__, module


def _rebind(impl_name: str, module: types.ModuleType | None, chosen: list) -> None:
    """Point every exported FSDP2 function at ``module``'s (torch's own when None), with
    ``fully_shard`` setting the variants ``chosen`` on what it shards when there are any."""
    sharding = {}  # one wrapper for all of torch's modules, so that its hooks are in one place
    for (module_name, name), original in _torch_originals().items():
        replacement = original if module is None else getattr(module, name, original)
        if name == "fully_shard" and chosen:
            if replacement not in sharding:
                sharding[replacement] = switched.attaching(replacement, chosen)
            replacement = sharding[replacement]
        setattr(sys.modules[module_name], name, replacement)


def _parse_variants(spec: str) -> list:
    """The variants ``spec`` names (``--variants`` spelling), refused by name when unusable."""
    try:
        chosen = parse_variants(spec)
        refuse_unusable(chosen)
    except ValueError as error:
        raise SwitchError(f"twinshard.switch: variants {spec!r}: {error}") from error
    return chosen


def active() -> str:
    """The implementation torch's FSDP2 names point to: a module name, or ``"torch"``."""
    return "torch" if _active is None else _active


def active_variants() -> str:
    """The variants ``fully_shard`` sets on what it shards, as ``--variants`` spells them, or
    ``""`` for none."""
    return _variants


def use(impl: str | types.ModuleType = "optimized", variants: str = "") -> str:
    """Switch torch's ``fully_shard`` (and its sibling functions) to ``impl``'s.

    ``impl``: ``"optimized"``, ``"reference"``, ``"torch"`` (switch off), an importable
    module name or a module with the ``fully_shard`` interface. ``variants``: communication
    variants as ``--variants`` spells them (``"qwz+qgz:node=8"``), set by ``fully_shard`` on
    every module it shards; ``""`` for none. Returns what was active before (for
    ``use(previous)``). Logs the switch on rank 0.
    """
    global _active, _variants
    previous = active()
    name, module = _resolve(impl)
    chosen = _parse_variants(variants)
    if name == "torch.distributed.fsdp":
        _rebind(name, None, chosen)
        _active = None
    else:
        _rebind(name, module, chosen)
        _active = name
        _warn_about_early_imports()
    _variants = variants if chosen else ""
    _announce(previous)
    return previous


def restore() -> str:
    """Put torch's own functions back; returns what was active before."""
    return use("torch")


@contextlib.contextmanager
def using(impl: str | types.ModuleType = "optimized", variants: str = "") -> Iterator[str]:
    """Switch to ``impl`` (and ``variants``) for the ``with`` block, then back to what was
    active before."""
    previous_variants = active_variants()
    previous = use(impl, variants)
    try:
        yield active()
    finally:
        use(previous, previous_variants)


def use_from_env(default: str = "optimized") -> str:
    """Switch to the implementation ``TWINSHARD_FSDP`` names (``default`` when unset), with
    the variants ``TWINSHARD_VARIANTS`` names (none when unset)."""
    chosen = os.environ.get(ENV_VAR, "").strip() or default
    spec = os.environ.get(VARIANTS_ENV_VAR, "").strip()
    try:
        use(chosen, spec)
    except SwitchError as error:
        where = f"{ENV_VAR}={chosen!r}" + (f", {VARIANTS_ENV_VAR}={spec!r}" if spec else "")
        raise SwitchError(f"{where}: {error}") from error
    return active()


def _announce(previous: str) -> None:
    if os.environ.get("RANK", "0") != "0":
        return
    if not log.hasHandlers():  # nobody configured logging: still say it, on stderr
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
    now = active()
    what = "torch's own" if now == "torch" else f"{now}'s"
    if _variants:
        what += f", with variants {_variants}"
    log.info(
        "twinshard.switch: torch.distributed.fsdp.fully_shard is %s (was %s)",
        what,
        previous,
    )


def _warn_about_early_imports() -> None:
    """Name the modules outside torch that hold torch's ``fully_shard`` under a name of theirs."""
    original = _torch_originals()["torch.distributed.fsdp", "fully_shard"]
    holders = []
    for module_name, module in list(sys.modules.items()):
        if module_name.split(".")[0] == "torch" or module is None:
            continue
        names = [n for n, v in list(getattr(module, "__dict__", {}).items()) if v is original]
        holders += [f"{module_name}.{n}" for n in names]
    if holders:
        warnings.warn(
            f"twinshard.switch: these names were bound to torch's fully_shard before the "
            f"switch and still call it: {', '.join(sorted(holders))}; switch before importing "
            f"their modules (python -m twinshard.run, or twinshard.switch.use() first in the "
            f"script)",
            stacklevel=3,
        )
