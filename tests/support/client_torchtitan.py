"""What tests/ecosystem/test_torchtitan.py runs: torchtitan's own trainer under torchrun, and its records.

One job for every run: torchtitan's debug Llama (``llama3``, flavor ``debugmodel``) in one TOML
file of torchtitan's own config system (``JOB``), on 2 gloo ranks, pure FSDP, AdamW, 4 steps,
a full DCP checkpoint after steps 2 and 4, metrics to TensorBoard at every step. Only the dump
folder differs between runs (``--job.dump_folder``, torchtitan's command-line override).

The wheel ships neither torchtitan's test tokenizer nor its ``c4_test`` data, and nothing may
come from a hub, so ``make_assets`` writes both: a byte-level tokenizer (``tokenizers``, the 256
bytes and the two Llama 3 special tokens, no merges) and a few seeded lines of text in the
json layout that torchtitan's ``c4_test`` loader reads with ``datasets.load_dataset(path)``.

A run is launched as a user would launch it: ``torchrun --standalone --nproc-per-node 2`` of
tests/support/torchtitan_on_cpu.py (the CPU shim, then ``torchtitan.train``), under torch's own
``fully_shard``, or with ``-m twinshard.run --impls NAME`` in front for twinshard. What a run
leaves is read back from its folder: the TensorBoard scalars and each checkpoint, as one flat
dict of everything DCP saved (``read_checkpoint``).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
SHIM = HERE / "torchtitan_on_cpu.py"
STEPS = 4  # training steps of a run
SAVE_EVERY = 2  # torchtitan saves a full checkpoint at steps 2 and 4
RESUME_AT = 2  # the checkpoint a resumed run starts from
# The TensorBoard scalars compared per step (torchtitan's own names).
SCALARS = (
    "loss_metrics/global_avg_loss",
    "loss_metrics/global_max_loss",
    "grad_norm",
    "lr",
    "n_tokens_seen",
)
TIMEOUT_S = 300  # one launch
SPECIAL_TOKENS = ("<|begin_of_text|>", "<|end_of_text|>")

# torchtitan's debug_model.toml, made short: 4 steps of 2 sequences of 64 tokens per rank.
JOB = """\
[job]
description = "twinshard: torchtitan's debug Llama, pure FSDP on 2 gloo ranks"

[metrics]
log_freq = 1
enable_tensorboard = true
disable_color_printing = true

[model]
name = "llama3"
flavor = "debugmodel"
hf_assets_path = "{assets}/tokenizer"

[optimizer]
name = "AdamW"
lr = 8e-4
eps = 1e-8

[lr_scheduler]
warmup_steps = 2
decay_ratio = 0.8

[training]
local_batch_size = 2
seq_len = 64
max_norm = 1.0
steps = {steps}
dataset = "c4_test"
dataset_path = "{assets}/c4_test"

[parallelism]
data_parallel_replicate_degree = 1
data_parallel_shard_degree = -1

[checkpoint]
enable = true
folder = "checkpoint"
interval = {save_every}
last_save_model_only = false

[activation_checkpoint]
mode = "selective"
selective_ac_option = "2"

[debug]
seed = 42
"""


def make_assets(folder: Path) -> Path:
    """Write the job's TOML, tokenizer and data under ``folder``; returns the TOML's path."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    (folder / "tokenizer").mkdir(parents=True, exist_ok=True)
    (folder / "c4_test").mkdir(exist_ok=True)
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    tokenizer.save(str(folder / "tokenizer" / "tokenizer.json"))
    bos, eos = SPECIAL_TOKENS
    config = {"bos_token": bos, "eos_token": eos}
    (folder / "tokenizer" / "tokenizer_config.json").write_text(json.dumps(config))
    rng = random.Random(0)
    words = "shard gather reduce scatter rank mesh tensor gradient step loss the of on".split()
    lines = [json.dumps({"text": " ".join(rng.choices(words, k=40))}) for _ in range(32)]
    (folder / "c4_test" / "data.json").write_text("\n".join(lines) + "\n")
    toml = folder / "job.toml"
    toml.write_text(JOB.format(assets=folder, steps=STEPS, save_every=SAVE_EVERY))
    return toml


@dataclass
class Run:
    """What one launch left: its exit code, its output, and its dump folder."""

    impl: str  # torch, reference or optimized
    returncode: int
    output: str  # stdout and stderr of torchrun and both ranks
    folder: Path

    def scalars(self) -> dict[int, dict[str, float]]:
        """step -> SCALARS name -> value, as torchtitan wrote them to TensorBoard (float32)."""
        from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
        from tensorboard.util.tensor_util import make_ndarray

        found: dict[int, dict[str, float]] = {}
        for path in sorted((self.folder / "tb").rglob("events.out.tfevents.*")):
            for event in EventFileLoader(str(path)).Load():
                for value in event.summary.value:
                    if value.tag in SCALARS:
                        scalar = make_ndarray(value.tensor).item()
                        found.setdefault(event.step, {})[value.tag] = scalar
        return found

    def checkpoint(self, step: int) -> Path:
        return self.folder / "checkpoint" / f"step-{step}"

    def failure(self) -> str:
        """Empty when the launch exited 0; otherwise its exit code and the end of its output."""
        if self.returncode == 0:
            return ""
        return f"{self.impl} run exited {self.returncode}:\n{self.output[-6000:]}"


def launch(impl: str, toml: Path, folder: Path, resume_from: Path | None = None) -> Run:
    """torchrun of torchtitan's trainer on 2 ranks under ``impl``, dumping into ``folder``;
    with ``resume_from`` (a checkpoint folder, ``step-N``) copied into ``folder`` first, so that
    torchtitan resumes from it, as it resumes a job of its own."""
    if resume_from is not None:
        shutil.copytree(resume_from, folder / "checkpoint" / resume_from.name)
    switch = [] if impl == "torch" else ["-m", "twinshard.run", "--impls", impl]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc-per-node", "2", *switch, str(SHIM)]
    command += ["--job.config_file", str(toml), "--job.dump_folder", str(folder)]
    env = {k: v for k, v in os.environ.items() if k != "TWINSHARD_FSDP"}
    env |= {
        "OMP_NUM_THREADS": "1",
        "HF_HOME": str(toml.parent / "hf"),  # the datasets cache, with the test's files
        "HF_HUB_OFFLINE": "1",  # nothing from a hub: the data is local
        "HF_DATASETS_OFFLINE": "1",
    }
    # A session of its own, so that a launch past TIMEOUT_S ends with both of its ranks.
    with subprocess.Popen(
        command,
        env=env,
        cwd=folder.parent,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    ) as agent:
        try:
            output, _ = agent.communicate(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(agent.pid, signal.SIGKILL)
            output, _ = agent.communicate()
            return Run(impl, -1, f"still running after {TIMEOUT_S} s\n{output}", folder)
    return Run(impl, agent.returncode, output, folder)


def read_checkpoint(path: Path) -> dict[str, object]:
    """Everything a DCP checkpoint holds (model, optimizer, lr scheduler, dataloader, train
    state), whole tensors, as one flat dict: ``"optimizer/state.output.weight.exp_avg"``."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    whole = path.parent.parent / f"{path.name}.pt"  # beside the run's checkpoint/ folder
    if not whole.exists():
        dcp_to_torch_save(path, whole)
    return _flatten(torch.load(whole, weights_only=False))


def _flatten(value, prefix: str = "") -> dict[str, object]:
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, (list, tuple)):
        items = enumerate(value)
    else:
        return {prefix: value}
    flat = {}
    for key, item in items:
        flat |= _flatten(item, f"{prefix}/{key}" if prefix else str(key))
    return flat


def checkpoint_differences(mine: dict[str, object], truth: dict[str, object]) -> list[str]:
    """The entries of two flat checkpoints that are not bitwise equal (dtype included), and
    the names that only one of them has; empty when they are the same."""
    found = [f"missing: {k}" for k in sorted(truth.keys() - mine.keys())]
    found += [f"unexpected: {k}" for k in sorted(mine.keys() - truth.keys())]
    for key in sorted(truth.keys() & mine.keys()):
        a, b = mine[key], truth[key]
        if isinstance(b, torch.Tensor):
            same = isinstance(a, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
        else:
            same = type(a) is type(b) and a == b
        if not same:
            found.append(f"differs: {key}")
    return found


def scalar_differences(mine: dict[int, dict], truth: dict[int, dict], steps) -> list[str]:
    """Per step in ``steps``, each SCALARS value of ``mine`` that is not bitwise torch's."""
    found = []
    for step in steps:
        for name in SCALARS:
            a, b = mine.get(step, {}).get(name), truth.get(step, {}).get(name)
            if a is None or b is None or a.hex() != b.hex():
                found.append(f"step {step} {name}: {a!r} != {b!r}")
    return found


def is_model_weight(key: str) -> bool:
    """A parameter of the model in torchtitan's checkpoint (it saves the model's state dict
    at the top level, beside optimizer/, lr_scheduler/, dataloader/ and train_state/)."""
    return key.endswith(".weight") and "/" not in key
