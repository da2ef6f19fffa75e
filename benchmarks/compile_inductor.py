"""Layers compiled in place with inductor: does twinshard compile and compute as torch does?

    python benchmarks/compile_inductor.py                 # 2 gloo ranks, backend inductor
    python benchmarks/compile_inductor.py --backend aot_eager

The setting of tests/ecosystem/test_compile_markers.py with code generation: the tiny ``transformers``
Llama of tests/support/client_common.py (4 decoder layers) is sharded by torch's ``fully_shard``, the
reference and the optimized path in turn, on 2 gloo ranks of one ``launch``; its layers are
compiled in place (``layer.compile(backend=...)``), it trains 2 steps (SGD) and is evaluated
once under ``no_grad``. Per implementation and rank it records the graphs dynamo compiled
(``counters["stats"]["unique_graphs"]``), the guard failures of each recompile in order, the
losses, the evaluation logits and the seconds taken, then prints a markdown table comparing
each implementation with torch on the same rank (bitwise, else the largest difference).

Each implementation compiles with a fresh inductor cache of its own, so none reuses the code
an earlier one generated, after a warm-up compile has paid the one-time costs (imports, compile
workers): the seconds compare. Which ``twinshard`` is measured is printed:
put an older tree first on ``PYTHONPATH`` (and run from outside the checkout) to measure it.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import re
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

IMPLS = {
    "torch": "torch.distributed.fsdp",
    "reference": "twinshard.reference",
    "optimized": "twinshard.optimized",
}
GUARD_FAILURE = re.compile(r"^\s*- (\d+/\d+): (.*?)(?:\s+#.*)?$", re.M)


class _GuardFailures(logging.Handler):
    """Collects, per recompile dynamo logs, the failing guards as (cache entry, guard) pairs."""

    def __init__(self):
        super().__init__()
        self.recompiles: list[list[tuple[str, str]]] = []

    def emit(self, record):
        found = GUARD_FAILURE.findall(record.getMessage())
        if found:
            self.recompiles.append(found)


def _one_impl(module_name: str, backend: str, layers: int, cache: str) -> dict:
    """Shard, compile the layers in place, train 2 steps, evaluate: what this rank saw."""
    import torch._dynamo
    from client_common import tiny_llama, tokens
    from torch._dynamo.utils import counters
    from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir

    impl = importlib.import_module(module_name)
    torch._dynamo.reset()
    counters.clear()
    watcher = _GuardFailures()
    dynamo_log = logging.getLogger("torch._dynamo")
    torch._logging.set_logs(recompiles=True)
    dynamo_log.addHandler(watcher)
    start = time.perf_counter()
    try:
        with temporary_cache_dir(cache):
            model = tiny_llama(layers=layers)
            for layer in model.model.layers:
                impl.fully_shard(layer)
            impl.fully_shard(model)
            for layer in model.model.layers:
                layer.compile(backend=backend)
            sgd = torch.optim.SGD(model.parameters(), lr=0.1)
            losses = []
            for step in range(2):
                batch = tokens(step)
                loss = model(input_ids=batch, labels=batch).loss
                loss.backward()
                sgd.step()
                sgd.zero_grad()
                losses.append(loss.detach())
            model.eval()
            with torch.no_grad():
                logits = model(input_ids=tokens(2)).logits
    finally:
        dynamo_log.removeHandler(watcher)
        torch._logging.set_logs()
    return {
        "graphs": counters["stats"]["unique_graphs"],
        "recompiles": watcher.recompiles,
        "losses": torch.stack(losses),
        "logits": logits,
        "seconds": time.perf_counter() - start,
    }


def _warm_up(backend: str, cache: str) -> None:
    """Pay the backend's one-time costs (imports, compile workers) before the first timing."""
    from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir

    with temporary_cache_dir(cache):
        x = torch.ones(4, requires_grad=True)
        torch.compile(lambda t: (t.sin() * 2).sum(), backend=backend)(x).backward()
    torch._dynamo.reset()


def every_impl(backend: str, layers: int, cache_root: str) -> dict:
    _warm_up(backend, f"{cache_root}/warm-up")
    return {n: _one_impl(m, backend, layers, f"{cache_root}/{n}") for n, m in IMPLS.items()}


def _difference(mine: torch.Tensor, truth: torch.Tensor) -> str:
    if torch.equal(mine, truth):
        return "bitwise"
    return f"max abs {(mine - truth).abs().max().item():.3g}"


def table(by_rank: list[dict]) -> str:
    rows = [
        "| impl | rank | graphs | recompiles | = torch's guards | losses | eval logits | s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name in IMPLS:
        for rank, runs in enumerate(by_rank):
            mine, truth = runs[name], runs["torch"]
            rows.append(
                f"| {name} | {rank} | {mine['graphs']} | {len(mine['recompiles'])} "
                f"| {'yes' if mine['recompiles'] == truth['recompiles'] else 'NO'} "
                f"| {_difference(mine['losses'], truth['losses'])} "
                f"| {_difference(mine['logits'], truth['logits'])} | {mine['seconds']:.1f} |"
            )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="inductor", help="torch.compile backend")
    parser.add_argument("--layers", type=int, default=4, help="decoder layers of the Llama")
    args = parser.parse_args(argv)

    import twinshard
    from twinshard.ranks.launch import launch

    print(f"twinshard from {Path(twinshard.__file__).parent}, torch {torch.__version__}")
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="compile-inductor-") as cache_root:
        by_rank = launch(
            every_impl, 2, args.backend, args.layers, cache_root, backend="gloo", timeout=3000
        )
    print(
        f"backend {args.backend}, {args.layers} layers, {time.perf_counter() - start:.0f} s in all\n"
    )
    print(table(by_rank))
    for name in IMPLS:
        print(f"\n{name}, rank 0, the first failing guard of each recompile:")
        for entry, guard in (failures[0] for failures in by_rank[0][name]["recompiles"]):
            print(f"  {entry}: {guard}")


if __name__ == "__main__":
    main()
