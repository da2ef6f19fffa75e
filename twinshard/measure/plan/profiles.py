"""The constants a plan predicts time with: devices and networks, chosen once and named.

A ``Device`` turns an operator into seconds (``Device.seconds``), ``DEVICES`` names the ones a
plan can target and ``CALIBRATED_ON`` the one published run each GPU's efficiency was fitted
on; that efficiency is the one constant that is not a datasheet figure, and it is held fixed
for every other prediction. A ``Network`` turns a collective into seconds on one of its two
links, each a ``measure.simnet.Link``, so the plan and the simulated network share one link
model; the latencies are NCCL's own model for rings (``src/graph/tuning.cc``, ring, Simple
protocol), the bus bandwidths those ``measure.simnet.LINKS`` uses where they coincide.
``NETWORKS`` names the clusters, ``simulated_network`` makes one of a simnet link for a CPU
plan. The CPU has no datasheet: ``measure_cpu()`` times this machine when a CPU plan starts,
and its one constant is ``CPU_EFFICIENCY`` (its fit is told beside it).

Every value and where it comes from: docs/plan.md, "The constants, chosen once"; how they are
applied: "How the time is predicted".
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

from twinshard.measure import simnet
from twinshard.measure.simnet import Link
from twinshard.measure.units import GiB

BF16, FP32 = "torch.bfloat16", "torch.float32"


@dataclass(frozen=True)
class Device:
    name: str
    peak_flops: dict  # dtype (str) -> FLOP/s, dense
    memory_bandwidth: float  # bytes/s
    efficiency: dict  # dtype -> the fraction of peak reached (docs/plan.md)
    capacity: int  # bytes of device memory
    host_link: float  # bytes/s between host and device, each way
    kernel_s: float = 4e-6  # no kernel takes less: launch and ramp-up
    overhead_s: float = 0.0  # the CPU's own time per operator (the CPU profile only)
    about: str = ""

    def seconds(self, flops: float, moved: float, dtype: str, host_copy: bool) -> float:
        """How long one operator takes (docs/plan.md, "How the time is predicted")."""
        if host_copy:
            return self.kernel_s + moved / self.host_link
        efficiency = self.efficiency.get(dtype, self.efficiency[BF16])
        work = max(flops / self.peak(dtype), moved / self.memory_bandwidth) / efficiency
        return self.overhead_s + max(work, self.kernel_s)

    def peak(self, dtype: str) -> float:
        return self.peak_flops.get(dtype, self.peak_flops[FP32])


# Fitted once per device, on the run named here; see benchmarks/results/*-plan-published.md.
CALIBRATED_ON = {
    "a100": "torchtitan, Llama 3 8B, 64 A100, local batch 1, selective op AC: 2,973 tokens/s",
    "h100-500w": "torchtitan, Llama 3.1 8B, 8 H100, local batch 2, selective AC: 5,762 tokens/s",
}
A100_EFFICIENCY = 0.816
H100_500W_EFFICIENCY = 0.684


def _gpu(name, bf16, fp32, bandwidth, efficiency, capacity, host_link, about) -> Device:
    """An accelerator from its datasheet: dense bf16 (= fp16) and fp32 peaks, one efficiency."""
    peaks = {BF16: bf16, "torch.float16": bf16, FP32: fp32}
    same = {BF16: efficiency, FP32: efficiency}
    return Device(name, peaks, bandwidth, same, capacity, host_link, about=about)


DEVICES = {
    "a100": _gpu(
        "A100 SXM4 80GB",
        312e12,
        19.5e12,
        2.039e12,
        A100_EFFICIENCY,
        80 * GiB,
        25e9,
        "NVIDIA A100 datasheet; PCIe 4.0 x16",
    ),
    "h100": _gpu(
        "H100 SXM5 80GB",
        989.4e12,
        66.9e12,
        3.35e12,
        H100_500W_EFFICIENCY,
        80 * GiB,
        55e9,
        "NVIDIA H100 SXM datasheet, 700 W; efficiency of the 500 W part (none fitted at 700 W)",
    ),
}
DEVICES["h100-500w"] = replace(  # the same peaks, host link and efficiency as the SXM part
    DEVICES["h100"],
    name="H100 96GB HBM2e, 500 W (Grand Teton)",
    memory_bandwidth=2.4e12,
    capacity=96 * GiB,
    about="torchtitan's H100s: 2.4 TB/s, 96 GB, 500 W; SXM's peak, as torchtitan's MFU uses",
)
# Two more, from their datasheets: no published FSDP run on them is known to fit an efficiency
# on, so each takes the H100's (the same tensor cores for the H200; an assumption for the B200,
# said in every plan of it). Capacity: the datasheet's GB (10^9 bytes).
DEVICES["h200"] = _gpu(
    "H200 SXM 141GB",
    989.4e12,
    66.9e12,
    4.8e12,
    H100_500W_EFFICIENCY,
    141 * 10**9,
    55e9,
    "NVIDIA H200 datasheet (SXM, 700 W): the H100's peaks, 141 GB HBM3e at 4.8 TB/s; PCIe 5.0 "
    "x16; efficiency of the H100 500 W part",
)
DEVICES["b200"] = _gpu(
    "B200 (HGX, 1000 W)",
    2.25e15,
    80e12,
    8.0e12,
    H100_500W_EFFICIENCY,
    180 * 10**9,
    55e9,
    "NVIDIA HGX B200 datasheet, per GPU: 2.25 PFLOP/s dense bf16, 80 TFLOP/s fp32, 180 GB "
    "HBM3e at 8 TB/s; PCIe 5.0 x16 host link; the H100's efficiency, not fitted (assumed)",
)


@dataclass(frozen=True)
class Network:
    """A cluster as its collectives see it: the link within a node and the one across."""

    name: str
    intra: Link  # within a node
    inter: Link  # across nodes
    ranks_per_node: int
    about: str = ""

    def link(self, ranks: list[int]) -> Link:
        nodes = {r // self.ranks_per_node for r in ranks}
        return self.intra if len(nodes) <= 1 else self.inter

    def seconds(self, op: str, nbytes: int, ranks: list[int]) -> float:
        return self.link(ranks).seconds(op, nbytes, len(ranks))


NCCL_BASE_S = 8.4e-6
NVLINK_STEP_S = 5.7e-6
NET_STEP_S = 6.6e-6
NVLINK_H100 = Link("NVLink (H100)", simnet.LINKS["nvlink"].bandwidth, NCCL_BASE_S, NVLINK_STEP_S)
NVLINK_A100 = Link("NVLink (A100)", 230e9, NCCL_BASE_S, NVLINK_STEP_S)
# NVLink 5 moves twice NVLink 4's bytes per GPU (1.8 against 0.9 TB/s both ways): twice the
# H100's bus bandwidth, an estimate until a measured nccl-tests figure is published
NVLINK_B200 = Link("NVLink 5 (B200)", 2 * NVLINK_H100.bandwidth, NCCL_BASE_S, NVLINK_STEP_S)
NIC_400 = Link("400 Gb/s per GPU", simnet.LINKS["ib"].bandwidth, NCCL_BASE_S, NET_STEP_S)
NIC_200 = Link("200 Gb/s per GPU", 22.5e9, NCCL_BASE_S, NET_STEP_S)


def _nodes_of_8(gpu: str, nvlink: Link, nic: Link, fabric: str) -> Network:
    """A cluster of 8-GPU nodes: NVLink within a node, ``fabric`` (one NIC per GPU) across."""
    return Network(f"{gpu} nodes of 8, NVLink + {fabric} per GPU", nvlink, nic, 8)


NETWORKS = {
    "h100-ib": _nodes_of_8("H100", NVLINK_H100, NIC_400, "400 Gb/s InfiniBand"),
    "h100-roce": _nodes_of_8("H100", NVLINK_H100, NIC_400, "400 Gb/s RoCE"),
    # torchtitan's A100 page names no network; at 200 Gb/s per GPU the collectives of its
    # Llama 2 13B run (no AC, batch 2) alone take longer than its published step, so the
    # published A100 runs are planned on 400 Gb/s per GPU, as the H100 cluster has (see
    # docs/plan.md); a100-hdr is the 200 Gb/s (HDR InfiniBand per GPU) cluster
    "a100-ib": _nodes_of_8("A100", NVLINK_A100, NIC_400, "400 Gb/s InfiniBand"),
    "a100-hdr": _nodes_of_8("A100", NVLINK_A100, NIC_200, "200 Gb/s HDR InfiniBand"),
    "h200-ib": _nodes_of_8("H200", NVLINK_H100, NIC_400, "400 Gb/s InfiniBand"),
    "b200-ib": _nodes_of_8("B200", NVLINK_B200, NIC_400, "400 Gb/s InfiniBand"),
}
DEFAULT_NETWORK = {
    "a100": "a100-ib",
    "h100": "h100-ib",
    "h100-500w": "h100-roce",
    "h200": "h200-ib",
    "b200": "b200-ib",
}


def simulated_network(link_text: str, world: int) -> Network:
    """``twinshard bench --backend simnet``'s link as a network of one node: a constant latency
    per collective and its bandwidth (``simnet.parse_link``)."""
    link = simnet.parse_link(link_text)
    return Network(f"simulated link {link.name}", link, link, max(world, 1))


# A training step's operators on one core reach this fraction of the large matmul's FLOP/s and the
# large copy's bandwidth that ``measure_cpu`` times (small matmuls, transposed operands, pointwise
# work in cache). Fitted on the job of ``benchmarks/plan_measured.py`` (the small Llama with 4
# blocks, 2 x 128 tokens per rank, fp32, 2 ranks, the median of 8 timed steps): over 12 runs of the
# three implementations 0.70 predicted 0.85-1.00 of the measured step's CPU time (median 0.92) and
# 0.60 predicted 0.99-1.16 (median 1.09); 0.65 puts the median at 1.0. (A first fit, 0.70 on one run
# of torch's, sat near the edge: CI once measured 0.798.) The hooks' own Python time is not in the
# model, so the implementation with the heaviest hooks (torch's) runs longer than predicted. Held
# for every plan.
CPU_EFFICIENCY = 0.65


def measure_cpu(threads: int = 1, seconds: float = 0.3) -> Device:
    """This CPU as a device: a matmul's FLOP/s per dtype, a large
    copy's bandwidth, and the time of one small operator under autograd (the dispatch and
    bookkeeping every operator of a training step pays), with ``threads`` threads."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        flops = {}
        for dtype in (torch.float32, torch.bfloat16):
            a = torch.randn(512, 1024, dtype=dtype)
            b = torch.randn(1024, 1024, dtype=dtype)
            flops[str(dtype)] = 2 * 512 * 1024 * 1024 / _best(lambda a=a, b=b: a @ b, seconds)
        big = torch.empty(8 * 2**20)
        out = torch.empty_like(big)
        bandwidth = 2 * big.numel() * 4 / _best(lambda: out.copy_(big), seconds)
        x = torch.randn(8, requires_grad=True)
        overhead = _best(lambda: (x * 2).sum().backward(), seconds) / 4  # about 4 operators
    finally:
        torch.set_num_threads(before)
    return Device(
        "this CPU",
        flops,
        bandwidth,
        {BF16: CPU_EFFICIENCY, FP32: CPU_EFFICIENCY},
        0,
        bandwidth,
        kernel_s=0.0,
        overhead_s=overhead,
        about=f"measured with {threads} thread(s): matmul, copy and small-operator times",
    )


def _best(work, seconds: float) -> float:
    """The shortest time of ``work`` over about ``seconds`` of repetitions."""
    work()
    best, end = float("inf"), time.perf_counter() + seconds
    while time.perf_counter() < end:
        start = time.perf_counter()
        work()
        best = min(best, time.perf_counter() - start)
    return best
