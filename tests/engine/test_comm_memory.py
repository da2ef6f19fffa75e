"""torch's switches for the collectives' memory (``twinshard/api/comm_memory.py``, used by the
optimized path): on gloo, which has neither a tensor allocator nor symmetric memory, training
is unchanged and one warning per switch says so; where a backend allocates, the group's
buffers come from it."""

import warnings

import torch

from twinshard.ranks.launch import launch


def _train(switch: str):
    import twinshard.optimized as O
    from twinshard.models import MLPStack

    torch.manual_seed(0)
    model = MLPStack(dim=16, hidden=24, n_blocks=3)
    for block in model.blocks:
        O.fully_shard(block)
    O.fully_shard(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for module in (*model.blocks, model):
            if switch == "process_group":
                module.set_allocate_memory_from_process_group_for_comm(True)
            elif switch == "symm_mem":
                module.set_symm_mem_for_comm()
            elif switch == "allocating backend":  # a backend that allocates: every buffer
                from twinshard.api.comm_memory import ProcessGroupMemory
                from twinshard.reference.state import get_state

                get_state(module).group.comm_memory = ProcessGroupMemory(_Group())
        torch.manual_seed(1 + torch.distributed.get_rank())
        for _ in range(2):
            model(torch.randn(8, 16)).sum().backward()
    said = [str(w.message) for w in caught if "communication buffers" in str(w.message)]
    if switch == "allocating backend":
        said = [
            len(get_state(m).group.comm_memory.group.backend.calls) for m in (*model.blocks, model)
        ]
    return [p.grad.to_local().clone() for p in model.parameters()], said


def test_gloo_trains_the_same_and_says_once_that_a_switch_does_nothing():
    plain = launch(_train, 2, "none")
    for switch, name in (
        ("process_group", "set_allocate_memory_from_process_group_for_comm"),
        ("symm_mem", "set_symm_mem_for_comm"),
    ):
        switched = launch(_train, 2, switch)
        for rank in range(2):
            grads, said = switched[rank]
            assert all(torch.equal(a, b) for a, b in zip(grads, plain[rank][0]))
            assert len(said) == 1 and said[0].startswith(name) and "gloo" in said[0], said
        assert plain[0][1] == []


class _Backend:
    def __init__(self):
        self.calls = []

    def supports_tensor_alloc(self, device):
        return True

    def allocate_tensor(self, numel, *, dtype, device):
        self.calls.append((numel, dtype))
        return torch.full((numel,), 7.0, dtype=dtype, device=device)


class _Group:
    def __init__(self):
        self.backend = _Backend()

    def _get_backend(self, device):
        return self.backend


def test_a_backend_that_allocates_gives_every_buffer():
    from twinshard.api.comm_memory import ProcessGroupMemory

    plain = launch(_train, 2, "none")
    allocated = launch(_train, 2, "allocating backend")
    for rank in range(2):
        grads, calls = allocated[rank]
        assert all(torch.equal(a, b) for a, b in zip(grads, plain[rank][0]))
        # per group and step: the all-gather's output twice (forward and backward; the root
        # keeps its parameters after forward: once) and the packed gradients (on gloo the
        # reduce-scatter is an all-reduce in place: no output of its own)
        assert calls == [2 * (2 + 1)] * 3 + [2 * (1 + 1)], calls
    group = _Group()
    memory = ProcessGroupMemory(group)
    buffer = memory.allocate((3, 4), dtype=torch.bfloat16, device=torch.device("cpu"))
    assert buffer.shape == (12,) and buffer.dtype == torch.bfloat16 and buffer[0] == 7
    assert group.backend.calls == [(12, torch.bfloat16)]


def test_symmetric_memory_comes_from_the_pool_and_is_made_known_as_it_is_allocated(
    monkeypatch,
):
    """The NCCL path, its calls recorded: the backend set and the communicator made once, each
    buffer allocated inside the device's pool and rendezvoused as it is."""
    import contextlib

    import torch.distributed as dist
    import torch.distributed._symmetric_memory as symm_mem

    from twinshard.api.comm_memory import SymmetricMemory

    calls = []
    monkeypatch.setattr(dist, "get_backend", lambda group: "nccl")
    monkeypatch.setattr(dist, "barrier", lambda group: calls.append(("barrier", group)))
    monkeypatch.setattr(symm_mem, "set_backend", lambda name: calls.append(("backend", name)))
    monkeypatch.setattr(symm_mem, "get_mem_pool", lambda device: ("pool", device.type))

    @contextlib.contextmanager
    def use_mem_pool(pool):
        calls.append(("in", pool))
        yield
        calls.append(("out", pool))

    monkeypatch.setattr(torch.cuda, "use_mem_pool", use_mem_pool)
    monkeypatch.setattr(
        symm_mem, "rendezvous", lambda t, group: calls.append(("rendezvous", t.numel(), group))
    )

    class OnThisMachine(SymmetricMemory):
        devices = ("cpu",)  # the pool stubbed above stands for CUDA's

    class Group:
        group_name = "g0"

    memory = OnThisMachine(Group())
    cpu = torch.device("cpu")
    memory.allocate((6,), dtype=torch.float32, device=cpu)
    memory.allocate((2,), dtype=torch.float32, device=cpu)
    assert calls[:2] == [("backend", "NCCL"), ("barrier", memory.group)]
    pool = ("pool", "cpu")
    assert calls[2:] == [("in", pool), ("out", pool), ("rendezvous", 6, "g0")] + [
        ("in", pool),
        ("out", pool),
        ("rendezvous", 2, "g0"),
    ]


def _symm_mem_after_custom_all_gather():
    import pytest as pt

    import twinshard.optimized as O
    from twinshard.api import FSDPUsageError
    from twinshard.models import MLPStack

    model = MLPStack(dim=8, hidden=8, n_blocks=1)
    O.fully_shard(model)

    class Gather:
        def allocate(self, size, *, dtype, device):
            return None

        def __call__(self, output_tensor, input_tensor, group, async_op=False):
            return torch.distributed.all_gather_into_tensor(output_tensor, input_tensor, group)

    model.set_custom_all_gather(Gather())
    with pt.raises(FSDPUsageError, match="custom all-gather or reduce-scatter") as caught:
        model.set_symm_mem_for_comm()
    return str(caught.value)


def test_symmetric_memory_is_refused_beside_a_custom_collective():
    said = launch(_symm_mem_after_custom_all_gather, 1)[0]
    assert said.startswith("set_symm_mem_for_comm")


def test_the_switch_check_for_a_gpu_holds_on_gloo_and_misses_a_fallback_on_nccl(tmp_path):
    """``benchmarks/comm_switches.py``, which ``gpu.sh`` runs on NCCL, run on the CPU as its
    docstring says: on gloo each switch that asks for memory at one rank warns once, gets none
    and trains to the same bits. Its verdict on NCCL rows: a fallback, a buffer not given, an
    error or other bits are each a miss."""
    import json
    import subprocess
    import sys

    from benchmark_scripts import BENCHMARKS, load

    command = [sys.executable, str(BENCHMARKS / "comm_switches.py"), "--device", "cpu"]
    done = subprocess.run(
        [*command, "--out", str(tmp_path)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    record = json.loads((tmp_path / "comm-switches.json").read_text())
    rows = {row["setting"]: row for row in record["rows"]}
    assert record["backend"] == "gloo" and record["missed"] == []
    assert rows["process_group"]["asked"] > 0 and rows["process_group"]["given"] == 0
    assert rows["symm_mem+force_sum"]["warnings"][0].startswith("set_symm_mem_for_comm")
    assert rows["none"]["asked"] == 0 and rows["none"]["warnings"] == []

    script = load("comm_switches")
    same = [torch.ones(2)]

    def row(setting, asked=4, given=4, said=(), params=same):
        return {"setting": setting, "asked": asked, "given": given, "warnings": list(said),
                "params": params}  # fmt: skip

    good = [
        row("none", 0, 0),
        row("process_group"),
        row("symm_mem+force_sum"),
        row("force_sum", 0, 0),
    ]
    assert script.verdict(good, "nccl") == []
    for bad in (
        row("process_group", said=["set_allocate_memory_from_process_group_for_comm: no"]),
        row("process_group", given=3),
        row("symm_mem+force_sum", asked=0, given=0),
        row("force_sum", 0, 0, params=[torch.zeros(2)]),
        {"setting": "force_sum", "error": "RuntimeError: refused"},
    ):
        missed = script.verdict([good[0], bad], "nccl")
        assert len(missed) == 1 and missed[0].startswith(bad["setting"]), missed
