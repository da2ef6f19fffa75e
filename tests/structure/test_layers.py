"""Rules of the package's layering, checked by parsing the code (as ``test_contract.py`` does
for the contract between the trees).

- The optimized path imports nothing from the conformance suite: the suite imports the optimized
  path, and the stand-in streams with their sanitizer live in ``twinshard/dispatch/standin.py``, which
  both import.
- One rule for what identifies a tensor's memory (``twinshard/dispatch/storages.py``): no other function
  writes out "the address, or the storage object where there is none" again.
- One table of c10d operators (``twinshard/dispatch/c10d.py``): no other module names one, and the
  measuring layer's observers (and the guard) import nothing from the conformance suite.
- The measuring package (``twinshard/measure/``) imports only downward through its layers
  (``LAYERS``): the job, the step, the worlds, the observers, then the runs and commands.
- One step builder and driver (``twinshard/measure/step.py``) and one way to join a world
  (``twinshard/measure/world.py``): no other module of the measuring layer shards a model, makes
  an optimizer, or starts a process group or a backend's world; ``twinshard train`` shards
  through it too.
- One implementation resolver for every command: ``test_outside_impl.py``.
- The commands' words live below train and the measuring package: ``test_vocabulary.py``.
- The measuring package's size (``MEASURE_LINES``): product code only.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
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
        "(the stand-in streams and their sanitizer: twinshard/dispatch/standin.py)"
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
    object (``_cdata``): a copy of ``twinshard.dispatch.storages.memory_key``'s rule."""
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
    copies = copies_outside(ROOT / "twinshard" / "dispatch" / "storages.py", rule_copies)
    assert copies == [], "use twinshard.dispatch.storages.memory_key"


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
    underscore: ``allreduce_``, ``_reduce_scatter_base_``): a copy of ``twinshard.dispatch.c10d``'s
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
    table = ROOT / "twinshard" / "dispatch" / "c10d.py"
    assert copies_outside(table, c10d_names) == [], (
        "read c10d operators through twinshard.dispatch.c10d"
    )
    assert c10d_names(table.read_text()), "the table itself must be found by the check"


def test_the_c10d_copy_check_can_fail():
    made_up = """
OPS = {"_allgather_base_": "all_gather", "allreduce_coalesced_": "all_reduce"}
WRITES = {"broadcast_": {0}}
kind = "all_gather"  # a collective's kind is not an operator
"""
    assert c10d_names(made_up) == ["_allgather_base_", "allreduce_coalesced_", "broadcast_"]


MEASURE = ROOT / "twinshard" / "measure"
COMMANDS = ("fakeaccel", "schedule", "bench", "plan")  # its runs and commands, in layer order


def modules_of(*folders: str):
    """A parametrization over the modules of ``twinshard/<folder>`` for each of ``folders``."""
    paths = [p for folder in folders for p in sorted((ROOT / "twinshard" / folder).glob("*.py"))]
    return pytest.mark.parametrize("path", paths, ids=lambda p: f"{p.parent.name}/{p.name}")


LAYER = ("measure", *(f"measure/{name}" for name in COMMANDS))  # the measuring package


@modules_of(*LAYER, "guard")
def test_observers_and_the_guard_import_nothing_from_the_suite(path):
    package = ".".join(path.parent.relative_to(ROOT).parts)
    assert suite_imports(path.read_text(), package) == [], (
        f"{path.parent.name}/{path.name} imports the conformance suite; the c10d table is "
        "twinshard/dispatch/c10d.py"
    )


STEP = {"fully_shard", "optimizer"}  # what only measure/step.py does
WORLD = {"init_process_group", "a backend's join"}  # what only measure/world.py decides
OWN = {
    "measure/step.py": STEP,
    "measure/world.py": WORLD,
    # the backends themselves, which world.py calls
    "measure/simnet.py": {"init_process_group"},
    "measure/fakedevice.py": {"init_process_group"},
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


@modules_of("train")
def test_train_shards_through_the_one_step_builder(path):
    assert "fully_shard" not in steps_and_joins(path.read_text()), (
        f"train/{path.name} calls fully_shard itself: shard through twinshard.measure.step.shard"
    )


# The measuring package's layers, bottom first: a module imports its own layer and those below.
LAYERS = (
    ("__init__", "job", "flags", "grid", "units"),  # the job, its flags, its grid
    ("step",),  # one training step built and driven
    ("world", "simnet", "fakedevice", "fakecuda"),  # ways to join a world, and their backends
    ("observe", "probe", "monitor", "memory", "allocator"),  # observers, the memory predictor
    ("fakeaccel", "schedule"),  # runs that import neither each other nor a command above
    ("bench",),
    ("plan",),
)
RANK = {name: rank for rank, names in enumerate(LAYERS) for name in names}


def upward_imports(sources: dict[str, str]) -> list[str]:
    """``importer -> imported`` for each import, among ``sources`` (module name -> source, all
    under ``twinshard.measure``), of a higher layer or of the other run of the same layer."""
    found = []
    for name, source in sources.items():
        part = name.split(".")[2] if name.count(".") >= 2 else "__init__"
        package = name if name.endswith("__init__") else name.rsplit(".", 1)[0]
        package = package.removesuffix(".__init__")
        for target in imported_modules(source, package):
            if not target.startswith("twinshard.measure."):
                continue
            other = target.split(".")[2]
            if other not in RANK or other == part:
                continue
            if RANK[other] > RANK[part] or (RANK[other] == RANK[part] == RANK["schedule"]):
                found.append(f"{name} -> {target}")
    return sorted(set(found))


def measure_sources() -> dict[str, str]:
    paths = sorted(MEASURE.rglob("*.py"))
    return {".".join(p.relative_to(ROOT).with_suffix("").parts): p.read_text() for p in paths}


def test_the_measuring_package_imports_only_downward():
    sources = measure_sources()
    parts = {name.split(".")[2] for name in sources if name.count(".") >= 2}
    assert parts <= set(RANK), f"give {sorted(parts - set(RANK))} a layer in LAYERS"
    assert upward_imports(sources) == []


def test_the_layer_check_can_fail():
    sources = {
        "twinshard.measure.world": "from twinshard.measure.bench.config import Job\n",
        "twinshard.measure.schedule.cli": "def f():\n    from ..fakeaccel import Monitor\n",
        "twinshard.measure.plan.cli": "from twinshard.measure import step, probe\n",
        "twinshard.measure.job": "from . import units\n",
    }
    assert upward_imports(sources) == [
        "twinshard.measure.schedule.cli -> twinshard.measure.fakeaccel",
        "twinshard.measure.schedule.cli -> twinshard.measure.fakeaccel.Monitor",
        "twinshard.measure.world -> twinshard.measure.bench.config",
        "twinshard.measure.world -> twinshard.measure.bench.config.Job",
    ]


def test_the_step_and_join_check_can_fail():
    made_up = """
import torch
from twinshard.measure.fakedevice import join as join_fake
from twinshard.measure.simnet import init, parse_link
def build(model, impl):
    impl.fully_shard(model)
    torch.distributed.init_process_group("fake", rank=0, world_size=2)
    return torch.optim.SGD(model.parameters(), lr=0.1)
"""
    assert steps_and_joins(made_up) == STEP | WORLD
    assert steps_and_joins("from twinshard.measure import step\nstep.build(job, d)\n") == set()


# Issue 52: the measuring package is product code only (benchmarks and the docs' recorders live
# beside what uses them). The issue asks for at most 6,700 lines. It was 8,026; the first moves
# left 7,222, one memory predictor in place of memmodel.py's schedules and the commands' words
# moved below train and measure left 6,911, and the schedule's fake-accelerator recording through
# observe.record with the plan's swaps by mock.patch.object left 6,905; one dispatch mode for
# memory (the probe plugged into the monitor) and the lent GPU's checks through the one loop left
# 6,878. This bound holds that and only ever comes down.
MEASURE_LINES = 6_880


def lines_of(folder: Path) -> int:
    """The lines of the Python files under ``folder``, its subfolders included."""
    return sum(len(path.read_text().splitlines()) for path in folder.rglob("*.py"))


def test_the_measuring_package_is_within_its_size():
    assert lines_of(MEASURE) <= MEASURE_LINES, (
        f"twinshard/measure/ has {lines_of(MEASURE):,} lines, more than {MEASURE_LINES:,}: "
        "move what is not product code beside what uses it, or share what is repeated"
    )


def test_the_size_check_can_fail(tmp_path):
    (tmp_path / "a.py").write_text("x = 1\n" * 3)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.py").write_text("y = 2\n\nz = 3")  # no newline at the end
    (tmp_path / "notes.md").write_text("not code\n" * 50)
    assert lines_of(tmp_path) == 6


def test_memory_key_names_memory_not_tensors():
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from twinshard.dispatch.storages import memory_key

    t = torch.zeros(8)
    assert memory_key(t) == t.data_ptr() != 0 and memory_key(t[2:]) == memory_key(t)
    assert memory_key(torch.zeros(8)) != memory_key(t)
    assert memory_key(torch.empty(0)) == 0 and memory_key(torch.zeros(8, device="meta")) == 0
    with FakeTensorMode():
        fake = torch.zeros(8)
        assert memory_key(fake) != 0 and memory_key(fake[2:]) == memory_key(fake)
        assert memory_key(torch.zeros(8)) != memory_key(fake)
