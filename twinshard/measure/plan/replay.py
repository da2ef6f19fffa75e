"""A recorded step, timed: its operators and collectives replayed over its streams and waits.

``replay(trace, device, network, cpu)`` walks ``trace.StepTrace``'s entries in the order the
host issued them, once, keeping one clock per stream, per process group and for the host, and
charges what a wait moves on the compute stream to the entry's label; ``per_link`` counts the
step's collectives by op and link. Nothing here knows which implementation ran: the schedule
is what the recorded waits and events say it is.

The rule for each kind of entry and how exposed communication is named: docs/plan.md, "How
the time is predicted".
"""

from __future__ import annotations

from collections import Counter, defaultdict

from twinshard.measure.simnet import wire_bytes

COMPUTE = {"accelerator": "default", "cpu": "host"}


def replay(trace: dict, device, network, cpu: bool) -> dict:
    """Time the recorded step (see the module docstring); seconds and where they went."""
    ready: dict[str, float] = defaultdict(float)  # per stream: when its queued work is done
    events: dict = {}
    wires: dict[int, float] = defaultdict(float)
    ends: dict[int, float] = {}  # collective index -> when it ends
    host = 0.0
    compute_stream = COMPUTE["cpu" if cpu else "accelerator"]
    busy = Counter()  # compute seconds by label
    exposed = Counter()  # seconds the compute stream waited for others, by label
    comm = Counter()  # seconds on the wire by op
    label = "setup"
    infos = trace["collectives"]

    def wait(stream: str, until: float) -> None:
        nonlocal host
        if cpu or stream == "host":  # the host waits: on the CPU it is the compute stream
            if until > host:
                exposed[label] += until - host
                host = until
            return
        if until > ready[stream]:
            if stream == compute_stream:
                exposed[label] += until - ready[stream]
            ready[stream] = until

    for entry in trace["entries"]:
        kind = entry[0]
        if kind in ("op", "host_copy"):
            _, stream, label, flops, moved, dtype, causal = entry
            seconds = device.seconds(flops / 2 if causal else flops, moved, dtype, kind != "op")
            if cpu:
                host += seconds
                busy[label] += seconds
                continue
            start = max(ready[stream], host)
            ready[stream] = start + seconds
            if stream == compute_stream:
                busy[label] += seconds
        elif kind == "collective":
            info = infos[entry[2]]
            stream = "host" if cpu else entry[1]
            start = max(host if cpu else max(ready[stream], host), wires[info["group"]])
            seconds = network.seconds(info["op"], info["bytes"], info["ranks"])
            ends[entry[2]] = wires[info["group"]] = start + seconds
            if not cpu:  # the collective's kernel holds its stream until it ends
                ready[stream] = start + seconds
            comm[info["op"]] += seconds
        elif kind == "wait_work":
            wait("host" if cpu else entry[1], ends.get(entry[2], 0.0))
        elif kind == "record_event":
            events[entry[2]] = ready[entry[1]]
        elif kind == "wait_event":
            wait(entry[1], events.get(entry[2], 0.0))
        elif kind == "wait_stream":
            wait(entry[1], ready[entry[2]])
        elif kind == "sync":
            host = max([host, *ready.values()])
        elif kind == "host_sync":
            host = max(host, ready[entry[1]])
    step = max([host, *ready.values(), *wires.values()])
    return {
        "step_s": step,
        "compute_s": sum(busy.values()),
        "comm_s": sum(comm.values()),
        "exposed_s": sum(exposed.values()),
        "comm_by_op_s": dict(comm),
        "exposed_by_label_s": dict(exposed.most_common()),
        "compute_by_label_s": dict(busy),
    }


def per_link(trace: dict, network) -> dict:
    """Collectives of the step by (op, link): count, bytes per rank, wire bytes, seconds."""
    out: dict = {}
    for info in trace["collectives"]:
        size = len(info["ranks"])
        link = network.link(info["ranks"]).name if size > 1 else "none (one rank)"
        row = out.setdefault(f"{info['op']} @ {link}", Counter())
        row["count"] += 1
        row["bytes"] += info["bytes"]
        row["wire_bytes"] += wire_bytes(info["op"], info["bytes"], size)
        row["seconds"] += network.seconds(info["op"], info["bytes"], info["ranks"])
    return {k: dict(v) for k, v in out.items()}
