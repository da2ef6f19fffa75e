"""The lossy certificate's own checks, each shown to catch the mistake it was made for.

Every planted variant of ``conformance/planted/lossy.py``'s ``CERTIFICATE`` is judged by the
suite's lossy case (``conformance.cases.lossy.judge``) under the optimized path, without the
reference or torch as oracles (``--no-oracles`` must lose no catch), on the mesh where its
mistake shows: it must fail, and among its failures must be the check made for it (the wire
from the declared format, the gathered parameters bit for bit, the reduced gradients within
their bound). The correct variants each claims to be, judged the same way, pass, and their
gradients stay within a third of the bound (a margin of 3x at least), as does their distance
to the exact oracle within the bound measured from the exact run (``lossy_noise.py``), which
each planted mistake that moves the numbers exceeds by 3x at least.
"""

from __future__ import annotations

import re
import tempfile

import pytest
import torch

from twinshard.conformance.planted.lossy import CERTIFICATE
from twinshard.ranks.launch import launch

BOUND = r"([0-9.e+]+|inf)x the bound\)"  # the oracle's measured bound (lossy_noise.py)
MESHES = sorted({entry[3] for entry in CERTIFICATE.values()})


def _judge_all(shape: tuple) -> dict:
    """On each rank: planted name -> (failures, notes) of the planted variant and of the correct
    variants it claims to be."""
    import twinshard.optimized as impl
    from twinshard.conformance.cases.core import Context
    from twinshard.conformance.cases.lossy import judge
    from twinshard.conformance.planted.lossy import PlantedCommunication
    from twinshard.variants import Communication

    out = {}
    for name, (cls, variants, param, mesh, _) in CERTIFICATE.items():
        if mesh != shape:
            continue
        precision = {} if param is None else {"param": param, "reduce": torch.float32}
        with tempfile.TemporaryDirectory() as tmp:
            ctx = Context(impl, "optimized", None, shape, tmp)
            planted = judge(ctx, PlantedCommunication(cls, variants), **precision)
            correct = judge(ctx, Communication(variants), **precision)
        out[name] = {"planted": planted.failures, "correct": (correct.failures, correct.notes)}
    return out


@pytest.fixture(scope="module")
def judged() -> dict:
    found = {}
    for shape in MESHES:
        ranks = launch(_judge_all, int(torch.tensor(shape).prod()), shape, timeout=600)
        for name in ranks[0]:
            found[name] = [rank[name] for rank in ranks]
    return found


@pytest.mark.parametrize("name", list(CERTIFICATE))
def test_each_mistake_is_caught_by_its_check(judged, name):
    words = CERTIFICATE[name][4]
    failures = [f for rank in judged[name] for f in rank["planted"]]
    assert failures, f"{name} passed the certificate"
    assert any(words in f for f in failures), f"{name}: not caught by '{words}': {failures[:3]}"
    for f in failures:  # a gradient's catch says by how much: at least 3x its bound
        if "declared sum" in f:
            assert float(re.search(r"([0-9.]+)x the bound", f).group(1)) >= 3, f
    measured = [float(m.group(1)) for f in failures if (m := re.search(BOUND, f))]
    assert not measured or max(measured) >= 3, f"{name}: at most {max(measured)}x its bound"


@pytest.mark.parametrize("name", list(CERTIFICATE))
def test_what_each_mistake_claims_passes_with_a_margin(judged, name):
    for rank in judged[name]:
        failures, notes = rank["correct"]
        assert failures == [], failures[:3]
        ratios = [float(m) for n in notes for m in re.findall(r"at most ([0-9.]+)x", n)]
        assert ratios and max(ratios) <= 1 / 3, notes
        near = [float(m) for n in notes for m in re.findall(r"measured bound: ([0-9.e+-]+)x", n)]
        assert near and max(near) <= 1 / 3, notes  # against the oracle, in the measured bound
