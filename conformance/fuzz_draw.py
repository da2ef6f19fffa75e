"""Drawing fuzzed-parity examples with hypothesis: the strategy, and a seeded list of examples.

``examples(mesh)`` is a hypothesis strategy of ``fuzz.Example``: depth 1-4, data widths 1-15,
block widths down to 1 row (fewer rows than ranks) and up to 37, bias, ``LayerNorm``, blocks
sharded on their own or in the root's group, frozen weights, a tied ``inp``/``out`` weight,
per group ``reshard_after_forward`` (default, bool, or an int dividing the shard group) and
CPU offload, one mixed-precision policy, 1-3 micro-batches with switches on all but the last,
1-3 steps (one in low precision: [Note: one step in low precision] in ``fuzz.py``), clipping,
frozen input scales in bf16 or float8 beside the fp32 weights (groups of mixed dtypes), and,
where there is a second step, a post-optimizer event followed by an assign-load after each
step. The meshes include HSDP with one replica (1x2, 1x3) and with one shard (2x1, 3x1).
``stand_in`` is the caller's choice, not drawn: the optimized path on stand-in streams
under the stream sanitizer. ``draw(n, seed, mesh, stand_in)`` turns it into a list, the same
for the same seed (and hypothesis version), so that a parent process can split it by mesh and
hand each part to one process group. Hypothesis is a test dependency (the ``dev`` extra); only
this file needs it.
"""

from __future__ import annotations

from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st

from .fuzz import POLICIES, RELOADS, SCALE_DTYPES, SYNC_OFF, Example

MESHES = ((1,), (2,), (3,), (4,), (2, 2), (1, 2), (2, 1), (1, 3), (3, 1))
WIDTHS = (1, 2, 3, 5, 7, 15, 37)


@st.composite
def examples(draw, mesh: tuple | None = None, stand_in: bool = False) -> Example:
    """A random ``Example`` on ``mesh`` (drawn from ``MESHES`` when None)."""
    mesh = tuple(mesh) if mesh else draw(st.sampled_from(MESHES))
    depth = draw(st.integers(1, 4))
    d = draw(st.sampled_from((3, 7, 1, 15)))
    inner = draw(st.lists(st.sampled_from(WIDTHS), min_size=depth - 1, max_size=depth - 1))
    flags = lambda: tuple(draw(st.lists(st.booleans(), min_size=depth, max_size=depth)))  # noqa: E731
    bias, norm, own_group, frozen = flags(), flags(), flags(), flags()
    groups = sum(own_group) + 1
    shards = mesh[-1]
    divisors = [k for k in range(1, shards + 1) if shards % k == 0]
    reshard = st.sampled_from([None, True, False, *divisors])
    micro = draw(st.integers(1, 3))
    # a reload happens between steps: fp32, which trains more than one (see fuzz.py's notes)
    reload = draw(st.sampled_from((None, None, None, None, *RELOADS)))
    policy = "fp32" if reload else draw(st.sampled_from(list(POLICIES)))
    steps = 1 if POLICIES[policy][0] else draw(st.integers(2 if reload else 1, 3))
    scale = st.sampled_from((None, None, *SCALE_DTYPES))
    # HSDP keeps partial sums across backwards without its all-reduce: drawn 3 times as often
    switches = (None, *SYNC_OFF) + (("all_reduce",) * 2 if len(mesh) == 2 else ())
    return Example(
        mesh=mesh,
        widths=(d, *inner, d),
        bias=bias,
        norm=norm,
        own_group=own_group,
        frozen=frozen,
        tie=draw(st.booleans()),
        frozen_inp=draw(st.booleans()),
        reshard=tuple(draw(reshard) for _ in range(groups)),
        offload=tuple(draw(st.booleans()) for _ in range(groups)),
        policy=policy,
        micro=micro,
        sync_off=tuple(draw(st.sampled_from(switches)) for _ in range(micro - 1)),
        steps=steps,
        clip=draw(st.sampled_from((None, 1.0))),
        scale=tuple(draw(scale) for _ in range(depth)),
        reload=reload,
        stand_in=stand_in,
    )


def draw(
    n: int, seed_value: int, mesh: tuple | None = None, stand_in: bool = False
) -> list[Example]:
    """``n`` examples (fewer if hypothesis repeats itself), the same for the same seed."""
    drawn: list[Example] = []

    @seed(seed_value)
    @settings(
        max_examples=n,
        database=None,
        phases=[Phase.generate],
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(examples(mesh, stand_in))
    def collect(example: Example) -> None:
        drawn.append(example)

    collect()
    return list(dict.fromkeys(drawn))
