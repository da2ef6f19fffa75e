"""Run conformance cases inside a process group and merge the verdicts of all ranks.

A case that raises on some ranks only leaves the others inside its collectives, waiting for
ranks that have moved on; merging the verdicts would then wait with them until the launcher's
timeout (ten minutes by default), and every case of the mesh would read as failed. So each rank
posts to the job's store when it has finished a case, and a rank whose case raised waits there
for the others (``grace``), not in a collective. If one is missing, it is still inside the
case: the rank writes the rows so far, with this case's traceback, for ``run_suite``
(``partial_rows_path``) and stops the mesh (``CaseAbandoned``); the cases after it on that mesh
are reported as not run.
"""

from __future__ import annotations

import contextlib
import fnmatch
import importlib
import json
import os
import time
import traceback

import torch.distributed as dist

from twinshard.guard import channel

from .cases import CASES, Context
from .driver import set_device
from .shared_runs import case_scope


def grace(elapsed: float) -> float:
    """How long a rank whose case raised waits for the others to finish it: twice the time the
    case ran here, and at least half the guard's timeout. Shorter than that timeout, so that a
    peer held in one of the guard's checks (the model check at the first forward) is found
    missing here before the check gives up: a guard error it raised would stay in the store
    and fail the next cases too."""
    return max(channel.timeout / 2, 2 * elapsed)


class CaseAbandoned(RuntimeError):
    """A case failed on this rank while other ranks are still inside it: the mesh stops."""


def partial_rows_path(tmpdir: str, mesh_shape: tuple[int, ...]) -> str:
    """Where a rank that stopped its mesh leaves the rows of the cases run so far."""
    return os.path.join(tmpdir, f"conform-partial-{'x'.join(map(str, mesh_shape))}.json")


def finished_topic(index: int) -> str:
    """The store topic under which each rank posts that it has finished case ``index``."""
    return f"twinshard-conform/finished/{index}"


def others_finished(store, index: int, started: float) -> list[int]:
    """Post that this rank has finished case ``index`` (of this launch); the ranks that have
    not posted the same within the grace (empty: every other rank has)."""
    ranks = tuple(range(dist.get_world_size()))
    deadline = time.monotonic() + grace(time.monotonic() - started)
    topic = finished_topic(index)
    _, missing = channel.exchange(store, topic, ranks, "1", deadline, errors=False)
    return missing


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
    device this rank was given (``twinshard.ranks.devices``)."""
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
    store = channel.connection()  # None: one rank, or one process playing every rank
    for index, name in enumerate(select(patterns)):
        case = CASES[name]
        if (reason := case.skip_reason(ctx)) is not None:
            results.append(skip_row(name, mesh_shape, reason))
            continue
        start, started = time.perf_counter(), time.monotonic()
        raised = False
        try:
            with stream_checks(), case_scope(name, mesh_shape, str(ctx.device)):
                summary = case.fn(ctx).summary()
        except Exception:  # reported as a failure of this case; the next case still runs
            raised = True
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
        if store is not None and not raised:
            store.set(f"{finished_topic(index)}/{dist.get_rank()}", "1")  # as ``exchange`` posts
        elif store is not None and (missing := others_finished(store, index, started)):
            abandon(results, summary, mesh_shape, tmpdir, missing)
        merged = _merge_ranks(summary)
        merged.update(
            mesh="x".join(map(str, mesh_shape)), status="PASS" if merged["ok"] else "FAIL"
        )
        results.append(merged)
    return results


def abandon(results: list, summary: dict, mesh_shape, tmpdir: str, missing: list) -> None:
    """Leave the rows so far and this rank's failed case for ``run_suite``, and stop the mesh:
    ranks ``missing`` are still inside the case."""
    rank = dist.get_rank()
    why = (
        f"case {summary['case']} failed on rank {rank}, and rank(s) {missing} did not finish it "
        "within the grace: they are waiting inside it, so the mesh stops here"
    )
    row = dict(summary, failures=[f"rank {rank}: {f}" for f in summary["failures"]] + [why])
    row.update(mesh="x".join(map(str, mesh_shape)), status="FAIL")
    with open(partial_rows_path(tmpdir, mesh_shape), "w") as f:
        json.dump(results + [row], f)
    raise CaseAbandoned(f"{why}\n{summary['failures'][0]}")


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
    from twinshard.dispatch.standin import standin_streams

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
