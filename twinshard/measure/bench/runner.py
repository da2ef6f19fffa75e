"""Running the implementations: one training run in one process, and many side by side.

``run_rank(config)`` is what every rank executes: join the world (``measure.world``; a
simulated one, ``fake`` or ``simnet``, as rank 0 of ``config.world``), build the model and step it
(``measure.step``), warm up, time ``config.steps`` steps (wall clock, and CPU time of the whole
process), then one untimed step under ``monitor.Monitor`` with ``probe.Probe`` for memory by
category and the collectives.

``run(config)`` starts the processes: ``twinshard.ranks.launch`` for real ranks (gloo, nccl), one
freshly spawned process for a simulated world. Every run gets processes of its own, so no
implementation's memory or allocator state is left to the next one.

``compare(configs, repeat)`` interleaves: repetition 1 runs every configuration once, then
repetition 2 again, starting one further along the list each time, so that a slow spell of a
shared machine hits all implementations alike rather than one of them.
"""

from __future__ import annotations

import os
import resource
import statistics
import time

import torch
import torch.distributed as dist

from twinshard.measure import step, world
from twinshard.measure.job import Job
from twinshard.measure.monitor import Monitor
from twinshard.measure.probe import Probe, sharded_modules
from twinshard.ranks import fresh_process

from .progress import Progress


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _comm_of_step(calls: list) -> dict:
    """Simulated communication of one step: its total time, the first all-gather and the last
    reduce-scatter (DDP: all-reduce), which nothing can hide, and the number of collectives."""
    first = next((c for c in calls if c.op == "all_gather"), None)
    last = next((c for c in reversed(calls) if c.op == "reduce_scatter"), None)
    if last is None:  # DDP: its last bucket's all-reduce
        last = next((c for c in reversed(calls) if c.op == "all_reduce"), None)
    return {
        "comm_s": sum(c.end - c.start for c in calls),
        "first_all_gather_s": (first.end - first.start) if first else 0.0,
        "last_reduce_scatter_s": (last.end - last.start) if last else 0.0,
        "count": len(calls),
    }


def run_rank(config: Job) -> dict:
    """One implementation on this rank: step times, memory, collectives (see the module doc)."""
    if config.simulated:
        torch.set_num_threads(int(os.environ.get("TWINSHARD_THREADS", "1") or "0") or 1)
    device = world.join(config.backend, config.world, config.device, config.link, config.latency_us)
    net = None
    if config.backend == "simnet":
        from twinshard.measure import simnet

        net = simnet.network()
    cuda = config.device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    rss0 = _rss_bytes()
    model, opt = step.build(config, device)
    tokens = step.tokens(config, config.llama().vocab_size, dist.get_rank(), device)
    wall, cpu, comm, phases = [], [], [], []  # phases: CPU s of forward, backward, optimizer
    marks: list[float] = []  # CPU time when a step's forward and backward end
    mark = lambda _: marks.append(time.process_time())  # noqa: E731
    profiler = None
    for k in range(config.warmup + config.steps):
        timed = k >= config.warmup
        if timed and config.profile and profiler is None:
            import cProfile

            profiler = cProfile.Profile()
            profiler.enable()
        n0 = len(net.calls) if net else 0
        sync()
        marks.clear()
        t0, c0 = time.perf_counter(), time.process_time()
        loss = step.train_step(model, opt, tokens, mark)
        sync()
        t1, c1 = time.perf_counter(), time.process_time()
        if timed:
            c_fwd, c_bwd = marks
            wall.append(t1 - t0)
            cpu.append(c1 - c0)
            phases.append((c_fwd - c0, c_bwd - c_fwd, c1 - c_bwd))
            if net:
                comm.append(_comm_of_step(net.calls[n0:]))
    if profiler is not None:
        profiler.disable()
        os.makedirs(config.profile, exist_ok=True)
        profiler.dump_stats(os.path.join(config.profile, f"{config.impl}.prof"))
    result = {
        "wall_s": wall,
        "cpu_s": cpu,
        "phases_cpu_s": phases,
        "loss": loss.item(),
        "params": sum(p.numel() for p in model.parameters()),
        "tokens_per_step": config.per_rank * config.seq * dist.get_world_size(),
        "comm": comm,
        "rss_growth": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss0,
    }
    if cuda:
        result["accelerator_peak"] = torch.cuda.max_memory_allocated()
    if config.memory:
        result.update(_measure_memory(model, opt, tokens, net))
    return result


def _measure_memory(model, opt, tokens, net) -> dict:
    """One more step under the monitor, with the probe: bytes by category at the peak, and the
    collectives."""
    monitor = Monitor("cpu", Probe(model, opt, sharded_modules(model)))
    monitor.begin("step")  # out of "setup", where host operators are not watched
    if net is not None:
        net.observer = monitor.saw
    with monitor:
        step.train_step(model, opt, tokens)
    if net is not None:
        net.observer = None
    ops: dict[str, list[int]] = {}
    for c in monitor.finish()[-1].collectives:
        entry = ops.setdefault(c.op, [0, 0])
        entry[0] += 1
        entry[1] += c.nbytes
    probe = monitor.probe
    return {
        "memory": probe.peak,
        "memory_total": probe.peak_total,
        "heap_peak": probe.heap_peak,
        "collectives": {op: {"count": n, "bytes": b} for op, (n, b) in ops.items()},
    }


def run(config: Job, timeout: float = 1800) -> dict:
    """Run ``config`` in processes of its own; the ranks' results combined (rank 0's memory,
    each step as slow as its slowest rank)."""
    if config.simulated:
        return fresh_process.call(run_rank, config, timeout=timeout)
    from twinshard.ranks.launch import launch

    results = launch(run_rank, config.nproc, config, backend=config.backend, timeout=timeout)
    first = dict(results[0])
    for key in ("wall_s", "cpu_s"):
        first[key] = [max(steps) for steps in zip(*(r[key] for r in results))]
    return first


def compare(configs: list[Job], repeat: int, progress: bool = True) -> list[list[dict]]:
    """Every configuration ``repeat`` times, interleaved; ``out[i]`` holds config i's runs."""
    out: list[list[dict]] = [[] for _ in configs]
    bar = Progress(len(configs) * repeat, "bench", enabled=progress)
    for rep in range(repeat):
        order = [(rep + k) % len(configs) for k in range(len(configs))]
        for i in order:
            start = time.monotonic()
            out[i].append(run(configs[i]))
            bar.advance(f"{label(configs[i])} #{rep + 1} ({time.monotonic() - start:.0f}s)")
    bar.close()
    return out


def label(config: Job) -> str:
    extra = f" @{config.link}" if config.backend == "simnet" else ""
    return config.impl + extra


def median(values) -> float:
    values = list(values)
    return statistics.median(values) if values else float("nan")
