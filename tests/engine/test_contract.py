"""The contract between the two trees, checked on the source.

``twinshard.optimized`` may use the reference only through public names: it never imports or
touches an underscore name defined in ``reference/``, and it never assigns to the attributes
of a ``ShardedParam`` (it moves parameters between states only through the contract methods).
The contract methods themselves are documented, and both trees call them (the few the reference
offers without using them itself, the optimized path calls).

The rest of the contract, the subclass surface, is checked in ``tests/engine/test_contract_surface.py``.
"""

import ast
import inspect
import pathlib
import re

import pytest
import torch.nn as nn

from twinshard.reference.sharded_param import ShardedParam

ROOT = pathlib.Path(__file__).resolve().parents[2]
OPTIMIZED = sorted((ROOT / "optimized").glob("*.py"))
CONTRACT = (
    "all_gather_mesh",
    "all_gather_inputs",
    "all_gather_outputs",
    "finish_unshard",
    "reshard",
    "take_grad",
    "reduce_scatter_input",
    "combine_partial_sum",
    "accumulate_grad",
    "refresh",
    "has_new_grad",
    "local_shard",
    "adopt_local",
    "held",
)
# What an implementation that keeps the blocks in storage of its own (optimized/kept_blocks.py)
# uses; the reference calls them too (the offload layout moves a shard with ``adopt_local``).
KEPT = ("local_shard", "adopt_local", "refresh", "held")
REFERENCE_FILES = sorted((ROOT / "reference").rglob("*.py"))  # both readings
BATCHED = (
    "all_gather_mesh",
    "all_gather_inputs",
    "all_gather_outputs",
    "combine_partial_sum",
)
# The contract's group-level methods (reference/more/group.py): each names the per-parameter
# method it does for a whole group, and the optimized path moves its groups with them.
GROUP_LEVEL = {
    "all_gather_outputs_all": "all_gather_outputs",
    "finish_unshard_all": "finish_unshard",
    "reshard_all": "reshard",
    "reduce_scatter_inputs": "reduce_scatter_input",
    "accumulate_grads": "accumulate_grad",
}


def _private_names_of_the_reference() -> set[str]:
    """Every ``_name`` the reference defines: functions, methods, module globals, attributes."""
    names = set()
    for path in REFERENCE_FILES:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
    # Names torch's nn.Module defines (``_apply``, ``_load_from_state_dict``) are torch's: both
    # trees may override them, as torch's own FSDPModule does.
    return {n for n in names if n.startswith("_") and not n.startswith("__")} - set(dir(nn.Module))


def _sharded_param_attributes() -> set[str]:
    tree = ast.parse(inspect.getsource(ShardedParam))
    return {
        n.attr
        for n in ast.walk(tree)
        if isinstance(n, ast.Attribute)
        and isinstance(n.ctx, ast.Store)
        and isinstance(n.value, ast.Name)
        and n.value.id == "self"
    }


@pytest.mark.parametrize("path", OPTIMIZED, ids=lambda p: p.name)
def test_optimized_uses_no_private_name_of_the_reference(path):
    private = _private_names_of_the_reference()
    tree = ast.parse(path.read_text())
    hits = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
            "twinshard.reference"
        ):
            hits += [f"imports {a.name}" for a in node.names if a.name.startswith("_")]
        elif isinstance(node, ast.Attribute) and node.attr in private:
            hits.append(f"line {node.lineno}: .{node.attr}")
    assert not hits, f"{path.name} reaches into the reference: {hits}"


@pytest.mark.parametrize("path", OPTIMIZED, ids=lambda p: p.name)
def test_optimized_sets_no_attribute_of_a_sharded_param(path):
    owned = _sharded_param_attributes()
    tree = ast.parse(path.read_text())
    hits = [
        f"line {n.lineno}: {ast.unparse(n)}"
        for n in ast.walk(tree)
        if isinstance(n, ast.Attribute)
        and isinstance(n.ctx, ast.Store)
        and n.attr in owned
        and not (isinstance(n.value, ast.Name) and n.value.id == "self")
    ]
    assert not hits, f"{path.name} sets a ShardedParam's state from outside: {hits}"


def test_the_checks_can_fail():
    """The two checks above find what they look for (on a made-up file)."""
    private = _private_names_of_the_reference()
    assert {"_register", "_shard", "_local_tensor"} <= private
    assert "_apply" not in private  # torch's, overridden by both trees
    assert {"state", "post_forward_block", "grad_to_reduce"} <= _sharded_param_attributes()


@pytest.mark.parametrize("name", CONTRACT)
def test_contract_methods_are_documented_and_used_by_the_reference(name):
    member = getattr(ShardedParam, name)
    doc = (member.fget if isinstance(member, property) else member).__doc__
    assert doc and len(doc.split()) >= 8, f"ShardedParam.{name} needs a docstring"
    reference = "\n".join(p.read_text() for p in REFERENCE_FILES)
    assert f".{name}" in reference, (
        f"the reference does not call ShardedParam.{name} through the contract"
    )


@pytest.mark.parametrize("name", [*BATCHED, *GROUP_LEVEL])
def test_optimized_collectives_call_the_contract(name):
    """The optimized path batches these calls itself, a group's parameters at once where the
    contract has a group-level method; the others (take_grad, refresh, has_new_grad, reshard
    with a piece kept) it reaches through the reference's ParamGroup, which it extends."""
    files = ("collectives.py", "reduction.py", "flat_group.py")
    assert f".{name}(" in "".join((ROOT / "optimized" / f).read_text() for f in files)


@pytest.mark.parametrize("name", GROUP_LEVEL)
def test_group_level_methods_name_the_method_they_do_for_a_group(name):
    doc = getattr(ShardedParam, name).__doc__ or ""
    assert f"``{GROUP_LEVEL[name]}" in doc, f"ShardedParam.{name} must name its method"
    assert name not in _sharded_param_attributes()  # inherited, not ShardedParam's own code


@pytest.mark.parametrize("name", KEPT)
def test_the_kept_blocks_use_the_contract(name):
    """The kept blocks live on the optimized side and reach a parameter only through the
    contract; nothing of them is left in the reference."""
    source = (ROOT / "optimized" / "kept_blocks.py").read_text()
    assert re.search(rf"\bp\.{name}\b", source), f"kept_blocks.py does not use {name}"
    reference = "\n".join(p.read_text() for p in REFERENCE_FILES)
    old = r"shard_storage_shape|keep_shard_in|shard_is_kept|kept_local"
    leftovers = re.findall(rf"\b(?:{old})\b", reference)
    assert not leftovers, f"the reference still defines the kept blocks' {leftovers}"
