"""twinshard.ranks.fork_server: a fresh rank forked from a server that imported torch once sees
what a spawned rank sees ([Note: ranks from a fork server]): the caller's environment, output and
modules as they are at the launch, not as they were when the server started."""

import importlib
import os
import sys
import time

import pytest
import torch.distributed as dist

from twinshard.ranks import fork_server
from twinshard.ranks.launch import FRESH, launch

pytestmark = [
    pytest.mark.real_launch,  # ranks of their own, not the shared worlds'
    pytest.mark.skipif(FRESH != "forkserver", reason="this platform has no fork server"),
]


def environment(*names):
    return {name: os.environ.get(name) for name in names}


def say(text):
    print(f"rank {dist.get_rank()} says {text}", flush=True)
    print(f"rank {dist.get_rank()} warns {text}", file=sys.stderr, flush=True)
    return os.getpid()


def imported(name):
    return name in sys.modules


def test_a_rank_has_the_callers_environment_at_the_launch_not_the_servers(monkeypatch):
    monkeypatch.setenv("TWINSHARD_FORK_SERVER_BEFORE", "kept")
    launch(environment, 2)  # the server starts now at the latest, with this environment
    monkeypatch.setenv("TWINSHARD_FORK_SERVER_AFTER", "set since")
    monkeypatch.delenv("TWINSHARD_FORK_SERVER_BEFORE")
    names = ("TWINSHARD_FORK_SERVER_BEFORE", "TWINSHARD_FORK_SERVER_AFTER", "EXTRA")
    seen = launch(environment, 2, *names, env={"EXTRA": "x"})
    assert (
        seen
        == [
            {
                "TWINSHARD_FORK_SERVER_BEFORE": None,
                "TWINSHARD_FORK_SERVER_AFTER": "set since",
                "EXTRA": "x",
            }
        ]
        * 2
    )


def test_a_ranks_output_goes_where_the_callers_goes_now(capfd):
    with capfd.disabled():
        launch(environment, 1)  # a server started while the output went elsewhere
    pids = launch(say, 2, "hello")
    out, err = capfd.readouterr()  # the ranks' lines may interleave: each is looked for
    assert "rank 0 says hello" in out and "rank 1 says hello" in out, out
    assert "rank 0 warns hello" in err and "rank 1 warns hello" in err, err
    assert os.getpid() not in pids and len(set(pids)) == 2


def test_a_users_module_is_imported_as_it_is_at_each_launch(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    module = tmp_path / "fork_server_user_module.py"
    answers = []
    for answer in ("first", "edited"):
        module.write_text(f"def answer():\n    return {answer!r}\n")
        os.utime(module, (time.time() + len(answers), time.time() + len(answers)))
        sys.modules.pop("fork_server_user_module", None)
        importlib.invalidate_caches()
        answers.append(launch(importlib.import_module("fork_server_user_module").answer, 2))
    assert answers == [["first", "first"], ["edited", "edited"]]


def test_a_rank_starts_with_the_preloaded_modules_and_the_server_keeps_none_of_its_state():
    # forked from the server: torch and twinshard's rank modules are there before fn runs
    assert launch(imported, 2, "twinshard.reference") == [True, True]
    assert set(fork_server.PRELOAD) >= {"torch", "twinshard.reference", "twinshard.optimized"}
    # a rank that changed its process (a process group, a global) leaves the next one clean
    assert launch(environment, 2, "RANK") == [{"RANK": "0"}, {"RANK": "1"}]
    assert launch(imported, 1, "fork_server_user_module") == [False]
