"""What one plan is: the model, the batch, the policies, the mesh, the implementation, the target.

``PlanConfig`` travels to the process that runs the step (by pickle). ``check()`` says in one
line what is wrong with it, before any work starts, or returns nothing. The model is a
twinshard preset (``tiny``, ``small``, ``medium``, ``1b``), a published model's shape
(``MODELS``: ``llama3-8b``, ``llama3-70b``, ... from the models' published configs), or the
path of a Hugging Face ``config.json`` (``hf.py``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from twinshard import impls
from twinshard.bench.checks import reshard_problem
from twinshard.bench.config import DTYPES, RunConfig
from twinshard.models import PRESETS, LlamaConfig

from . import checkpointing, hf
from .profiles import DEVICES, NETWORKS

LLAMA3 = dict(vocab_size=128256, n_kv_heads=8, rope_theta=500000.0)
MODELS = {
    "llama3-8b": dict(LLAMA3, dim=4096, n_layers=32, n_heads=32, ffn_hidden=14336),
    "llama3-70b": dict(LLAMA3, dim=8192, n_layers=80, n_heads=64, ffn_hidden=28672),
    "llama3-405b": dict(LLAMA3, dim=16384, n_layers=126, n_heads=128, ffn_hidden=53248),
    "llama2-7b": dict(vocab_size=32000, dim=4096, n_layers=32, n_heads=32, ffn_hidden=11008),
    "llama2-13b": dict(vocab_size=32000, dim=5120, n_layers=40, n_heads=40, ffn_hidden=13824),
    "llama2-70b": dict(
        vocab_size=32000, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_hidden=28672
    ),
}
OPTIMIZERS = ("adamw", "sgd")
DEVICE_CHOICES = (*DEVICES, "cpu")


@dataclass
class PlanConfig:
    model: str = "small"  # a preset, a published model's name, or a config.json
    layers: int | None = None  # overrides the model's number of blocks
    impl: str = "optimized"
    world: int = 8
    hsdp: int = 1  # replicas of a 2D mesh; 1: FSDP
    batch: int = 1  # sequences per rank per step
    seq: int = 2048
    dtype: str = "bf16"  # parameters in bf16 with fp32 reduction, or fp32
    ac: str = "none"
    reshard_after_forward: bool | int = True
    offload: bool = False
    optimizer: str = "adamw"
    device: str = "h100"
    network: str | None = None  # None: the device's usual network; "simnet:<link>" for a CPU
    probe: bool = False  # also bench.probe's categories at its peak (slow for large models)
    real: bool = False  # the CPU target only: real tensors instead of FakeTensors (a check)
    extra: dict = field(default_factory=dict)  # LlamaConfig overrides (tests, sweeps)

    @property
    def cpu(self) -> bool:
        return self.device == "cpu"

    def llama(self) -> LlamaConfig:
        overrides = dict(self.extra)
        if self.layers:
            overrides["n_layers"] = self.layers
        overrides["max_seq_len"] = max(self.seq, 16)
        if hf.looks_like_file(self.model):
            return hf.llama_config(self.model, **overrides)
        if self.model in MODELS:
            return LlamaConfig(**{**MODELS[self.model], **overrides})
        return LlamaConfig.preset(self.model, **overrides)

    def run_config(self) -> RunConfig:
        """The same job as ``twinshard bench`` describes it (``bench.config.shard`` takes it)."""
        return RunConfig(
            impl=self.impl,
            dtype=self.dtype,
            seq=self.seq,
            per_rank=self.batch,
            backend="fake" if self.cpu else "fakeaccel",
            world=self.world,
            replicas=self.hsdp,
            offload=self.offload,
            reshard_after_forward=self.reshard_after_forward,
        )

    def as_dict(self) -> dict:
        return asdict(self)

    def check(self) -> str | None:
        """What is wrong with this plan, in one line naming the flag; None if nothing."""
        positive = dict(world=self.world, hsdp=self.hsdp, batch=self.batch, seq=self.seq)
        for name, value in positive.items():
            if not isinstance(value, int) or value < 1:
                return f"--{name} must be a positive integer, got {value!r}"
        if self.layers is not None and self.layers < 1:
            return f"--layers must be a positive integer, got {self.layers!r}"
        if self.world % self.hsdp:
            return f"--hsdp {self.hsdp} does not divide --world {self.world}"
        wrong = impls.problem(self.impl, "--impls")
        if wrong:
            return wrong
        if self.dtype not in DTYPES:
            return f"--dtype {self.dtype!r} unknown; use {', '.join(DTYPES)}"
        if self.optimizer not in OPTIMIZERS:
            return f"--optimizer {self.optimizer!r} unknown; use {', '.join(OPTIMIZERS)}"
        if self.device not in DEVICE_CHOICES:
            return f"--device {self.device!r} unknown; use {', '.join(DEVICE_CHOICES)}"
        if self.real and not self.cpu:
            return "real tensors (real=True) are for --device cpu only"
        if self.network and not (self.network in NETWORKS or self.network.startswith("simnet:")):
            return f"--network {self.network!r} unknown; use {', '.join(NETWORKS)} or simnet:<link>"
        wrong = reshard_problem(self.reshard_after_forward, self.world, self.hsdp)
        if wrong:
            return wrong
        try:
            checkpointing.parse(self.ac)
        except ValueError as error:
            return str(error)
        if not hf.looks_like_file(self.model) and self.model not in (*PRESETS, *MODELS):
            names = ", ".join((*PRESETS, *MODELS))
            return f"--model {self.model!r}: not a preset ({names}) nor a config.json path"
        try:
            self.llama()
        except ValueError as error:
            return str(error)
        return None
