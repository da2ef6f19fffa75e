"""The training loop that every rank runs: set up, maybe resume, train, checkpoint, evaluate.

``rank_main(cfg)`` is what each rank executes, inside a process group that the entry point
(``cli.py``) set up, locally with ``twinshard.ranks.launch`` or under ``torchrun``. Each step reads
this rank's contiguous part of the global batch (``data.Windows``) in ``--grad-accum``
micro-batches, whose gradients are reduced only after the last one
(``set_requires_gradient_sync``); then the gradient norm is clipped and AdamW steps. The loss
of a step is averaged over the ranks, so every rank sees the same number and stops together.

Checkpoints (``checkpoint.save``) are written every ``--checkpoint-every`` steps and at the
end. ``--resume`` loads one before anything is written, at any number of ranks, and restores
each rank's RNG state when the world size is unchanged (else re-derives it from the seed),
so the run ends with the same parameters as one that was never interrupted.

SIGINT and SIGTERM stop the run after the step in progress, with a checkpoint of it
(``stop.py``): the request travels with the loss average of every step. Each step and each
phase is reported to the watchdog (``twinshard.ranks.watchdog.progress``).
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from twinshard.clip_grad import clip_grad_norm_
from twinshard.ranks import watchdog
from twinshard.ranks.devices import rank_device

from . import checkpoint as ckpt
from . import stop as stopping
from .build import build_model, build_optimizer, seed_rank_rngs
from .config import TrainConfig, TrainError, fresh_run_name
from .data import Windows, load_corpus
from .report import Reporter, duration, log_summary, memory_mb


def _agree_on_out(cfg: TrainConfig) -> Path:
    """Under torchrun without --out, rank 0 names the run directory for everyone."""
    choice = [cfg.out]
    if choice[0] is None:
        if dist.get_rank() == 0:
            choice[0] = str(fresh_run_name())
        dist.broadcast_object_list(choice, src=0)
    return Path(choice[0])


def rank_main(cfg: TrainConfig, lock_run_dir: bool = False) -> dict:
    """What every rank runs: set up, maybe resume, train, checkpoint, report.
    ``lock_run_dir``: rank 0 locks the run directory (under torchrun; a local launcher holds
    the lock itself)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    device = rank_device()  # asked of the accelerator API, not of the backend's name
    with stopping.StopRequest(announce=rank == 0) as request:
        run_dir = _agree_on_out(cfg)
        lock = _prepare_run_dir(cfg, run_dir, lock_run_dir)
        try:
            log = Reporter(rank == 0, run_dir)
            try:
                mesh = _mesh(cfg, device, world, log)
                return _train(cfg, rank, world, device, run_dir, log, mesh, request)
            finally:
                log.close()
        finally:
            if lock is not None:
                lock.release()


def _mesh(cfg, device, world: int, log: Reporter):
    """The run's device mesh: every rank in one dimension, or with ``--hsdp`` (nodes, ranks
    per node), replicated across the nodes and sharded within each. Launchers give a node's
    ranks consecutive numbers (torchrun: an agent's ``LOCAL_WORLD_SIZE``)."""
    from torch.distributed.device_mesh import init_device_mesh

    if not cfg.hsdp:
        return init_device_mesh(device.type, (world,))
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if per_node < 1 or world % per_node:
        raise TrainError(f"--hsdp: {world} ranks are not whole nodes of {per_node}")
    nodes = world // per_node
    log.info(f"HSDP: {nodes} replica(s), one per node, each sharded over {per_node} rank(s)")
    shape = (nodes, per_node)
    return init_device_mesh(device.type, shape, mesh_dim_names=("replicate", "shard"))


def _prepare_run_dir(cfg: TrainConfig, run_dir: Path, lock_run_dir: bool):
    """Rank 0 makes sure the run directory exists, and locks it if asked; the lock this rank
    holds, or None."""
    from .runlock import claim

    lock, problem = None, None
    if dist.get_rank() == 0:
        cfg.out = str(run_dir)
        try:
            if lock_run_dir:
                lock = claim(cfg)
            else:
                run_dir.mkdir(parents=True, exist_ok=True)
        except (TrainError, OSError) as e:
            problem = str(e)
    box = [problem]
    dist.broadcast_object_list(box, src=0)  # also: the directory exists before anyone writes
    if box[0]:
        raise TrainError(box[0])
    return lock


def _train(cfg, rank, world, device, run_dir, log: Reporter, mesh, request) -> dict:
    watchdog.progress("building the model")
    corpus = load_corpus(cfg.data, cfg.seq_len)
    windows = Windows(corpus.train, cfg.seq_len, cfg.seed)
    model = build_model(cfg, device, mesh)
    opt, sched = build_optimizer(cfg, model)
    n_params = sum(p.numel() for p in model.parameters())  # DTensor: the global size
    step, samples, losses, resumed = 0, 0, [], None
    if cfg.resume_from:  # before anything is written, so a failed load leaves the run as it was
        watchdog.progress("loading the checkpoint")
        step, samples, losses, resumed = _resume(cfg, rank, world, model, opt, sched)
    else:
        seed_rank_rngs(cfg.seed, 0, rank)
    log.info(
        f"twinshard train: {cfg.impl} fully_shard on {world} rank(s) ({dist.get_backend()}, "
        f"{device.type}); preset {cfg.preset} ({n_params / 1e6:.2f}M parameters); data "
        f"{corpus.name} ({len(corpus.train) / 1e6:.2f}M bytes); run directory {run_dir}"
    )
    if resumed:
        log.info(resumed)
    end = cfg.stop_at or cfg.steps
    tokens_per_step = cfg.batch_size * cfg.seq_len
    log.info(
        f"steps {step} -> {end} of {cfg.steps}; global batch {cfg.batch_size} x "
        f"{cfg.seq_len} tokens ({cfg.batch_size // world // cfg.grad_accum} per micro-batch x "
        f"{cfg.grad_accum} on each rank); lr {cfg.lr:g} (warmup {cfg.warmup}, cosine to "
        f"{cfg.min_lr:g}); {cfg.param_dtype} params"
        + (f", {cfg.reduce_dtype} reduce" if cfg.reduce_dtype else "")
        + (", CPU offload" if cfg.cpu_offload else "")
        + (f"; communication --variants {cfg.variants}" if cfg.variants else "")
    )
    for note in cfg.notes:
        log.info(f"note: {note}")
    manifest_base = {
        "model": cfg.model,
        "config": cfg.remembered(),
        "data_fingerprint": cfg.data_fingerprint,
        "impl": cfg.impl,
        "torch": torch.__version__,
    }
    t_start = time.perf_counter()
    train_time, last_ckpt, interrupted = 0.0, None, None
    first_step = step
    while step < end:
        t0 = time.perf_counter()
        watchdog.progress(f"step {step + 1}")
        lr = sched.get_last_lr()[0]  # the rate this step uses
        local = train_step(model, opt, windows, samples, cfg, rank, world, device)
        sched.step()
        step, samples = step + 1, samples + cfg.batch_size
        loss, stop_now = mean_and_stop(local, request.signum)
        if not math.isfinite(loss):
            raise TrainError(f"the loss is {loss} at step {step}; lower --lr or use --clip-norm")
        losses.append(loss)
        train_time += time.perf_counter() - t0
        rate = tokens_per_step * (step - first_step) / train_time
        status = (
            f"step {step}/{cfg.steps}  loss {loss:.4f}  lr {lr:.2e}  "
            f"{rate / 1e3:.1f}k tok/s  mem {memory_mb(device):.0f} MB"
        )
        log.bar(step, end, status)
        if step % cfg.log_every == 0 or step == end or step == first_step + 1:
            eta = (end - step) * train_time / (step - first_step)
            log.info(f"{status}  eta {duration(eta)}")
        if stop_now:
            interrupted, end = stopping.name(request.signum), step  # save this step, then stop
            log.info(f"stop requested ({interrupted}): saving a checkpoint of step {step}")
        if (cfg.checkpoint_every and step % cfg.checkpoint_every == 0) or step == end:
            t_ck = time.perf_counter()
            last_ckpt = ckpt.save(
                run_dir,
                step,
                model,
                opt,
                sched,
                {"step": step, "samples": samples},
                {**manifest_base, "samples": samples, "losses": losses},
                cfg.keep,
            )
            log.info(f"checkpoint {last_ckpt} ({time.perf_counter() - t_ck:.1f}s)")
    if interrupted:
        log.info(
            f"interrupted by {interrupted} after step {step}; checkpoint {last_ckpt}; continue "
            f"with: twinshard train --resume {run_dir}"
        )
        return {"step": step, "interrupted": interrupted, "checkpoint": str(last_ckpt)}
    watchdog.progress("evaluating")
    val_loss = None
    if corpus.val is not None and cfg.eval_batches:
        val_loss = evaluate(
            model, Windows(corpus.val, cfg.seq_len, cfg.seed), cfg, rank, world, device
        )
    sample = None
    if cfg.sample_length:
        sample = generate(model, b"The ", cfg.sample_length, cfg.seq_len, cfg.seed, device)
    elapsed = time.perf_counter() - t_start
    if rank == 0:
        log_summary(
            cfg,
            log,
            run_dir,
            losses,
            val_loss,
            sample,
            elapsed,
            first_step,
            step,
            train_time,
            world,
            last_ckpt,
        )
    return {"step": step, "losses": losses, "val_loss": val_loss, "checkpoint": str(last_ckpt)}


def _resume(cfg, rank, world, model, opt, sched) -> tuple[int, int, list, str]:
    """Load the checkpoint into model, optimizer and scheduler and restore or re-derive the
    RNGs; return (step, samples consumed, loss history, a line for the log)."""
    where = Path(cfg.resume_from)
    manifest = ckpt.read_manifest(where)  # verified before the ranks started
    trainer = ckpt.load(where, model, opt, sched)
    if trainer["step"] != manifest["step"] or trainer["samples"] != manifest["samples"]:
        raise ckpt.CheckpointError(
            f"checkpoint {where} is inconsistent: its DCP data is at step "
            f"{trainer['step']}, its manifest at {manifest['step']}"
        )
    if manifest["world_size"] == world:
        ckpt.set_rng_state(ckpt.load_rng(where, rank))
        rng = "per-rank RNG states restored"
    else:
        seed_rank_rngs(cfg.seed, trainer["step"], rank)
        rng = (
            f"per-rank RNG states cannot be resharded from {manifest['world_size']} to {world} "
            f"ranks: re-derived from (seed {cfg.seed}, step {trainer['step']}, rank)"
        )
    history = list(manifest.get("losses", []))[: trainer["step"]]
    return (
        trainer["step"],
        trainer["samples"],
        history,
        f"resumed {where} ({ckpt.describe(manifest)}) on {world} rank(s); {rng}",
    )


def train_step(
    model,
    opt,
    windows: Windows,
    position: int,
    cfg: TrainConfig,
    rank: int,
    world: int,
    device: torch.device,
) -> torch.Tensor:
    """One optimizer step on the global batch at ``position``; returns this rank's mean loss."""
    x, y = windows.rank_batch(position, cfg.batch_size, rank, world)  # (B / W, T) each
    x, y = x.to(device), y.to(device)
    micro = x.shape[0] // cfg.grad_accum
    total = torch.zeros((), device=device)
    for k in range(cfg.grad_accum):
        last = k == cfg.grad_accum - 1
        if cfg.grad_accum > 1:  # reduce only the summed gradient of the last micro-batch
            model.set_requires_gradient_sync(last)
        rows = slice(k * micro, (k + 1) * micro)
        loss = model(x[rows], y[rows])  # mean over this micro-batch's tokens
        # Each rank's gradient is the mean over its micro-batches, and FSDP averages over the
        # ranks: the step sees the mean over the global batch, whatever W and grad_accum are.
        (loss / cfg.grad_accum).backward()
        total += loss.detach()
    if cfg.clip_norm > 0:
        clip_grad_norm_(model.parameters(), cfg.clip_norm)  # torch's bits, on the local shards
    opt.step()
    opt.zero_grad(set_to_none=True)
    return total / cfg.grad_accum


def mean_and_stop(value: torch.Tensor, signum: int) -> tuple[float, bool]:
    """The mean of ``value`` over all ranks, and whether any rank was asked to stop (one
    collective: the step's loss average carries the stop request)."""
    packed = torch.stack([value.detach().float(), value.new_tensor(float(signum > 0)).float()])
    dist.all_reduce(packed)  # (2,) the summed losses, the number of ranks asked to stop
    return packed[0].item() / dist.get_world_size(), packed[1].item() > 0


def global_mean(value: torch.Tensor) -> float:
    """The mean of ``value`` over all ranks, as a number every rank gets."""
    value = value.detach().clone()
    dist.all_reduce(value)
    return value.item() / dist.get_world_size()


@torch.no_grad()
def evaluate(
    model, windows: Windows, cfg: TrainConfig, rank: int, world: int, device: torch.device
) -> float:
    """Mean loss over ``eval_batches`` global batches of held-out data."""
    total = torch.zeros((), device=device)
    for b in range(cfg.eval_batches):
        x, y = windows.rank_batch(b * cfg.batch_size, cfg.batch_size, rank, world)
        total += model(x.to(device), y.to(device))
    return global_mean(total / cfg.eval_batches)


@torch.no_grad()
def generate(
    model, prompt: bytes, length: int, seq_len: int, seed: int, device: torch.device
) -> str:
    """Sample ``length`` bytes after ``prompt``; rank 0 draws, every rank runs the model."""
    tokens = torch.tensor([list(prompt)], device=device)  # (1, t)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(length):
        logits = model(tokens[:, -seq_len:])[0, -1, :256].float().cpu()  # (256,) bytes only
        nxt = torch.multinomial(F.softmax(logits / 0.7, dim=-1), 1, generator=gen)  # (1,)
        nxt = nxt.to(device)
        dist.broadcast(nxt, src=0)  # one rank decides, so all feed the same next input
        tokens = torch.cat([tokens, nxt[None]], dim=1)  # (1, t + 1)
    return bytes(tokens[0].tolist()).decode("utf-8", errors="replace")
