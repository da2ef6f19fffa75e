"""Runs that the checks of several implementations share, computed once per rank process.

A training case compares the implementation under test with the plain model (the truth, and in
low precision its data-parallel twin) and with the oracles (the reference, torch's
``fully_shard``). None of these depends on which implementation is under test: the case, the
mesh and the rank decide them. A rank that checks several implementations one after the other
(a rank of ``twinshard.ranks.worlds``, which runs the reference's suite, then the optimized path's
with the reference and torch as oracles, then torch's own) computes each of them once and reads
it back after: the same tensors, so the same verdicts as computing it again.

``case_scope`` (the runner, around each case) names what the runs belong to: the case, the
mesh, the device, and the settings that change what a run computes (the lossy case's variant,
the guard's checks). The stand-in streams are not among them: the plain model and the oracles
run with the streams' checks paused, so a case checked on stand-in streams reads the same truth
and oracles as without. ``shared(what, impl, compute)`` returns the run ``what`` of ``impl``
(a module name; ``None`` for the plain model) made in this scope before, else ``compute()``.
``what`` carries the recipe's ``fingerprint`` (its settings, and for each function its name and
the plain values it closes over), and the n-th call for the same ``what`` and ``impl`` within
one execution of a case gets the n-th stored run, so a case that trains several recipes keeps
them apart. Only runs whose results
are read and never changed are shared (``train_case``'s traces): a run whose model a case goes
on training is always computed.
"""

from __future__ import annotations

import contextlib
import os
from collections import Counter
from collections.abc import Callable

# Settings that change what a run computes, read from the environment per case.
SETTINGS = ("TWINSHARD_CONFORM_VARIANT", "TWINSHARD_DEBUG")

_scope: tuple | None = None  # the current case's key
_calls: Counter = Counter()  # (what, impl) -> calls so far in the current case
_runs: dict = {}  # every shared run of this process, by key
hits = Counter()  # "computed" and "reused", for the tests


@contextlib.contextmanager
def case_scope(case: str, mesh_shape: tuple[int, ...], device: str):
    """Runs made inside belong to ``case`` on ``mesh_shape`` and ``device``."""
    global _scope
    settings = tuple(os.environ.get(name, "") for name in SETTINGS)
    _scope = (case, tuple(mesh_shape), str(device), settings)
    _calls.clear()
    try:
        yield
    finally:
        _scope = None
        _calls.clear()


def shared(what: str, impl: str | None, compute: Callable):
    """The run ``what`` of ``impl`` made in the current scope before, else ``compute()``
    (and kept). Outside a scope, always ``compute()``."""
    if _scope is None:
        return compute()
    n = _calls[what, impl]
    _calls[what, impl] += 1
    return _kept((*_scope, what, impl, n), compute)


def shared_by_cases(what: str, impl: str | None, compute: Callable):
    """As ``shared``, but the run ``what`` of ``impl`` is one for every case of this mesh,
    device and settings: ``what`` must name everything the run depends on (a recipe's
    ``fingerprint``). For the runs several cases make alike (the lossy cases' exact run)."""
    if _scope is None:
        return compute()
    return _kept(("any case", *_scope[1:], what, impl), compute)


def _kept(key: tuple, compute: Callable):
    """The run kept under ``key``, else ``compute()``, kept there."""
    if key in _runs:
        hits["reused"] += 1
        return _runs[key]
    value = compute()
    _runs[key] = value
    hits["computed"] += 1
    return value


_PLAIN = (bool, int, float, str, bytes, type(None))


def _plain(value, depth: int = 0) -> str:
    """``repr`` of a value that says what it is (numbers, strings, dtypes, tuples of them,
    dataclasses of them, functions as ``_function`` says them); else its type's name."""
    if isinstance(value, _PLAIN) or type(value).__name__ == "dtype":
        return repr(value)
    if isinstance(value, tuple | list):
        return "(" + ", ".join(_plain(v, depth) for v in value) + ")"
    if hasattr(value, "__code__") and depth < 3:  # a function a recipe's function holds
        return _function(value, depth + 1)
    fields = getattr(value, "__dataclass_fields__", None)  # a policy: its settings
    if fields is not None:
        inside = ", ".join(f"{f}={_plain(getattr(value, f, None), depth)}" for f in fields)
        return f"{type(value).__qualname__}({inside})"
    return type(value).__qualname__


def _function(fn, depth: int = 0) -> str:
    """A function by name and where its code is (two lambdas differ), with the plain values
    it closes over and its defaults."""
    cells = getattr(fn, "__closure__", None) or ()
    held = []
    for cell in cells:
        try:
            held.append(_plain(cell.cell_contents, depth))
        except ValueError:  # an empty cell
            held.append("?")
    defaults = getattr(fn, "__defaults__", None) or ()
    code = getattr(fn, "__code__", None)
    where = f"@{os.path.basename(code.co_filename)}:{code.co_firstlineno}" if code else ""
    name = getattr(fn, "__qualname__", type(fn).__qualname__)
    return f"{name}{where}{held}{[_plain(d, depth) for d in defaults]}"


def fingerprint(recipe) -> str:
    """What identifies a recipe across the implementations checked: its fields, functions by
    name with the plain values they hold."""
    return "; ".join(
        f"{k}={_function(v) if callable(v) else _plain(v)}" for k, v in sorted(vars(recipe).items())
    )


def forget() -> None:
    """Drop every shared run of this process."""
    _runs.clear()
    hits.clear()
