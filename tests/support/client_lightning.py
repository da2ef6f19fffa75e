"""Lightning's ``ModelParallelStrategy`` on 2 gloo ranks, under torch, the reference and the
optimized path.

Lightning runs FSDP2 on the CPU as it is: ``Trainer(accelerator="cpu",
strategy=ModelParallelStrategy(...))`` joins the process group that is already there (the
launcher's, gloo), builds its ("data_parallel", "tensor_parallel") mesh and calls the
module's ``configure_model``, where the user applies ``fully_shard``: Lightning's documented
pattern, with the import inside the method so that the switch reaches it. Checkpoints are
Lightning's own (``trainer.save_checkpoint``, a DCP folder; ``fit(ckpt_path=...)``).
"""

from __future__ import annotations

import os

import client_common as common
import lightning as L
import torch
from client_common import IMPLS, SAVE_AT, STEPS, Record


class LlamaModule(L.LightningModule):
    """The tiny Llama, sharded in ``configure_model``; records loss and gradient norm."""

    def __init__(self, checkpoint: str | None):
        super().__init__()
        self.model = common.tiny_llama()
        self.record = Record()
        self.checkpoint = checkpoint  # where to save after step SAVE_AT, or None

    def configure_model(self):
        from torch.distributed.fsdp import fully_shard  # at call time: the switch's

        mesh = self.device_mesh["data_parallel"]
        for layer in self.model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(self.model, mesh=mesh)

    def training_step(self, batch, batch_idx):
        ids = common.tokens(self.global_step)  # by step, so a resumed fit gets the same data
        loss = self.model(input_ids=ids, labels=ids).loss
        self.record.loss.append(loss.item())
        return loss

    def on_before_optimizer_step(self, optimizer):
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.record.grad_norm.append(common.norm_value(norm))

    def on_train_batch_end(self, outputs, batch, batch_idx):
        if self.checkpoint and self.global_step == SAVE_AT:
            self.trainer.save_checkpoint(self.checkpoint)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(range(STEPS), batch_size=None)


def train(impl: str, checkpoint: str, resume: bool, variants: str = "") -> Record:
    """One fit under ``impl`` (with ``variants``): from step 0 (torch's saves ``checkpoint``),
    or resumed from it."""
    from lightning.pytorch.strategies import ModelParallelStrategy

    environ = dict(os.environ)  # Lightning's teardown removes WORLD_SIZE
    try:
        with common.switched(impl, variants):
            module = LlamaModule(checkpoint if impl == "torch" and not variants else None)
            trainer = L.Trainer(
                accelerator="cpu",
                devices=2,
                strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
                max_steps=STEPS,
                logger=False,
                enable_checkpointing=False,
                enable_progress_bar=False,
                enable_model_summary=False,
                use_distributed_sampler=False,
            )
            trainer.fit(module, ckpt_path=checkpoint if resume else None)
            return common.fill_final_state(module.record, module.model, trainer.optimizers[0])
    finally:
        os.environ.clear()
        os.environ.update(environ)


def ranks(folder: str) -> dict[str, Record]:
    """Every run of this client on this rank (as client_accelerate.ranks)."""
    checkpoint = f"{folder}/lightning-torch-step{SAVE_AT}"
    runs = {impl: train(impl, checkpoint, resume=False) for impl in IMPLS}
    for impl in IMPLS[1:]:
        runs[f"{impl} resumed"] = train(impl, checkpoint, resume=True)
    return runs | common.variant_runs(lambda impl, variants: train(impl, "", False, variants))
