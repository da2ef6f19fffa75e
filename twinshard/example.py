"""A first run: train a small Llama-style model with the reference FSDP on 2 CPU ranks.

    python -m twinshard.example            # 2 ranks, 40 steps, prints the loss falling
    python -m twinshard.example --nproc 3 --steps 60

Each rank reads its own slice of every batch of a tiny built-in byte-level corpus; every
block and the root are sharded with ``twinshard.reference.fully_shard``. Rank 0 prints the
global loss (the mean over ranks) every few steps.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist

from twinshard.models import Llama, LlamaConfig
from twinshard.ranks.launch import launch

TEXT = (
    "fully sharded data parallel keeps one slice of every weight on each rank. "
    "before a layer runs, the ranks gather its weights; after it runs, they free them. "
    "after backward, the ranks reduce and scatter the gradients, so each keeps its slice. "
)


def batch(step: int, batch_size: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    data = torch.tensor(list(TEXT.encode()), dtype=torch.long)  # (N,) bytes
    g = torch.Generator().manual_seed(step)
    starts = torch.randint(0, len(data) - seq - 1, (batch_size,), generator=g)
    rows = torch.stack([data[s : s + seq + 1] for s in starts.tolist()])  # (B, seq + 1)
    return rows[:, :-1], rows[:, 1:]


def train(steps: int, lr: float, every: int) -> list[float]:
    from twinshard.reference import fully_shard

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = Llama(LlamaConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, max_seq_len=64))
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses, start = [], time.perf_counter()
    per_rank = 8
    for step in range(steps):
        x, y = batch(step, per_rank * world, 48)
        x, y = (
            x[rank * per_rank : (rank + 1) * per_rank],
            y[rank * per_rank : (rank + 1) * per_rank],
        )
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
        if rank == 0 and (step % every == 0 or step == steps - 1):
            print(
                f"step {step:4d}  loss {losses[-1]:.4f}  ({time.perf_counter() - start:.1f}s)",
                flush=True,
            )
    return losses


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nproc", type=int, default=2, help="local ranks (default 2)")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args(argv)
    print(f"training with twinshard.reference on {args.nproc} CPU ranks (gloo)")
    losses = launch(train, args.nproc, args.steps, args.lr, 5)[0]
    print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f}")


if __name__ == "__main__":
    main()
