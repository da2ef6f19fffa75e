"""The fake-accelerator run's old module path; it lives in ``twinshard.measure.fakeaccel`` now.

``python -m twinshard.fakeaccel`` still runs it (``__main__.py``), after a note that names the
new path."""
