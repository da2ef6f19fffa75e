"""Rules of the package's layering, checked by parsing the code (as ``test_contract.py`` does
for the contract between the trees).

- The optimized path imports nothing from the conformance suite: the suite imports the optimized
  path, and the stand-in streams with their sanitizer live in ``twinshard/standin.py``, which
  both import.
- One rule for what identifies a tensor's memory (``twinshard/storages.py``): no other function
  writes out "the address, or the storage object where there is none" again.
- One table of c10d operators (``twinshard/c10d.py``): no other module names one, and the
  measuring layer's observers (and the guard) import nothing from the conformance suite.
- One step builder and driver (``twinshard/measure/step.py``) and one way to join a world
  (``twinshard/measure/world.py``): no other module of the measuring layer shards a model, makes
  an optimizer, or starts a process group or a backend's world.
- One implementation resolver (``twinshard/impls.py``): every command takes a module from
  outside the project by its import path, as it takes the short names, and refuses a bad name
  naming its flag.
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from twinshard import impls

ROOT = Path(__file__).resolve().parents[1]
OPTIMIZED = sorted((ROOT / "optimized").glob("*.py"))
SUITE = "twinshard.conformance"


def imported_modules(source: str, package: str) -> list[str]:
    """Every module ``source`` (a module of ``package``) imports, relative imports resolved; a
    ``from a import b`` counts as ``a`` and as ``a.b`` (``b`` may be a submodule)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            found.append(base)
            found += [f"{base}.{alias.name}" for alias in node.names]
    return found


def suite_imports(source: str, package: str = "twinshard.optimized") -> list[str]:
    """The imports of ``source`` that reach into the conformance suite."""
    return sorted(
        {m for m in imported_modules(source, package) if m == SUITE or m.startswith(SUITE + ".")}
    )


@pytest.mark.parametrize("path", OPTIMIZED, ids=lambda p: p.name)
def test_optimized_imports_nothing_from_the_suite(path):
    assert suite_imports(path.read_text()) == [], (
        f"{path.name} imports the conformance suite; shared tools live outside it "
        "(the stand-in streams and their sanitizer: twinshard/standin.py)"
    )


def test_the_suite_check_can_fail():
    made_up = """
import torch
import twinshard.conformance.compare
from twinshard.conformance.stream_check import StreamSanitizer
from twinshard import conformance
from ..conformance import cases
from .streams import streams_for
from twinshard.conformance_like import nothing
def late():
    from twinshard.conformance import run_suite
"""
    assert suite_imports(made_up) == [
        "twinshard.conformance",
        "twinshard.conformance.cases",
        "twinshard.conformance.compare",
        "twinshard.conformance.run_suite",
        "twinshard.conformance.stream_check",
        "twinshard.conformance.stream_check.StreamSanitizer",
    ]
    assert suite_imports("import torch\nfrom .streams import streams_for\n") == []


def rule_copies(source: str) -> list[str]:
    """The functions of ``source`` that read both a storage's address (``data_ptr``) and its
    object (``_cdata``): a copy of ``twinshard.storages.memory_key``'s rule."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names = {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)}
            if {"data_ptr", "_cdata"} <= names:
                found.append(node.name)
    return found


def copies_outside(home: Path, find) -> list[str]:
    """What ``find(source)`` finds in every module of the package but ``home``."""
    return [
        f"{path.relative_to(ROOT)}: {name}"
        for folder in ("twinshard", "optimized", "reference", "conformance")
        for path in sorted((ROOT / folder).rglob("*.py"))
        if path != home
        for name in find(path.read_text())
    ]


def test_the_memory_identity_rule_is_written_once():
    copies = copies_outside(ROOT / "twinshard" / "storages.py", rule_copies)
    assert copies == [], "use twinshard.storages.memory_key"


def test_the_rule_copy_check_can_fail():
    made_up = """
def key(t):
    s = t.untyped_storage()
    return s._cdata if s.device.type == "meta" else s.data_ptr()
def address(t):
    return t.untyped_storage().data_ptr()
"""
    assert rule_copies(made_up) == ["key"]


C10D_NAME = re.compile(r"_?(allgather|all_gather|reduce_scatter|allreduce|broadcast|alltoall)\w*_")


def c10d_names(source: str) -> list[str]:
    """The string constants of ``source`` that are c10d operator names (they end in an
    underscore: ``allreduce_``, ``_reduce_scatter_base_``): a copy of ``twinshard.c10d``'s
    table, or of a part of it."""
    return sorted(
        {
            n.value
            for n in ast.walk(ast.parse(source))
            if isinstance(n, ast.Constant)
            and isinstance(n.value, str)
            and C10D_NAME.fullmatch(n.value)
        }
    )


def test_c10d_operators_are_named_in_one_table():
    table = ROOT / "twinshard" / "c10d.py"
    assert copies_outside(table, c10d_names) == [], "read c10d operators through twinshard.c10d"
    assert c10d_names(table.read_text()), "the table itself must be found by the check"


def test_the_c10d_copy_check_can_fail():
    made_up = """
OPS = {"_allgather_base_": "all_gather", "allreduce_coalesced_": "all_reduce"}
WRITES = {"broadcast_": {0}}
kind = "all_gather"  # a collective's kind is not an operator
"""
    assert c10d_names(made_up) == ["_allgather_base_", "allreduce_coalesced_", "broadcast_"]


LAYER = ("bench", "plan", "schedule", "fakeaccel", "measure")  # the measuring layer


def modules_of(*folders: str):
    """A parametrization over the modules of ``twinshard/<folder>`` for each of ``folders``."""
    paths = [p for folder in folders for p in sorted((ROOT / "twinshard" / folder).glob("*.py"))]
    return pytest.mark.parametrize("path", paths, ids=lambda p: f"{p.parent.name}/{p.name}")


@modules_of(*LAYER, "guard")
def test_observers_and_the_guard_import_nothing_from_the_suite(path):
    package = f"twinshard.{path.parent.name}"
    assert suite_imports(path.read_text(), package) == [], (
        f"{path.parent.name}/{path.name} imports the conformance suite; the c10d table is "
        "twinshard/c10d.py"
    )


STEP = {"fully_shard", "optimizer"}  # what only measure/step.py does
WORLD = {"init_process_group", "a backend's join"}  # what only measure/world.py decides
OWN = {
    "measure/step.py": STEP,
    "measure/world.py": WORLD,
    # the backends themselves, which world.py calls
    "bench/simnet.py": {"init_process_group"},
    "fakeaccel/device.py": {"init_process_group"},
    # not yet on measure/step.py and measure/world.py (issue 32): the commands' own copies
    "schedule/cli.py": STEP,
}


def steps_and_joins(source: str) -> set[str]:
    """What ``source`` does of building a step or joining a world: calls ``fully_shard`` or a
    ``torch.optim`` optimizer, calls ``init_process_group``, imports a backend's join (the
    fake accelerator's ``join``, the simulated network's ``init``)."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            name = ast.unparse(node.func)
            if name.split(".")[-1] == "fully_shard":
                found.add("fully_shard")
            elif name.startswith(("torch.optim.", "optim.")):
                found.add("optimizer")
            elif name.split(".")[-1] == "init_process_group":
                found.add("init_process_group")
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = {a.name for a in node.names}
            if (node.module.endswith("fakeaccel") or node.module.endswith("device")) and (
                "join" in names
            ):
                found.add("a backend's join")
            if node.module.endswith("simnet") and "init" in names:
                found.add("a backend's join")
    return found


@modules_of(*LAYER)
def test_one_step_builder_and_one_way_to_join_a_world(path):
    where = f"{path.parent.name}/{path.name}"
    extra = steps_and_joins(path.read_text()) - OWN.get(where, set())
    assert not extra, f"{where} does {extra} itself: use twinshard.measure.step and world"


def test_the_step_and_join_check_can_fail():
    made_up = """
import torch
from twinshard.fakeaccel.device import join as join_fake
from twinshard.bench.simnet import init, parse_link
def build(model, impl):
    impl.fully_shard(model)
    torch.distributed.init_process_group("fake", rank=0, world_size=2)
    return torch.optim.SGD(model.parameters(), lr=0.1)
"""
    assert steps_and_joins(made_up) == STEP | WORLD
    assert steps_and_joins("from twinshard.measure import step\nstep.build(job, d)\n") == set()


def test_memory_key_names_memory_not_tensors():
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from twinshard.storages import memory_key

    t = torch.zeros(8)
    assert memory_key(t) == t.data_ptr() != 0 and memory_key(t[2:]) == memory_key(t)
    assert memory_key(torch.zeros(8)) != memory_key(t)
    assert memory_key(torch.empty(0)) == 0 and memory_key(torch.zeros(8, device="meta")) == 0
    with FakeTensorMode():
        fake = torch.zeros(8)
        assert memory_key(fake) != 0 and memory_key(fake[2:]) == memory_key(fake)
        assert memory_key(torch.zeros(8)) != memory_key(fake)


# One implementation resolver (twinshard/impls.py) for every command: a module from outside the
# project, given by its import path, runs wherever the short names do.

OUTSIDE = "my_outside_fsdp"  # re-exports twinshard.reference's interface
TINY = "--model tiny --layers 2 --dim 32 --heads 2 --vocab 64 --seq 8 --per-rank 1".split()
QUICK = "--warmup 1 --steps 2 --repeat 1 --no-progress".split()


@pytest.fixture
def outside(tmp_path) -> dict:
    """The environment of a process that can import ``OUTSIDE`` (a package in ``tmp_path``)."""
    package = tmp_path / "site" / OUTSIDE
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(
        "from twinshard.reference import *  # noqa: F403\n"
        "from twinshard.reference import __all__  # noqa: F401\n"
    )
    path = [str(tmp_path / "site"), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in path if p)}


def _twinshard(env, *args, cwd=None) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "twinshard.cli", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=600, env=env, cwd=cwd)


def test_bench_takes_a_module_from_outside(outside, tmp_path):
    out = tmp_path / "bench.json"
    flags = ["--backend", "fake", "--world", "2", "--impls", f"{OUTSIDE},reference"]
    done = _twinshard(outside, "bench", *flags, *TINY, *QUICK, "--json", str(out), cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(out.read_text())["summary"]
    assert list(summary) == [OUTSIDE, "reference"]
    assert summary[OUTSIDE]["collectives"] == summary["reference"]["collectives"]
    assert "model_total" not in summary[OUTSIDE]  # the memory model knows the three only


def test_plan_takes_a_module_from_outside(outside, tmp_path):
    out = tmp_path / "plan.json"
    flags = "--model tiny --world 2 --seq 16 --no-progress --impls".split()
    done = _twinshard(outside, "plan", *flags, OUTSIDE, "--json", str(out), cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    (row,) = json.loads(out.read_text())["plans"]
    assert row["config"]["impl"] == OUTSIDE and "error" not in row, row.get("error")
    assert row["memory"]["fits"]["h100"]


def test_schedule_takes_a_module_from_outside(outside, tmp_path):
    text = tmp_path / "step.txt"
    flags = "--model mlp --layers 1 --world 2 --quiet --impls".split()
    done = _twinshard(outside, "schedule", *flags, OUTSIDE, "--text", str(text), cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert text.read_text().startswith(f"{OUTSIDE}, rank 0 of 2: one training step")


def test_the_fake_accelerator_takes_a_module_from_outside(outside, tmp_path):
    out = tmp_path / "fake.json"
    flags = "--world 2 --layers 1 --dim 32 --seq 8 --per-rank 1 --steps 1 --no-cpu".split()
    command = [sys.executable, "-m", "twinshard.fakeaccel", "--impls", OUTSIDE, *flags]
    done = subprocess.run(
        [*command, "--json", str(out)], capture_output=True, text=True, timeout=600, env=outside
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    (result,) = json.loads(out.read_text())["results"]
    assert result["config"]["impl"] == OUTSIDE and "error" not in result


def test_conform_takes_a_module_from_outside_and_a_short_name(outside, tmp_path):
    for impl in (OUTSIDE, "reference"):
        flags = "--world-sizes 1 --cases one_group --no-oracles".split()
        done = _twinshard(outside, "conform", impl, *flags, cwd=tmp_path)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        assert "1 pass" in done.stdout


BAD = "no_such_fsdp_pkg.fsdp"


@pytest.mark.parametrize(
    "args, flag",
    [
        (["bench", "--impls", f"reference,{BAD}", "--json", "x"], "--impls"),
        (["plan", "--model", "tiny", "--impls", BAD, "--json", "x"], "--impls"),
        (["schedule", "--impls", BAD, "--text", "x"], "--impls"),
        (["train", "--impl", BAD, "--steps", "1", "--out", "x"], "--impl"),
    ],
    ids=lambda v: v[0] if isinstance(v, list) else v,
)
def test_a_bad_name_is_refused_naming_the_flag(args, flag, tmp_path):
    done = _twinshard(None, *args, cwd=tmp_path)
    assert done.returncode == 2, done.stderr[-2000:]
    said = done.stderr.strip().splitlines()[-1]
    assert f"{flag} {BAD!r}: cannot import {BAD!r}" in said and "importable module" in said
    assert not (tmp_path / "x").exists()


def test_the_fake_accelerator_and_conform_refuse_a_bad_name(tmp_path):
    command = [sys.executable, "-m", "twinshard.fakeaccel", "--impls", f"torch,{BAD}"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode != 0 and f"--impls {BAD!r}: cannot import" in done.stderr
    done = _twinshard(None, "conform", "json", cwd=tmp_path)
    assert done.returncode == 2 and "json lacks fully_shard" in done.stderr


def test_short_names_modules_and_module_objects_resolve_alike():
    import torch.distributed.fsdp

    import twinshard.optimized

    assert impls.load("optimized") is impls.load("twinshard.optimized") is twinshard.optimized
    assert impls.load(torch.distributed.fsdp) is impls.load("torch")
    with pytest.raises(impls.ImplError, match=r"^--impl 'json': json lacks fully_shard"):
        impls.load("json", "--impl")
    assert impls.problem(" plain , optimized", "--impls", also=("plain",)) is None
    assert impls.problem(",", "--impls").startswith("--impls ',': name reference, optimized")
