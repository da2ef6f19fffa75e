"""No import circle in the package, counting every import statement, at module level or inside
a function: a circle held together by a function-level import is still one. Broken by moving
the shared piece down (the c10d table into ``twinshard/dispatch/c10d.py``, the fake
accelerator's device name into its device module), never by hiding an import in a function.
A module importing its own package's face is no edge: ``twinshard/api/fsdp_module.py`` takes
the errors from ``twinshard.api``, whose ``__getattr__`` exports its ``FSDPModule``.
"""

from __future__ import annotations

from pathlib import Path

from test_layers import imported_modules

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = {"twinshard": "twinshard", "reference": "twinshard.reference"}
FOLDERS.update(optimized="twinshard.optimized", conformance="twinshard.conformance")
# none: ``twinshard.api.fsdp_module`` imports its own package's face, which is no edge
ALLOWED: list[set[str]] = []


def package_modules() -> dict[str, Path]:
    """Every module of the package by its import name (``reference/x.py`` is
    ``twinshard.reference.x``; a package by its ``__init__.py``)."""
    found = {}
    for folder, name in FOLDERS.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = [name, *path.relative_to(ROOT / folder).with_suffix("").parts]
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def import_graph(sources: dict[str, tuple[str, bool]]) -> dict[str, set[str]]:
    """module -> the modules of ``sources`` it imports; ``sources``: module -> (its source,
    whether it is a package). ``from a import b`` reaches ``a.b`` if that is a module; a
    package the module belongs to is no edge (Python has imported it already)."""
    edges = {}
    for module, (source, is_package) in sources.items():
        package = module if is_package else module.rpartition(".")[0]
        targets = set()
        for name in imported_modules(source, package):
            while name and name not in sources:
                name = name.rpartition(".")[0]
            if name and not (module == name or module.startswith(name + ".")):
                targets.add(name)
        edges[module] = targets
    return edges


def circles(edges: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(component)

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_no_import_circle():
    sources = {m: (p.read_text(), p.name == "__init__.py") for m, p in package_modules().items()}
    extra = [sorted(c) for c in circles(import_graph(sources)) if c not in ALLOWED]
    assert extra == [], "break each circle by moving the shared piece down"


def test_the_circle_check_can_fail():
    made_up = {
        "pkg": ("from . import a\n", True),
        "pkg.a": ("def late():\n    from .b import helper\n", False),
        "pkg.b": ("from pkg.a import thing\nimport torch\n", False),
        "pkg.c": ("from pkg import a\nfrom . import d\n", False),
        "pkg.d": ("import pkg.c\n", False),
    }
    assert circles(import_graph(made_up)) == [{"pkg.a", "pkg.b"}, {"pkg.c", "pkg.d"}]
