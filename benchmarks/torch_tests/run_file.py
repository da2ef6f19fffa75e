"""Run one of PyTorch's FSDP2 test files against one implementation; write each test's outcome.

    python benchmarks/torch_tests/run_file.py /tmp/torch-tests/test_fully_shard_frozen.py \
        --impl optimized --out frozen-optimized.json [-k test_name]

The patches (``patches.py``) are installed at import, before the test file is imported, from the
environment that ``--impl`` and ``--max-world-size`` set: a rank that the test spawns imports
this file again as its main module and so runs the same patched test. ``run.py`` calls this
once per file and implementation.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import patches  # noqa: E402  (first: it must run before torch's test helpers are imported)

patches.install_from_env()

import argparse  # noqa: E402
import importlib  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
import unittest  # noqa: E402


class Outcomes(unittest.TestResult):
    """Each test's status (passed, failed, error, skipped, xfail, xpass), time and message."""

    def __init__(self, out: Path | None = None):
        super().__init__()
        self.tests: dict[str, dict] = {}
        self.started = 0.0
        self.out = out  # written after every test: a file stopped midway keeps what ran

    def startTest(self, test):
        super().startTest(test)
        self.started = time.monotonic()
        print(f"  {test.id()} ...", end="", flush=True)

    def record(self, test, status: str, message: str = "") -> None:
        seconds = round(time.monotonic() - self.started, 1)
        self.tests[test.id()] = {"status": status, "seconds": seconds, "message": message}
        print(f" {status} ({seconds} s)", flush=True)
        if self.out is not None:
            self.out.write_text(json.dumps(self.tests, indent=1, sort_keys=True))

    def addSuccess(self, test):
        self.record(test, "passed")

    def addFailure(self, test, err):
        self.record(test, "failed", last_lines(err))

    def addError(self, test, err):
        self.record(test, "error", last_lines(err))

    def addSkip(self, test, reason):
        self.record(test, "skipped", str(reason))

    def addExpectedFailure(self, test, err):
        self.record(test, "xfail", last_lines(err))

    def addUnexpectedSuccess(self, test):
        self.record(test, "xpass")

    def addSubTest(self, test, subtest, err):
        if err is not None:  # a failed subtest fails its test
            status = "failed" if issubclass(err[0], AssertionError) else "error"
            self.record(test, status, last_lines(err))


def last_lines(err, lines: int = 25) -> str:
    """The end of a traceback: where a rank's error text says what went wrong."""
    text = "".join(traceback.format_exception(*err))
    return "\n".join(text.rstrip().splitlines()[-lines:])


def run(path: Path, pattern: str | None, names: str | None = None, out: Path | None = None) -> dict:
    """Import the test file (after the patches) and run its tests; outcomes by test id."""
    sys.path.insert(0, str(path.parent))
    try:
        module = importlib.import_module(path.stem)
    except Exception:  # a file that cannot even be imported: one error for the whole file
        return {
            f"{path.stem}:import": {
                "status": "error",
                "seconds": 0.0,
                "message": traceback.format_exc()[-3000:],
            }
        }
    loader = unittest.TestLoader()
    if pattern:
        loader.testNamePatterns = [f"*{pattern}*"]
    if names:  # exactly these tests (Class.method, comma-separated)
        loader.testNamePatterns = [f"*.{name}" for name in names.split(",")]
    suite = loader.loadTestsFromModule(module)
    outcomes = Outcomes(out)
    suite.run(outcomes)
    return outcomes.tests


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("file", type=Path)
    parser.add_argument("--impl", default="torch", help="torch, reference, optimized or a module")
    parser.add_argument("--max-world-size", type=int, default=4)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("-k", dest="pattern", default=None, help="run only tests matching this")
    parser.add_argument("--names", default=None, help="run only these Class.method, a comma list")
    args = parser.parse_args()
    if os.environ.get(patches.IMPL_ENV) != args.impl:  # set it for this process and its ranks
        os.environ[patches.IMPL_ENV] = args.impl
        os.environ[patches.WORLD_ENV] = str(args.max_world_size)
        os.execv(sys.executable, [sys.executable, *sys.argv])
    tests = run(args.file.resolve(), args.pattern, args.names, args.out)
    args.out.write_text(json.dumps(tests, indent=1, sort_keys=True))


if __name__ == "__main__":
    main()
