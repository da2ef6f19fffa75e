"""The conformance suite itself: its command, its report, its pytest plugin, and that it
catches planted bugs.

The planted bugs run through ``run_suite`` in this process, so that their ranks are the
session's shared worlds; the command itself (``twinshard conform``, as a user types it) runs
once in a process of its own, and its misuse in this process (``test_conform_args.py`` has the
rest)."""

import json
import subprocess
import sys

import pytest

from twinshard.cli import main as cli
from twinshard.conformance.suite import (
    apply_xfail,
    failed,
    load_xfail,
    parse_meshes,
    report,
    run_suite,
)


def conform(*args, timeout=900):
    return subprocess.run(
        [sys.executable, "-m", "twinshard.cli", "conform", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_the_command_passes_the_reference_and_writes_reports(tmp_path):
    md = tmp_path / "r.md"
    out = conform(
        "twinshard.reference",
        "--world-sizes",
        "2",
        "--cases",
        "per_block,trace_default",
        "--report",
        str(md),
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "| per_block | 2 | PASS |" in md.read_text()
    assert "twinshard.reference: 2 pass" in out.stdout


def test_the_json_report_holds_every_row(tmp_path, capsys):
    js = tmp_path / "r.json"
    code = cli(["conform", "twinshard.reference", "--world-sizes", "1", "--cases", "llama"]
               + ["--report", str(js)])  # fmt: skip
    assert code == 0, capsys.readouterr()
    data = json.loads(js.read_text())
    assert data["passed"] and data["rows"][0]["case"] == "llama"
    assert data["rows"][0]["compared"] > 100


# Each planted bug: the cases that must report it, the mesh, and how the suite runs. Against the
# plain model alone (the truth; the oracles would double the time). The optimized path's stream
# bugs show only on stand-in streams, where the stream order is checked.
STANDIN = {"stand_in_streams": True, "oracles": False}
PLAIN = {"oracles": False}
PLANTED = {
    "scaled_grads": (["per_block", "llama"], "2", PLAIN),
    "dropped_grad": (["per_block", "trace_default"], "2", PLAIN),
    "shifted_shard": (["per_block", "llama"], "2", PLAIN),
    "bf16_reduce": (["trace_bf16_fp32"], "2", PLAIN),
    "optimized_no_wait": (["per_block", "llama"], "2", STANDIN),
    "optimized_early_release": (["per_block", "llama"], "2", STANDIN),
    "optimized_drops_grads_at_pack": (["per_block", "llama"], "2", STANDIN),
    "optimized_dropped_partial": (["no_all_reduce"], "2x2", PLAIN),
    "optimized_wrong_prefetch": (["per_block", "llama"], "2", PLAIN),
    "optimized_scaled_grads": (["per_block", "llama"], "2", PLAIN),
    "optimized_prefetch_races_edits": (["edit_between_forwards"], "2", STANDIN),
    "optimized_prefetch_misses_edits": (["edit_between_forwards"], "2", PLAIN),
    "optimized_moves_shards_late": (["views_before_training", "views_after_replacing"], "2", PLAIN),
}
_planted: dict[str, dict] = {}  # bug -> case -> row, each bug run once


def planted_rows(bug: str, tmp_path_factory) -> dict:
    if bug not in _planted:
        cases, mesh, options = PLANTED[bug]
        rows = run_suite(
            f"twinshard.conformance.planted.{bug}",
            parse_meshes(mesh),
            cases + ["trace_reshard_false"],
            tmpdir=str(tmp_path_factory.mktemp(bug)),
            **options,
        )
        _planted[bug] = {r["case"]: r for r in rows}
    return _planted[bug]


@pytest.mark.parametrize("bug", sorted(PLANTED))
def test_planted_bug_is_caught(bug, tmp_path_factory):
    rows = planted_rows(bug, tmp_path_factory)
    assert failed(list(rows.values()))
    for case in PLANTED[bug][0]:
        assert rows[case]["status"] == "FAIL", (bug, case, rows[case])
        assert rows[case]["failures"], (bug, case)
    assert rows["trace_reshard_false"]["status"] in ("PASS", "FAIL")  # the run went through


def test_stream_bugs_name_the_streams(tmp_path_factory):
    """On stand-in streams the failure says which access was out of order, and where."""
    failure = planted_rows("optimized_no_wait", tmp_path_factory)["per_block"]["failures"][0]
    assert "StreamOrderError" in failure and "stream 'copy_out'" in failure, failure[-800:]


def test_trace_cases_want_no_all_reduce_from_a_single_replica(tmp_path):
    """torch's fully_shard all-reduces over a replicate group of one rank (HSDP 1x2), which the
    trace cases reject (its expected-failures file lists it; here none is applied)."""
    (row,) = run_suite(
        "torch.distributed.fsdp",
        parse_meshes("1x2"),
        ["trace_default"],
        tmpdir=str(tmp_path),
        oracles=False,
    )
    assert row["status"] == "FAIL" and row["failures"], row
    assert all("where a single replica needs none" in f for f in row["failures"]), row["failures"]


@pytest.mark.parametrize(
    "module,message",
    [
        ("no_such_fsdp_module", "cannot import 'no_such_fsdp_module'"),
        ("json", "lacks fully_shard"),
    ],
)
def test_a_module_that_is_no_implementation_is_a_clear_error(module, message, capsys):
    with pytest.raises(SystemExit) as done:
        cli(["conform", module, "--world-sizes", "1"])
    assert done.value.code != 0
    assert message in capsys.readouterr().err


def test_pytest_plugin_needs_an_implementation(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "--pyargs",
            "twinshard.conformance.check",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
    )
    assert out.returncode != 0
    assert "--fsdp-impl" in out.stdout + out.stderr


def test_pytest_plugin_runs_cases(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "--pyargs",
            "twinshard.conformance.check",
            "--fsdp-impl",
            "twinshard.reference",
            "--fsdp-world-sizes",
            "2",
            "--fsdp-cases",
            "per_block,errors",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout[-3000:]
    assert "2 passed" in out.stdout


def test_xfail_file_marks_and_flags_stale_entries(tmp_path):
    path = tmp_path / "x.txt"
    path.write_text("# comment\nper_block@2: known issue\nllama: another\n")
    expected = load_xfail(path)
    rows = [
        {"case": "per_block", "mesh": "2", "status": "FAIL"},
        {"case": "per_block", "mesh": "3", "status": "FAIL"},
        {"case": "llama", "mesh": "1", "status": "PASS"},
    ]
    rows = apply_xfail(rows, expected)
    assert [r["status"] for r in rows] == ["XFAIL", "FAIL", "XPASS"]
    assert rows[0]["reason"] == "known issue"
    path.write_text("per_block without reason\n")
    with pytest.raises(ValueError, match="CASE"):
        load_xfail(path)


def test_meshes_parse_with_world_size_two_first():
    assert parse_meshes("1,2x2,2,3") == [(2,), (1,), (2, 2), (3,)]
    with pytest.raises(ValueError, match="bad mesh"):
        parse_meshes("2x2x2")


def test_report_counts_every_status():
    rows = [
        {
            "case": "a",
            "mesh": "2",
            "status": s,
            "max_abs": 0.0,
            "max_rel": 0.0,
            "where": "",
            "reason": "r",
            "failures": ["boom"],
            "seconds": 0.1,
        }
        for s in ("PASS", "FAIL", "XFAIL")
    ]
    text = report(rows, "impl")
    assert "1 pass, 1 fail, 1 xfail" in text
    assert "| a | 2 | FAIL |" in report(rows, "impl", "markdown")


def test_gloo_trace_counts_a_float_all_reduce_as_the_reduce_scatter():
    import torch

    from twinshard.conformance import trace

    calls = [
        trace.Call("all_gather", torch.float32, 8),
        trace.Call("all_reduce", torch.float32, 16),
        trace.Call("all_reduce", torch.int32, 3),  # bookkeeping stays what it is
    ]
    ops = [(c.op, c.dtype, c.numel) for c in trace.gloo_reduce_scatters(calls)]
    assert ops == [
        ("all_gather", torch.float32, 8),
        ("reduce_scatter", torch.float32, 16),
        ("all_reduce", torch.int32, 3),
    ]


def test_an_exchange_in_place_counts_as_the_all_gather_it_stands_for():
    import torch

    from twinshard.dispatch.c10d import gathered_in_place

    buffer = torch.zeros(2, 5)  # two ranks' slots: this rank sends row 0 and receives row 1
    assert gathered_in_place([buffer[1]], [buffer[0]]) == 10
    assert gathered_in_place([buffer[1, :3]], [buffer[0]]) is None  # part of the buffer only
    assert gathered_in_place([torch.zeros(5)], [buffer[0]]) is None  # memory not shared
    assert gathered_in_place([buffer[1], buffer[0]], [buffer[0]]) is None  # not one of each


def _cut_plain_tensors() -> list:
    """On each rank: a plain tensor cut down to the rank's rows twice, and a new tensor of the
    same name cut after it (a case may replace a plain run's tensor between comparisons)."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from twinshard.conformance.driver import Trace, _cut

    mesh = init_device_mesh("cpu", (2,))
    full = torch.arange(10.0).reshape(5, 2)  # 5 rows: 3 on rank 0, 2 on rank 1
    dt = distribute_tensor(full, mesh, [Shard(0)])
    plain = Trace()
    first, again = _cut(plain, full, dt), _cut(plain, full, dt)
    replaced = _cut(plain, full + 100, dt)
    return [first.tolist(), first is again, replaced.tolist(), len(plain.pieces)]


def test_a_plain_tensor_is_cut_to_the_ranks_rows_once_and_a_new_one_again():
    from twinshard.ranks.launch import launch

    rank0, rank1 = launch(_cut_plain_tensors, 2, backend="gloo")
    assert rank0[0] == [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]] and rank1[0] == [[6.0, 7.0], [8.0, 9.0]]
    assert rank0[1] and rank1[1]  # the second cut is the first one's piece
    assert rank1[2] == [[106.0, 107.0], [108.0, 109.0]]  # the new tensor's rows, not the old
    assert rank0[3] == rank1[3] == 2
