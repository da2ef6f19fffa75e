"""What the collective guard costs (``twinshard.guard``): debug off, debug on, the fingerprint.

    python benchmarks/guard_cost.py            # 2 gloo ranks

1. ``check_collective`` with debug off: the call every collective pays, timed in one process.
2. A bare all-gather of 1,000 floats on 2 ranks, unchecked and checked: the cost per collective.
3. Training steps of the small Llama (2 blocks) with the reference and the optimized path,
   debug off and on: what a run pays per step.
4. ``check_model`` (the fingerprint exchange at the root's first forward).

Timings are medians over repetitions, printed by rank 0; they depend on the machine's load.
"""

from __future__ import annotations

import importlib
import statistics
import time
import timeit

import torch
import torch.distributed as dist

from twinshard import guard
from twinshard.guard import channel
from twinshard.models import Llama, LlamaConfig
from twinshard.ranks.launch import launch

all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _median_seconds(fn, repeat: int, number: int) -> float:
    return statistics.median(timeit.repeat(fn, repeat=repeat, number=number)) / number


def _collectives(n: int = 400) -> tuple[float, float]:
    send, recv = torch.ones(1000), torch.empty(2000)
    plain = lambda: all_gather(recv, send)  # noqa: E731

    def checked():
        guard.check_collective("all_gather", send, None, "bench.weight")
        all_gather(recv, send)

    guard.set_debug(False)
    off = _median_seconds(plain, 5, n)
    guard.set_debug(True)  # what TWINSHARD_DEBUG=1 turns on
    on = _median_seconds(checked, 5, n)
    guard.set_debug(False)
    return off, on


def _steps(impl_name: str, debug: bool, steps: int = 12) -> float:
    impl = importlib.import_module(impl_name)
    torch.manual_seed(0)
    config = LlamaConfig.preset("tiny")
    model = Llama(config)
    for block in model.blocks:
        impl.fully_shard(block)
    impl.fully_shard(model)
    tokens = torch.randint(0, config.vocab_size, (4, 65))
    model(tokens[:, :-1], tokens[:, 1:]).backward()  # lazy init (reads the environment)
    guard.set_debug(debug)
    times, before = [], sum(channel.seq.values())
    for _ in range(steps):
        dist.barrier()
        start = time.perf_counter()
        model(tokens[:, :-1], tokens[:, 1:]).backward()
        times.append(time.perf_counter() - start)
    guard.set_debug(False)
    if debug:
        print(f"{impl_name}: {(sum(channel.seq.values()) - before) / steps:.0f} collectives a step")
    return statistics.median(times)


def _fingerprint() -> float:
    model = Llama(LlamaConfig.preset("tiny"))
    return _median_seconds(lambda: guard.check_model(model), 5, 5)


def measure() -> dict:
    off, on = _collectives()
    result = {"all_gather unchecked": off, "all_gather checked": on}
    for impl in ("twinshard.reference", "twinshard.optimized"):
        for debug in (False, True):
            result[f"{impl} step, debug {'on' if debug else 'off'}"] = _steps(impl, debug)
    result["check_model (Llama tiny)"] = _fingerprint()
    return result


def main() -> None:
    guard.set_debug(False)
    call = _median_seconds(lambda: guard.check_collective("all_gather", None, None), 5, 200_000)
    print(f"check_collective, debug off: {call * 1e9:.0f} ns per call")
    result = launch(measure, 2, timeout=600)[0]
    for name, seconds in result.items():
        print(f"{name}: {seconds * 1e3:.3f} ms")
    per = result["all_gather checked"] - result["all_gather unchecked"]
    print(f"the check, per collective (2 ranks): {per * 1e3:.3f} ms")


if __name__ == "__main__":
    main()
