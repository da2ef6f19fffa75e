"""The optimized path's order of stream waits and events: the device's against the stand-ins'.

    python benchmarks/stream_order.py                    # the fake accelerator (no GPU needed)
    python benchmarks/stream_order.py --device cuda      # a real GPU's streams (gpu.sh runs it)

Runs two steps of the optimized path (a tiny Llama, bf16, world size 8 played by one process
on the fake process group) on the device with its stream calls logged, and the same steps on
the CPU with the stand-in streams, and compares the two logs by name
(``twinshard.measure.fakeaccel.stream_order``). Exit status 1 if they differ: then the stream
sanitizer that CI runs on the stand-ins did not check the order the device gets.
"""

from __future__ import annotations

import argparse
import sys

from twinshard.measure.fakeaccel.stream_order import first_difference, orders
from twinshard.measure.job import Job


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="fake", help="fake (default) or cuda")
    parser.add_argument("--world", type=int, default=8)
    parser.add_argument("--hsdp", type=int, default=1, help="replicas of a 2D mesh")
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()
    config = Job(
        impl="optimized", preset="tiny", seq=16, per_rank=2, dtype="bf16",
        world=args.world, replicas=args.hsdp,
    )  # fmt: skip
    device, standin = orders(config, args.steps, args.device)
    difference = first_difference(device, standin)
    print(
        f"optimized path, {args.steps} steps, world {args.world} ({args.hsdp} replicas): "
        f"{len(device)} stream entries on {args.device}, {len(standin)} with the stand-ins: "
        + ("the same order" if difference is None else f"they differ at {difference}")
    )
    return 0 if difference is None and device else 1


if __name__ == "__main__":
    sys.exit(main())
