"""``twinshard plan``: one step of the real code recorded at the user's scale, then priced.

config.py         what one plan is: the measuring layer's job, with a plan's own fields
profiles.py       devices and networks: the constants a plan predicts time with
checkpointing.py  activation checkpointing: none, every block, every N-th, selective ops
labels.py         where a step is, hook by hook: what time and memory are named by
trace.py          what the step did: operators, streams, collectives, memory
ideal.py          the ideal step: what rank 0 would compute if FSDP cost nothing
runner.py         the step recorded in a process of its own
replay.py         the recorded step, timed over its streams and waits
summary.py        the answer: memory, communication and time, per rank
search.py         ``--search``: the fastest setting that fits, and why each other lost
table.py          the plan as text and as a picture
cli.py            the command
"""
