"""``twinshard train`` and ``twinshard export`` end to end, through the command line: a short
run's log, plot and checkpoints, export, and every refusal of bad input.

Each run is a real multi-process run (gloo on CPU) of a small model for a few steps; the short
run is shared (tests/conftest.py). Resuming and damaged checkpoints are in
test_train_resume.py. Parameters are compared with ``assert_close`` defaults (fp32).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from train_support import (
    final_params,
    run_train,
    snapshot,
)

from twinshard.cli import main as cli
from twinshard.models import Llama, LlamaConfig
from twinshard.ranks.launch import launch
from twinshard.train import build, config, flags, report
from twinshard.train import checkpoint as ckpt
from twinshard.train.export import load_exported


def test_short_run_loss_falls(short_run):
    rows = (short_run / "loss.csv").read_text().splitlines()
    assert rows[0] == "step,loss" and len(rows) == 41
    losses = [float(r.split(",")[1]) for r in rows[1:]]
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert first > 5.0, losses[:5]  # about ln 256 at the start
    assert last < first - 1.0, (first, last)


def test_short_run_writes_log_plot_and_keeps_two_checkpoints(short_run):
    log = (short_run / "train.log").read_text()
    assert "optimized fully_shard on 2 rank(s)" in log  # the default implementation
    assert "step 40/40" in log and "done: steps 0 -> 40" in log and "sample: " in log
    assert "validation loss" in log
    names = [p.name for p in ckpt.complete_checkpoints(short_run / "checkpoints")]
    assert names == ["step_00000030", "step_00000040"]  # --keep 2 pruned 10 and 20
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "matplotlib is not installed" in log
    else:
        assert (short_run / "loss.png").read_bytes()[:4] == b"\x89PNG"
    manifest = ckpt.validate(short_run / "checkpoints" / "step_00000040")
    assert manifest["step"] == 40 and manifest["world_size"] == 2
    assert manifest["samples"] == 40 * 12  # the data position: samples consumed
    assert len(manifest["losses"]) == 40


def test_loss_curve_without_matplotlib_is_a_csv(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    message = report.write_loss_curve(tmp_path, [5.0, 4.0, 3.5], 3.6, "t")
    assert "matplotlib is not installed" in message and "loss.csv" in message
    assert (tmp_path / "loss.csv").read_text().splitlines() == [
        "step,loss",
        "1,5.000000",
        "2,4.000000",
        "3,3.500000",
    ]
    assert not (tmp_path / "loss.png").exists()


# ------------------------------------------------------------------------------ export
def sharded_logits(checkpoint: str, tokens: torch.Tensor) -> torch.Tensor:
    """Load ``checkpoint`` into the sharded training model on these ranks; its logits."""
    from torch.distributed.device_mesh import init_device_mesh

    manifest = ckpt.validate(Path(checkpoint))
    cfg = config.TrainConfig(**manifest["config"], model=manifest["model"])
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = build.build_model(cfg, torch.device("cpu"), mesh)
    opt, sched = build.build_optimizer(cfg, model)
    ckpt.load(Path(checkpoint), model, opt, sched)
    with torch.no_grad():
        return model(tokens)


def test_export_loads_into_the_plain_model_with_the_same_outputs(short_run, tmp_path):
    out = tmp_path / "model.safetensors"
    assert cli(["export", str(short_run), str(out)]) == 0
    from safetensors.torch import load_file

    config = LlamaConfig.preset("tiny", dim=32, n_heads=2)
    plain = Llama(config)
    plain.load_state_dict(load_file(str(out)))  # strict: every key, every shape
    tokens = torch.tensor([list(b"The small cat sees a dog. 3 plus 4 is 7.")])  # (1, T)
    checkpoint = ckpt.resolve(short_run)
    expected = launch(sharded_logits, 2, str(checkpoint), tokens)[0]
    torch.testing.assert_close(plain(tokens), expected)
    torch.testing.assert_close(load_exported(out)(tokens), expected)  # config from the file
    for name, value in final_params(short_run).items():
        assert torch.equal(plain.state_dict()[name], value)


def test_export_refuses_to_overwrite_and_reports_missing_checkpoints(short_run, tmp_path, capsys):
    out = tmp_path / "model.safetensors"
    out.write_bytes(b"keep me")
    assert cli(["export", str(short_run), str(out)]) == 2
    assert "already exists" in capsys.readouterr().err and out.read_bytes() == b"keep me"
    missing = tmp_path / "no-such-run"
    assert cli(["export", str(missing), str(tmp_path / "other.safetensors")]) == 2
    assert str(missing) in capsys.readouterr().err
    assert not (tmp_path / "other.safetensors").exists()


# -------------------------------------------------------------------------- error cases
def test_bad_arguments_are_refused_before_anything_runs(tmp_path, capsys):
    out = tmp_path / "run"
    cases = [
        (
            ["--batch-size", "5", "--world", "2"],
            "--batch-size 5 cannot be split evenly over 2 rank(s)",
        ),
        (["--steps", "0"], "--steps must be positive"),
        (["--lr", "0.001", "--min-lr", "0.01"], "--min-lr 0.01 is above --lr 0.001"),
        (["--dim", "30", "--heads", "4"], "must be divisible by n_heads"),
        (["--stop-at", "9", "--steps", "5"], "--stop-at 9 must be between 1 and --steps 5"),
        (["--data", str(tmp_path / "missing.txt")], f"{tmp_path / 'missing.txt'}' does not exist"),
        (["--resume", str(tmp_path / "nowhere")], "does not exist"),
        (["--resume", str(tmp_path)], "no complete checkpoint in"),
        (["--variants", "qwz:bits=3"], "bits=8 or 4"),
        (["--variants", "qgz+bf16-wire"], "more than one variant replaces the reduce_scatter"),
        (["--variants", "qgz:node=3", "--world", "2"], "node=3 does not divide 2 ranks"),
    ]
    short = tmp_path / "short.txt"
    short.write_text("too short")
    cases.append((["--data", str(short)], "has 9 bytes, too few for --seq 32"))
    for argv, message in cases:
        assert run_train("--out", out, *argv) == 2, argv
        err = capsys.readouterr().err
        assert message in err, (argv, err)
    assert not out.exists()
    with pytest.raises(SystemExit):
        run_train("--model", "enormous")


def losses_of(run_dir: Path) -> list[float]:
    lines = (run_dir / "loss.csv").read_text().splitlines()[1:]
    return [float(line.split(",")[1]) for line in lines]


def test_variants_train_close_to_the_exact_collectives_but_not_equal(tmp_path):
    exact, lossy = tmp_path / "exact", tmp_path / "lossy"
    assert run_train("--out", exact, "--steps", 4, "--checkpoint-every", 0) == 0
    argv = ["--steps", 4, "--checkpoint-every", 0, "--variants", "qwz+qgz:bits=4"]
    assert run_train("--out", lossy, *argv) == 0
    assert "--variants qwz+qgz:bits=4" in (lossy / "train.log").read_text()
    exact_losses, lossy_losses = losses_of(exact), losses_of(lossy)
    assert len(exact_losses) == len(lossy_losses) == 4
    for step, (a, b) in enumerate(zip(exact_losses, lossy_losses), 1):
        # int4 weights change the first forward already; the change stays small
        assert a != b and abs(a - b) < 0.02 * a, (step, a, b)


def test_optimized_is_the_default_and_reference_one_flag_away(tmp_path, capsys):
    with pytest.raises(SystemExit) as done:
        cli(["train", "--help"])
    assert done.value.code == 0
    help_text = " ".join(capsys.readouterr().out.split())  # argparse wraps the lines
    start = help_text.index("--impls IMPLS, --impl IMPLS the one fully_shard")
    impl_help = help_text[start:][:300]
    for name in ("optimized", "reference", "torch", "an importable module"):
        assert name in impl_help, impl_help
    assert "default optimized)" in impl_help, impl_help
    args = argparse.Namespace(
        **dict.fromkeys(flags.DEFAULTS),
        nproc=2,
        stop_at=None,
        resume=None,
        out=str(tmp_path / "run"),
    )
    assert config.resolve(args).impl == "optimized"
    args.impl = "reference"
    assert config.resolve(args).impl == "reference"
    assert not (tmp_path / "run").exists()  # resolving writes nothing


def test_an_existing_run_or_an_incompatible_checkpoint_is_never_overwritten(
    short_run, tmp_path, capsys
):
    before = snapshot(short_run)
    data = tmp_path / "other.txt"
    data.write_text("some other text, long enough for a few windows of 32 bytes. " * 20)
    cases = [
        ([], "already holds a training run; continue it with --resume"),
        (
            ["--resume", str(short_run), "--model", "small"],
            "holds another model (preset 'tiny', this run asks for 'small'",
        ),
        (["--resume", str(short_run), "--layers", "3"], "n_layers 2 vs 3"),
        (["--resume", str(short_run), "--data", str(data)], "was trained on other data"),
        (["--resume", str(short_run), "--seq", "64"], "--seq 64 does not match"),
        (["--resume", str(short_run)], "already at step 40 of --steps 40"),
        (
            ["--resume", str(short_run / "checkpoints" / "step_00000030"), "--steps", "50"],
            "would overwrite the newer checkpoint(s) step_00000040",
        ),
    ]
    for argv, message in cases:
        assert cli(["train", "--out", str(short_run), *argv]) == 2, argv
        err = capsys.readouterr().err
        assert message in err, (argv, err)
    assert snapshot(short_run) == before
