"""``python -m twinshard.measure.fakeaccel``: see ``twinshard.measure.fakeaccel.cli``."""

import sys

from .cli import main

sys.exit(main())
