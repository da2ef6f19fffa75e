"""``python -m twinshard.fakeaccel``: the old spelling of ``python -m twinshard.measure.fakeaccel``."""

import sys

from twinshard.measure.fakeaccel.cli import main

print(
    "note: python -m twinshard.fakeaccel is now python -m twinshard.measure.fakeaccel",
    file=sys.stderr,
)
sys.exit(main())
