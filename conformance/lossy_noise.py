"""How close a lossy run must come to its exact oracle: a bound measured from the exact run.

A lossy run and its exact oracle (``lossy.run_plain_with``) compute with the same gathered
weights and the same declared sums, so what still separates them is what separates any
sharded run from the plain model: the backend's order of additions in the exact collectives
(the replicas' all-reduce, an exact reduce-scatter beside a quantized all-gather), and what a
step's rounding does to the next one. fp32's fixed tolerances (rtol 1.3e-6, atol 1e-5) are
blind to the small tensors where a lossy mistake shows (biases of magnitude 1e-3 to 1e-2, a
block's scale off by 25% there is under atol). So the suite measures that noise instead:

- ``Noise``: the same implementation trained at the same mesh with no variant, against the
  plain model computing as it does; per step, kind and tensor, the largest difference: the
  reduction-order noise of this mesh and this backend, measured. One tensor's difference is
  one draw of that noise, so each tensor's noise is taken as the larger of its own and the
  largest of its step and kind (losses, gradients, parameters) relative to magnitude, at its
  magnitude.
- ``Measured``: the lossy run against its oracle is then held to twice that noise, plus a
  floor of one rounding of the reduce dtype per addition of each step's gradient sums so far,
  at the tensor's magnitude ((k + 1) (S + R) eps max |oracle| at step k, S ranks in the shard
  group and R replicas: each step's sums round, and their roundings carry into the values of
  the steps after; it is what an exact run could show where this one happened to be
  bitwise). Each
  comparison's distance over its bound is kept, and the case's worst is reported as its
  margin (``margin_note``); a failure says how many times the bound it is.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .compare import Checker


def _key(where: str) -> str:
    """What a comparison compared, without who: "step 0 grad 'fc.weight'"."""
    return "step " + where.split(" step ", 1)[1] if " step " in where else where


@dataclass
class Noise(Checker):
    """Records the largest difference of every comparison, by what was compared; fails none."""

    seen: dict = field(default_factory=dict)

    def _judge(self, where, actual, expected, diff, max_abs, plain_low, truth) -> None:
        magnitude = expected.double().abs().max().item() if expected.numel() else 0.0
        self.seen[_key(where)] = (max_abs, magnitude)

    def relative(self) -> dict:
        """Per step and kind ("step 0 grad"), the largest noise over magnitude of its tensors."""
        out: dict = {}
        for key, (noise, magnitude) in self.seen.items():
            kind = key.split(" '")[0]
            out[kind] = max(out.get(kind, 0.0), noise / magnitude if magnitude else 0.0)
        return out


@dataclass
class Measured(Checker):
    """Fails a comparison further than ``2 * noise + floor`` (module docstring)."""

    noise: Noise = field(default_factory=Noise)  # the exact run against the plain model
    additions: int = 2  # S + R
    eps: float = torch.finfo(torch.float32).eps  # of the reduce dtype
    ratios: dict = field(default_factory=dict)  # what was compared -> distance / bound

    def __post_init__(self):
        self.relative = self.noise.relative()

    def _judge(self, where, actual, expected, diff, max_abs, plain_low, truth) -> None:
        key = _key(where)
        magnitude = expected.double().abs().max().item() if expected.numel() else 0.0
        relative = self.relative.get(key.split(" '")[0], 0.0) * magnitude
        noise = max(self.noise.seen.get(key, (0.0, 0.0))[0], relative)
        steps = int(key.split()[1]) + 1 if key.startswith("step ") else 1
        floor = steps * self.additions * self.eps * magnitude
        bound = 2 * noise + floor
        ratio = max_abs / bound if bound > 0 else (0.0 if max_abs == 0 else float("inf"))
        self.ratios[where] = ratio
        if ratio > 1 or not torch.isfinite(actual).all():
            self.fail(
                f"{where}: max abs diff {max_abs:.3e} > 2 x the exact run's noise {noise:.3e} "
                f"+ {steps * self.additions} roundings {floor:.3e} ({ratio:.1f}x the bound)"
            )

    def margin_note(self) -> str | None:
        """The worst comparison's distance over its bound, said: a correct variant's margin."""
        if not self.ratios:
            return None
        where, worst = max(self.ratios.items(), key=lambda item: item[1])
        return f"closest to the measured bound: {worst:.3g}x it ({where})"
