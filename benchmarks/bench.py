"""``python benchmarks/bench.py ARGS`` is ``twinshard bench ARGS`` (see ``twinshard.measure.bench``).

The benchmark lives in the package now (``twinshard/measure/bench/``), so that an installed
twinshard has it as a command; this file stays for old commands and for a checkout that is
not installed.
"""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # a plain checkout

from twinshard.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
