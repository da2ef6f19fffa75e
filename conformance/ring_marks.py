"""Inputs that say what went wrong: the marked rows the ring exercises are graded on, and how a
result is read back into words (``exercise_ring.py`` runs them).

Every value a rank contributes is a power of four: a sum of such values is a number whose
base-4 digits say which contributions went into it and how many times (a digit up to 3 has no
carry; float64 holds every sum exactly up to 25 marks). So a wrong result reads as "rank 1
returned block 2's sum" or "row 0 holds rank 1's shard", not as a tensor's largest difference.

- The reduce-scatter (tutorial 10): rank r's row j is 4 ** (r * S + j), S ranks in the group;
  group rank r must return the sum of every rank's row r, shape (N,).
- The all-gather (tutorial 11): rank r's shard is 4 ** r; every rank must return the (S, N)
  rows of every rank's shard in rank order.
"""

from __future__ import annotations

import torch

N = 3  # values per row


def digits(value: float, marks: int) -> dict[int, int] | None:
    """{mark k: how many times 4 ** k was added} for a sum of the first ``marks`` powers of
    four, or None where ``value`` is no such sum (negative, fractional, too large)."""
    if not (value >= 0 and value == int(value) and value < 4.0**marks):
        return None
    count, out = int(value), {}
    for k in range(marks):
        if count % 4:
            out[k] = count % 4
        count //= 4
    return out


def one_value_per_row(result, shape: tuple, who: str, what: str) -> list[str] | torch.Tensor:
    """``result`` as float64 rows of ``shape`` whose values agree within each row, or what is
    wrong with it in words (``what`` says what the collective returns)."""
    if not isinstance(result, torch.Tensor):
        return [f"{who} returned {type(result).__name__}, not a tensor"]
    if tuple(result.shape) != shape:
        return [f"{who} returned shape {tuple(result.shape)}: {what}"]
    values = result.detach().to(torch.float64).reshape(-1, N)
    same = [torch.allclose(r, r[:1].expand(N), rtol=0, atol=0, equal_nan=True) for r in values]
    mixed = [i for i, agree in enumerate(same) if not agree]
    if mixed:
        row = values[mixed[0]].tolist()
        return [f"{who}'s row {mixed[0]} mixes values of different rows: {row}"]
    return values[:, 0]


class ReduceScatter:
    """Tutorial 10's ring: ``ring_reduce_scatter(chunks (S, N), group) -> (N,)``."""

    function = "ring_reduce_scatter"

    @staticmethod
    def marked(me: int, size: int) -> torch.Tensor:
        """Group rank ``me``'s input (S, N): row j is 4 ** (me * S + j), every value."""
        powers = torch.tensor([4.0 ** (me * size + j) for j in range(size)], dtype=torch.float64)
        return powers[:, None].expand(size, N).clone()

    @staticmethod
    def diagnose(result, me: int, size: int, who: str) -> list[str]:
        """What is wrong with ``result``, group rank ``me``'s return value, in words."""
        what = (
            f"the reduce-scatter returns this rank's block alone, shape ({N},) here (one row "
            f"of the ({size}, {N}) input)"
        )
        value = one_value_per_row(result, (N,), who, what)
        if isinstance(value, list):
            return value
        found = digits(value[0].item(), size * size)
        if found is None:
            return [f"{who}'s block {value[0].item()!r} is no sum of the ranks' rows"]
        found = {divmod(k, size): n for k, n in found.items()}  # (rank, row) -> times added
        blocks = {j for _, j in found}
        if len(blocks) == 1 and blocks != {me} and all(n == 1 for n in found.values()):
            (b,) = blocks
            what = "sum" if len(found) == size else "partial sum"
            return [f"{who} returned block {b}'s {what}, not block {me}'s"]
        problems = []
        missing = [r for r in range(size) if (r, me) not in found]
        if missing:
            problems.append(f"block {me} is missing the rows of rank(s) {missing}")
        for (r, j), n in found.items():
            if j == me and n > 1:
                problems.append(f"block {me} has rank {r}'s row {n} times")
        foreign = sorted((r, j) for r, j in found if j != me)
        if foreign:
            said = ", ".join(f"rank {r}'s row of block {j}" for r, j in foreign)
            problems.append(f"block {me} ({who}'s) also holds {said}")
        return problems


class AllGather:
    """Tutorial 11's ring: ``ring_all_gather(shard (N,), group) -> (S, N)``."""

    function = "ring_all_gather"

    @staticmethod
    def marked(me: int, size: int) -> torch.Tensor:
        """Group rank ``me``'s shard (N,): 4 ** me in every value."""
        return torch.full((N,), 4.0**me, dtype=torch.float64)

    @staticmethod
    def diagnose(result, me: int, size: int, who: str) -> list[str]:
        """What is wrong with ``result``, group rank ``me``'s return value, in words."""
        what = (
            f"the all-gather returns every rank's shard as a row, shape ({size}, {N}) here "
            f"({size} ranks' shards of ({N},))"
        )
        rows = one_value_per_row(result, (size, N), who, what)
        if isinstance(rows, list):
            return rows
        held = [digits(v.item(), size) for v in rows]  # row j: {rank: times}, or None
        if all(h == {j: 1} for j, h in enumerate(held)):
            return []
        owners = [next(iter(h)) if h and list(h.values()) == [1] else None for h in held]
        shifts = {(o - j) % size for j, o in enumerate(owners) if o is not None}
        if None not in owners and len(shifts) == 1:
            (shift,) = shifts
            return [
                f"{who}'s rows are shifted by {shift}: row j holds rank j + {shift}'s shard "
                f"(row 0 holds rank {owners[0]}'s)"
            ]
        problems = []
        for j, h in enumerate(held):
            if h == {j: 1}:
                continue
            if h is None:
                problems.append(
                    f"{who}'s row {j} holds {rows[j].item()!r}, no rank's shard: a row that "
                    f"was never written"
                )
            elif not h:
                problems.append(f"{who}'s row {j} is zeros: rank {j}'s shard never arrived")
            elif len(h) > 1 or list(h.values()) != [1]:
                times = {1: "", 2: " twice", 3: " three times"}
                said = " + ".join(f"rank {r}'s shard{times[n]}" for r, n in sorted(h.items()))
                problems.append(
                    f"{who}'s row {j} holds a sum, {said}: an all-gather copies each shard "
                    f"into its row, it adds nothing"
                )
            else:
                (owner,) = h
                problems.append(f"{who}'s row {j} holds rank {owner}'s shard, not rank {j}'s")
        return problems


EXERCISES = {kind.function: kind for kind in (ReduceScatter, AllGather)}
