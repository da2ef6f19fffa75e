"""Running ranks: starting them, reusing them, watching that they make progress.

launch.py         run a function on N local ranks and collect what each returns
worlds.py         worlds of N ranks started once and reused, task after task
world_rank.py     a rank of a shared world: its life, one task after another
rank_reset.py     what a rank puts back between two tasks, and the leaks it names
fresh_process.py  one call in a fresh process
fork_server.py    fresh ranks forked from a server that imported torch once
devices.py        the device each rank computes on, decided in one place
supervise.py      the launcher's side of a run: reports, stalls, signals, stop
watchdog.py       a run whose ranks stop making progress is stopped, the rank named
stall.py          the watchdog's verdict: who stalled, read from every rank's record
"""
