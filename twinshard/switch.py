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

from twinshard import impls

__all__ = ["ENV_VAR", "SwitchError", "active", "restore", "use", "use_from_env", "using"]

# The environment variable the launcher reads (python -m twinshard.run).
ENV_VAR = "TWINSHARD_FSDP"
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
    by ``twinshard.impls``, as every command resolves one."""
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


def _rebind(impl_name: str, module: types.ModuleType | None) -> None:
    """Point every exported FSDP2 function at ``module``'s (torch's own when None)."""
    for (module_name, name), original in _torch_originals().items():
        replacement = original if module is None else getattr(module, name, original)
        setattr(sys.modules[module_name], name, replacement)


def active() -> str:
    """The implementation torch's FSDP2 names point to: a module name, or ``"torch"``."""
    return "torch" if _active is None else _active


def use(impl: str | types.ModuleType = "optimized") -> str:
    """Switch torch's ``fully_shard`` (and its sibling functions) to ``impl``'s.

    ``impl``: ``"optimized"``, ``"reference"``, ``"torch"`` (switch off), an importable
    module name or a module with the ``fully_shard`` interface. Returns what was active
    before (for ``use(previous)``). Logs the switch on rank 0.
    """
    global _active
    previous = active()
    name, module = _resolve(impl)
    if name == "torch.distributed.fsdp":
        _rebind(name, None)
        _active = None
    else:
        _rebind(name, module)
        _active = name
        _warn_about_early_imports()
    _announce(previous)
    return previous


def restore() -> str:
    """Put torch's own functions back; returns what was active before."""
    return use("torch")


@contextlib.contextmanager
def using(impl: str | types.ModuleType = "optimized") -> Iterator[str]:
    """Switch to ``impl`` for the ``with`` block, then back to what was active before."""
    previous = use(impl)
    try:
        yield active()
    finally:
        use(previous)


def use_from_env(default: str = "optimized") -> str:
    """Switch to the implementation ``TWINSHARD_FSDP`` names (``default`` when unset)."""
    chosen = os.environ.get(ENV_VAR, "").strip() or default
    try:
        use(chosen)
    except SwitchError as error:
        raise SwitchError(f"{ENV_VAR}={chosen!r}: {error}") from error
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
