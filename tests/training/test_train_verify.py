"""Verified checkpoints: every kind of damage is named, and ``--resume`` and ``twinshard export``
fall back to the latest intact checkpoint of a run, or stop with an error whose advice works.

Each case damages a copy of the shared short run (checkpoints of steps 30 and 40): a truncated
file, flipped bytes, a missing shard, a checkpoint of another model (its files copied in, with
and without the checksums that give it away), an unreadable manifest. Most are checked through
``config.resolve`` and ``twinshard export``, which verify in this process; one of each kind of
outcome trains.
"""

from __future__ import annotations

import argparse
import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from train_support import snapshot

from twinshard.cli import main as cli
from twinshard.models import Llama, LlamaConfig
from twinshard.train import checkpoint as ckpt
from twinshard.train import config, flags

LATEST, EARLIER = "step_00000040", "step_00000030"


@pytest.fixture
def run(short_run, tmp_path) -> Path:
    copy = tmp_path / "copy"
    shutil.copytree(short_run, copy)
    return copy


def checkpoint(run: Path, name: str = LATEST) -> Path:
    return run / "checkpoints" / name


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:100])


def flip_bytes(path: Path) -> None:
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 64] = bytes(255 - b for b in data[middle : middle + 64])
    path.write_bytes(bytes(data))


def write_other_model(folder: Path) -> None:
    """A DCP checkpoint of a wider model (dim 48), written in this process."""
    model = Llama(LlamaConfig.preset("tiny", dim=48, n_heads=2))
    with warnings.catch_warnings():  # "in a single process", "overwriting": both meant
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"model": model.state_dict()}, checkpoint_id=str(folder), no_dist=True)


def resolve_resume(path: Path, **flags_given):
    args = argparse.Namespace(
        **dict.fromkeys(flags.DEFAULTS), nproc=2, stop_at=None, resume=str(path), out=None
    )
    for k, v in flags_given.items():
        setattr(args, k, v)
    return config.resolve(args)


def export(run: Path, tmp_path: Path, capsys) -> tuple[int, str, Path]:
    out = tmp_path / "model.safetensors"
    code = cli(["export", str(run), str(out)])
    return code, capsys.readouterr().err, out


def exported_step(path: Path) -> int:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return int(f.metadata()["twinshard.step"])


# ----------------------------------------------------------------------- every corruption
@pytest.mark.parametrize(
    "damage, named",
    [
        (lambda c: truncate(c / "__1_0.distcp"), "file __1_0.distcp has 100 bytes, the save wrote"),
        (lambda c: flip_bytes(c / "__0_0.distcp"), "file __0_0.distcp does not match its sha256"),
        (lambda c: (c / "__0_0.distcp").unlink(), "file __0_0.distcp is missing"),
        (lambda c: (c / "rng" / "rank00001.pt").unlink(), "file rng/rank00001.pt is missing"),
        (lambda c: write_other_model(c), "file .metadata "),
        (lambda c: (c / "manifest.json").write_text("{not json"), "manifest.json cannot be read"),
    ],
    ids=["truncated", "flipped", "missing-shard", "missing-rng", "other-model", "manifest"],
)
def test_damage_is_named_and_the_earlier_checkpoint_used(run, tmp_path, capsys, damage, named):
    damage(checkpoint(run))
    code, err, out = export(run, tmp_path, capsys)
    assert code == 0, err
    assert f"{LATEST} is corrupt: {named}" in err, err
    assert f"using {EARLIER}, the latest intact checkpoint, instead" in err
    assert exported_step(out) == 30
    cfg = resolve_resume(run, steps=50)
    assert Path(cfg.resume_from).name == EARLIER
    assert named in cfg.notes[0] and cfg.set_aside == [str(checkpoint(run))]


def test_a_checkpoint_of_another_model_is_caught_without_checksums(run, tmp_path, capsys):
    """Files of a wider model under a manifest without checksums (as a checkpoint of an older
    twinshard has): DCP's metadata does not describe the manifest's model."""
    latest = checkpoint(run)
    write_other_model(latest)
    manifest = json.loads((latest / "manifest.json").read_text())
    del manifest["checksums"]
    manifest["files"] = {
        name: (latest / name).stat().st_size
        for name in manifest["files"]
        if (latest / name).exists()
    }
    (latest / "manifest.json").write_text(json.dumps(manifest))
    code, err, _ = export(run, tmp_path, capsys)
    assert code == 0, err
    assert "holds another model than its manifest says: tok_embeddings.weight is (256, 48)" in err
    assert "(256, 32) in the model of its manifest (dim 32, n_layers 2, n_heads 2)" in err


def test_no_intact_checkpoint_left_is_a_clear_error(run, tmp_path, capsys):
    truncate(checkpoint(run) / "__0_0.distcp")
    flip_bytes(checkpoint(run, EARLIER) / "__1_0.distcp")
    before = snapshot(run)
    code, err, out = export(run, tmp_path, capsys)
    assert code == 2 and not out.exists()
    assert f"no intact checkpoint in {run}:" in err and LATEST in err and EARLIER in err
    assert cli(["train", "--resume", str(run), "--steps", "50"]) == 2
    err = capsys.readouterr().err
    assert "start a new run without --resume" in err and "Traceback" not in err
    assert snapshot(run) == before  # nothing set aside, nothing written


def test_the_advice_for_a_damaged_checkpoint_works(run, capsys):
    """Naming the damaged checkpoint is refused with advice; following it trains on from the
    earlier checkpoint, which sets the damaged one aside."""
    truncate(checkpoint(run) / "__1_0.distcp")
    assert cli(["train", "--resume", str(checkpoint(run)), "--steps", "50"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "Traceback" not in err
    advice = f"pass the run directory instead (twinshard train --resume {run})"
    assert advice in err, err
    assert cli(["train", "--resume", str(run), "--steps", "50"]) == 0
    log = (run / "train.log").read_text()
    assert f"using {EARLIER}, the latest intact checkpoint, instead" in log
    assert f"the corrupt {LATEST} was moved to" in log
    assert (run / "checkpoints" / f"corrupt-{LATEST}" / "__1_0.distcp").stat().st_size == 100
    final = ckpt.resolve(run)
    assert final.name == "step_00000050" and ckpt.validate(final)["step"] == 50


def test_bytes_a_manifest_cannot_vouch_for_fail_the_load_with_a_clear_error(run, capsys):
    """Zeroed shard bytes under a manifest without checksums: the load itself fails, with one
    line, and nothing is written."""
    latest = checkpoint(run)
    shard = latest / "__0_0.distcp"
    shard.write_bytes(b"\0" * shard.stat().st_size)
    manifest = json.loads((latest / "manifest.json").read_text())
    del manifest["checksums"]
    (latest / "manifest.json").write_text(json.dumps(manifest))
    before = snapshot(run)
    assert cli(["train", "--resume", str(run), "--steps", "50"]) == 1
    err = capsys.readouterr().err
    assert f"{LATEST} could not be loaded: DCP says" in err and "Traceback" not in err
    unlocked = lambda files: {k: v for k, v in files.items() if k != ".lock"}  # noqa: E731
    assert unlocked(snapshot(run)) == unlocked(before)


def test_checksums_are_recorded_for_every_file(short_run):
    latest = checkpoint(short_run)
    manifest = ckpt.validate(latest)
    assert manifest["checksum"] == "sha256"
    assert set(manifest["checksums"]) == set(manifest["files"])
    assert {".metadata", "__0_0.distcp", "__1_0.distcp", "rng/rank00000.pt"} <= set(
        manifest["files"]
    )
    for name, digest in manifest["checksums"].items():
        assert ckpt.file_checksum(latest / name) == digest
    assert torch.load(latest / "rng" / "rank00000.pt", weights_only=True)["torch"].numel() > 0
