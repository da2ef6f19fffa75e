#!/usr/bin/env bash
# One call on a GPU machine (no network): install twinshard, run the GPU conformance suite at
# world size 1 with NCCL, then the side-by-side benchmark on a ~1B-parameter Llama in bf16,
# with a profiler trace of the optimized run. Results go to ${OUT:-benchmarks/results/gpu}.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-benchmarks/results/gpu}
mkdir -p "$out"
python3 -m pip install -q --no-deps --no-build-isolation -e .
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/gpu.txt" || true
python3 -m twinshard.cli conform twinshard.optimized --device cuda --world-sizes 1 \
    --report "$out/conform_optimized_cuda.md" 2>&1 | tail -n 60 | tee "$out/conform.log" || true
python3 benchmarks/bench.py --device cuda --nproc 1 --preset 1b --dtype bf16 --seq 2048 \
    --per-rank 4 --warmup 3 --steps 10 --repeat 2 --trace "$out" \
    --json "$out/bench_1b_bf16.json" 2>&1 | tee "$out/bench.log"
