"""A case that fails on one rank only: the suite names it within about a minute, keeps the
verdicts of the cases before it and reports the rest of the mesh as not run, where it used to
wait for the launcher's timeout (ten minutes) and report every case of the mesh failed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

FAILING = "rank_one_fails_fsdp"  # the reference, except that rank 1 raises in one case


def test_a_case_that_fails_on_one_rank_stops_its_mesh_at_once(tmp_path):
    package = tmp_path / "site" / FAILING
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(
        "import inspect\n"
        "import torch.distributed as dist\n"
        "from twinshard.reference import *  # noqa: F403\n"
        "from twinshard.reference import __all__  # noqa: F401\n"
        "from twinshard.reference import fully_shard as _fully_shard\n"
        "\n"
        "\n"
        "def _case():\n"
        "    frames = (f.frame for f in inspect.stack())\n"
        "    return next(f.f_locals['name'] for f in frames if f.f_code.co_name == 'run_cases')\n"
        "\n"
        "\n"
        "def fully_shard(module, **kwargs):\n"
        "    if dist.get_rank() == 1 and _case() == 'per_block':\n"
        "        raise RuntimeError('planted: rank 1 cannot shard in per_block')\n"
        "    return _fully_shard(module, **kwargs)\n"
    )
    path = [str(tmp_path / "site"), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in path if p)}
    report = tmp_path / "report.json"
    command = [sys.executable, "-m", "twinshard.cli", "conform", FAILING, "--world-sizes", "2"]
    command += ["--cases", "one_group,per_block,reshard_false", "--no-oracles"]
    command += ["--report", str(report)]
    started = time.monotonic()
    done = subprocess.run(command, capture_output=True, text=True, timeout=900, env=env)
    took = time.monotonic() - started
    assert done.returncode != 0, done.stdout[-3000:]
    rows = {r["case"]: r for r in json.loads(report.read_text())["rows"]}
    assert rows["one_group"]["status"] == "PASS"
    failed = "\n".join(rows["per_block"]["failures"])
    assert rows["per_block"]["status"] == "FAIL"
    assert "planted: rank 1 cannot shard" in failed and "did not finish it" in failed
    assert rows["reshard_false"]["status"] == "FAIL"
    assert "not run" in rows["reshard_false"]["failures"][0]
    assert took < 240, took  # the grace is 15 s here; the launcher's timeout is 600 s
