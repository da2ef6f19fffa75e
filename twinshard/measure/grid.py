"""One grid of jobs behind every sweep: values of a job's fields expanded into jobs.

``points(axes)`` is every combination of ``axes`` (a name -> its values, in order; the last
axis changes fastest), each a dict of name -> value; no axes is one point, the job itself.
``at(job, point)`` is ``job`` with a point's values: a ``Job`` field by its name, anything else
(``n_layers``, ``dim``, ``n_heads``, ...) as an override of its model. ``jobs(job, axes)`` is
both. ``twinshard bench sweep`` (one quantity at a time), ``twinshard plan --sweep`` (one
axis), ``plan --search`` (four at once) and the site's schedule explorer (its settings) each
make their points here.
"""

from __future__ import annotations

import itertools
from dataclasses import fields, replace


def points(axes: dict) -> list[dict]:
    """Every combination of ``axes``' values, as name -> value."""
    return [dict(zip(axes, values)) for values in itertools.product(*axes.values())]


def at(job, point: dict):
    """``job`` (a ``Job``) with ``point``'s values: its fields, and its model's overrides."""
    own = {f.name for f in fields(job)}
    model = {k: v for k, v in point.items() if k not in own}
    chosen = {k: v for k, v in point.items() if k in own}
    return replace(job, **chosen, model={**job.model, **model}) if model else replace(job, **chosen)


def jobs(job, axes: dict) -> list:
    """``job`` at every point of ``axes``."""
    return [at(job, point) for point in points(axes)]
