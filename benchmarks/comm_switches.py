"""Torch's communication switches on a real backend: where the optimized path's buffers come
from under each one, whether anything falls back, and whether the values stay the same.

    python benchmarks/comm_switches.py --device cuda --out DIR   # NCCL on one GPU (gpu.sh)
    python benchmarks/comm_switches.py --device cpu --out DIR    # gloo: every fallback

Issue 53 asks for ``set_allocate_memory_from_process_group_for_comm`` and
``set_symm_mem_for_comm`` real on NCCL, with a warning once elsewhere, and for
``set_force_sum_reduction_for_comms`` and ``set_reduce_scatter_max_input_buffers`` to do what
torch's do. The CPU tests check all of it with a backend that pretends
(``tests/engine/test_comm_memory.py``); this script asks the real one. One process is rank 0 of
a world of one (``nccl`` on a GPU, ``gloo`` on the CPU), and for each setting of ``SETTINGS`` a
fresh ``MLPStack`` (same seed), every block and the root sharded by ``twinshard.optimized``,
takes ``STEPS`` steps of SGD. Each setting reports:

- how many buffers the optimized path asked the backend (or the symmetric-memory pool) for,
  and how many it got (``ProcessGroupMemory.allocate`` and ``SymmetricMemory.allocate``,
  counted from outside);
- the warnings that say a switch changed nothing;
- whether the parameters after the steps equal, bit for bit, those of the setting without any
  switch (deterministic kernels on the GPU), and the peak of allocated memory on a GPU.

What one rank can show: at world size 1 the optimized path exchanges nothing (the copy-out
reads the all-gather's input, the packed gradients are the sum), so the only buffer a switch can
take is the reduce-scatter's packed input: from the backend with
``set_allocate_memory_from_process_group_for_comm``, from the symmetric-memory pool (made known
to the world by a rendezvous) only with ``set_force_sum_reduction_for_comms`` as well.
``set_symm_mem_for_comm`` alone then asks for nothing. The verdict (``verdict``): on NCCL each
setting that asks gets every buffer it asks for and no fallback warning, on gloo it warns once
and gets none, nothing else asks or warns, and every setting trains to the same bits. The exit
status is 1 on a miss. What needs two GPUs or more, and so waits for a larger machine: NCCL
running its collectives on that memory, and the mean taken inside the collective
(``ReduceOp.AVG``), which the optimized path uses only with two or more data-parallel ranks.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from pathlib import Path
from unittest import mock

# before CUDA starts: cuBLAS picks the same kernels every time, so runs compare bit for bit
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

STEPS = 3
SETTINGS = {  # name -> the FSDPModule methods called on every sharded module, with arguments
    "none": [],
    "process_group": [("set_allocate_memory_from_process_group_for_comm", (True,))],
    "symm_mem": [("set_symm_mem_for_comm", ())],
    "symm_mem+force_sum": [
        ("set_symm_mem_for_comm", ()),
        ("set_force_sum_reduction_for_comms", (True,)),
    ],
    "force_sum": [("set_force_sum_reduction_for_comms", (True,))],
    "max_input_buffers_2": [("set_reduce_scatter_max_input_buffers", (2,))],
    "separate_reduce_scatter_group": [("set_separate_reduce_scatter_group", (True,))],
}
ASKING = {  # the settings that ask for memory at one rank, and the switch a warning names
    "process_group": "set_allocate_memory_from_process_group_for_comm",
    "symm_mem+force_sum": "set_symm_mem_for_comm",
}


def join(device: str) -> tuple[torch.device, str]:
    """Be rank 0 of a world of one on ``device``: NCCL on a GPU, gloo on the CPU."""
    from twinshard.ranks import devices

    backend = "nccl" if device == "cuda" else "gloo"
    if device == "cuda":
        torch.use_deterministic_algorithms(True, warn_only=True)  # a difference shows below
    on = devices.join_group(backend, 0, store=dist.HashStore(), rank=0, world_size=1)
    return on, backend


class Counted:
    """Counts the calls of ``allocate`` on a class of ``twinshard/api/comm_memory.py``: asked,
    and given (a tensor back rather than None, which means the caching allocator's)."""

    def __init__(self, cls):
        self.cls, self.original = cls, cls.allocate
        self.asked = self.given = 0

    def __enter__(self):
        counter = self

        def allocate(memory, size, *, dtype, device):
            counter.asked += 1
            buffer = counter.original(memory, size, dtype=dtype, device=device)
            counter.given += buffer is not None
            return buffer

        self.patch = mock.patch.object(self.cls, "allocate", allocate)
        self.patch.start()
        return self

    def __exit__(self, *exc):
        self.patch.stop()


def train(setting: str, device: torch.device) -> dict:
    """``STEPS`` steps of a fresh ``MLPStack`` under ``setting``; what ``verdict`` reads."""
    import twinshard.optimized as O
    from twinshard.api import comm_memory
    from twinshard.models import MLPStack

    torch.manual_seed(0)
    model = MLPStack(dim=64, hidden=128, n_blocks=4).to(device)
    for block in model.blocks:
        O.fully_shard(block)
    O.fully_shard(model)
    comm_memory.WARNED.clear()  # each setting may warn again: one warning per setting is counted
    counters = [Counted(comm_memory.ProcessGroupMemory), Counted(comm_memory.SymmetricMemory)]
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    with warnings.catch_warnings(record=True) as caught, counters[0], counters[1]:
        warnings.simplefilter("always")
        for module in (*model.blocks, model):
            for method, args in SETTINGS[setting]:
                getattr(module, method)(*args)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        torch.manual_seed(1)
        for _ in range(STEPS):
            model(torch.randn(16, 64, device=device)).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
    said = [str(w.message) for w in caught if "communication buffers" in str(w.message)]
    return {
        "setting": setting,
        "asked": sum(c.asked for c in counters),
        "given": sum(c.given for c in counters),
        "warnings": said,
        "params": [p.to_local().detach().cpu().clone() for p in model.parameters()],
        "peak_mb": torch.cuda.max_memory_allocated() / 2**20 if device.type == "cuda" else None,
    }


def attempt(setting: str, device: torch.device) -> dict:
    """``train``, or the error it raised (a setting the backend refuses is a finding, and the
    other settings still run)."""
    try:
        return train(setting, device)
    except Exception as error:  # noqa: BLE001 - reported, and counted as a miss
        return {"setting": setting, "error": f"{type(error).__name__}: {error}"}


def same_bits(row: dict, base: dict) -> bool:
    """Whether ``row``'s parameters after the steps equal ``base``'s bit for bit."""
    if "params" not in row or "params" not in base:
        return False
    return all(torch.equal(a, b) for a, b in zip(row["params"], base["params"], strict=True))


def verdict(rows: list[dict], backend: str) -> list[str]:
    """What is missed, one line each (none: every check held). ``rows``: ``train``'s, the
    setting ``none`` first."""
    missed = []
    for row in rows:
        name = row["setting"]
        if "error" in row:
            missed.append(f"{name}: raised {row['error']}")
            continue
        if not same_bits(row, rows[0]):
            missed.append(f"{name}: the parameters after {STEPS} steps differ from 'none'")
        switch = ASKING.get(name)
        if switch is None:
            if row["asked"] or row["warnings"]:
                missed.append(f"{name}: asked for memory or warned, with no switch that asks")
        elif backend == "nccl":
            if row["warnings"] or row["asked"] == 0 or row["given"] != row["asked"]:
                missed.append(
                    f"{name}: on NCCL {row['given']} of {row['asked']} buffers came from "
                    f"{switch}'s memory; warnings: {row['warnings']}"
                )
        elif len(row["warnings"]) != 1 or not row["warnings"][0].startswith(switch):
            missed.append(f"{name}: on {backend} not one warning from {switch}: {row['warnings']}")
        elif row["given"]:
            missed.append(f"{name}: {backend} gave {row['given']} buffers")
    return missed


def table(rows: list[dict], backend: str, device: str) -> list[str]:
    lines = [
        f"## Communication switches, `twinshard.optimized`, {backend} on {device}, world size 1",
        "",
        f"`MLPStack` (dim 64, 4 blocks), {STEPS} steps of SGD per setting, from the same seed.",
        "",
        "| setting | buffers asked | given | fallback warnings | same bits as none | peak MB |",
        "|---|---:|---:|---:|---|---:|",
    ]
    for row in rows:
        if "error" in row:
            lines.append(f"| {row['setting']} | raised: {row['error'][:200]} | | | | |")
            continue
        same = same_bits(row, rows[0])
        peak = f"{row['peak_mb']:.1f}" if row["peak_mb"] is not None else "-"
        lines.append(
            f"| {row['setting']} | {row['asked']} | {row['given']} | {len(row['warnings'])} "
            f"| {'yes' if same else 'NO'} | {peak} |"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--out", type=Path, default=None, help="a folder for the results")
    args = parser.parse_args(argv)
    device, backend = join(args.device)
    try:
        rows = [attempt(setting, device) for setting in SETTINGS]
    finally:
        dist.destroy_process_group()
    missed = verdict(rows, backend)
    lines = table(rows, backend, args.device)
    lines += ["", *(f"- MISSED: {m}" for m in missed)] if missed else ["", "- every check held"]
    print("\n".join(lines))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "comm-switches.md").write_text("\n".join(lines) + "\n")
        kept = [{k: v for k, v in row.items() if k != "params"} for row in rows]
        record = {"backend": backend, "torch": torch.__version__, "rows": kept, "missed": missed}
        (args.out / "comm-switches.json").write_text(json.dumps(record, indent=1) + "\n")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
