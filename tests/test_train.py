"""``twinshard train`` and ``twinshard export`` end to end, through the command line.

Each run is a real multi-process run (gloo on CPU) of a small model for a few steps. Runs
are shared between tests through module-scoped fixtures, so the whole file launches about
ten process groups. Parameters are compared with ``assert_close`` defaults (fp32).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from twinshard.cli import main as cli
from twinshard.launch import launch
from twinshard.models import Llama, LlamaConfig
from twinshard.train import build, config, flags, report
from twinshard.train import checkpoint as ckpt
from twinshard.train.export import load_exported

# A model and batch small enough for a few seconds per run; 12 sequences split over 1, 2 or 3
# ranks and into 2 micro-batches.
SMALL = ["--dim", "32", "--n-heads", "2", "--seq-len", "32", "--batch-size", "12",
         "--sample-length", "0", "--eval-batches", "1", "--log-every", "1"]
RESUME_STEPS = 6


def run_train(*argv) -> int:
    return cli(["train", *SMALL, *map(str, argv)])


def snapshot(path: Path) -> dict:
    """Every file under ``path`` with its size, modification time and content hash."""
    return {str(f.relative_to(path)): (f.stat().st_size, f.stat().st_mtime_ns,
                                       hashlib.sha256(f.read_bytes()).hexdigest())
            for f in sorted(path.rglob("*")) if f.is_file()}


def final_params(run_dir: Path) -> dict[str, torch.Tensor]:
    return ckpt.load_full_model(ckpt.resolve(run_dir))[1]


def assert_same_params(actual: dict, expected: dict) -> None:
    assert actual.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], msg=lambda m: f"{name}: {m}")


def rng_files(checkpoint: Path) -> list[dict]:
    return [torch.load(f, weights_only=True) for f in sorted((checkpoint / "rng").glob("*.pt"))]


def expected_rng(seed: int, step: int, rank: int) -> dict:
    saved = torch.get_rng_state()
    try:
        build.seed_rank_rngs(seed, step, rank)
        return ckpt.rng_state()
    finally:
        torch.set_rng_state(saved)


def assert_same_rng(actual: dict, expected: dict) -> None:
    assert torch.equal(actual["torch"], expected["torch"])
    assert actual["python"] == expected["python"]


# ------------------------------------------------------------------------ a short run
@pytest.fixture(scope="module")
def short_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("short") / "run"
    assert run_train("--out", out, "--steps", 40, "--checkpoint-every", 10, "--keep", 2,
                     "--sample-length", 8) == 0
    return out


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
        "step,loss", "1,5.000000", "2,4.000000", "3,3.500000"]
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


# ------------------------------------------------------ resume across world sizes
@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("uninterrupted") / "run"
    assert run_train("--out", out, "--nproc", 2, "--steps", RESUME_STEPS, "--checkpoint-every", 0,
                     "--impl", "reference") == 0
    return out


def test_resume_at_1_then_3_ranks_matches_an_uninterrupted_run(uninterrupted, tmp_path):
    """2 ranks (optimized, the default) -> 1 rank (torch's fully_shard, 2 micro-batches) -> 3
    ranks (reference): the same parameters as 2 ranks of the reference throughout."""
    out = tmp_path / "run"
    assert run_train("--out", out, "--nproc", 2, "--steps", RESUME_STEPS, "--stop-at", 2,
                     "--checkpoint-every", 0) == 0
    # Options left out come from the checkpoint; --impl and --grad-accum may change.
    assert cli(["train", "--resume", str(out), "--nproc", "1", "--stop-at", "4",
                "--grad-accum", "2", "--impl", "torch"]) == 0
    assert cli(["train", "--resume", str(out), "--nproc", "3", "--impl", "reference"]) == 0
    final = ckpt.resolve(out)
    assert final.name == f"step_{RESUME_STEPS:08d}"
    assert ckpt.validate(final)["world_size"] == 3
    assert_same_params(final_params(out), final_params(uninterrupted))
    truth = ckpt.validate(ckpt.resolve(uninterrupted))["losses"]
    torch.testing.assert_close(ckpt.validate(final)["losses"], truth)
    log = (out / "train.log").read_text()
    assert "from 2 to 1 ranks: re-derived from (seed 0, step 2, rank)" in log
    assert "from 1 to 3 ranks: re-derived from (seed 0, step 4, rank)" in log
    # The per-rank RNG states saved at the end are the re-derived ones, rank by rank.
    states = rng_files(final)
    assert len(states) == 3
    for rank, state in enumerate(states):
        assert_same_rng(state, expected_rng(0, 4, rank))


def test_a_save_killed_halfway_leaves_the_last_checkpoint_loadable(uninterrupted, tmp_path,
                                                                   monkeypatch, capsys):
    out = tmp_path / "run"
    monkeypatch.setenv(ckpt.CRASH_ENV, "4")  # rank 0 is SIGKILLed inside the save of step 4
    assert run_train("--out", out, "--nproc", 2, "--steps", RESUME_STEPS,
                     "--checkpoint-every", 2) == 1
    assert "killed" in capsys.readouterr().err
    monkeypatch.delenv(ckpt.CRASH_ENV)
    partial = out / "checkpoints" / ".partial-step_00000004"
    written = {p.name for p in partial.iterdir()}
    assert "__0_0.distcp" in written and ".metadata" not in written  # really halfway
    assert not (out / "checkpoints" / "step_00000004").exists()
    assert ckpt.resolve(out).name == "step_00000002"
    ckpt.load_full_model(ckpt.resolve(out))  # the previous checkpoint is whole
    # Resuming at the same world size restores each rank's own RNG state and finishes
    # exactly like the run that was never killed.
    assert cli(["train", "--resume", str(out)]) == 0
    assert not partial.exists()
    assert "per-rank RNG states restored" in (out / "train.log").read_text()
    assert_same_params(final_params(out), final_params(uninterrupted))
    truth = rng_files(ckpt.resolve(uninterrupted))
    for actual, expected in zip(rng_files(ckpt.resolve(out)), truth, strict=True):
        assert_same_rng(actual, expected)
    for rank, state in enumerate(truth):  # and those are the ones derived at step 0
        assert_same_rng(state, expected_rng(0, 0, rank))


def test_torchrun_runs_unchanged(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
               "--standalone", "-m", "twinshard.cli", "train", *SMALL, "--steps", "3"]
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    runs = list((tmp_path / "runs").iterdir())  # no --out: rank 0 named one run directory
    assert len(runs) == 1
    manifest = ckpt.validate(ckpt.resolve(runs[0]))
    assert manifest["step"] == 3 and manifest["world_size"] == 2
    assert "on 2 rank(s)" in (runs[0] / "train.log").read_text()


# -------------------------------------------------------------------------- error cases
def test_bad_arguments_are_refused_before_anything_runs(tmp_path, capsys):
    out = tmp_path / "run"
    cases = [
        (["--batch-size", "5", "--nproc", "2"], "--batch-size 5 cannot be split evenly over 2 rank(s)"),
        (["--steps", "0"], "--steps must be positive"),
        (["--lr", "0.001", "--min-lr", "0.01"], "--min-lr 0.01 is above --lr 0.001"),
        (["--dim", "30", "--n-heads", "4"], "must be divisible by n_heads"),
        (["--stop-at", "9", "--steps", "5"], "--stop-at 9 must be between 1 and --steps 5"),
        (["--data", str(tmp_path / "missing.txt")], f"{tmp_path / 'missing.txt'}' does not exist"),
        (["--resume", str(tmp_path / "nowhere")], "does not exist"),
        (["--resume", str(tmp_path)], "no complete checkpoint in"),
    ]
    short = tmp_path / "short.txt"
    short.write_text("too short")
    cases.append((["--data", str(short)], "has 9 bytes, too few for --seq-len 32"))
    for argv, message in cases:
        assert run_train("--out", out, *argv) == 2, argv
        err = capsys.readouterr().err
        assert message in err, (argv, err)
    assert not out.exists()
    with pytest.raises(SystemExit):
        run_train("--preset", "enormous")


def test_optimized_is_the_default_and_reference_one_flag_away(tmp_path, capsys):
    with pytest.raises(SystemExit) as done:
        cli(["train", "--help"])
    assert done.value.code == 0
    help_text = " ".join(capsys.readouterr().out.split())  # argparse wraps the lines
    assert "--impl {reference,optimized,torch}" in help_text
    assert "(default optimized)" in help_text
    args = argparse.Namespace(**dict.fromkeys(flags.DEFAULTS), nproc=2, stop_at=None, resume=None,
                              out=str(tmp_path / "run"))
    assert config.resolve(args).impl == "optimized"
    args.impl = "reference"
    assert config.resolve(args).impl == "reference"
    assert not (tmp_path / "run").exists()  # resolving writes nothing


def test_an_existing_run_or_an_incompatible_checkpoint_is_never_overwritten(short_run, tmp_path, capsys):
    before = snapshot(short_run)
    data = tmp_path / "other.txt"
    data.write_text("some other text, long enough for a few windows of 32 bytes. " * 20)
    cases = [
        ([], "already holds a training run; continue it with --resume"),
        (["--resume", str(short_run), "--preset", "small"], "holds another model (preset 'tiny', "
                                                              "this run asks for 'small'"),
        (["--resume", str(short_run), "--n-layers", "3"], "n_layers 2 vs 3"),
        (["--resume", str(short_run), "--data", str(data)], "was trained on other data"),
        (["--resume", str(short_run), "--seq-len", "64"], "--seq-len 64 does not match"),
        (["--resume", str(short_run)], "already at step 40 of --steps 40"),
        (["--resume", str(short_run / "checkpoints" / "step_00000030"), "--steps", "50"],
         "would overwrite the newer checkpoint(s) step_00000040"),
    ]
    for argv, message in cases:
        assert cli(["train", "--out", str(short_run), *argv]) == 2, argv
        err = capsys.readouterr().err
        assert message in err, (argv, err)
    assert snapshot(short_run) == before


@pytest.fixture
def copied_run(short_run, tmp_path) -> Path:
    copy = tmp_path / "copy"
    shutil.copytree(short_run, copy)
    return copy


def test_a_corrupt_checkpoint_is_named_and_left_alone(copied_run, tmp_path, capsys):
    latest = copied_run / "checkpoints" / "step_00000040"
    shard = latest / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])  # truncated
    before = snapshot(copied_run)
    assert cli(["train", "--resume", str(copied_run), "--steps", "50"]) == 2
    err = capsys.readouterr().err
    assert "step_00000040 is corrupt: file __1_0.distcp has 100 bytes" in err
    assert cli(["export", str(copied_run), str(tmp_path / "m.safetensors")]) == 2
    assert "is corrupt" in capsys.readouterr().err
    assert not (tmp_path / "m.safetensors").exists()
    (latest / "manifest.json").write_text("{not json")
    assert cli(["train", "--resume", str(latest), "--steps", "50"]) == 2
    assert "manifest.json cannot be read" in capsys.readouterr().err
    (latest / "manifest.json").unlink()  # now it looks like an interrupted save
    assert cli(["train", "--resume", str(latest), "--steps", "50"]) == 2
    assert "is incomplete" in capsys.readouterr().err
    after = snapshot(copied_run)
    del before["checkpoints/step_00000040/manifest.json"]
    assert after == before


def test_corrupt_bytes_that_keep_the_size_fail_the_load_with_a_clear_error(copied_run, capsys):
    shard = copied_run / "checkpoints" / "step_00000040" / "__0_0.distcp"
    shard.write_bytes(b"\0" * shard.stat().st_size)  # same size: only loading can tell
    before = snapshot(copied_run)
    assert cli(["train", "--resume", str(copied_run), "--steps", "50"]) == 1
    err = capsys.readouterr().err
    assert "step_00000040 could not be loaded: DCP says" in err
    assert "Traceback" not in err
    assert snapshot(copied_run) == before
    assert not (copied_run / "checkpoints" / "step_00000050").exists()
