#!/usr/bin/env bash
# The CPU measurements recorded in benchmarks/results/ (see its README), in one call, one after
# the other: run it when the machine is quiet; every file notes the load average it saw.
#   1. gloo, world size 2, the 'small' preset: all five implementations;
#   2. hook overhead: fake process group, world size 8, 64 tiny blocks, profiled, with the
#      optimizer as on an accelerator (foreach) and as torch runs it on the CPU (a loop);
#   3. simulated network, world size 8, a link where communication and compute per block are of
#      the same order: overlap efficiency; and world size 64: memory against the model;
#   4. the sweep (model size, groups, world size) and its three plots.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-benchmarks/results}
day=${DAY:-$(date +%Y-%m-%d)}
py=${PYTHON:-python3}
mkdir -p "$out"
bench() { name=$1; shift; $py -m twinshard.cli bench "$@" --json "$out/$day-$name.json" \
    --markdown "$out/$day-$name.md" 2>&1 | grep --line-buffered -v -i warning | tee "$out/$day-$name.log"; }

bench cpu-gloo-ws2-small --world 2 --model small --seq 128 --per-rank 4 --warmup 3 \
    --steps 12 --repeat 5 --plot "$out/$day-cpu-gloo-ws2-small.png"
bench hooks-fake-ws8-64groups hooks --repeat 5
bench hooks-fake-ws8-64groups-cpu-loop hooks --repeat 5 --foreach auto
bench simnet-ws8-overlap --backend simnet --world 8 --link 0.3 --model small --vocab 1024 \
    --seq 64 --per-rank 2 --warmup 3 --steps 12 --repeat 3 --plot "$out/$day-simnet-ws8-overlap.png"
bench simnet-ws64-memory --backend simnet --world 64 --link ib --model small --seq 64 \
    --per-rank 2 --warmup 2 --steps 6 --repeat 2
$py -m twinshard.cli bench sweep --repeat 2 --out "$out" 2>&1 | grep --line-buffered -v -i warning \
    | tee "$out/$day-sweep.log"
for f in "$out"/sweep.json "$out"/sweep-*.png; do mv "$f" "$out/$day-$(basename "$f")"; done
