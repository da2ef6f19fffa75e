"""Run conformance cases inside a process group and merge the verdicts of all ranks."""

from __future__ import annotations

import contextlib
import fnmatch
import importlib
import os
import time
import traceback

import torch.distributed as dist

from .cases import CASES, Context
from .driver import set_device


def select(patterns: list[str] | None) -> list[str]:
    """Case names matching any of the shell-style ``patterns`` (all cases when None)."""
    if not patterns:
        return list(CASES)
    names = [n for n in CASES if any(fnmatch.fnmatch(n, p) for p in patterns)]
    if not names:
        raise ValueError(f"no case matches {patterns}; cases: {', '.join(CASES)}")
    return names


ORACLES = ("torch", "reference")


def oracle_names(oracles) -> tuple[str, ...]:
    """``True``: both oracles (torch's ``fully_shard`` and the reference); ``False``: none (the
    plain model only); or the names of those wanted."""
    if oracles is True:
        return ORACLES
    if oracles is False or oracles is None:
        return ()
    names = tuple(oracles)
    if unknown := [n for n in names if n not in ORACLES]:
        raise ValueError(f"unknown oracle(s) {unknown}; choose from {list(ORACLES)}")
    return names


def run_cases(
    impl_name: str,
    mesh_shape: tuple[int, ...],
    tmpdir: str,
    patterns: list[str] | None = None,
    with_oracle=True,
    device: str | None = None,
) -> list[dict]:
    """Run the selected cases on this rank; every rank returns the same merged results.

    A case that does not apply to this mesh gets a SKIP row with its reason. With stand-in
    streams (``TWINSHARD_STANDIN_STREAMS=1``) every case runs under the stream checks.
    ``device``: the device type the cases run on (``twinshard conform --device``); None, the
    device this rank was given (``twinshard.devices``)."""
    impl = importlib.import_module(impl_name)
    oracle = reference = None
    wanted = oracle_names(with_oracle)
    if "torch" in wanted and impl_name != "torch.distributed.fsdp":
        oracle = importlib.import_module("torch.distributed.fsdp")
    if "reference" in wanted and impl_name != "twinshard.reference":
        reference = importlib.import_module("twinshard.reference")
    label = "torch" if impl_name == "torch.distributed.fsdp" else impl_name.rsplit(".", 1)[-1]
    ctx = Context(impl, label, oracle, tuple(mesh_shape), tmpdir, reference, device_choice=device)
    set_device(ctx.device)
    results = []
    for name in select(patterns):
        case = CASES[name]
        if (reason := case.skip_reason(ctx)) is not None:
            results.append(skip_row(name, mesh_shape, reason))
            continue
        start = time.perf_counter()
        try:
            with stream_checks():
                summary = case.fn(ctx).summary()
        except Exception:  # reported as a failure of this case; the next case still runs
            summary = {
                "ok": False,
                "failures": [traceback.format_exc()],
                "max_abs": float("nan"),
                "max_rel": float("nan"),
                "where": "",
                "compared": 0,
                "tolerance": "-",
            }
        summary.update(case=name, group=case.group, seconds=time.perf_counter() - start)
        merged = _merge_ranks(summary)
        merged.update(
            mesh="x".join(map(str, mesh_shape)), status="PASS" if merged["ok"] else "FAIL"
        )
        results.append(merged)
    return results


def skip_row(
    name: str,
    mesh_shape: tuple[int, ...],
    reason: str,
    status: str = "SKIP",
    failures: list[str] | None = None,
) -> dict:
    """A row for a case that did not run: skipped (with ``reason``) or failed as a whole."""
    return {
        "case": name,
        "mesh": "x".join(map(str, mesh_shape)),
        "group": CASES[name].group,
        "ok": False,
        "status": status,
        "reason": reason,
        "failures": list(failures or []),
        "compared": 0,
        "max_abs": float("nan"),
        "max_rel": float("nan"),
        "where": "",
        "seconds": 0.0,
        "notes": [],
        "worst_by": {},
    }


def stream_checks():
    """The stand-in streams' checks when they are asked for, else nothing."""
    from twinshard.optimized.streams import STANDIN_ENV

    if os.environ.get(STANDIN_ENV, "0") in ("", "0"):
        return contextlib.nullcontext()
    from twinshard.standin import standin_streams

    return standin_streams().checking()


def _merge_ranks(summary: dict) -> dict:
    """One verdict per case: it passes only if it passed on every rank."""
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, summary)
    merged = dict(summary)
    merged["ok"] = all(s["ok"] for s in every)
    merged["failures"] = [f"rank {r}: {f}" for r, s in enumerate(every) for f in s["failures"]]
    worst = max(every, key=lambda s: -1.0 if s["max_abs"] != s["max_abs"] else s["max_abs"])
    merged.update(
        max_abs=worst["max_abs"],
        max_rel=max(s["max_rel"] for s in every),
        where=worst["where"],
        compared=sum(s["compared"] for s in every),
    )
    by: dict = {}
    for s in every:
        for series, w in s.get("worst_by", {}).items():
            if series not in by or w["abs"] > by[series]["abs"]:
                by[series] = w
    merged["worst_by"] = by
    return merged
