"""Every bad argument of ``twinshard plan``, ``bench`` and ``schedule`` gets one line, before
any work starts: exit status 2, ``twinshard <command>: error: ...`` naming the flag, no
traceback (issue 26, item 5: ``schedule --impl bogus`` printed 57 lines, ``--world-size 0`` and
``bench --world 0`` a ``ValueError`` from the launcher)."""

from __future__ import annotations

import json

import pytest

from twinshard.cli import main

LLAMA = dict(
    model_type="llama", vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4
)
BAD = [
    ("schedule --impls bogus", "--impls 'bogus'"),
    ("schedule --impls os", "--impls 'os'"),
    ("schedule --world 0", "--world"),
    ("schedule --layers 0", "--layers"),
    ("schedule --reshard-after-forward maybe", "--reshard-after-forward"),
    ("schedule --world 2 --reshard-after-forward 3", "--reshard-after-forward 3"),
    ("schedule --prefetch 0", "--prefetch must be a positive integer"),
    ("schedule --world 1000", "--fake-accelerator"),
    ("bench --world 0", "--world"),
    ("bench --per-rank 0", "--per-rank"),
    ("bench --hsdp 3 --world 4", "--hsdp 3"),
    ("bench --impls foo", "--impls 'foo'"),
    ("bench --model huge", "--model 'huge'"),
    ("bench --backend simnet --link fast", "--link"),
    ("bench --reshard-after-forward maybe", "--reshard-after-forward"),
    ("bench --heads 3", "n_heads (3)"),
    ("bench --backend nccl", "--backend nccl"),
    ("bench --backend fakeaccel --impls plain", "--backend fakeaccel"),
    ("bench --steps 0", "--steps"),
    ("bench sweep --link 0", "--link"),
    ("bench hooks --world 0", "--world"),
    ("plan --world 0", "--world"),
    ("plan --world 8 --hsdp 3", "--hsdp 3"),
    ("plan --impls bogus", "--impls 'bogus'"),
    ("plan --model nonesuch", "--model 'nonesuch'"),
    ("plan --model /nowhere/config.json", "no such file"),
    ("plan --dtype fp8", "--dtype 'fp8'"),
    ("plan --ac sometimes", "--ac"),
    ("plan --ac layer:0", "--ac"),
    ("plan --device tpu", "--device 'tpu'"),
    ("plan --network carrier-pigeon", "--network 'carrier-pigeon'"),
    ("plan --optimizer lion", "--optimizer 'lion'"),
    ("plan --world 8 --reshard-after-forward 3", "--reshard-after-forward 3"),
    ("plan --sweep colour=1,2", "--sweep"),
    ("plan --sweep world=8,x", "--sweep world"),
    ("plan --sweep world=8,0", "--world"),
    ("plan --ranks-per-node 0", "--ranks-per-node"),
    ("plan --layers 0", "--layers"),
    ("plan --variants qxz", "--variants: unknown variant 'qxz'"),
    ("plan --variants qwz:bits=3", "--variants: 'qwz:bits=3'"),
    ("plan --variants qgz:size=2", "--variants: 'size=2'"),
    ("plan --world 8 --variants qgz:node=3", "--variants: node=3"),
    ("bench --impls plain --variants qwz", "--variants qwz needs an FSDP implementation"),
    ("bench --variants bf16", "--variants: unknown variant 'bf16'"),
]


@pytest.mark.parametrize("line,named", BAD, ids=[b[0] for b in BAD])
def test_bad_argument_is_one_line(line, named, capsys):
    status = main(line.split())
    out, err = capsys.readouterr()
    command = line.split()[0]
    assert status == 2, (out, err)
    assert err.count("\n") == 1 and err.startswith(f"twinshard {command}: error: "), err
    assert named in err, err
    assert "Traceback" not in out + err


@pytest.mark.parametrize(
    "raw,named",
    [
        ({"model_type": "gpt2", "vocab_size": 8, "hidden_size": 8}, "model_type 'gpt2'"),
        ({"model_type": "llama", "vocab_size": 8}, "missing hidden_size"),
        ({**LLAMA, "attention_bias": True}, "biases"),
        ({**LLAMA, "num_attention_heads": 3}, "head_dim"),
        ([1, 2], "one object"),
    ],
)
def test_bad_hf_config_is_one_line(raw, named, tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(raw))
    assert main(["plan", "--model", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(path) in err and named in err, err


@pytest.mark.parametrize(
    "conf", ["max_split_size_mb:big", "expandable_segments:True,max_split_size_mb:8"]
)
def test_bad_allocator_setting_is_one_line(conf, monkeypatch, capsys):
    """The plan replays the step under the ``PYTORCH_CUDA_ALLOC_CONF`` it runs with, as the
    training run would allocate; a setting PyTorch would refuse is refused before any work."""
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", conf)
    assert main(["plan", "--world", "8"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "PYTORCH_CUDA_ALLOC_CONF: max_split_size_mb is" in err, err
