"""``python -m twinshard.train``: the same as ``twinshard train``."""

import sys

from .cli import main

sys.exit(main())
