"""Comparing a sharded run against the truth: tolerance classes and the worst difference.

A ``Checker`` collects every comparison of one case (loss per step, each parameter shard,
each gradient shard) instead of stopping at the first mismatch, so the report can say how
far off the worst one was and where. The tolerance is chosen by the case, from three classes:

- ``bitwise``: the same reduction order gives the same bits (reference vs optimized in fp32
  at world size <= 2);
- ``fp32``: ``torch.testing.assert_close`` defaults for float32 (rtol 1.3e-6, atol 1e-5);
- ``low_precision``: for bf16/fp16 runs, the implementation may be off the fp32 truth by at
  most twice what the plain (unsharded) model shows when it runs the same computation in
  the same low precision (per tensor, max abs), plus a floor of one rounding step of the
  low-precision dtype at the tensor's magnitude (``eps * max |truth|``, at least the fp32
  ``atol``): no comparison can be finer than the dtype that carried the values, and a
  small tensor's error is a handful of such roundings. Nothing is tuned per case.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

FP32_RTOL, FP32_ATOL = 1.3e-6, 1e-5


@dataclass
class Worst:
    abs: float = 0.0
    rel: float = 0.0
    where: str = ""


@dataclass
class Checker:
    """Records comparisons; ``failures`` lists the ones outside tolerance."""

    tolerance: str = "fp32"  # "bitwise" | "fp32" | "low_precision"
    worst: Worst = field(default_factory=Worst)
    failures: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # e.g. an oracle that could not run here
    low_eps: float = 2.0**-7  # rounding step of the low-precision dtype (bf16)
    worst_by: dict = field(default_factory=dict)  # per comparison series ("reference", ...)
    count: int = 0

    @property
    def ok(self) -> bool:
        return not self.failures

    def fail(self, message: str) -> None:
        self.failures.append(message)

    def close(self, where: str, actual, expected, plain_low=None, truth=None) -> None:
        """Compare ``actual`` with ``expected``.

        ``plain_low`` is the plain model's result of the same computation in low precision,
        required in the ``low_precision`` class: the allowed error is twice its distance from
        the fp32 truth (``truth``, default ``expected``), plus the floor described above.
        """
        self.count += 1
        if actual is None or expected is None:
            if (actual is None) != (expected is None):
                self.fail(
                    f"{where}: {'missing' if actual is None else 'unexpected'} value "
                    f"(expected {'None' if expected is None else 'a tensor'})"
                )
            return
        actual, expected = (
            _comparable(torch.as_tensor(t).detach().to("cpu")) for t in (actual, expected)
        )
        if actual.shape != expected.shape:
            self.fail(f"{where}: shape {tuple(actual.shape)} != expected {tuple(expected.shape)}")
            return
        a, e = actual.double(), expected.double()
        diff = (a - e).abs()
        max_abs = diff.max().item() if diff.numel() else 0.0
        rel = diff / e.abs().clamp_min(1e-12)
        max_rel = rel.max().item() if rel.numel() else 0.0
        if max_abs > self.worst.abs:
            self.worst = Worst(max_abs, max_rel, where)
        series = where.split(" step ")[0] if " step " in where else "other"
        if max_abs >= self.worst_by.get(series, Worst(-1.0)).abs:
            self.worst_by[series] = Worst(max_abs, max_rel, where)
        self._judge(
            where,
            actual,
            expected,
            diff,
            max_abs,
            plain_low,
            expected if truth is None else torch.as_tensor(truth).detach().cpu(),
        )

    def _judge(self, where, actual, expected, diff, max_abs, plain_low, truth) -> None:
        if self.tolerance == "bitwise":
            if not torch.equal(actual, expected.to(actual.dtype)):
                self.fail(f"{where}: not bitwise equal (max abs diff {max_abs:.3e})")
            return
        if self.tolerance == "fp32":
            allowed = FP32_ATOL + FP32_RTOL * expected.double().abs()
            if bool((diff > allowed).any()) or not torch.isfinite(actual).all():
                self.fail(
                    f"{where}: max abs diff {max_abs:.3e} outside fp32 assert_close "
                    f"defaults (rtol {FP32_RTOL}, atol {FP32_ATOL})"
                )
            return
        if plain_low is None:
            raise ValueError(
                f"{where}: the low_precision class needs the plain model's low-precision result"
            )
        plain_low = torch.as_tensor(plain_low).detach().cpu().double()
        plain_err = (plain_low - truth.double()).abs().max().item() if truth.numel() else 0.0
        magnitude = truth.double().abs().max().item() if truth.numel() else 0.0
        floor = max(FP32_ATOL, self.low_eps * magnitude)
        if max_abs > 2 * plain_err + floor or not torch.isfinite(actual).all():
            self.fail(
                f"{where}: max abs diff {max_abs:.3e} > 2 x plain low-precision error "
                f"{plain_err:.3e} + one rounding {floor:.3e}"
            )

    def absorb(self, other: Checker) -> None:
        """Fold another checker's comparisons (made under another tolerance) into this one."""
        self.failures += other.failures
        self.count += other.count
        for series, w in other.worst_by.items():
            if w.abs >= self.worst_by.get(series, Worst(-1.0)).abs:
                self.worst_by[series] = w
        if other.worst.abs > self.worst.abs:
            self.worst = other.worst

    def summary(self) -> dict:
        return {
            "ok": self.ok,
            "tolerance": self.tolerance,
            "compared": self.count,
            "max_abs": self.worst.abs,
            "max_rel": self.worst.rel,
            "where": self.worst.where,
            "failures": self.failures[:10],
            "notes": self.notes,
            "worst_by": {k: vars(w) for k, w in self.worst_by.items()},
        }


def local_rows(full: torch.Tensor, dtensor) -> torch.Tensor:
    """The piece of ``full`` that this rank holds in ``dtensor``, whatever its placements
    (``Shard``, the strided shards of FSDP over TP, ``Replicate``): DTensor's own slicing of
    this rank's copy, without communication."""
    from torch.distributed.tensor import distribute_tensor

    device = dtensor.device_mesh.device_type
    piece = distribute_tensor(
        full.to(device), dtensor.device_mesh, dtensor.placements, src_data_rank=None
    )
    return piece.to_local()


def _comparable(t: torch.Tensor) -> torch.Tensor:
    """float8 has almost no arithmetic on the CPU: compare it as float32 (exactly the same
    values)."""
    return t.float() if t.is_floating_point() and t.element_size() == 1 else t
