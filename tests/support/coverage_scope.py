"""Where CI measures coverage of optimized/ (the README's test command).

``coverage run`` passes its configuration to every Python subprocess through ``COVERAGE_ENV``,
and a measured rank runs its Python about a third slower. Only the test modules in
``MEASURED_MODULES`` run the optimized path in the ways the report needs (the whole conformance
suite, with and without stand-in streams, the planted bugs, the drop-in features, the kept
blocks' fallbacks, the fp16 division and the root in pieces);
``unmeasured()`` starts the ranks of everything else without it, which keeps CI short.
"""

from __future__ import annotations

import contextlib
import os

COVERAGE_ENV = "COVERAGE_PROCESS_CONFIG"
MEASURED_MODULES = {
    "test_all_gather_extension",
    "test_api",
    "test_comm_memory",
    "test_conformance",
    "test_contract",
    "test_drop_in",
    "test_gradient_division",
    "test_gradient_pack",
    "test_kept_shards",
    "test_optimized_schedule",
    "test_parity",
    "test_pieces",
    "test_reduce_switches",
    "test_stream_order",
}


@contextlib.contextmanager
def unmeasured(skip: bool = True):
    """Subprocesses started inside run outside coverage (with ``skip=False``: no change)."""
    saved = os.environ.pop(COVERAGE_ENV, None) if skip else None
    try:
        yield
    finally:
        if saved is not None:
            os.environ[COVERAGE_ENV] = saved
