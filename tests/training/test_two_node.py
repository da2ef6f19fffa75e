"""A two-node rehearsal on one machine (issue 26, item 4): how a user outgrows one machine.

Two ``torchrun`` agents, ``--nnodes 2`` with a c10d rendezvous on localhost, 2 ranks each,
run ``twinshard train --hsdp``: one replica per "node", sharded within it (a 2 x 2 mesh on
gloo). The run checkpoints, and is resumed by one agent of 2 ranks (another node count: the
checkpoint's 4-rank sharded state is resharded by DCP onto a 1 x 2 mesh) to its last step.
Every launch is bounded in time; a failure shows the agents' last output.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

from train_support import SMALL

from twinshard.train import checkpoint as ckpt

TIMEOUT_S = 240


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(nodes: str, *train_args) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        *nodes.split(),
        "--nproc-per-node",
        "2",
        "-m",
        "twinshard.cli",
        "train",
        *SMALL,
        "--hsdp",
        *train_args,
    ]


def _finish(agents: list[subprocess.Popen]) -> list[str]:
    """Wait for every agent, all within one ``TIMEOUT_S``; past it, stop them all and fail
    with each agent's last output (which agent waited, and for what)."""
    deadline = time.monotonic() + TIMEOUT_S
    outputs, late = [], []
    for agent in agents:
        try:
            out, _ = agent.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            agent.kill()
            out, _ = agent.communicate()
            late.append(len(outputs))
        outputs.append(out)
    tails = "\n".join(
        f"--- agent {i} (exit {a.returncode}):\n{o[-2000:]}"
        for i, (a, o) in enumerate(zip(agents, outputs))
    )
    assert not late, f"agent(s) {late} still running after {TIMEOUT_S} s\n{tails}"
    assert all(agent.returncode == 0 for agent in agents), tails
    return outputs


def test_two_torchrun_agents_train_hsdp_and_resume_on_one(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = tmp_path / "run"
    rendezvous = (
        f"--nnodes 2 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:{_free_port()} "
        "--rdzv-id twinshard-two-node"
    )
    first = ["--steps", "4", "--checkpoint-every", "2", "--out", str(run)]
    agents = [
        subprocess.Popen(
            _torchrun(rendezvous, *first),
            cwd=tmp_path,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for _ in range(2)
    ]
    _finish(agents)
    manifest = ckpt.validate(ckpt.resolve(run))
    assert manifest["step"] == 4 and manifest["world_size"] == 4
    log = (run / "train.log").read_text()
    assert "HSDP: 2 replica(s), one per node, each sharded over 2 rank(s)" in log
    assert "on 4 rank(s)" in log

    again = ["--steps", "6", "--resume", str(run)]
    one = subprocess.Popen(
        _torchrun("--nnodes 1 --standalone", *again),
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    _finish([one])
    manifest = ckpt.validate(ckpt.resolve(run))
    assert manifest["step"] == 6 and manifest["world_size"] == 2
    log = (run / "train.log").read_text()
    assert "world size changed on resume" in log
    assert "HSDP: 1 replica(s), one per node, each sharded over 2 rank(s)" in log
