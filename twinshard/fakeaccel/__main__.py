"""``python -m twinshard.fakeaccel``: see ``twinshard.fakeaccel.cli``."""

import sys

from .cli import main

sys.exit(main())
