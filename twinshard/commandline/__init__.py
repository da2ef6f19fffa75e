"""What every command of the ``twinshard`` command line shares, below train, the measuring
package, the conformance suite's command and the switch's launcher alike (``twinshard/cli.py``
is the command itself).

vocabulary.py    the flags' spellings, old spellings and help texts, and the precisions' names
impls.py         which implementation a command runs: a short name or any importable module
report_files.py  how a report command ends: its table printed, then written where asked
"""
