"""What every command of the ``twinshard`` command line shares, below train and the measuring
package alike (``twinshard/cli.py`` is the command itself).

vocabulary.py  the flags' spellings, old spellings and help texts, and the precisions' names
"""
