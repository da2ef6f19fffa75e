"""twinshard.measure.schedule: one training step of any FSDP implementation, hook by hook.

    from twinshard.measure.schedule import Recorder, format_table, plot_timeline
    recorder = Recorder(model, impl="reference")    # after fully_shard, before the step
    with recorder:
        model(x).sum().backward()
    print(format_table(recorder.schedule))
    plot_timeline([recorder.schedule], "step.png")

Or, for the example model on N local ranks, ``record_step("optimized", world_size=2)`` and
the command ``twinshard schedule --impls optimized --out step.png --text step.txt``.

``steps.py`` holds what a recorded step is made of (plain data), ``record.py`` watches
(hooks, autograd markers, a dispatch mode for collectives), ``groups.py`` finds the sharded
modules and the parameters each manages, ``buffers.py`` the buffers a collective leaves behind
and whether the implementation still holds them, ``attribute.py`` works out which
group each collective carries, ``text.py`` prints the table, ``timeline.py`` draws the
picture (matplotlib, imported only there), ``cli.py`` runs the example model and is the
command. (The site's schedule explorer records the example over a grid of settings with the
docs build's own ``docs/hooks/explorer_data.py``.)
"""

from .record import Recorder
from .steps import HOOKS, Collective, Event, Schedule, name_of
from .text import format_table


def plot_timeline(*args, **kwargs):
    """Draw schedules as a timeline; see ``twinshard.measure.schedule.timeline.plot_timeline``."""
    from .timeline import plot_timeline as plot

    return plot(*args, **kwargs)


def record_step(*args, **kwargs):
    """Record one step of the example model; see ``twinshard.measure.schedule.cli.record_step``."""
    from .cli import record_step as record

    return record(*args, **kwargs)


__all__ = [
    "HOOKS",
    "Collective",
    "Event",
    "Recorder",
    "Schedule",
    "format_table",
    "name_of",
    "plot_timeline",
    "record_step",
]
