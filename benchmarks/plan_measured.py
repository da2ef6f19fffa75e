"""``twinshard plan`` against ``twinshard bench`` at small scale, on this CPU (issue 26, item 3).

One job, planned and measured: the small Llama (``LAYERS`` blocks) on 2 ranks, 2 x 128 tokens
per rank, fp32, SGD, over the simulated network (``bench --backend simnet --world 2``, which
really runs rank 0's step on this CPU while the network is simulated). ``twinshard plan
--device cpu`` predicts it with constants it measures on this machine as it starts
(``profiles.measure_cpu``); ``twinshard bench`` measures it.

- **memory** is deterministic: the plan's probe (``measure.probe``'s categories at their peak,
  recorded under ``FakeTensorMode``) and the bench's measured one are compared to the byte by
  ``tests/measuring/test_plan_measured.py``, in CI;
- **time** is a measurement on a shared machine, so it is a benchmark, not a test: this module
  runs the job ``--runs`` times and reports, run by run and implementation by implementation,
  the predicted step against the measured step's CPU time (``time.process_time`` of the rank's
  process, the median of ``STEPS`` steps: on shared cores a wall-clock step is as long as the
  neighbours make it, and the plan predicts a step on a core of its own). The target is
  within 20%; the exit code is 1 when an implementation's median ratio misses it.

    python benchmarks/plan_measured.py --runs 5 \\
        --out benchmarks/results/DATE-plan-measured.md \\
        --json benchmarks/results/DATE-plan-measured.json
"""

from __future__ import annotations

import argparse
import statistics
import sys

from twinshard.commandline.report_files import publish
from twinshard.measure.job import Job
from twinshard.measure.units import markdown_table, ms

IMPLS = ("reference", "optimized", "torch")
LAYERS = 4
SHAPE = dict(world=2, seq=128, dtype="fp32")
JOB = dict(SHAPE, preset="small", per_rank=2)  # and LAYERS blocks
STEPS = 8  # timed steps per run; their CPU times vary by about 8% from step to step
TARGET = (0.8, 1.2)  # predicted over measured


def bench_config(steps: int = STEPS, link: str = "ib") -> Job:
    """The job as ``twinshard bench`` runs it (2 warm-up steps, then ``steps`` timed)."""
    where = dict(backend="simnet", link=link, warmup=2, steps=steps)
    return Job(**JOB, model={"n_layers": LAYERS}, **where)


def plan_configs(impls=IMPLS) -> list:
    """The same job as ``twinshard plan --device cpu --network simnet:ib --probe`` plans it."""
    from twinshard.measure.plan import config

    plan = dict(device="cpu", network="simnet:ib", optimizer="sgd", probe=True)
    return [config.job(**JOB, model={"n_layers": LAYERS}, impl=impl, **plan) for impl in impls]


def measure_and_plan(impls=IMPLS, steps: int = STEPS, link: str = "ib") -> tuple[dict, dict]:
    """Bench then plan every implementation: (bench's summary by impl, the plan's row by
    impl). A plan that failed raises, naming the implementation. ``link``: the simulated
    network's link for the bench ("inf": each collective done when issued, so that every
    buffer lives as the program holds it; over a slower link the wire holds a collective's
    input until it is sent, as a real network does, for a time the CPU's load decides)."""
    from twinshard.measure.bench.compare import side_by_side
    from twinshard.measure.plan.cli import plan

    config = bench_config(steps, link)
    measured = side_by_side(config, list(impls), 1, progress=False, overlap=False)
    planned = dict(zip(impls, plan(plan_configs(impls), progress=False)))
    for impl, row in planned.items():
        if "error" in row:
            raise RuntimeError(f"twinshard plan ({impl}): {row['error']}")
    return measured["summary"], planned


def step_ratios(measured: dict, planned: dict) -> dict:
    """impl -> the predicted step, the measured step's CPU seconds and their ratio."""
    out = {}
    for impl, row in planned.items():
        predicted, cpu = row["time"]["step_s"], measured[impl]["cpu_s"]
        out[impl] = {"predicted_s": predicted, "measured_cpu_s": cpu, "ratio": predicted / cpu}
    return out


def verdict(runs: list[dict]) -> dict:
    """impl -> the median, lowest and highest ratio over ``runs`` (each ``step_ratios``'s
    answer), how many runs were within ``TARGET``, and whether the median is."""
    low, high = TARGET
    out = {}
    for impl in runs[0]:
        ratios = [run[impl]["ratio"] for run in runs]
        median = statistics.median(ratios)
        out[impl] = {
            "median": median,
            "lowest": min(ratios),
            "highest": max(ratios),
            "within": sum(low <= r <= high for r in ratios),
            "runs": len(ratios),
            "met": low <= median <= high,
        }
    return out


def markdown(runs: list[dict], summary: dict) -> str:
    head = ["run", "implementation", "predicted step (ms)", "measured CPU time (ms)", "ratio"]
    rows = [
        [str(k), impl, ms(r["predicted_s"]), ms(r["measured_cpu_s"]), f"{r['ratio']:.3f}"]
        for k, run in enumerate(runs, 1)
        for impl, r in run.items()
    ]
    spread = [
        [impl, *(f"{v[k]:.3f}" for k in ("median", "lowest", "highest"))]
        + [f"{v['within']} of {v['runs']}"]
        for impl, v in summary.items()
    ]
    second = ["implementation", "median ratio", "lowest", "highest", "runs within 20%"]
    return markdown_table(head, rows, "rlrrr") + "\n\n" + markdown_table(second, spread, "lrrrr")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=5, help="how many times to bench and plan")
    parser.add_argument("--out", default=None, help="write the markdown tables here")
    parser.add_argument("--json", default=None, help="write every run's figures here")
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error(f"--runs must be at least 1, not {args.runs}")
    runs = []
    for k in range(args.runs):
        runs.append(step_ratios(*measure_and_plan()))
        ratios = ", ".join(f"{i} {r['ratio']:.3f}" for i, r in runs[-1].items())
        print(f"run {k + 1} of {args.runs}: {ratios}", file=sys.stderr, flush=True)
    summary = verdict(runs)
    text = markdown(runs, summary)
    publish(text, args.out, args.json, {"runs": runs, "summary": summary, "target": TARGET})
    return 0 if all(v["met"] for v in summary.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
