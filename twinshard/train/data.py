"""Training data for ``twinshard train``: a built-in generated language, or any file, as bytes.

Tokens are bytes (vocabulary 256), so there is no tokenizer to download or train and any file
can be read. The built-in corpus is a small made-up language, generated on the fly from a
fixed seed: English-like sentences whose verb agrees with the subject, pronouns that agree
with an earlier noun, counting runs and sums of small numbers. It is big enough (1 MB) that a
small model cannot memorize it in a few minutes, and regular enough that the loss visibly
falls from ``ln 256 = 5.55`` nats per byte to about 0.45 in the default run of
``twinshard train`` (500 steps of the "tiny" preset).

Batches. The token stream is cut into windows of ``seq_len + 1`` tokens (inputs and targets
shifted by one). Sample ``i`` of the run is a fixed function of ``(seed, seq_len, i)``: epoch
``e = i // K`` shifts every window by a per-epoch offset and visits the ``K`` windows in a
per-epoch shuffled order. A global batch is the samples ``[position, position + batch)``, and
rank ``r`` of ``W`` reads only its contiguous ``batch / W`` of them. So the data position (the
number of samples consumed) is one integer that does not depend on the number of ranks: a run
resumed at another world size reads exactly the samples it would have read uninterrupted.

The shuffle is an affine permutation ``j -> (a * j + b) mod K`` with ``a`` coprime to ``K``:
O(1) memory, so a multi-GB file needs no index (it is memory-mapped, not read into memory).
"""

from __future__ import annotations

import hashlib
import math
import os
import random
from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["BUILTIN", "DataError", "Corpus", "Windows", "builtin_text", "load_corpus"]

BUILTIN = "builtin"
BUILTIN_VERSION = 1  # bump when the generator changes: it is part of the data fingerprint
BUILTIN_TRAIN_BYTES = 1 << 20
BUILTIN_VAL_BYTES = 1 << 16


class DataError(ValueError):
    """The data cannot be used; the message names the file and what to do."""


# --------------------------------------------------------------------------- built-in corpus
# (singular, plural) forms; the generator picks one number per clause and keeps it throughout.
_NOUNS = [
    ("cat", "cats"),
    ("dog", "dogs"),
    ("bird", "birds"),
    ("fox", "foxes"),
    ("child", "children"),
    ("mouse", "mice"),
    ("farmer", "farmers"),
    ("robot", "robots"),
    ("teacher", "teachers"),
    ("horse", "horses"),
    ("sheep", "sheep"),
    ("wolf", "wolves"),
]
_ADJECTIVES = [
    "small",
    "old",
    "red",
    "quick",
    "quiet",
    "happy",
    "tired",
    "brave",
    "grey",
    "young",
    "clever",
    "hungry",
]
_TRANSITIVE = [
    ("sees", "see"),
    ("chases", "chase"),
    ("finds", "find"),
    ("likes", "like"),
    ("follows", "follow"),
    ("watches", "watch"),
    ("helps", "help"),
    ("hears", "hear"),
]
_INTRANSITIVE = [
    ("sleeps", "sleep"),
    ("runs", "run"),
    ("sings", "sing"),
    ("waits", "wait"),
    ("plays", "play"),
    ("rests", "rest"),
]
_PLACES = [
    "the river",
    "the barn",
    "the old tree",
    "the hill",
    "the gate",
    "the house",
    "the field",
    "the bridge",
]
_PREPOSITIONS = ["near", "under", "behind", "beside", "over", "inside"]
_FEELINGS = ["tired", "hungry", "happy", "cold", "afraid", "bored"]
_NUMBER_WORDS = [
    "zero",
    "one",
    "two",
    "three",
    "four",
    "five",
    "six",
    "seven",
    "eight",
    "nine",
    "ten",
    "eleven",
    "twelve",
]


def _pick(rng: random.Random, items: list):
    # rng.random() is the one method whose sequence Python promises to keep across versions,
    # so the corpus is the same on every interpreter (random.choice is not guaranteed).
    return items[int(rng.random() * len(items))]


def _noun_phrase(rng: random.Random, plural: bool) -> str:
    noun = _pick(rng, _NOUNS)[plural]
    if plural:
        det = _pick(rng, ["the", "some", "two", "three", "many"])
    else:
        det = _pick(rng, ["the", "a", "this", "every"])
    if rng.random() < 0.5:
        return f"{det} {_pick(rng, _ADJECTIVES)} {noun}"
    return f"{det} {noun}"


def _story_sentence(rng: random.Random) -> str:
    plural = rng.random() < 0.4
    subject = _noun_phrase(rng, plural)
    if rng.random() < 0.6:
        verb = _pick(rng, _TRANSITIVE)[plural]
        clause = f"{subject} {verb} {_noun_phrase(rng, rng.random() < 0.4)}"
    else:
        clause = f"{subject} {_pick(rng, _INTRANSITIVE)[plural]}"
    if rng.random() < 0.5:
        clause += f" {_pick(rng, _PREPOSITIONS)} {_pick(rng, _PLACES)}"
    if rng.random() < 0.35:  # the pronoun must agree with the subject, several words back
        pronoun, be = ("they", "are") if plural else ("it", "is")
        clause += f" because {pronoun} {be} {_pick(rng, _FEELINGS)}"
    return clause[0].upper() + clause[1:] + "."


def _number_sentence(rng: random.Random) -> str:
    if rng.random() < 0.5:
        a, b = int(rng.random() * 50), int(rng.random() * 50)
        return f"{a} plus {b} is {a + b}."
    start = int(rng.random() * 8)
    stop = start + 2 + int(rng.random() * (len(_NUMBER_WORDS) - start - 2))
    words = " ".join(_NUMBER_WORDS[start : stop + 1])
    return f"Count from {_NUMBER_WORDS[start]} to {_NUMBER_WORDS[stop]}: {words}."


def builtin_text(n_bytes: int, seed: int) -> bytes:
    """``n_bytes`` of the generated language (paragraphs of 3 to 6 sentences)."""
    rng = random.Random(seed)
    parts: list[str] = []
    size = 0
    while size < n_bytes:
        sentences = [
            _number_sentence(rng) if rng.random() < 0.25 else _story_sentence(rng)
            for _ in range(3 + int(rng.random() * 4))
        ]
        paragraph = " ".join(sentences) + "\n"
        parts.append(paragraph)
        size += len(paragraph)
    return "".join(parts).encode("ascii")[:n_bytes]


# --------------------------------------------------------------------------------- corpora
@dataclass
class Corpus:
    """A training and an optional validation token stream (uint8 arrays) and where they are from."""

    name: str  # "builtin" or the file's path, for messages
    fingerprint: str  # identifies the content; a checkpoint refuses to resume on other data
    train: np.ndarray  # (N,) uint8 bytes
    val: np.ndarray | None  # (M,) uint8 bytes, or None when the file is too short to spare any


def _fingerprint_file(path: str, size: int) -> str:
    """sha256 of the size and the first and last MiB: cheap even for a file of many GB."""
    h = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        h.update(f.read(1 << 20))
        if size > 2 << 20:
            f.seek(size - (1 << 20))
            h.update(f.read(1 << 20))  # bounded reads only: a file may be one huge line
    return "file-sha256-head-tail:" + h.hexdigest()[:32]


def load_corpus(data: str | None, seq_len: int) -> Corpus:
    """The built-in corpus (``data`` None or "builtin") or the bytes of the file ``data``.

    Raises ``DataError`` when the file is missing, unreadable or shorter than two windows.
    """
    if data is None or data == BUILTIN:
        train = np.frombuffer(builtin_text(BUILTIN_TRAIN_BYTES, seed=1), dtype=np.uint8)
        val = np.frombuffer(builtin_text(BUILTIN_VAL_BYTES, seed=2), dtype=np.uint8)
        return Corpus(BUILTIN, f"builtin-v{BUILTIN_VERSION}", train, val)
    if not os.path.exists(data):
        raise DataError(
            f"data file {data!r} does not exist; pass --data with the path of a "
            "text file, or leave --data out to use the built-in corpus"
        )
    if not os.path.isfile(data):
        raise DataError(f"--data {data!r} is not a regular file; pass the path of a text file")
    size = os.path.getsize(data)
    need = 2 * (seq_len + 1)
    if size < need:
        raise DataError(
            f"data file {data!r} has {size} bytes, too few for --seq {seq_len}: "
            f"it needs at least {need}; use a longer file or a smaller --seq"
        )
    try:
        tokens = np.memmap(data, dtype=np.uint8, mode="r")  # (size,) read lazily
        fingerprint = _fingerprint_file(data, size)
    except OSError as e:
        raise DataError(f"cannot read data file {data!r}: {e.strerror or e}") from e
    # Hold out the last 5% for validation when that leaves at least 20 windows of training data.
    n_val = size // 20
    if size - n_val < 20 * (seq_len + 1) or n_val < 2 * seq_len:
        return Corpus(data, fingerprint, tokens, None)
    return Corpus(data, fingerprint, tokens[: size - n_val], tokens[size - n_val :])


# --------------------------------------------------------------------------------- batches
class Windows:
    """Sample ``i`` -> a ``(seq_len + 1,)`` window of ``tokens``, shuffled per epoch."""

    def __init__(self, tokens: np.ndarray, seq_len: int, seed: int):
        if len(tokens) < 2 * seq_len:
            raise DataError(f"{len(tokens)} tokens are too few for windows of {seq_len + 1}")
        self.tokens, self.seq_len, self.seed = tokens, seq_len, seed
        # Every epoch shifts all windows by an offset in [0, seq_len); K windows fit for any.
        self.per_epoch = (len(tokens) - seq_len) // seq_len  # K

    def _epoch_plan(self, epoch: int) -> tuple[int, int, int]:
        """(offset, a, b) of ``epoch``: window j of the epoch starts at offset + perm(j) * T."""
        rng = random.Random(self.seed * 1_000_003 + epoch)
        k = self.per_epoch
        a = 1 + int(rng.random() * max(1, k - 1))
        while math.gcd(a, k) != 1:
            a = a % k + 1
        return int(rng.random() * self.seq_len), a, int(rng.random() * k)

    def sample(self, i: int) -> np.ndarray:
        """The ``(seq_len + 1,)`` window that sample ``i`` of the run reads."""
        epoch, j = divmod(i, self.per_epoch)
        offset, a, b = self._epoch_plan(epoch)
        start = offset + ((a * j + b) % self.per_epoch) * self.seq_len
        return self.tokens[start : start + self.seq_len + 1]

    def batch(self, first: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Samples ``[first, first + count)`` as inputs and targets, each ``(count, seq_len)``."""
        rows = np.stack([self.sample(i) for i in range(first, first + count)])  # (count, T + 1)
        rows = torch.from_numpy(rows.astype(np.int64))
        return rows[:, :-1], rows[:, 1:]

    def rank_batch(
        self, position: int, global_batch: int, rank: int, world: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rank ``rank``'s contiguous part of the global batch that starts at ``position``."""
        per_rank = global_batch // world
        return self.batch(position + rank * per_rank, per_rank)
