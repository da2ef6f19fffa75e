"""One training job, as every measuring command describes it, and what is wrong with it.

``Job`` is what ``twinshard bench`` times, ``twinshard plan`` records and prices,
``twinshard schedule`` draws and ``python -m twinshard.measure.fakeaccel`` checks: an
implementation, a Llama-style model, a world, the policies, the optimizer. It travels to the ranks
by pickle. ``Job.problem()`` is the one validator: the first thing wrong, in one line naming the
flag (``flags.py`` holds the spellings), or ``None``.

The model (``preset``) is a twinshard preset (``tiny``, ``small``, ``medium``, ``1b``), a
published model's shape (``PUBLISHED``: ``llama3-8b``, ``llama2-70b``, ...) or the path of a
Hugging Face ``config.json`` (``twinshard.hf_config``); ``model`` overrides its fields (``n_layers``, ...).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

from twinshard import hf_config
from twinshard.commandline import impls
from twinshard.commandline.vocabulary import DTYPES
from twinshard.models import PRESETS, LlamaConfig
from twinshard.ranks import devices

BASELINES = ("plain", "ddp")  # run by the bench itself, without FSDP
SHARDED = tuple(impls.SHORT_NAMES)  # FSDP by short name
# DTYPES names the precisions of every flag that takes one (--dtype, schedule's --param-dtype
# and --reduce-dtype); a job's --dtype is fp32 or bf16 (see Job.low_precision)
JOB_DTYPES = ("fp32", "bf16")
# fake, simnet and fakeaccel: one process stands in for W (fakeaccel: on the fake accelerator)
BACKENDS = ("gloo", "nccl", "fake", "simnet", "fakeaccel")
OPTIMIZERS = ("sgd", "adamw")
LLAMA3 = dict(vocab_size=128256, n_kv_heads=8, rope_theta=500000.0)
PUBLISHED = {  # from the models' published configs
    "llama3-8b": dict(LLAMA3, dim=4096, n_layers=32, n_heads=32, ffn_hidden=14336),
    "llama3-70b": dict(LLAMA3, dim=8192, n_layers=80, n_heads=64, ffn_hidden=28672),
    "llama3-405b": dict(LLAMA3, dim=16384, n_layers=126, n_heads=128, ffn_hidden=53248),
    "llama2-7b": dict(vocab_size=32000, dim=4096, n_layers=32, n_heads=32, ffn_hidden=11008),
    "llama2-13b": dict(vocab_size=32000, dim=5120, n_layers=40, n_heads=40, ffn_hidden=13824),
    "llama2-70b": dict(
        vocab_size=32000, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_hidden=28672
    ),
}
# the fields and model overrides that must be positive integers -> the flags that set them
POSITIVE = {"world": "--world", "replicas": "--hsdp", "seq": "--seq", "per_rank": "--per-rank"}
POSITIVE |= {"steps": "--steps"}
OVERRIDES = {"n_layers": "--layers", "dim": "--dim", "n_heads": "--heads", "vocab_size": "--vocab"}
CHOICES = {"dtype": JOB_DTYPES, "backend": BACKENDS, "optimizer": OPTIMIZERS}
CHOICES |= dict.fromkeys(("param_dtype", "reduce_dtype"), (*DTYPES, None))  # None: dtype's


@dataclass
class Job:
    impl: str = "optimized"
    preset: str = "small"  # the model: a preset, a published name or a config.json (--model)
    model: dict = field(default_factory=dict)  # LlamaConfig overrides (n_layers, dim, ...)
    dtype: str = "fp32"  # fp32, or bf16 compute with fp32 reduction and fp32 master weights
    param_dtype: str | None = None  # mixed precision's where not dtype's: schedule's --param-dtype
    reduce_dtype: str | None = None  # and --reduce-dtype (fp16 too; see Job.mixed_precision)
    seq: int = 128
    per_rank: int = 4  # sequences per rank per step
    warmup: int = 2
    steps: int = 10
    # where it runs (cpu, cuda); for a plan, the device whose constants price it (h100, cpu)
    device: str = "cpu"
    backend: str = "gloo"
    world: int = 2  # world size; for fake, simnet and fakeaccel, simulated by one process
    replicas: int = 1  # HSDP: a (replicas, world // replicas) mesh; 1 is plain FSDP
    link: str = "ib"  # simnet: nvlink, ib, or GB/s
    latency_us: float | None = None  # simnet: overrides the link's latency
    memory: bool = True  # one more (untimed) step that tracks memory by category
    profile: str | None = None  # a directory: write a cProfile of the timed steps there
    # the optimizer's ``foreach``: None is torch's own choice (measure/step.py's build says which)
    foreach: bool | None = None
    offload: bool = False  # CPUOffloadPolicy (pinned): shards and sharded gradients on the host
    # of the blocks (the root keeps torch's default); a string is a value the flag could not
    # read, kept for problem() to name
    reshard_after_forward: bool | int | str = True
    # explicit prefetch lists of this many blocks on the root and each block (--prefetch,
    # ``step.prefetch``); None leaves the implementation's own choice
    prefetch: int | None = None
    optimizer: str = "sgd"  # sgd (momentum) or adamw (fused)
    variants: str = ""  # communication variants (--variants, twinshard.variants.parse)
    ac: str = "none"  # activation checkpointing (plan/checkpointing.py): none, block, ...
    network: str | None = None  # a plan: the network that prices it (None: the device's)
    probe: bool = False  # a plan: also measure.probe's categories at its peak
    real: bool = False  # a plan on the CPU: real tensors instead of FakeTensors (a check)

    @property
    def simulated(self) -> bool:
        return self.backend in ("fake", "simnet")

    @property
    def nproc(self) -> int:
        return 1 if self.simulated else self.world

    @property
    def cpu(self) -> bool:
        return self.device == "cpu"

    @property
    def low_precision(self) -> torch.dtype | None:
        """The compute dtype of a mixed-precision job, or None for fp32 throughout."""
        return None if self.dtype == "fp32" else DTYPES[self.dtype]

    @property
    def mixed_precision(self) -> tuple[torch.dtype | None, torch.dtype | None] | None:
        """The (param_dtype, reduce_dtype) of the job's ``MixedPrecisionPolicy``, or None for
        no policy: those of ``dtype`` (bf16 compute, fp32 reduction), each replaced by
        ``param_dtype`` or ``reduce_dtype`` where given."""
        low = self.low_precision
        reduce = DTYPES.get(self.reduce_dtype, low and torch.float32)  # bf16's reduces in fp32
        chosen = (DTYPES.get(self.param_dtype, low), reduce)
        return None if chosen == (None, None) else chosen

    def llama(self) -> LlamaConfig:
        overrides = {"max_seq_len": max(self.seq, 16), **self.model}
        if hf_config.looks_like_file(self.preset):
            return hf_config.llama_config(self.preset, **overrides)
        if self.preset in PUBLISHED:
            return LlamaConfig(**{**PUBLISHED[self.preset], **overrides})
        return LlamaConfig.preset(self.preset, **overrides)

    def as_dict(self) -> dict:
        return asdict(self)

    def problem(self, baselines: bool = False) -> str | None:
        """The first thing wrong with this job, in one line naming the flag, or None.
        ``baselines``: plain and ddp are implementations too (``twinshard bench``)."""
        values = [(f, getattr(self, k)) for k, f in POSITIVE.items()]
        values += [(f, self.model.get(k, 1)) for k, f in OVERRIDES.items()]
        wrong = next(filter(None, (positive(*value) for value in values)), None)
        if wrong:
            return wrong
        if self.warmup < 0:
            return f"--warmup must be 0 or more, got {self.warmup}"
        if self.world % self.replicas:
            return f"--hsdp {self.replicas} does not divide --world {self.world}: use a divisor"
        also = BASELINES if baselines and self.backend != "fakeaccel" else ()
        wrong = impls.problem(self.impl, "--impls", also=also)
        if wrong:
            return wrong
        wrong = reshard_problem(self.reshard_after_forward, self.world // self.replicas)
        if wrong:
            return wrong
        if self.prefetch is not None and (wrong := positive("--prefetch", self.prefetch)):
            return wrong
        for name, allowed in CHOICES.items():
            if getattr(self, name) not in allowed:
                flag, use = name.replace("_", "-"), ", ".join(filter(None, allowed))
                return f"--{flag} {getattr(self, name)!r} unknown; use {use}"
        return self._where_problem() or self._model_problem() or self._variants_problem()

    def _variants_problem(self) -> str | None:
        if not self.variants:
            return None
        from twinshard.variants import parse, problem

        try:  # what the spec says is wrong first, then what the job makes of it
            parse(self.variants)
        except ValueError as error:
            return str(error)
        if self.impl in ("plain", "ddp"):
            return f"--variants {self.variants} needs an FSDP implementation, not {self.impl}"
        return problem(self.variants, self.world // self.replicas)

    def _where_problem(self) -> str | None:
        """The backend and the device: what the run needs of this machine. (What only one
        command reads is checked beside it: ``--link`` by bench, ``--ac`` by plan.)"""
        if self.latency_us is not None and self.latency_us < 0:
            return f"--latency-us must be 0 or more, got {self.latency_us}"
        if self.device not in ("cpu", "cuda"):
            return None  # a plan's device: the plan command knows its profiles
        if self.device == "cuda" and not torch.cuda.is_available():
            return "--device cuda: no CUDA device here; use --device cpu (or --backend fakeaccel)"
        runs_on = devices.backend_device(self.backend, 0).type
        if runs_on != "cpu" and self.device != runs_on:
            return (
                f"--backend {self.backend} runs on {runs_on} only: it needs --device {runs_on}; "
                "on the CPU use gloo, fake or simnet"
            )
        if self.backend == "gloo" and self.world > 64:
            return f"--world {self.world}: too many gloo processes; use --backend fake or simnet"
        return None

    def _model_problem(self) -> str | None:
        if not hf_config.looks_like_file(self.preset) and self.preset not in (*PRESETS, *PUBLISHED):
            names = ", ".join((*PRESETS, *PUBLISHED))
            return f"--model {self.preset!r}: not a preset ({names}) nor a config.json path"
        try:
            self.llama()
        except ValueError as error:
            return f"the model of --model/--layers/--dim/--heads/--vocab: {error}"
        return None


def positive(name: str, value) -> str | None:
    """The complaint about flag ``name``'s ``value`` unless it is a positive integer."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        return f"{name} must be a positive integer, got {value!r}"
    return None


def parse_reshard(value) -> bool | int:
    """``--reshard-after-forward``: true, false or a group size; a ``ValueError`` otherwise."""
    if isinstance(value, (bool, int)):
        return value
    lowered = str(value).lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    try:
        return int(value)
    except ValueError:
        raise ValueError(
            f"--reshard-after-forward takes true, false or an int (a group size), not {value!r}"
        ) from None


def reshard_problem(value, shard: int) -> str | None:
    """What is wrong with ``--reshard-after-forward`` ``value`` for ``shard`` ranks, or None."""
    try:
        parsed = parse_reshard(value)
    except ValueError as error:
        return str(error)
    if not isinstance(parsed, bool) and (parsed < 1 or shard % parsed):
        return f"--reshard-after-forward {parsed} must divide the shard group's size ({shard})"
    return None
