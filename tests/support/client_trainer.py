"""The HF ``Trainer`` with FSDP2 (``fsdp="full_shard"``, FSDP version 2) on 2 gloo ranks,
under torch, the reference and the optimized path.

How FSDP2 runs on gloo. The Trainer hands FSDP to accelerate, which turns a run into FSDP only
on an accelerator backend (see client_accelerate.py). The Trainer's supported way to use an
accelerate state configured beforehand is ``accelerator_config={"use_configured_state":
True}``; the forced setting is the one of client_accelerate.py: an accelerate state built on
the CPU and declared FSDP, with the plugin the Trainer itself builds from its arguments
(``TrainingArguments.fsdp_plugin_args``). Everything else is the Trainer's: its data loader,
AdamW, clipping, logging, checkpoints (``SHARDED_STATE_DICT``: DCP) and
``train(resume_from_checkpoint=...)``.
"""

from __future__ import annotations

import torch
from client_common import (
    IMPLS,
    SAVE_AT,
    STEPS,
    Record,
    fill_final_state,
    switched,
    tiny_llama,
    variant_runs,
)
from client_common import tokens as step_tokens


class Samples(torch.utils.data.Dataset):
    """Token rows for every step and rank; the Trainer's sampler deals them out."""

    def __init__(self):
        self.rows = torch.cat([step_tokens(s, r) for s in range(STEPS) for r in range(2)])

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


def arguments(folder: str, save: bool, configured: bool):
    from transformers import TrainingArguments

    return TrainingArguments(
        output_dir=folder,
        use_cpu=True,
        fsdp=True,
        fsdp_config={"version": 2, "state_dict_type": "SHARDED_STATE_DICT"},
        accelerator_config={"use_configured_state": configured},
        max_steps=STEPS,
        per_device_train_batch_size=2,
        learning_rate=1e-2,
        logging_steps=1,
        save_strategy="steps" if save else "no",
        save_steps=SAVE_AT,
        report_to="none",
        disable_tqdm=True,
        seed=0,
    )


def configured_arguments(folder: str, save: bool):
    """Arguments that use an accelerate state forced to FSDP on the CPU (see the docstring)."""
    from client_accelerate import fsdp_on_gloo

    plugin_args = arguments(folder, save, configured=False).fsdp_plugin_args
    fsdp_on_gloo(plugin_args)
    return arguments(folder, save, configured=True)


def train(impl: str, folder: str, resume: str | None, variants: str = "") -> Record:
    """One ``Trainer.train`` under ``impl`` (with ``variants``): from step 0 (torch's saves a
    checkpoint every SAVE_AT steps), or resumed from the checkpoint ``resume``."""
    from transformers import Trainer, TrainerCallback

    record = Record()

    class Recording(Trainer):
        def compute_loss(self, model, inputs, *args, **kwargs):
            loss = super().compute_loss(model, inputs, *args, **kwargs)
            record.loss.append((loss[0] if isinstance(loss, tuple) else loss).item())
            return loss

    class GradNorms(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "grad_norm" in logs:
                record.grad_norm.append(logs["grad_norm"])

    with switched(impl, variants):
        where = f"{folder}/{impl}{'-variants' if variants else ''}"
        args = configured_arguments(where, save=impl == "torch" and not variants)
        trainer = Recording(
            model=tiny_llama(), args=args, train_dataset=Samples(), callbacks=[GradNorms()]
        )
        trainer.train(resume_from_checkpoint=resume)
        return fill_final_state(record, trainer.model, trainer.optimizer)


def ranks(folder: str) -> dict[str, Record]:
    """Every run of this client on this rank (as client_accelerate.ranks)."""
    runs = {impl: train(impl, folder, resume=None) for impl in IMPLS}
    for impl in IMPLS[1:]:
        runs[f"{impl} resumed"] = train(impl, folder, f"{folder}/torch/checkpoint-{SAVE_AT}")
    return runs | variant_runs(lambda impl, variants: train(impl, folder, None, variants))
