"""The recordings behind the site's schedule explorer: one training step per setting of a grid.

A part of the docs build, not of the package: ``explorer.py`` (the hook beside it) calls it.
The explorer (``docs/explorer.md``, drawn by ``docs/js/explorer.js``) lets a student pick an
implementation, a world size, ``reshard_after_forward``, a prefetch depth and the parameters'
dtype, and step through the schedule of one training step that the code really ran with
those settings. This module records them; ``explorer_page.py`` turns them into what the page
shows:

- ``AXES`` declares the grid, ``grid(axes)`` is every combination of it (a ``Setting`` each);
- ``record_grid(settings)`` records each setting's step with ``record_on_rank``, the
  example job that ``twinshard schedule`` runs (``Setting.command`` is that command line),
  and keeps rank 0's schedule as the command does. The settings of one world size share one
  launch of gloo ranks on the CPU, recorded one after the other (starting ranks is what costs:
  seconds a launch, against under a second a recording). A setting that cannot be recorded
  raises ``RecordingFailed`` naming it.

The model has ``LAYERS`` blocks: enough that gathering two blocks ahead holds less than the
whole model, so that the prefetch depth trades memory for overlap instead of gathering
everything (with 3 blocks "two ahead" had the whole model unsharded in forward).
"""

from __future__ import annotations

import os
import sys
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from twinshard.measure import grid as jobs_grid
from twinshard.measure.schedule.cli import example, record_on_rank
from twinshard.measure.schedule.steps import Schedule

HERE = os.path.dirname(os.path.abspath(__file__))

# Each axis of the grid: its values, in the order the page offers them.
AXES = {
    "impl": ("reference", "optimized", "torch"),
    "world": (2, 4),
    # reshard_after_forward of the blocks; 2: keep a piece sharded over 2 ranks after forward
    "reshard": (True, False, 2),
    "prefetch": (1, 2),  # explicit prefetch lists of this many blocks (``step.prefetch``)
    "dtype": ("fp32", "bf16"),  # bf16: bf16 parameters, gradients reduced in fp32
}
# Two settings set side by side: the same choices but for one axis, which takes both values.
COMPARISONS = (
    ("reference vs optimized", "impl", "reference", "optimized"),
    ("one vs two ahead", "prefetch", 1, 2),
    ("reshard true vs false", "reshard", True, False),
    ("reshard true vs 2", "reshard", True, 2),
    ("fp32 vs bf16", "dtype", "fp32", "bf16"),
)
LAYERS = 6  # blocks of the tiny Llama (see the module's docstring)


class RecordingFailed(RuntimeError):
    """A setting of the explorer's grid could not be recorded; the message names it."""


@dataclass(frozen=True)
class Setting:
    """One point of the grid: the example job's policies for one recorded step."""

    impl: str
    world: int
    reshard: bool | int
    prefetch: int
    dtype: str

    @property
    def key(self) -> str:
        """How the page finds it: the values in ``AXES``' order, 'optimized|2|true|1|fp32'."""
        return "|".join(str(v).lower() for v in asdict(self).values())

    @property
    def label(self) -> str:
        ahead = {1: "one", 2: "two"}.get(self.prefetch, str(self.prefetch))
        return (
            f"{self.impl} on {self.world} ranks, reshard_after_forward={self.reshard}, "
            f"prefetch {ahead} ahead, {self.dtype} parameters"
        )

    def policies(self) -> dict:
        """``cli.example``'s keywords for this setting (``record_on_rank`` takes the same)."""
        low = self.dtype != "fp32"
        return dict(
            layers=LAYERS,
            reshard_after_forward=self.reshard,
            prefetch=self.prefetch,
            param_dtype=self.dtype if low else None,
            reduce_dtype="fp32" if low else None,
        )

    def command(self) -> str:
        """The ``twinshard schedule`` command that prints this setting's table."""
        words = f"twinshard schedule --impls {self.impl} --world {self.world} --layers {LAYERS}"
        words += f" --reshard-after-forward {str(self.reshard).lower()} --prefetch {self.prefetch}"
        if self.dtype != "fp32":
            words += f" --param-dtype {self.dtype} --reduce-dtype fp32"
        return words


def grid(axes: dict = AXES) -> list[Setting]:
    """Every combination of ``axes`` (``AXES``' keys, each with its values)."""
    return [Setting(**point) for point in jobs_grid.points(axes)]


# --- recording --------------------------------------------------------------------------------
def _record_on_rank(settings: list[Setting]) -> list[Schedule]:
    """On every rank of one launch: each setting's step in turn; rank 0 returns its records."""
    found = []
    for s in settings:
        try:
            found.append(record_on_rank(s.impl, **s.policies()))
        except Exception as error:
            raise RuntimeError(f"recording [{s.label}] failed: {error}") from error
    return found if dist.get_rank() == 0 else []


def record_grid(settings: list[Setting], timeout: float = 600) -> dict[Setting, Schedule]:
    """Rank 0's schedule of each setting, recorded on gloo ranks on this machine, one launch
    per world size. ``RecordingFailed`` names the first setting whose job is wrong (checked
    before any rank starts, with ``Job.problem``) or that failed on a rank."""
    from twinshard.ranks.launch import LaunchError, launch

    for s in settings:
        wrong = example(s.impl, s.world, **s.policies()).problem()
        if wrong:
            raise RecordingFailed(f"the explorer cannot record {s.label}: {wrong}")
    # Forking skips re-importing torch in every rank, as ``record_step`` does; a spawned rank
    # (where there is CUDA) imports this module by name, from the path it is given here.
    start = None if torch.cuda.is_available() else "fork"
    recorded = {}
    sys.path.insert(0, HERE)
    try:
        for world in sorted({s.world for s in settings}):
            batch = [s for s in settings if s.world == world]
            try:
                ranks = launch(_record_on_rank, world, batch, start_method=start, timeout=timeout)
            except LaunchError as error:
                named = [s.label for s in batch if f"[{s.label}]" in str(error)]
                which = named[0] if named else "one of: " + "; ".join(s.label for s in batch)
                raise RecordingFailed(f"the explorer failed to record {which}\n{error}") from None
            recorded.update(zip(batch, ranks[0]))
    finally:
        sys.path.remove(HERE)
    return recorded
