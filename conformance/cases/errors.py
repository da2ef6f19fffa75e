"""Misuse cases: each wrong use of the interface gets a clear error that names the module or
parameter, in the implementation under test as in the others.
"""

from __future__ import annotations

import contextlib
import copy

import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

from .. import models as M
from ..compare import Checker
from .core import case
from .state_dict import sources


@contextlib.contextmanager
def expect_error(checker: Checker, what: str, *words: str):
    checker.count += 1
    try:
        yield
    except (ValueError, RuntimeError, TypeError, AssertionError) as error:
        text = str(error).lower()
        # a word given as a tuple is satisfied by any one of its alternatives
        missing = [
            w
            for w in words
            if not any(a.lower() in text for a in (w if isinstance(w, tuple) else (w,)))
        ]
        if missing:
            checker.fail(f"{what}: the error does not mention {missing}: {text!r}")
    else:
        checker.fail(f"{what}: no error was raised")


@case("errors")
def case_errors(ctx):
    """Misuse gives a clear error that names the module or parameter."""
    checker = Checker("fp32")
    impl, mesh = ctx.impl, ctx.mesh
    with expect_error(checker, "ModuleList", "ModuleList"):
        impl.fully_shard(nn.ModuleList([nn.Linear(3, 3)]), mesh=mesh)
    with expect_error(checker, "3D mesh", "mesh"):
        impl.fully_shard(nn.Linear(3, 3), mesh=init_device_mesh(ctx.device_type, (1, 1, ctx.world)))
    with expect_error(checker, "reshard_after_forward='yes'", "reshard_after_forward"):
        impl.fully_shard(nn.Linear(3, 3), mesh=mesh, reshard_after_forward="yes")
    with expect_error(checker, "reshard_after_forward=0", "reshard_after_forward"):
        impl.fully_shard(nn.Linear(3, 3), mesh=mesh, reshard_after_forward=0)
    twice = nn.Linear(3, 3)
    impl.fully_shard(twice, mesh=mesh)
    with expect_error(checker, "applied twice"):
        impl.fully_shard(twice, mesh=mesh)
    with expect_error(checker, "deepcopy", "deepcopy"):
        copy.deepcopy(twice)
    with torch.device("meta"):
        on_meta = M.MLPStack()
    M.shard_blocks(impl, on_meta, mesh)
    with expect_error(checker, "parameters left on meta", "meta"):
        on_meta(torch.randn(2, 15))
    tied = M.Llama(M.llama_config(tie=True))
    impl.fully_shard(tied.tok_embeddings, mesh=mesh)
    with expect_error(
        checker, "tied parameters split across groups", ("output.weight", "tok_embeddings.weight")
    ):
        impl.fully_shard(tied, mesh=mesh)
        tied(torch.zeros(1, 4, dtype=torch.long))
    return checker


@case("errors")
def case_child_forward_first(ctx):
    """Forward through a block before the root: an error that says to run the root first."""
    checker = Checker("fp32")
    for label, impl, checks in sources(ctx):
        with checks:
            model = M.MLPStack()
            M.shard_blocks(impl, model, ctx.mesh)
            model.blocks[0](torch.randn(2, 15))
            with expect_error(checker, f"{label}: child before root", "root"):
                model(torch.randn(2, 15))
    return checker
