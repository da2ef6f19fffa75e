"""The rest of the contract between the two trees: the subclass surface, checked on the source.

What the optimized path's subclasses use of the reference's ``ParamGroup`` and ``FSDPState``
(fields read or written, methods called or overridden, the ``__wrapped__`` of the
compile-disabled hooks), the names it imports from the reference, and the ``Implementation``
record it gives ``shard_module``. The list is the table under "The contract between the two
trees" in docs/optimized-path.md, beside the ``ShardedParam`` contract
(``tests/engine/test_contract.py``); the tests below read it and parse optimized/*.py, so that a
use without its row, and a row without its use, both fail.
"""

import ast
import inspect
import pathlib
import re

import pytest

from twinshard.reference.fully_shard import Implementation, fully_shard, shard_module
from twinshard.reference.state import FSDPState

ROOT = pathlib.Path(__file__).resolve().parents[2]
OPTIMIZED = sorted((ROOT / "optimized").glob("*.py"))


# --- the subclass surface: ParamGroup, FSDPState, imports, shard_module --------------------------
DOC = ROOT / "docs" / "optimized-path.md"
HEADING = "## The contract between the two trees"
# The reference classes the optimized path extends, by the name it imports them under.
EXTENDED = {
    "twinshard.reference.param_group.ParamGroup": ("param_group.py", "ParamGroup"),
    "twinshard.reference.state.FSDPState": ("state.py", "FSDPState"),
}
# Uses that must be named in the row's "how" column; any other use may read "reads" or "calls".
EXACT = ("overrides", "writes", "__wrapped__")


def _members(file: str, cls: str) -> set[str]:
    """The methods of a reference class and the fields its methods set on ``self``."""
    tree = ast.parse((ROOT / "reference" / file).read_text())
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
    names = {n.name for n in node.body if isinstance(n, ast.FunctionDef)}
    names |= {t.id for n in node.body if isinstance(n, ast.Assign) for t in n.targets}  # seams
    for n in ast.walk(node):
        if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store):
            if isinstance(n.value, ast.Name) and n.value.id == "self":
                names.add(n.attr)
    return names


MEMBERS = {cls: _members(file, cls) for file, cls in EXTENDED.values()}


def documented_surface() -> dict[tuple[str, str], str]:
    """The table in docs/optimized-path.md: (of, name) -> how, where ``of`` is ``ParamGroup``,
    ``FSDPState`` or a module of ``twinshard.reference`` (for the names imported from it)."""
    section = DOC.read_text().split(HEADING, 1)[1]
    section = re.split(r"^#", section, flags=re.M)[0]
    rows = re.findall(r"^ *\| `([\w.]+)` \| `(\w+)` \| ([^|]*) \|", section, re.M)
    return {(of, name): how for of, name, how in rows}


class _Uses(ast.NodeVisitor):
    """What one source file uses of the reference: (of, name, how, line) tuples. ``of`` is the
    reference class when the receiver shows it (``self`` in a subclass, the imported class
    itself), else None: then the name alone says which reference class it may belong to."""

    def __init__(self):
        self.imported: dict[str, str] = {}  # local name -> twinshard.reference.<module>.<name>
        self.extends: str | None = None  # inside a class: the reference class it extends, or ""
        self.found: list[tuple] = []

    def visit_ImportFrom(self, node):
        if (node.module or "").startswith("twinshard.reference."):
            for alias in node.names:
                self.imported[alias.asname or alias.name] = f"{node.module}.{alias.name}"
                module = node.module.removeprefix("twinshard.reference.")
                self.found.append((module, alias.name, "imports", node.lineno))

    def extended(self, node) -> str | None:
        """The reference class that the name ``node`` stands for, if it is one, or that a
        class of the optimized path it stands for extends (``KeptBlocks``)."""
        if isinstance(node, ast.Name) and self.imported.get(node.id) in EXTENDED:
            return EXTENDED[self.imported[node.id]][1]
        if isinstance(node, ast.Name):
            return OWN_SUBCLASSES.get(node.id)
        return None

    def visit_ClassDef(self, node):
        outer = self.extends
        self.extends = next((c for b in node.bases if (c := self.extended(b))), "")
        for item in node.body:
            if isinstance(item, ast.FunctionDef) and item.name in MEMBERS.get(self.extends, ()):
                self.found.append((self.extends, item.name, "overrides", item.lineno))
        self.generic_visit(node)
        self.extends = outer

    def visit_Call(self, node):
        # ``unguarded(ReferenceState.pre_forward)``: the hook's ``__wrapped__`` (optimized/state.py)
        if isinstance(node.func, ast.Name) and node.func.id == "unguarded" and node.args:
            hook = node.args[0]
            if isinstance(hook, ast.Attribute) and (cls := self.extended(hook.value)):
                self.found.append((cls, hook.attr, "__wrapped__", node.lineno))
        self.generic_visit(node)

    def visit_Attribute(self, node):
        value = node.value
        if isinstance(value, ast.Attribute) and node.attr == "__wrapped__":
            if cls := self.extended(value.value):
                self.found.append((cls, value.attr, "__wrapped__", node.lineno))
        own = (isinstance(value, ast.Name) and value.id == "self") or (
            isinstance(value, ast.Call) and getattr(value.func, "id", None) == "super"
        )
        if own and self.extends is not None:
            owners = [self.extends] if self.extends else []  # another class's own fields: skip
        elif cls := self.extended(value):
            owners = [cls]
        else:
            owners = [None]
        how = "writes" if isinstance(node.ctx, (ast.Store, ast.Del)) else "reads"
        for cls in owners:
            if any(node.attr in MEMBERS[c] for c in ([cls] if cls else MEMBERS)):
                self.found.append((cls, node.attr, how, node.lineno))
        self.generic_visit(node)


def _own_subclasses() -> dict[str, str]:
    """The optimized path's classes that extend a reference class, by name: uses through
    their subclasses are uses of the reference class too."""
    found = {}
    for path in OPTIMIZED:
        visitor = _Uses()
        tree = ast.parse(path.read_text())
        visitor.visit(tree)
        for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
            if base := next((c for b in cls.bases if (c := visitor.extended(b))), None):
                found[cls.name] = base
    return found


OWN_SUBCLASSES: dict[str, str] = {}
OWN_SUBCLASSES.update(_own_subclasses())


def uses_of_the_reference(source: str) -> list[tuple]:
    visitor = _Uses()
    visitor.visit(ast.parse(source))
    return visitor.found


def _rows_for(of, name, rows) -> list[str]:
    """The "how" of every row that may document a use of ``name`` of ``of`` (None: any class
    that has it)."""
    if of is None:
        return [how for (o, n), how in rows.items() if n == name and name in MEMBERS.get(o, ())]
    return [how for (o, n), how in rows.items() if (o, n) == (of, name)]


def undocumented(uses: list[tuple], rows: dict) -> list[str]:
    """Each use without a row, or whose row does not say how (overrides, writes, __wrapped__)."""
    missing = []
    for of, name, how, line in uses:
        found = _rows_for(of, name, rows)
        if not found or (how in EXACT and not any(how in h for h in found)):
            missing.append(f"line {line}: {of or 'ParamGroup/FSDPState'}.{name} ({how})")
    return missing


def unused(rows: dict, uses: list[tuple]) -> list[str]:
    """Each row that names nothing the reference has, or nothing the optimized path uses (as
    the row says: every one of overrides, writes, __wrapped__ it lists)."""
    stale = []
    for (of, name), how in rows.items():
        if of in MEMBERS:
            exists = name in MEMBERS[of]
        else:
            tree = ast.parse((ROOT / "reference" / f"{of.replace('.', '/')}.py").read_text())
            exists = any(getattr(n, "name", None) == name for n in tree.body)
        hows = {h for o, n, h, _ in uses if n == name and o in (of, None)}
        if not exists or not hows or any(k in how and k not in hows for k in EXACT):
            stale.append(f"{of}.{name} ({how.strip()})")
    return stale


def _optimized_uses() -> list[tuple]:
    return [u for path in OPTIMIZED for u in uses_of_the_reference(path.read_text())]


@pytest.mark.parametrize("path", OPTIMIZED, ids=lambda p: p.name)
def test_optimized_uses_only_the_documented_surface(path):
    missing = undocumented(uses_of_the_reference(path.read_text()), documented_surface())
    assert not missing, (
        f"{path.name} uses the reference beyond the documented contract; add a row to the table "
        f"under '{HEADING}' in docs/optimized-path.md (what for, and how): {missing}"
    )


def test_every_documented_name_is_in_the_reference_and_used():
    rows = documented_surface()
    assert len(rows) >= 20, "the table in docs/optimized-path.md was not found"
    stale = unused(rows, _optimized_uses())
    assert not stale, f"rows of docs/optimized-path.md that no longer hold: {stale}"


def test_overridden_methods_are_reached_through_the_reference():
    """An override takes effect only where the reference calls the method on the object (its
    hooks on ``self``, ``fully_shard`` on the group); ``__init__`` is ``shard_module``'s call."""
    reference = "\n".join(p.read_text() for p in (ROOT / "reference").rglob("*.py"))
    for (of, name), how in documented_surface().items():
        if "overrides" in how and name != "__init__":
            calls = re.findall(rf"\.{name}\b", reference)
            assert calls, f"the reference never reaches {of}.{name}: overriding it changes nothing"


def test_the_optimized_hooks_are_the_references():
    """The reference decides when: the optimized path overrides none of the reference's
    compile-disabled hooks and calls none through its ``__wrapped__``; it changes how through
    the seams (``ParamGroup.unshard``'s ``meanwhile``, ``FSDPState.while_gathering``)."""
    wrapped = [name for (of, name), how in documented_surface().items() if "__wrapped__" in how]
    assert not wrapped, f"rows that call a reference hook through __wrapped__: {wrapped}"
    hooks = [n for n, f in vars(FSDPState).items() if hasattr(f, "__wrapped__")]
    assert {"pre_forward", "post_forward", "pre_backward"} <= set(hooks)
    for path in OPTIMIZED:
        tree = ast.parse(path.read_text())
        found = [n.lineno for n in ast.walk(tree) if getattr(n, "attr", None) == "__wrapped__"]
        assert not found, f"{path.name} lines {found} reach around a hook's guard"
        for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
            if any(getattr(b, "id", None) == "ReferenceState" for b in cls.bases):
                overridden = {f.name for f in cls.body if isinstance(f, ast.FunctionDef)}
                assert not overridden & set(hooks), (
                    f"{path.name} overrides {overridden & set(hooks)}"
                )


def test_shard_module_gets_named_things():
    """The optimized path passes ``shard_module`` the module and an ``Implementation``, both
    by position, its types and every option by name, and the options are ``fully_shard``'s."""
    options = [
        n
        for n, p in inspect.signature(fully_shard).parameters.items()
        if p.kind is inspect.Parameter.KEYWORD_ONLY
    ]
    assert list(inspect.signature(shard_module).parameters) == ["module", "impl", *options]
    fields = list(inspect.signature(Implementation).parameters)
    assert fields == ["group_type", "state_type", "module_type"]
    calls = [
        n
        for path in OPTIMIZED
        for n in ast.walk(ast.parse(path.read_text()))
        if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "shard_module"
    ]
    assert calls
    for call in calls:
        assert len(call.args) == 2, ast.unparse(call)
        assert [k.arg for k in call.keywords] == options, ast.unparse(call)
        impl = call.args[1]
        assert isinstance(impl, ast.Call) and getattr(impl.func, "id", None) == "Implementation"
        assert not impl.args and [k.arg for k in impl.keywords] == fields, ast.unparse(impl)


def test_the_surface_checks_can_fail():
    """On a made-up file: an undocumented write, override, hook's ``__wrapped__`` and import
    are found, documented reads are not; a row nothing uses and a row of a name the reference
    does not have are found."""
    source = """
from twinshard.reference.param_group import ParamGroup
from twinshard.reference.state import FSDPState as Base
from twinshard.reference.mesh import mesh_info

class Group(ParamGroup):
    def post_backward(self):
        self.divide_factor = 2.0
        return self.params, self.own_field

class State(Base):
    def lazy_init(self):
        self.callback_queued = True

class Other:
    def __init__(self):
        self.module = None  # its own field, though FSDPState has one of that name

hook = unguarded(Base.final_callback)
"""
    missing = undocumented(uses_of_the_reference(source), documented_surface())
    assert {m.split(": ", 1)[1] for m in missing} == {
        "mesh.mesh_info (imports)",
        "ParamGroup.post_backward (overrides)",
        "ParamGroup.divide_factor (writes)",
        "FSDPState.callback_queued (writes)",
        "FSDPState.final_callback (__wrapped__)",
        "FSDPState.final_callback (reads)",
    }, missing
    rows = {**documented_surface(), ("ParamGroup", "no_such_field"): "reads"}
    stale = unused(rows, _optimized_uses() + [(None, "params", "reads", 1)])
    assert stale == ["ParamGroup.no_such_field (reads)"], stale
    rows[("ParamGroup", "finish_backward")] = "overrides"  # exists, unused
    rows[("FSDPState", "is_root")] = "reads, writes"  # used, but never written
    stale = unused(rows, _optimized_uses())
    assert set(stale) == {
        "ParamGroup.no_such_field (reads)",
        "ParamGroup.finish_backward (overrides)",
        "FSDPState.is_root (reads, writes)",
    }, stale
