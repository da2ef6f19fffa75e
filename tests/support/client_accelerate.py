"""accelerate's FSDP2 plugin on 2 gloo ranks, under torch, the reference and the optimized path.

How FSDP2 runs on gloo. accelerate turns a run into FSDP only on an accelerator backend:
``AcceleratorState`` takes the FSDP branch for MULTI_GPU, MULTI_XPU and the like, and a CPU
run stays MULTI_CPU, whose ``prepare`` never calls ``fully_shard``. No setting or environment
variable changes that (accelerate 1.15). The smallest forced setting, used here: build the
``Accelerator`` on the CPU with the FSDP2 plugin, then declare its shared state FSDP with that
plugin (``fsdp_on_gloo``). From there on everything is accelerate's own FSDP2 path:
``prepare`` (its auto-wrap, ``fully_shard`` per decoder layer, the embedding, the tail group
and the root), ``backward``, ``clip_grad_norm_``, ``save_state`` and ``load_state`` (DCP).
"""

from __future__ import annotations

import torch
from client_common import (
    IMPLS,
    SAVE_AT,
    STEPS,
    Record,
    fill_final_state,
    norm_value,
    switched,
    tiny_llama,
    tokens,
    variant_runs,
)


def fsdp_on_gloo(plugin_args: dict | None = None):
    """A fresh ``Accelerator`` on the CPU whose state is FSDP with an FSDP2 plugin
    (``FullyShardedDataParallelPlugin(**plugin_args)``; by default version 2 with the
    transformer-layer auto-wrap)."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState, PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    AcceleratorState._reset_state(reset_partial_state=True)  # one process, several runs
    GradientState._reset_state()
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2, auto_wrap_policy="transformer_based_wrap"
    )
    accelerator = Accelerator(cpu=True, fsdp_plugin=plugin)
    accelerator.state.distributed_type = DistributedType.FSDP  # the forced setting
    accelerator.state.fsdp_plugin = plugin
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    assert accelerator.is_fsdp2
    return accelerator


def train(impl: str, checkpoint: str, first: int, save: bool, variants: str = "") -> Record:
    """Steps ``first``..STEPS-1 of one run under ``impl`` (with ``variants``); from
    ``checkpoint`` when first > 0."""
    record = Record()
    with switched(impl, variants):
        accelerator = fsdp_on_gloo()
        model = tiny_llama()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        model, optimizer = accelerator.prepare(model, optimizer)
        if first:
            accelerator.load_state(checkpoint)
        for step in range(first, STEPS):
            ids = tokens(step)
            loss = model(input_ids=ids, labels=ids).loss
            accelerator.backward(loss)
            norm = accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
            record.loss.append(loss.item())
            record.grad_norm.append(norm_value(norm))
            if save and step + 1 == SAVE_AT:
                accelerator.save_state(checkpoint)
        return fill_final_state(record, model, optimizer)


def ranks(folder: str) -> dict[str, Record]:
    """Every run of this client on this rank: each implementation from step 0 (torch's saves
    a checkpoint after step SAVE_AT), then each twinshard implementation resumed from it."""
    checkpoint = f"{folder}/accelerate-torch-step{SAVE_AT}"
    runs = {impl: train(impl, checkpoint, 0, save=impl == "torch") for impl in IMPLS}
    for impl in IMPLS[1:]:
        runs[f"{impl} resumed"] = train(impl, checkpoint, SAVE_AT, save=False)
    return runs | variant_runs(lambda impl, variants: train(impl, "", 0, False, variants))
