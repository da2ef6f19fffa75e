"""Loaded by every Python process the test session starts (conftest.py puts this folder on
``PYTHONPATH``): logs the process for the time breakdown (``../processes.py``)."""

import os
import sys

if os.environ.get("TWINSHARD_PROCESS_LOG"):
    sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import processes

    processes.install()
