"""One vocabulary of the commands' words, below both train and the measuring package (issue
52, item 5): ``twinshard/commandline/vocabulary.py`` holds the flags' spellings
(``VOCABULARY``), the action of a renamed flag (``Renamed``) and the precisions' names
(``DTYPES``). ``twinshard.train`` takes none of them from ``twinshard.measure`` (train does
not depend on the measuring package for its words), and no other module of the package
defines them again.
"""

from __future__ import annotations

import ast

from test_layers import ROOT, copies_outside, imported_modules, modules_of

WORDS = {"VOCABULARY", "Renamed", "DTYPES"}  # what commandline/vocabulary.py holds
VOCABULARY_HOME = ROOT / "twinshard" / "commandline" / "vocabulary.py"


def words_from_measure(source: str, package: str) -> list[str]:
    """The imports of ``source`` (a module of ``package``) that take the commands' words from
    the measuring package: its ``flags`` module, or one of ``WORDS`` from any of its modules."""
    flags = "twinshard.measure.flags"
    return sorted(
        {
            m
            for m in imported_modules(source, package)
            if m.startswith("twinshard.measure.")
            and (m == flags or m.startswith(flags + ".") or m.rsplit(".", 1)[-1] in WORDS)
        }
    )


def word_definitions(source: str) -> list[str]:
    """The names of ``WORDS`` that ``source`` defines at module level (a class or an
    assignment): a second copy of the vocabulary, or of the precisions' names."""
    found = []
    for node in ast.parse(source).body:
        if isinstance(node, ast.ClassDef):
            found.append(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            found += [t.id for t in targets if isinstance(t, ast.Name)]
    return sorted(set(found) & WORDS)


@modules_of("train")
def test_train_takes_the_commands_words_from_below_the_measuring_package(path):
    package = ".".join(path.parent.relative_to(ROOT).parts)
    assert words_from_measure(path.read_text(), package) == [], (
        f"train/{path.name} takes the commands' words from twinshard.measure: import them "
        "from twinshard.commandline.vocabulary, below both"
    )


def test_the_commands_words_are_defined_once():
    assert word_definitions(VOCABULARY_HOME.read_text()) == sorted(WORDS)
    assert copies_outside(VOCABULARY_HOME, word_definitions) == [], (
        "import VOCABULARY, Renamed and DTYPES from twinshard.commandline.vocabulary"
    )


def test_the_words_checks_can_fail():
    made_up = """
from twinshard.measure.flags import VOCABULARY, Renamed
from twinshard.measure import flags, step
from twinshard.measure.job import DTYPES, Job
from twinshard.commandline.vocabulary import VOCABULARY
"""
    assert words_from_measure(made_up, "twinshard.train") == [
        "twinshard.measure.flags",
        "twinshard.measure.flags.Renamed",
        "twinshard.measure.flags.VOCABULARY",
        "twinshard.measure.job.DTYPES",
    ]
    assert words_from_measure("from ..measure.flags import add\n", "twinshard.train") == [
        "twinshard.measure.flags",
        "twinshard.measure.flags.add",
    ]
    copies = 'DTYPES = {"fp32": 1}\nclass Renamed:\n    pass\ndef f():\n    VOCABULARY = {}\n'
    assert word_definitions(copies) == ["DTYPES", "Renamed"]
