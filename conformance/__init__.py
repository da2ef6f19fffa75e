"""twinshard.conformance: checks that any FSDP implementation behaves like the truth.

An implementation is any importable module with the ``fully_shard`` interface; the cases touch
it only through that interface. The package holds:

- ``cases``: the cases, one feature each (training parity, reshard modes, no-sync, clipping,
  mixed precision, offload, state dicts, DCP save and load across world sizes, meta init,
  errors, collective traces), registered in ``CASES``;
- ``models``: the small models with uneven sizes and the recipe each case trains;
- ``driver``: trains one recipe three ways (the plain model on the global batch, the
  implementation under test, torch's ``fully_shard``) and records every step;
- ``compare``: the oracles' verdict: a ``Checker`` that compares loss, parameter and gradient
  shards under a tolerance class (bitwise, fp32, low precision) and keeps the worst miss;
- ``trace``: the per-rank collective trace (op, dtype, numel), compared across ranks;
- ``runner``: runs cases inside one process group and merges the ranks' verdicts;
- ``suite``: runs the cases over several meshes, applies an expected-failures file
  (``xfail/``) and renders the report;
- ``cli``: ``twinshard conform MODULE``;
- ``pytest_plugin`` and ``check``: the same suite as pytest tests (``--fsdp-impl``);
- ``planted``: copies of the reference with one planted bug each, which the suite must catch;
- ``exercise_ring`` and ``ring_marks``: the ring exercises' grading by hand on marked inputs
  (tutorials 10 and 11), and a class's submissions graded in one command;
- ``exercise_group``: tutorial 12's parameter group held to the suite, each failure said as
  the mistake it shows (``planted.group_bugs``: tutorial 13's mystery group, one planted line
  drawn by a seed).
"""
