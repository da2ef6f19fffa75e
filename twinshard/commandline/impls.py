"""Which FSDP implementation to run: a short name or any importable module.

Every command that takes an implementation resolves it here, so that a researcher's variant
runs wherever twinshard's own do: ``twinshard bench --impls``, ``twinshard schedule --impls``,
``twinshard plan --impls``, ``python -m twinshard.measure.fakeaccel --impls``, ``twinshard conform
MODULE``, ``twinshard train --impls`` and the switch (``twinshard.switch.use``,
``python -m twinshard.run --impls``). The short names:

    reference   twinshard.reference       the readable spec
    optimized   twinshard.optimized       the fast path
    torch       torch.distributed.fsdp    PyTorch's FSDP2

Any other name is a module path (``my_pkg.my_fsdp``, importable from ``sys.path`` or
``PYTHONPATH``; spawned ranks inherit the latter), accepted when it imports and has what the
command calls: ``fully_shard`` always, ``MixedPrecisionPolicy`` for the measuring commands
(``MEASURED``), the whole interface for ``conform``. A name that is neither says so in one line
naming the flag, the name and what to give instead (``ImplError``).
"""

from __future__ import annotations

import importlib
import types

SHORT_NAMES = {
    "reference": "twinshard.reference",
    "optimized": "twinshard.optimized",
    "torch": "torch.distributed.fsdp",
}
# What the measuring commands (bench, schedule, plan, the fake accelerator) call of a module.
MEASURED = ("fully_shard", "MixedPrecisionPolicy")
_INSTEAD = (
    "name reference, optimized, torch or an importable module name (e.g. my_pkg.my_fsdp, its "
    "folder on PYTHONPATH)"
)


class ImplError(ValueError):
    """An implementation that cannot be imported or lacks the interface (names the flag)."""


def module_name(name: str) -> str:
    """The module path of ``name``: a short name's module, else ``name`` itself."""
    return SHORT_NAMES.get(name, name)


def names(text: str) -> list[str]:
    """The names of a comma-separated flag value (``"reference, my_pkg.fsdp"``)."""
    return [name.strip() for name in text.split(",") if name.strip()]


def load(name: str | types.ModuleType, flag: str = "", needs: tuple[str, ...] = ("fully_shard",)):
    """The module ``name`` (a short name, a module path or a module) stands for, checked to have
    ``needs``; ``ImplError`` (its message opening with ``flag`` and the name) if it cannot be
    imported or lacks any of them."""
    where = f"{flag} {name!r}: " if flag else ""
    if isinstance(name, types.ModuleType):
        module = name
    elif not isinstance(name, str) or not name.strip():
        raise ImplError(f"{where or f'{name!r}: '}{_INSTEAD}")
    else:
        path = module_name(name)
        try:
            module = importlib.import_module(path)
        except Exception as error:  # a syntax error or a failing import inside it, too
            said = f"{type(error).__name__}: {error}"
            if isinstance(error, SyntaxError):  # its file in full, and the line
                said = f"SyntaxError: {error.msg} ({error.filename}, line {error.lineno})"
            raise ImplError(f"{where}cannot import {path!r}: {said}; {_INSTEAD}") from error
    missing = [attr for attr in needs if getattr(module, attr, None) is None]
    if missing:
        raise ImplError(
            f"{where}{module.__name__} lacks {', '.join(missing)}; name a module with the "
            "fully_shard interface (see twinshard.api)"
        )
    return module


def problem(text: str, flag: str, needs=MEASURED, also: tuple[str, ...] = ()) -> str | None:
    """What is wrong with a flag's comma-separated implementations (one line), or None.
    ``also``: names the command runs itself (``bench``'s ``plain`` and ``ddp``)."""
    more = f"; {flag} also takes {', '.join(also)}" if also else ""
    chosen = names(text)
    if not chosen:
        return f"{flag} {text!r}: {_INSTEAD}{more}"
    for name in chosen:
        if name in also:
            continue
        try:
            load(name, flag, needs)
        except ImplError as error:
            return f"{error}{more}"
    return None
