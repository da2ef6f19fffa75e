"""The reference is the teaching copy: single-stream, small, documented. These rules are checked
here so that an optimization cannot creep into it unnoticed."""

import ast
import pathlib
import re

import pytest

REFERENCE = pathlib.Path(__file__).resolve().parents[1] / "reference"
FILES = sorted(REFERENCE.glob("*.py"))
# Overlap machinery has no place in the reference.
FORBIDDEN = re.compile(r"\bStream\b|\bEvent\b|async_op|record_stream|wait_stream|(?i:prefetch)")


def test_reference_files_exist():
    names = {f.name for f in FILES}
    assert {"fully_shard.py", "sharded_param.py", "param_group.py", "state.py"} <= names


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_no_overlap_machinery(path):
    hits = [
        f"{path.name}:{i}: {line.strip()}"
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if FORBIDDEN.search(line)
    ]
    assert not hits, "reference/ must stay single-stream:\n" + "\n".join(hits)


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_file_is_short_and_explained(path):
    text = path.read_text()
    assert len(text.splitlines()) <= 300, f"{path.name} is longer than one sitting (300 lines)"
    doc = ast.get_docstring(ast.parse(text))
    assert doc and len(doc.splitlines()) >= 3, f"{path.name} needs a prose module docstring"


def test_whole_reference_is_small():
    # DESIGN.md asked for well under 1,500 lines when the reference sharded dim 0 of 1-D
    # meshes only. FSDP2's whole interface (tensor parallelism, the list form, communication
    # hooks, parameters used on some ranks, Shard(dim), torch.compile) costs about a tenth
    # more, written as plainly: the bound moved to 1,600, and each file still reads in one go.
    # Running as on an accelerator (issue 23) added about 60 more: fp16 gradients divided before
    # and after their sum, offloaded gradients copied to host memory without waiting and
    # waited for once, the usage tally over the store instead of a collective, the default
    # mesh from the accelerator API. The bound moved to 1,700.
    # FSDP2's all-gather extension (tensor subclasses and shards that gather themselves:
    # float8 weights, extension.py) and the rest of PyTorch's own FSDP2 tests that use the
    # public interface (issue 24) cost about 170 more: the bound moved to 1,875. extension.py
    # is optional reading for a student.
    total = sum(len(p.read_text().splitlines()) for p in FILES)
    assert total < 1875, f"reference/ has {total} lines; keep it under 1,875"


def test_tensor_lines_carry_shape_comments():
    for name in ("collectives.py", "sharded_param.py"):
        text = (REFERENCE / name).read_text()
        assert len(re.findall(r"# \(", text)) >= 3, f"{name}: tensor lines need shape comments"


def test_reference_depends_only_on_torch_and_the_api():
    for path in FILES:
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                top = node.module.split(".")[0]
                assert top in {
                    "torch",
                    "twinshard",
                    "__future__",
                    "typing",
                    "enum",
                    "dataclasses",
                    "functools",
                    "weakref",
                }, (path.name, node.module)
                if top == "twinshard":  # the interface, and the guard's checks across ranks
                    assert node.module in ("twinshard.api", "twinshard.guard"), (
                        path.name,
                        node.module,
                    )
