#!/usr/bin/env bash
# One call on a GPU machine (no network needed): install twinshard, then, most valuable first
# (a loan is 15 minutes with start-up; the script must fit 8),
#   1. the accelerator checks: the reference, the optimized path and torch's fully_shard train
#      two steps on the GPU under torch.cuda.set_sync_debug_mode("error"), with the
#      fake-accelerator run's checks on the real device (real tensors, PyTorch's fake process
#      group registered for the GPU alone, so one GPU plays rank 0 of 8, of 64 and of HSDP 8x8;
#      host syncs, host tensors in collectives, the collectives against the CPU run's, memory
#      against the model), the optimized path's order of waits and events on the real
#      streams against the stand-in streams' log (benchmarks/stream_order.py), and torch's
#      switches for NCCL's own memory at world size 1 (benchmarks/comm_switches.py: every
#      buffer asked for given, no fallback, the same bits; about 20 s),
#   2. `twinshard bench` at world size 1 with NCCL: the optimized path against torch's
#      fully_shard (and the plain model, the step with no FSDP) on a ~1B-parameter Llama in bf16,
#   3. the hook overhead (fake process group, 64 tiny blocks) with the GPU doing the compute,
#   4. the conformance suite at world size 1 with NCCL,
#   5. `twinshard bench` on the simulated network at world sizes 8 and 64, the optimized path
#      against torch's (the GPU stands in for rank 0; each collective keeps its stream busy for
#      the NVLink time).
# Each command of steps 2 to 5 has a time limit of its own (LIMIT seconds, 150 by default),
# so that a slow one leaves the others their turn. Results go to ${OUT:-benchmarks/results/gpu}.
# DEVICE=cpu SMOKE=1 runs the same commands on the CPU with a tiny model (gloo instead of NCCL;
# step 1 on the fake accelerator), to check the script without a GPU. The exit status is 1 if a
# check of step 1 failed (after every step has run); it names them last.
# Only 8 files come back from a lent machine's $OUT, and this script writes about 30: with
# ARCHIVE set it packs the results folder into that one file at the end, whatever failed, e.g.
#   ARCHIVE=$OUT/gpu.tar.gz OUT=/tmp/gpu LIMIT=95 timeout 455 bash benchmarks/gpu.sh
set -euo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-benchmarks/results/gpu}
device=${DEVICE:-cuda}
py=${PYTHON:-python3}
limit=${LIMIT:-150}
mkdir -p "$out"
if [ -n "${ARCHIVE:-}" ]; then
    trap 'tar czf "$ARCHIVE" -C "$out" .' EXIT
fi
if [ "$device" = cuda ]; then
    backend=nccl
    model=(--model 1b --dtype bf16 --seq 2048 --per-rank 4)
    small=(--model small --dtype bf16 --seq 1024 --per-rank 4)
    # One repetition: each run of the 1B bench takes about 30 s on an H200 or an H100 (most of
    # it building the model), so the whole script fits the 8 minutes of a loan (measured
    # 2026-11-26 and 2026-11-27: step 1 took 75 s on the H100, step 2 85 s, step 3 about 110 s,
    # step 4 60 s; step 5 runs two implementations only, since five ran past 125 s).
    steps=(--warmup 3 --steps 10 --repeat 1)
    $py -m pip install -q --no-deps --no-build-isolation -e .
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/gpu.txt" || true
else
    backend=gloo
    model=(--model tiny --seq 32 --per-rank 2)
    small=(--model tiny --seq 32 --per-rank 2)
    steps=(--warmup 1 --steps 2 --repeat 1)
fi
[ "${SMOKE:-0}" = 1 ] && steps=(--warmup 1 --steps 2 --repeat 1)

accel=fake  # step 1 on the CPU: the fake accelerator (twinshard.measure.fakeaccel)
[ "$device" = cuda ] && accel=cuda
failed=()
stopped=()
for mesh in "8" "64" "64 --hsdp 8 --offload --reshard-after-forward 4"; do
    name=accel-ws${mesh// /}
    name=${name//--/-}
    # shellcheck disable=SC2086  # $mesh holds several flags
    $py -m twinshard.measure.fakeaccel --device "$accel" --world $mesh --json "$out/$name.json" \
        --markdown "$out/$name.md" > "$out/$name.log" 2>&1 || failed+=("$name")
    cat "$out/$name.md" 2>/dev/null || tail -n 30 "$out/$name.log"
done
$py benchmarks/stream_order.py --device "$accel" 2>&1 | tee "$out/stream-order.log" \
    || failed+=(stream-order)
$py benchmarks/comm_switches.py --device "$device" --out "$out" 2>&1 \
    | tee "$out/comm-switches.log" || failed+=(comm-switches)

timeout "$limit" $py -m twinshard.cli bench --device "$device" --backend "$backend" --world 1 "${model[@]}" \
    --impls plain,optimized,torch \
    "${steps[@]}" --json "$out/bench-ws1.json" --markdown "$out/bench-ws1.md" \
    --plot "$out/bench-ws1.png" 2>&1 | tee "$out/bench-ws1.log" || stopped+=(bench-ws1)

timeout "$limit" $py -m twinshard.cli bench hooks --device "$device" "${steps[@]}" \
    --json "$out/hooks.json" --markdown "$out/hooks.md" 2>&1 | tee "$out/hooks.log" \
    || stopped+=(hooks)

timeout "$limit" $py -m twinshard.cli conform twinshard.optimized --device "$device" --world-sizes 1 \
    --report "$out/conform_optimized_$device.md" 2>&1 | tail -n 60 | tee "$out/conform.log" || stopped+=(conform)

for world in 8 64; do
    timeout "$limit" $py -m twinshard.cli bench --device "$device" --backend simnet --world "$world" \
        --link nvlink --impls optimized,torch "${small[@]}" "${steps[@]}" \
        --json "$out/simnet-ws$world.json" --markdown "$out/simnet-ws$world.md" 2>&1 | tee "$out/simnet-ws$world.log" \
        || stopped+=("simnet-ws$world")
done

if [ ${#stopped[@]} -gt 0 ]; then  # a measurement is missing: say which, without failing
    echo "benchmarks that failed or ran past ${limit} s: ${stopped[*]}" >&2
fi
if [ ${#failed[@]} -gt 0 ]; then
    echo "accelerator checks failed: ${failed[*]} (see $out/<name>.log)" >&2
    exit 1
fi
