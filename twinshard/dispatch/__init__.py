"""What the dispatcher shows of a step, read in one place for every observer.

c10d.py      the collectives as the dispatcher shows them: one table, their arguments
storages.py  what identifies a tensor's memory, for the observers that count it
standin.py   stand-in streams: the accelerator schedule run on the CPU, its order checked
"""
