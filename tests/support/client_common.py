"""What the client runs of tests/ecosystem/test_clients.py share: the model, the data, the record.

Every client trains the same tiny ``transformers`` Llama, built from a config (no download)
with the same seed, on the same per-rank batches, so the runs of one client under torch's
``fully_shard``, the reference and the optimized path can be compared bit for bit. A run
returns a ``Record`` of what each rank saw: the loss and the gradient norm of every step, and
its local shard of every parameter and of every optimizer state tensor at the end.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from twinshard import switch

# The implementations every client runs under, torch's own first (the one the others match).
IMPLS = ("torch", "reference", "optimized")
# Communication variants every client also trains with, through the switch, at the default
# block: the three implementations must give the same bits with them too (docs/variants.md).
VARIANTS = "qwz+qgz"
WITH_VARIANTS = f" with {VARIANTS}"  # the suffix of those runs' names
STEPS = 4  # training steps of a run
SAVE_AT = 2  # the step after which the torch run's checkpoint is taken (resumed to STEPS)
BATCH, SEQ, VOCAB = 2, 8, 96  # per rank


@dataclass
class Record:
    """One rank's view of one run."""

    loss: list[float] = field(default_factory=list)  # per step
    grad_norm: list[float] = field(default_factory=list)  # per step, before the update
    params: dict[str, torch.Tensor] = field(default_factory=dict)  # name -> local shard
    optim: dict[str, torch.Tensor] = field(default_factory=dict)  # "param/state" -> local shard
    sharded_by: str = ""  # the implementation whose FSDPModule the root became

    def differences(self, other: Record) -> list[str]:
        """What is not bitwise equal between two records (empty when they are)."""
        found = []
        for what in ("loss", "grad_norm"):
            mine, theirs = getattr(self, what), getattr(other, what)
            if mine != theirs:
                found.append(f"{what}: {mine} != {theirs}")
        for what in ("params", "optim"):
            mine, theirs = getattr(self, what), getattr(other, what)
            if sorted(mine) != sorted(theirs):
                found.append(f"{what}: names {sorted(mine)} != {sorted(theirs)}")
                continue
            found += [f"{what}[{k}] differs" for k in mine if not torch.equal(mine[k], theirs[k])]
        return found


def tiny_llama(layers: int = 2):
    """A Llama of ``layers`` blocks from ``transformers``, built from a config with seed 0."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
        tie_word_embeddings=False,
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def tokens(step: int, rank: int | None = None) -> torch.Tensor:
    """This rank's token ids for ``step``: (BATCH, SEQ), different on every rank and step."""
    rank = dist.get_rank() if rank is None else rank
    generator = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (the tensor itself otherwise), detached and copied."""
    tensor = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return tensor.detach().clone()


def fill_final_state(record: Record, model: torch.nn.Module, optimizer) -> Record:
    """Copy this rank's parameter and optimizer-state shards into ``record``, and which
    implementation sharded the model."""
    record.sharded_by = sharded_by(model)
    names = {p: n for n, p in model.named_parameters()}
    record.params = {n: local(p) for p, n in names.items()}
    for p, state in optimizer.state.items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                record.optim[f"{names[p]}/{key}"] = local(value)
    return record


def sharded_by(model: torch.nn.Module) -> str:
    """``torch``, ``reference`` or ``optimized``: whose ``fully_shard`` made ``model`` an
    FSDPModule (read off the first FSDPModule class of its type), or "" when none did."""
    for cls in type(model).__mro__:
        if cls.__name__ == "FSDPModule":
            return (
                cls.__module__.split(".")[1] if cls.__module__.startswith("twinshard.") else "torch"
            )
    return ""


def norm_value(norm) -> float:
    """A gradient norm as a float (a DTensor norm is made whole first)."""
    norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
    return float(norm)


@contextlib.contextmanager
def switched(impl: str, variants: str = ""):
    """The documented switch: torch's ``fully_shard`` is ``impl``'s inside the block, setting
    ``variants`` on every module it shards."""
    with switch.using(impl, variants):
        yield


def variant_runs(train) -> dict[str, Record]:
    """``train(impl, variants)`` under every implementation with ``VARIANTS``, by run name."""
    return {f"{impl}{WITH_VARIANTS}": train(impl, VARIANTS) for impl in IMPLS}


def compare_runs(results: list[dict[str, Record]]) -> dict[str, list[str]]:
    """Per run, what differs from torch's run on the same rank: for a resumed run, from the
    steps of torch's run after the checkpoint; for a run with variants, from torch's with the
    same variants. A run must have been sharded by its own implementation (``"optimized
    resumed"`` by the optimized path)."""
    report = {}
    for run in results[0]:
        found = []
        for rank, runs in enumerate(results):
            truth = runs["torch" + (WITH_VARIANTS if run.endswith(WITH_VARIANTS) else "")]
            mine = runs[run]
            if run.endswith(" resumed"):
                truth = Record(
                    truth.loss[SAVE_AT:], truth.grad_norm[SAVE_AT:], truth.params, truth.optim
                )
            if mine.sharded_by != run.split()[0]:
                found.append(f"rank {rank}: the model was sharded by {mine.sharded_by or 'nobody'}")
            found += [f"rank {rank}: {d}" for d in mine.differences(truth)]
        report[run] = found
    return report
