"""PyTorch's own FSDP2 tests as a compatibility target: run them against torch's ``fully_shard``,
twinshard's reference and its optimized path, and record what passes.

    python benchmarks/torch_tests/run.py /tmp/torch-tests --out results.json
    python benchmarks/torch_tests/run.py /tmp/torch-tests --impls reference --files frozen,init
    python benchmarks/torch_tests/run.py /tmp/torch-tests --impls reference,optimized \
        --only-torch-passes torch-results.json --out ours.json  # the tests torch passes, only
    python benchmarks/torch_tests/run.py --summary results.json     # the tables, as markdown

The folder holds PyTorch's test files (``test/distributed/_composable/fsdp/test_fully_shard_*.py``,
read from PyTorch's repository; they are not ours and are never committed) and, optionally, a
``SOURCES.json`` naming the repository and commit each file was read from. Each file runs in
its own interpreter per implementation (``run_file.py``), on gloo, at most ``--max-world-size``
ranks, with the accelerator gates neutralised (``patches.py``). The JSON written holds, for
each implementation, every test's outcome and message, beside the commits and sha256 of the
files used, torch's version and twinshard's commit, so that a result can be traced to exactly
what produced it. ``--summary`` prints the counts per file and the tests that pass with torch
but fail with twinshard, each with its classification (``classification.py``) or flagged as
unclassified.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
IMPLS = ("torch", "reference", "optimized")
PASSING = ("passed", "xfail")  # an expected failure that failed is a pass of the file's intent


def test_files(folder: Path, names: str | None) -> list[Path]:
    """The test files in ``folder``, or those whose name contains one of ``names`` (a comma list)."""
    files = sorted(folder.glob("test_fully_shard*.py"))
    if names:
        wanted = [n.strip() for n in names.split(",") if n.strip()]
        files = [f for f in files if any(w in f.stem for w in wanted)]
    if not files:
        raise SystemExit(f"no test_fully_shard*.py files in {folder} (filter: {names!r})")
    return files


def provenance(folder: Path, files: list[Path]) -> dict:
    """Where each file came from (``SOURCES.json``) and its sha256; the environment."""
    sources_path = folder / "SOURCES.json"
    sources = json.loads(sources_path.read_text()) if sources_path.exists() else {}
    described = {
        f.name: {**sources.get(f.name, {}), "sha256": hashlib.sha256(f.read_bytes()).hexdigest()}
        for f in files
    }
    import torch

    head = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    dirty = subprocess.run(
        ["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
        capture_output=True,
        text=True,
    ).stdout.strip()
    return {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "torch_git": torch.version.git_version,
        "twinshard_commit": head + (" (with uncommitted changes)" if dirty else ""),
        "files": described,
    }


def run_one(path: Path, impl: str, max_world: int, timeout: float, select: list[str]) -> dict:
    """Every test of ``path`` under ``impl`` (or those ``select``, run_file.py's options,
    picks), as ``run_file.py`` records them."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "outcomes.json"
        cmd = [sys.executable, str(HERE / "run_file.py"), str(path), "--impl", impl]
        cmd += ["--max-world-size", str(max_world), "--out", str(out)]
        cmd += select
        env = {**os.environ, "DISTRIBUTED_TESTS_DEFAULT_TIMEOUT": str(int(timeout))}
        started = time.monotonic()
        try:
            done = subprocess.run(
                cmd, env=env, capture_output=True, text=True, timeout=timeout * 40
            )
        except subprocess.TimeoutExpired:
            if out.exists():  # the tests that ran, and the one that was stopped
                ran = json.loads(out.read_text())
                stopped = "the file ran past its time limit during the next test"
                return ran | {f"{path.stem}:file": {"status": "error", "seconds": 0.0,
                                                    "message": stopped}}  # fmt: skip
            return {
                f"{path.stem}:file": {
                    "status": "error",
                    "seconds": timeout * 40,
                    "message": "the file ran past its time limit",
                }
            }
        if out.exists():
            return json.loads(out.read_text())
        seconds = round(time.monotonic() - started, 1)
        tail = (done.stdout + done.stderr)[-3000:]
        return {f"{path.stem}:file": {"status": "error", "seconds": seconds, "message": tail}}


def run(args) -> None:
    folder = Path(args.tests).resolve()
    files = test_files(folder, args.files)
    impls = [i.strip() for i in args.impls.split(",")]
    record = json.loads(args.out.read_text()) if args.out.exists() else {}
    record.update(provenance(folder, files) | {"max_world_size": args.max_world_size})
    results = record.setdefault("results", {})
    torch_passes = None
    if args.only_torch_passes is not None:  # the held-out check: the tests torch passes
        torch_passes = json.loads(args.only_torch_passes.read_text())["results"]["torch"]
        results.setdefault("torch", {}).update(torch_passes)
    for impl in impls:
        for path in files:
            select = ["-k", args.k] if args.k else []
            if torch_passes is not None:
                names = [t.split(".", 1)[1] for t, o in torch_passes.items()
                         if file_of(t) == path.stem and o["status"] in PASSING]  # fmt: skip
                if not names:
                    continue
                select += ["--names", ",".join(names)]
            print(f"{impl}: {path.name}", flush=True)
            outcomes = run_one(path, impl, args.max_world_size, args.timeout, select)
            results.setdefault(impl, {}).update(outcomes)
            args.out.write_text(json.dumps(record, indent=1, sort_keys=True))
            counts = [o["status"] for o in outcomes.values()]
            print(f"  {sum(c in PASSING for c in counts)} of {len(counts)} pass", flush=True)
    print(summary(record))


def file_of(test_id: str) -> str:
    return test_id.split(".")[0].split(":")[0]


def summary(record: dict) -> str:
    """Markdown: per file, how many tests each implementation passes (twinshard's counted among
    the tests torch passes, the held-out check); then every test torch passes and twinshard
    fails, with its classification (``classification.py``)."""
    from classification import CLASSIFICATION

    results = record["results"]
    impls = [i for i in IMPLS if i in results] + [i for i in results if i not in IMPLS]
    tests = sorted({t for outcomes in results.values() for t in outcomes})

    def passed(impl: str, test: str) -> bool:
        return results[impl].get(test, {}).get("status") in PASSING

    torch_passes = [t for t in tests if "torch" not in results or passed("torch", t)]
    lines = ["| file | tests | " + " | ".join(impls) + " |", "|---" * (len(impls) + 2) + "|"]
    for name in [*sorted({file_of(t) for t in tests}), None]:
        ids = [t for t in tests if name is None or file_of(t) == name]
        cells = [
            str(sum(passed(i, t) for t in ids if i == "torch" or t in torch_passes)) for i in impls
        ]
        label = "**all**" if name is None else name.removeprefix("test_fully_shard_")
        lines.append(f"| {label} | {len(ids)} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "| test | " + " | ".join(impls) + " | class | why |",
        "|---" * (len(impls) + 3) + "|",
    ]
    for t in torch_passes:
        statuses = [results[i].get(t, {}).get("status", "-") for i in impls]
        if all(s in PASSING for s in statuses):
            continue
        name = t.split(".")[-1]
        kind, why = CLASSIFICATION.get(name, ("UNCLASSIFIED", ""))
        lines.append(f"| `{name}` | " + " | ".join(statuses) + f" | {kind} | {why} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tests", nargs="?", help="folder of PyTorch's test_fully_shard_*.py")
    parser.add_argument("--impls", default=",".join(IMPLS))
    parser.add_argument("--files", default=None, help="comma list of name parts: frozen,init")
    parser.add_argument("-k", default=None, help="only tests whose name contains this")
    parser.add_argument("--max-world-size", type=int, default=4)
    parser.add_argument("--timeout", type=float, default=240, help="seconds per test")
    parser.add_argument("--out", type=Path, default=Path("torch-tests-results.json"))
    parser.add_argument("--summary", type=Path, default=None, help="print a results file")
    parser.add_argument(
        "--only-torch-passes",
        type=Path,
        default=None,
        help="a results file with a torch run: run only the tests torch passed there",
    )
    args = parser.parse_args()
    sys.path.insert(0, str(HERE))
    if args.summary is not None:
        print(summary(json.loads(args.summary.read_text())))
    elif args.tests is None:
        parser.error("give the folder of PyTorch's test files (or --summary FILE)")
    else:
        run(args)


if __name__ == "__main__":
    main()
