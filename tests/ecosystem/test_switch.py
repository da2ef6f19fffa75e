"""twinshard.switch and its launcher (python -m twinshard.run): torch's FSDP2 functions are
rebound in every module that exports them, put back exactly, announced once on rank 0; bad
input is named; the launcher switches before a script imports anything, under torchrun too,
and under PyTorch's fake process group (HashStore, TCPStore) a switched script trains with the
defaults."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
import types

import pytest
import torch.distributed._composable.fsdp as composable
import torch.distributed.fsdp as fsdp
import torch.distributed.fsdp._fully_shard as fsdp_private

import twinshard.optimized
import twinshard.reference
from twinshard import run, switch

TORCH_FULLY_SHARD = fsdp.fully_shard
TORCH_REGISTER = fsdp.register_fsdp_forward_method
# the module torch.distributed._composable.fsdp.fully_shard (the package's attribute of that
# name is the function)
composable_module = sys.modules["torch.distributed._composable.fsdp.fully_shard"]
EXPORTERS = (fsdp, fsdp_private, composable, composable_module)


@pytest.fixture(autouse=True)
def torch_after_each_test():
    yield
    switch.restore()
    assert fsdp.fully_shard is TORCH_FULLY_SHARD


def test_use_rebinds_every_export_and_restore_puts_torch_back():
    assert switch.active() == "torch"
    assert switch.use("reference") == "torch"
    assert switch.active() == "twinshard.reference"
    for module in EXPORTERS:
        assert module.fully_shard is twinshard.reference.fully_shard, module.__name__
        assert (
            module.register_fsdp_forward_method is twinshard.reference.register_fsdp_forward_method
        )
    assert fsdp.share_comm_ctx is twinshard.reference.share_comm_ctx
    assert fsdp.FSDPModule is not twinshard.reference.FSDPModule  # the types stay torch's
    assert switch.use(twinshard.optimized) == "twinshard.reference"
    assert composable.fully_shard is twinshard.optimized.fully_shard
    assert switch.restore() == "twinshard.optimized"
    for module in EXPORTERS:
        assert module.fully_shard is TORCH_FULLY_SHARD, module.__name__
        assert module.register_fsdp_forward_method is TORCH_REGISTER
    assert switch.active() == "torch"


def test_using_nests_and_restores_after_an_error():
    with switch.using("optimized") as outer:
        assert outer == "twinshard.optimized"
        with pytest.raises(KeyError), switch.using("reference"):
            assert fsdp.fully_shard is twinshard.reference.fully_shard
            raise KeyError("inside")
        assert fsdp.fully_shard is twinshard.optimized.fully_shard
    assert fsdp.fully_shard is TORCH_FULLY_SHARD


def test_a_switched_fully_shard_is_what_a_client_imports_at_call_time():
    import torch

    def client_prepares(model):  # as accelerate does: the import inside the function
        from torch.distributed.fsdp import FSDPModule, fully_shard

        return fully_shard, isinstance(model, FSDPModule)

    with switch.using("reference"):
        got, _ = client_prepares(torch.nn.Linear(2, 2))
    assert got is twinshard.reference.fully_shard
    assert client_prepares(torch.nn.Linear(2, 2))[0] is TORCH_FULLY_SHARD


def test_bad_implementations_are_named_with_what_to_do():
    with pytest.raises(switch.SwitchError, match="'no_such_fsdp'.*importable module name"):
        switch.use("no_such_fsdp")
    with pytest.raises(
        switch.SwitchError,
        match="json lacks fully_shard; name a module with the fully_shard interface",
    ):
        switch.use("json")
    with pytest.raises(switch.SwitchError, match="module or its name"):
        switch.use(3)
    assert switch.active() == "torch"


def test_one_log_line_on_rank_zero_only(caplog, monkeypatch):
    caplog.set_level(logging.INFO, logger="twinshard.switch")
    monkeypatch.setenv("RANK", "1")
    switch.use("reference")
    assert caplog.records == []
    monkeypatch.setenv("RANK", "0")
    switch.use("optimized")
    assert [r.getMessage() for r in caplog.records] == [
        "twinshard.switch: torch.distributed.fsdp.fully_shard is twinshard.optimized's "
        "(was twinshard.reference)"
    ]


def test_modules_that_imported_torchs_fully_shard_early_are_named(monkeypatch):
    early = types.ModuleType("early_client")
    early.shard = TORCH_FULLY_SHARD  # from torch.distributed.fsdp import fully_shard as shard
    monkeypatch.setitem(sys.modules, "early_client", early)
    with pytest.warns(
        UserWarning,
        match=r"bound to torch's fully_shard before the switch and still call it: .*early_client\.shard",
    ):
        switch.use("optimized")


def test_use_from_env_reads_the_variable(monkeypatch):
    monkeypatch.setenv(switch.ENV_VAR, "reference")
    assert switch.use_from_env() == "twinshard.reference"
    monkeypatch.setenv(switch.ENV_VAR, "")
    assert switch.use_from_env() == "twinshard.optimized"  # the default
    monkeypatch.setenv(switch.ENV_VAR, "nope")
    with pytest.raises(switch.SwitchError, match="TWINSHARD_FSDP='nope'"):
        switch.use_from_env()


def test_launcher_parses_its_options_and_leaves_the_scripts_alone(capsys):
    assert run.parse(["s.py", "--impls", "x"]) == run.Command(
        None, None, None, ["s.py", "--impls", "x"]
    )
    assert run.parse(["--impls=reference", "-m", "pkg.mod", "-x"]) == run.Command(
        "reference", None, "pkg.mod", ["-x"]
    )
    assert run.parse(["--variants", "qwz", "--impls", "torch", "s.py"]) == run.Command(
        "torch", "qwz", None, ["s.py"]
    )
    assert capsys.readouterr().err == ""
    assert run.parse(["--impl", "torch", "s.py"]) == run.Command("torch", None, None, ["s.py"])
    assert capsys.readouterr().err == "note: --impl is now --impls\n"  # the old spelling
    bad_ones = [(["--impls"], "needs a value"), (["--variants"], "needs a value")]
    bad_ones += [([], "name a script"), (["-m"], "module")]
    for bad, says in bad_ones:
        with pytest.raises(SystemExit, match=says):
            run.parse(bad)


# A script that imports torch's fully_shard at the top, as torchtitan-style scripts do, and
# trains a small model with it on the group its launcher made (torchrun: gloo) or on PyTorch's
# fake process group with the store named by its argument.
SCRIPT = textwrap.dedent(
    """
    import sys, torch, torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from twinshard.models import MLPStack

    store = sys.argv[1]
    if store == "torchrun":
        dist.init_process_group("gloo")
    else:
        from torch.testing._internal.distributed.fake_pg import FakeStore
        made = {"hash": dist.HashStore, "fake": FakeStore}.get(store)
        made = made() if made else dist.TCPStore("127.0.0.1", 0, 1, is_master=True)
        dist.init_process_group("fake", store=made, rank=0, world_size=8)
    torch.manual_seed(0)
    model = MLPStack(dim=8, hidden=16, n_blocks=2)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        model(torch.randn(4, 8)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    # one write per line: the ranks share stdout, and print's pieces could interleave
    sys.stdout.write(f"rank {dist.get_rank()} trained with {fully_shard.__module__}\\n")
    sys.stdout.flush()
    """
)


def launched(tmp_path, *command: str, env: dict | None = None) -> subprocess.CompletedProcess:
    script = tmp_path / "train_script.py"
    script.write_text(SCRIPT)
    command = [a.replace("SCRIPT", str(script)) for a in command]
    import os

    done = subprocess.run(
        [sys.executable, *command],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **(env or {})},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done


@pytest.mark.parametrize("store", ["hash", "tcp"])
def test_launcher_under_the_fake_process_group(tmp_path, store):
    """The variable (optimized) and --impls (reference) forms, a script that imported
    fully_shard before anything else, PyTorch's fake process group with HashStore / TCPStore."""
    impl = {"hash": "optimized", "tcp": "reference"}[store]
    form = ["--impls", impl] if impl == "reference" else []
    done = launched(
        tmp_path, "-m", "twinshard.run", *form, "SCRIPT", store, env={switch.ENV_VAR: impl}
    )
    assert f"rank 0 trained with twinshard.{impl}.fully_shard" in done.stdout
    assert f"fully_shard is twinshard.{impl}'s (was torch)" in done.stderr


def test_torchrun_form_switches_every_rank_and_says_so_once(tmp_path):
    done = launched(
        tmp_path,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "twinshard.run",
        "SCRIPT",
        "torchrun",
        env={"OMP_NUM_THREADS": "1"},
    )
    for rank in (0, 1):
        assert f"rank {rank} trained with twinshard.optimized.fully_shard" in done.stdout
    assert done.stderr.count("twinshard.switch: torch.distributed.fsdp.fully_shard is") == 1
