"""``torch.compile`` of modules in place sees twinshard's modules as it sees torch's.

torch's ``fully_shard`` marks every module it manages with ``_is_fsdp_managed_module`` and
``_fsdp_use_orig_params``; dynamo then treats the module as FSDP-managed (its parameters and
structure are not guarded). Without the marks dynamo guards a twinshard module as an ordinary
one, which changes the guards of every graph and so what makes it recompile: with a
``transformers`` Llama whose decoder layers are compiled in place (``layer.compile()``), the
code before the marks (7cfb27f) compiled 8 graphs as torch does in 2 steps and an evaluation,
but its guards were not torch's: its first recompile failed on the KV cache's
``is_initialized`` where torch's fails on the layer's ``layer_idx`` (all four tests here fail
there).

Here torch's ``fully_shard``, the reference and the optimized path each shard the same tiny
Llama (built from a config, no download) on 2 gloo ranks, compile its layers in place
(``aot_eager``: dynamo's guards and graphs, no code generation), train 2 steps and evaluate
under ``no_grad``. The twinshard runs must compile as torch's did (the same number of graphs,
each recompile for the same guard) and give bitwise torch's losses and evaluation logits.
"""

from __future__ import annotations

import importlib.util
import os
import re

import pytest
import torch

from twinshard.ranks.launch import launch

IMPLS = {
    "torch": "torch.distributed.fsdp",
    "reference": "twinshard.reference",
    "optimized": "twinshard.optimized",
}


def compile_and_train(module_name: str) -> dict:
    """On one rank: shard, compile each layer in place, 2 steps, an evaluation."""
    import importlib
    import logging

    import torch._dynamo
    from client_common import tiny_llama, tokens
    from torch._dynamo.utils import counters

    impl = importlib.import_module(module_name)
    torch._dynamo.reset()
    counters.clear()
    failures = []  # the first failing guard of each recompile, as dynamo logs it

    class Recompiles(logging.Handler):
        def emit(self, record):
            found = re.search(r"- \d+/\d+: (.*?)(?:\s+#|$)", record.getMessage(), re.M)
            if found:
                failures.append(found.group(1).strip())

    handler = Recompiles()
    torch._logging.set_logs(recompiles=True)
    logging.getLogger("torch._dynamo").addHandler(handler)
    try:
        model = tiny_llama(layers=4)
        for layer in model.model.layers:
            impl.fully_shard(layer)
        impl.fully_shard(model)
        marked = [
            getattr(m, "_is_fsdp_managed_module", False) and m._fsdp_use_orig_params
            for m in model.modules()
        ]
        for layer in model.model.layers:
            layer.compile(backend="aot_eager")
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        losses = []
        for step in range(2):
            ids = tokens(step)
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.detach())
        model.eval()
        with torch.no_grad():
            logits = model(input_ids=tokens(2)).logits
    finally:
        logging.getLogger("torch._dynamo").removeHandler(handler)
        torch._logging.set_logs()
    return {
        "graphs": counters["stats"]["unique_graphs"],
        "failures": failures,
        "marked": marked,
        "losses": torch.stack(losses),
        "logits": logits,
    }


def every_impl() -> dict:
    return {name: compile_and_train(module) for name, module in IMPLS.items()}


@pytest.fixture(scope="module")
def runs():
    if importlib.util.find_spec("transformers") is None:
        if os.environ.get("CI"):
            pytest.fail('transformers is missing: CI installs the "clients" extra')
        pytest.skip('needs transformers (pip install torch==2.13.0 -e ".[clients]")')
    return launch(every_impl, 2, timeout=600)


@pytest.mark.parametrize("impl", ["reference", "optimized"])
def test_layers_compiled_in_place_compile_as_under_torch(runs, impl):
    for rank, by_impl in enumerate(runs):
        torch_run, ours = by_impl["torch"], by_impl[impl]
        assert torch_run["graphs"] >= 5, f"rank {rank}: the setting no longer recompiles"
        assert ours["graphs"] == torch_run["graphs"], (rank, ours["failures"])
        assert ours["failures"] == torch_run["failures"], rank
        torch.testing.assert_close(ours["losses"], torch_run["losses"], rtol=0, atol=0)
        torch.testing.assert_close(ours["logits"], torch_run["logits"], rtol=0, atol=0)


@pytest.mark.parametrize("impl", ["reference", "optimized"])
def test_every_managed_module_is_marked_as_torch_marks_it(runs, impl):
    for by_impl in runs:
        assert by_impl[impl]["marked"] == by_impl["torch"]["marked"]
        assert any(by_impl[impl]["marked"])
