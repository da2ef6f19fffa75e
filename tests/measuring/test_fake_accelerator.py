"""The fake-accelerator run (twinshard.measure.fakeaccel): an accelerator job's hazards, caught on the CPU.

One fresh interpreter (registering the fake accelerator is process-wide and for good, so never
this test process), started in the background once the session is collected
(``support/background.py``), runs every configuration below once and prints the results as
JSON:

- a Llama-style model at world size 8, 64 and HSDP 8x8, bf16 parameters with fp32 reduction,
  for the reference, the optimized path and torch's fully_shard, each with
  reshard_after_forward True, an int (4), and False with CPU offload: zero host syncs, zero
  host tensors in collectives, the CPU run's collectives, memory reported, and the memory
  predictor's figures of the same recording (the reserved peak at least the allocated one, at
  least the device's) (at 64, one setting in the default tier: ``FULL_NAMES``);
- hazards planted into a hook (``support/fake_accelerator_hazards.py``): each is reported, with where
  it came from, so the checks above can fail;
- the optimized path's stream order on the fake accelerator against the stand-in streams'
  (``benchmarks/stream_order.py``);
- ``twinshard schedule --fake-accelerator``'s recording of rank 0 of 64.

The cheap parts (canonical stream logs, the report, the shim's streams) are tested in process.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import background
import pytest
from benchmark_scripts import BENCHMARKS, load

from twinshard.measure.fakeaccel import report
from twinshard.measure.probe import CATEGORIES

stream_order = load("stream_order")  # the device's order of waits and events, and the stand-ins'
canonical, first_difference = stream_order.canonical, stream_order.first_difference

MESHES = [(8, 1), (64, 1), (64, 8)]  # (world, replicas): FSDP 8, FSDP 64, HSDP 8x8
IMPLS = ("reference", "optimized", "torch")
VARIANTS = {
    "reshard": dict(reshard_after_forward=True),
    "reshard4": dict(reshard_after_forward=4),
    "keep+offload": dict(reshard_after_forward=False, offload=True),
}
HAZARD_CONFIG = dict(impl="optimized", world=8)

SCRIPT = """
import json, sys, time, traceback
from twinshard.ranks import fresh_process
from twinshard.measure.job import Job
from twinshard.measure.fakeaccel.runner import check_all
sys.path[:0] = [sys.argv[2], sys.argv[3]]
from stream_order import first_difference, orders
from fake_accelerator_hazards import planter
from twinshard.measure.schedule.cli import record_on_fake_accelerator

def attempt(work):
    try:
        return work()
    except Exception:
        return {"error": traceback.format_exc(limit=-20)}

def stream_orders():
    found = {}
    for world, replicas in [(8, 1), (64, 8)]:
        device, standin = orders(Job(**base, world=world, replicas=replicas))
        found[f"{world}x{replicas}"] = [len(device), first_difference(device, standin)]
    return found

def schedule():
    recorded = record_on_fake_accelerator(["optimized"], 64, layers=2)[0]
    return [[c.op, c.ranks, list(c.params)] for c in recorded.collectives]

spec = json.loads(sys.argv[1])
base = dict(preset="tiny", seq=16, per_rank=2, dtype="bf16", backend="fakeaccel")
start = time.perf_counter()
jobs = [Job(**base, **c) for c in spec["configs"]]
jobs += [(Job(**base, **spec["hazard_config"]), {"plant": planter(h)}) for h in spec["hazards"]]
results = check_all(jobs)
print(json.dumps(dict(
    names=spec["names"],
    results=results,
    orders=attempt(stream_orders),
    schedule=attempt(schedule),
    seconds=time.perf_counter() - start,
)), flush=True)
fresh_process.leave(0)  # as its workers end: [Note: a worker's exit]
"""


def _configs() -> list[tuple[str, dict]]:
    out = []
    for world, replicas in MESHES:
        mesh = f"{replicas}x{world // replicas}" if replicas > 1 else str(world)
        for impl in IMPLS:
            for name, variant in VARIANTS.items():
                config = dict(impl=impl, world=world, replicas=replicas, **variant)
                out.append((f"{impl}-{mesh}-{name}", config))
    return out


CONFIGS = _configs()
# The full tier: FSDP over 64 ranks again for every implementation and setting, where 8 ranks
# and HSDP 8x8 already run every one of them through the same checks (the hook path does not
# depend on the world size); the default tier keeps one (the optimized path, resharded), which
# test_sizes_follow_the_world compares with 8.
FULL_NAMES = {n for n, c in CONFIGS if c["world"] == 64 and c["replicas"] == 1}
FULL_NAMES -= {"optimized-64-reshard"}
HAZARDS = ["item", "blocking_copy", "host_collective", "device_only_collective"]


def _command(items) -> list[str]:
    """The run for the collected tests ``items``: the full tier's configurations only where one
    of its tests was collected."""
    asked = {getattr(getattr(i, "callspec", None), "params", {}).get("name") for i in items}
    chosen = [(n, c) for n, c in CONFIGS if n not in FULL_NAMES or n in asked]
    spec = {
        "names": [n for n, _ in chosen],
        "configs": [c for _, c in chosen],
        "hazard_config": HAZARD_CONFIG,
        "hazards": HAZARDS,
    }
    support = Path(__file__).resolve().parents[1] / "support"
    return [sys.executable, "-c", SCRIPT, json.dumps(spec), str(BENCHMARKS), str(support)]


# The run starts in the background once the session is collected (support/background.py).
background.register("fake_accelerator_run", _command)


@pytest.fixture(scope="module")
def fake_accelerator_run() -> tuple[int, str]:
    return background.result("fake_accelerator_run")


@pytest.fixture(scope="module")
def found(fake_accelerator_run) -> dict:
    code, output = fake_accelerator_run
    assert code == 0, output[-4000:]
    printed = [line for line in output.splitlines() if line.startswith('{"names"')]
    assert printed, f"the run printed no line of results:\n{output[-4000:]}"
    data = json.loads(printed[-1])
    results = data["results"]
    ran = data["names"]
    data["by_name"] = dict(zip(ran, results[: len(ran)]))
    data["hazards"] = dict(zip(HAZARDS, results[len(ran) :]))
    print(f"fake-accelerator run: {data['seconds']:.1f} s of checks")
    return data


def _result(found: dict, name: str) -> dict:
    result = found["by_name"][name]
    assert "error" not in result, f"{name} failed on the fake accelerator:\n{result['error']}"
    return result


NAMES = [pytest.param(n, marks=[pytest.mark.full] if n in FULL_NAMES else []) for n, _ in CONFIGS]


@pytest.mark.parametrize("name", NAMES)
def test_no_host_sync(found, name):
    result = _result(found, name)
    for step in result["steps"]:
        assert step["host_syncs"] == 0, report.details([result])


@pytest.mark.parametrize("name", NAMES)
def test_no_host_tensor_in_a_collective(found, name):
    result = _result(found, name)
    for step in result["steps"]:
        assert step["host_collectives"] == 0, report.details([result])
        assert step["collectives"] > 0  # the step communicated: the check looked at something


@pytest.mark.parametrize("name", NAMES)
def test_collectives_equal_the_cpu_run(found, name):
    result = _result(found, name)
    assert "cpu_error" not in result, result["cpu_error"]
    assert result["collective_difference"] is None, result["collective_difference"]
    assert result["cpu_collectives"] == [s["collectives"] for s in result["steps"]]


@pytest.mark.parametrize("name", NAMES)
def test_memory_per_rank_and_its_prediction(found, name):
    result = _result(found, name)
    last = result["steps"][-1]
    assert last["peak_bytes"] > last["categories"]["unsharded"] > 0
    predicted = result["memory"]  # the same recording, and the allocator's model over it
    assert predicted["categories"] == {**dict.fromkeys(CATEGORIES, 0), **last["categories"]}
    # every request rounded up to 512 bytes; the device's bytes count each storage as it is
    assert predicted["allocated_peak"] >= last["peak_bytes"]
    assert predicted["reserved_peak"] >= predicted["allocated_peak"] > 0


@pytest.mark.parametrize("name", [p for p in NAMES if not p.values[0].startswith("torch")])
def test_explicit_syncs_at_most_once_a_step(found, name):
    """twinshard synchronizes the host only to finish offloaded gradients, once a step."""
    result = _result(found, name)
    limit = 1 if result["config"]["offload"] else 0
    for step in result["steps"]:
        assert step["explicit_syncs"] <= limit, report.details([result])


def test_sizes_follow_the_world(found):
    """The shards shrink with the world: the same model holds fewer bytes per rank at 64."""
    at8 = _result(found, "optimized-8-reshard")["steps"][-1]["categories"]["sharded"]
    at64 = _result(found, "optimized-64-reshard")["steps"][-1]["categories"]["sharded"]
    assert at64 < at8 / 4


def _sites(result: dict, key: str) -> list[dict]:
    return [site for step in result["steps"] for site in step[key]]


def test_an_item_in_a_hook_is_a_host_sync_with_its_site(found):
    result = found["hazards"]["item"]
    assert "error" not in result, result.get("error")
    sites = _sites(result, "sync_sites")
    assert [s["what"] for s in sites] == ["item: aten._local_scalar_dense"] * 2  # one a step
    assert any("hazards.py" in frame and "_item" in frame for frame in sites[0]["stack"])


def test_a_blocking_copy_to_the_host_is_a_host_sync(found):
    sites = _sites(found["hazards"]["blocking_copy"], "sync_sites")
    assert sites and all("device-to-host copy" in s["what"] for s in sites)
    assert any("_blocking_copy" in frame for frame in sites[0]["stack"])


def test_a_host_tensor_in_a_collective_is_reported(found):
    result = found["hazards"]["host_collective"]
    planted = [
        site
        for site in _sites(result, "host_collective_sites")
        if any("_host_collective" in frame for frame in site["stack"])
    ]
    assert [site["what"] for site in planted] == ["all_reduce of float32 x1"] * 2  # one a step


def test_a_collective_of_the_device_only_differs_from_the_cpu_run(found):
    difference = found["hazards"]["device_only_collective"]["collective_difference"]
    assert difference is not None and "all_reduce" in difference


def test_the_fake_accelerator_runs_the_stand_in_stream_order(found):
    assert "error" not in found["orders"], found["orders"]["error"]
    for mesh, (entries, difference) in found["orders"].items():
        assert entries > 0, mesh
        assert difference is None, f"{mesh}: {difference}"


def test_the_schedule_view_records_rank_0_of_64(found):
    assert "error" not in found["schedule"], found["schedule"]["error"]
    ops = [(op, ranks) for op, ranks, _ in found["schedule"]]
    assert ops.count(("all_gather", 64)) == 5  # root, block 0 and 1; blocks 1 and 0 again
    assert ops.count(("reduce_scatter", 64)) == 3
    assert all(params for _, _, params in found["schedule"])  # each attributed to its group


# --- in process: no registration here ------------------------------------------------------------
def test_canonical_names_streams_by_appearance_and_events_by_recording():
    standin = [
        ("wait_stream", "copy_in", "default"),
        ("record_event", "copy_in", 7),
        ("release", "default", "x"),
        ("wait_event", "default", 7),
        ("record_event", "default", 7),
        ("wait_event", "copy_in", 7),
    ]
    device = [
        ("wait_stream", "stream1", "default"),
        ("record_event", "stream1", 0),
        ("wait_event", "default", 0),
        ("record_event", "default", 1),
        ("wait_event", "stream1", 1),
    ]
    assert canonical(standin) == canonical(device)
    swapped = device[:3] + [("record_event", "default", 1), ("wait_event", "default", 1)]
    assert "entry #4" in first_difference(canonical(swapped), canonical(standin))


def test_the_report_flags_what_is_not_clean():
    from twinshard.measure.fakeaccel.report import clean

    step = {
        "name": "step 1",
        "host_syncs": 1,
        "explicit_syncs": 0,
        "host_collectives": 0,
        "collectives": 3,
        "peak_bytes": 2e6,
        "categories": {"unsharded": 1e6},
        "sync_sites": [{"what": "item: aten._local_scalar_dense", "stack": ["a.py:1"], "count": 1}],
        "explicit_sites": [],
        "host_collective_sites": [],
    }
    config = dict(impl="optimized", world=8, replicas=1, dtype="bf16", offload=False)
    result = {
        "config": {**config, "reshard_after_forward": True},
        "steps": [step],
        "collective_difference": None,
        "memory": {"reserved_peak": 4e6},
    }
    text = report.render([result], "title")
    assert (
        "| optimized | 8 | bf16 | no | True | 1 | 0 | 0 | 3 | yes | 2.000 | 1.000 | 4.000 |" in text
    )
    assert "host sync x1: item: aten._local_scalar_dense" in text
    assert not clean(result)
    assert clean({**result, "steps": [{**step, "host_syncs": 0}]})


def test_shim_streams_log_like_the_stand_ins_and_count_syncs():
    from twinshard.measure import fakecuda

    start, syncs = len(fakecuda.LOG), len(fakecuda.SYNCS)
    side = fakecuda.Stream(priority=-1)
    with fakecuda.stream(side):
        assert fakecuda.current_stream() is side
        event = side.record_event()
    assert fakecuda.current_stream() is fakecuda.default_stream()
    fakecuda.current_stream().wait_event(event)
    event.synchronize()
    fakecuda.synchronize()
    assert [e[0] for e in fakecuda.LOG[start:]] == ["record_event", "wait_event"]
    assert side.priority == -1 and event.query() and side.query()
    assert [what for what, _ in fakecuda.SYNCS[syncs:]] == [
        f"event recorded on {side.name}.synchronize()",
        "synchronize()",
    ]


def test_gpu_script_runs_the_accelerator_checks_with_flags_the_command_takes():
    import argparse
    import re
    import shlex
    from pathlib import Path

    from twinshard.measure.fakeaccel import cli

    script = (Path(__file__).resolve().parents[2] / "benchmarks" / "gpu.sh").read_text()
    assert '-m twinshard.measure.fakeaccel --device "$accel" --world $mesh' in script
    assert 'benchmarks/stream_order.py --device "$accel"' in script
    meshes = shlex.split(re.search(r"for mesh in ((?:\"[^\"]*\" ?)+); do", script).group(1))
    assert len(meshes) == 3
    parser = argparse.ArgumentParser(exit_on_error=False)
    cli.add_arguments(parser)
    for mesh in meshes:
        args = parser.parse_args(["--device", "cuda", "--world", *mesh.split(), "--json", "x"])
        assert [c.impl for c in cli.configs_from(args)] == list(IMPLS)
