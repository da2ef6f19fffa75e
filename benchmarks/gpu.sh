#!/usr/bin/env bash
# One call on a GPU machine (no network needed): install twinshard, then
#   1. the conformance suite at world size 1 with NCCL,
#   2. `twinshard bench` at world size 1 with NCCL: plain, DDP, reference, optimized and torch's
#      fully_shard on a ~1B-parameter Llama in bf16,
#   3. `twinshard bench` on the simulated network at world sizes 8 and 64 (the GPU stands in
#      for rank 0; each collective keeps its stream busy for the NVLink time),
#   4. the hook overhead (fake process group, 64 tiny blocks) with the GPU doing the compute.
# Results go to ${OUT:-benchmarks/results/gpu}. DEVICE=cpu SMOKE=1 runs the same commands on
# the CPU with a tiny model (gloo instead of NCCL), to check the script without a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-benchmarks/results/gpu}
device=${DEVICE:-cuda}
py=${PYTHON:-python3}
mkdir -p "$out"
if [ "$device" = cuda ]; then
    backend=nccl
    model=(--preset 1b --dtype bf16 --seq 2048 --per-rank 4)
    small=(--preset small --dtype bf16 --seq 1024 --per-rank 4)
    steps=(--warmup 3 --steps 10 --repeat 3)
    $py -m pip install -q --no-deps --no-build-isolation -e .
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/gpu.txt" || true
else
    backend=gloo
    model=(--preset tiny --seq 32 --per-rank 2)
    small=(--preset tiny --seq 32 --per-rank 2)
    steps=(--warmup 1 --steps 2 --repeat 1)
fi
[ "${SMOKE:-0}" = 1 ] && steps=(--warmup 1 --steps 2 --repeat 1)

$py -m twinshard.cli conform twinshard.optimized --device "$device" --world-sizes 1 \
    --report "$out/conform_optimized_$device.md" 2>&1 | tail -n 60 | tee "$out/conform.log" || true

$py -m twinshard.cli bench --device "$device" --backend "$backend" --world 1 "${model[@]}" \
    "${steps[@]}" --json "$out/bench-ws1.json" --markdown "$out/bench-ws1.md" \
    --plot "$out/bench-ws1.png" 2>&1 | tee "$out/bench-ws1.log"

for world in 8 64; do
    $py -m twinshard.cli bench --device "$device" --backend simnet --world "$world" \
        --link nvlink "${small[@]}" "${steps[@]}" --json "$out/simnet-ws$world.json" \
        --markdown "$out/simnet-ws$world.md" 2>&1 | tee "$out/simnet-ws$world.log"
done

$py -m twinshard.cli bench hooks --device "$device" "${steps[@]}" \
    --json "$out/hooks.json" --markdown "$out/hooks.md" 2>&1 | tee "$out/hooks.log"
