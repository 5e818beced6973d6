"""A small GPT trained with DDP over gloo on synthetic, step-seeded data.

torchrun-ready: under torchrun (or ``planaria run``) it reads RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR and MASTER_PORT from the environment; without RANK it runs as one process.

    torchrun --nproc-per-node 2 examples/train_gpt.py --steps 200

``--device cuda``: each worker trains on ``cuda:LOCAL_RANK`` and DDP reduces over NCCL (start
at most as many workers per node as it has GPUs); the flash checkpoint copies the device
tensors. ``--deterministic`` makes a GPU run bitwise reproducible (deterministic kernels, the
math attention), as a CPU run is already.

The task: each sequence follows a fixed random permutation of the vocabulary
(``next = perm[token]``), with a token replaced by a random one now and then, so the loss drops
from ln(vocab) towards the noise floor within a few hundred steps.

Checkpoints are flash checkpoints (``planaria.checkpoint``): every step is copied into shared
memory, every ``--ckpt-every`` steps it is also persisted in the background. Under
``planaria run`` a restarted worker restores from memory (no step lost); standalone it restores
from the newest committed checkpoint in ``--ckpt-dir``.

Determinism: the batch of step ``s`` on global rank ``r`` depends only on (seed, s, r), the
initial weights only on the seed, and a checkpoint holds the model and the optimizer state. So,
for one world size, a run that is interrupted and resumed from its checkpoint ends with bitwise
the same weights as a run without a fault.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import math
import os
import signal
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.parallel import DistributedDataParallel

from planaria import monitor
from planaria.checkpoint import Checkpointer

# --------------------------------------------------------------------------- model


class Block(nn.Module):
    """Pre-LayerNorm transformer block: causal self-attention, then a 4x GELU MLP."""

    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.out = nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, d_model = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d_model, dim=2)
        # (batch, seq, d_model) -> (batch, heads, seq, head_dim)
        q, k, v = (t.view(batch, seq, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(batch, seq, d_model))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab: int, d_model: int, heads: int, layers: int, seq: int) -> None:
        super().__init__()
        if d_model % heads:
            raise ValueError(f"--d-model {d_model} is not a multiple of --heads {heads}")
        self.tok_emb = nn.Embedding(vocab, d_model)
        self.pos_emb = nn.Embedding(seq, d_model)
        self.blocks = nn.ModuleList(Block(d_model, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)
        self.head.weight = self.tok_emb.weight  # weight tying
        self.apply(self._init)
        for block in self.blocks:  # scale the residual projections (GPT-2 style)
            for proj in (block.proj, block.out):
                nn.init.normal_(proj.weight, std=0.02 / math.sqrt(2 * layers))

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.tok_emb(tokens) + self.pos_emb(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


# --------------------------------------------------------------------------- data


def _mix(*values: int) -> int:
    """A 63-bit seed from integers (splitmix64 rounds): nearby steps get unrelated streams."""
    state = 0x9E3779B97F4A7C15
    for value in values:
        state = (state ^ (value & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        state ^= state >> 31
        state = state * 0x94D049BB133111EB & 0xFFFFFFFFFFFFFFFF
        state ^= state >> 29
    return state >> 1


def permutation(vocab: int, seed: int) -> torch.Tensor:
    """The fixed rule of the task: the token after ``t`` is ``perm[t]``."""
    return torch.randperm(vocab, generator=torch.Generator().manual_seed(_mix(seed, 0x5EED)))


def batch_for(
    step: int, rank: int, *, perm: torch.Tensor, seed: int, batch: int, seq: int, noise: float
) -> torch.Tensor:
    """``batch`` sequences of ``seq + 1`` tokens for (seed, step, rank): bitwise reproducible."""
    gen = torch.Generator().manual_seed(_mix(seed, step, rank))
    vocab = perm.numel()
    random_tokens = torch.randint(vocab, (batch, seq + 1), generator=gen)
    replace = torch.rand(batch, seq + 1, generator=gen) < noise
    tokens = torch.empty(batch, seq + 1, dtype=torch.long)
    tokens[:, 0] = random_tokens[:, 0]
    for i in range(1, seq + 1):
        tokens[:, i] = torch.where(replace[:, i], random_tokens[:, i], perm[tokens[:, i - 1]])
    return tokens


# --------------------------------------------------------------------------- checkpoints


def atomic_save(obj: Any, path: Path) -> None:
    """torch.save to a temp file beside ``path`` (mode 0600), fsync, rename over ``path``.

    A reader sees the old file or the new one, never a half-written one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # make the rename itself durable
    finally:
        os.close(dir_fd)


def checkpointer(args: argparse.Namespace) -> Checkpointer:
    """Under ``planaria run`` the job's ``checkpoint.storage`` (unless --ckpt-dir is given),
    else --ckpt-dir (default ./checkpoints)."""
    if args.ckpt_dir is None and "PLANARIA_CKPT_STORAGE" in os.environ:
        return Checkpointer()
    return Checkpointer(args.ckpt_dir or Path("checkpoints"))


# --------------------------------------------------------------------------- training


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seq", type=int, default=32, help="tokens per sequence")
    p.add_argument("--batch", type=int, default=8, help="sequences per rank and step")
    p.add_argument("--noise", type=float, default=0.1, help="chance a token is random")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0, help="initial weights and data")
    p.add_argument("--steps", type=int, default=200, help="total optimizer steps")
    p.add_argument("--log-every", type=int, default=1)
    p.add_argument(
        "--ckpt-dir",
        type=Path,
        default=None,
        help="default: the job's checkpoint storage under planaria run, else ./checkpoints",
    )
    p.add_argument(
        "--ckpt-every", type=int, default=10, help="persist every N steps (memory: every step)"
    )
    p.add_argument(
        "--no-ckpt", action="store_true", help="no checkpoint at all (to measure its cost)"
    )
    p.add_argument(
        "--pace",
        type=float,
        default=0.0,
        help="sleep this many seconds after each step, as a larger model's step would take "
        "(tests give background copies time on a busy machine)",
    )
    p.add_argument("--out", type=Path, default=None, help="save the final model state_dict here")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="cuda: cuda:LOCAL_RANK")
    p.add_argument(
        "--deterministic", action="store_true", help="bitwise reproducible on a GPU too (slower)"
    )
    p.add_argument(
        "--kill-in-save",
        type=int,
        default=None,
        metavar="STEP",
        help="rehearsal: SIGKILL rank --kill-rank --kill-delay s into its save of STEP (first "
        "attempt only), so the kill lands while the save is copying",
    )
    p.add_argument("--kill-rank", type=int, default=0)
    p.add_argument("--kill-delay", type=float, default=0.005, help="seconds into the save")
    return p.parse_args(argv)


def device_for(args: argparse.Namespace) -> torch.device:
    """This worker's device: ``cuda:LOCAL_RANK`` with ``--device cuda``."""
    if args.device == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise SystemExit(
            f"--device cuda: torch cannot use CUDA here (torch {torch.__version__}, CUDA build "
            f"{torch.version.cuda}): run on a GPU machine or with --device cpu"
        )
    local = int(os.environ.get("LOCAL_RANK", "0"))
    count = torch.cuda.device_count()
    if local >= count:
        raise SystemExit(
            f"--device cuda: LOCAL_RANK {local}, but this node has {count} GPU(s): start at most "
            f"{count} worker(s) per node"
        )
    torch.cuda.set_device(local)
    return torch.device("cuda", local)


def kill_in_save(args: argparse.Namespace, rank: int) -> None:
    """Arm a SIGKILL of this process ``--kill-delay`` seconds from now (it is about to save
    ``--kill-in-save``), logged first as planaria's chaos logs its kills."""
    if rank != args.kill_rank or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return

    def kill() -> None:
        print(
            f"planaria chaos: kill_worker rank={rank} at_step={args.kill_in_save} in_save "
            f"time={time.time():.6f}",
            file=sys.stderr,
            flush=True,
        )
        os.kill(os.getpid(), signal.SIGKILL)

    timer = threading.Timer(args.kill_delay, kill)
    timer.daemon = True
    timer.start()


def same_start(start: int, device: torch.device) -> None:
    """Fail clearly, not with a hang or silent drift, when ranks resume from different steps
    (on several nodes, ``--ckpt-dir`` must be storage that every node sees)."""
    bounds = torch.tensor([start, -start], device=device)
    dist.all_reduce(bounds, op=dist.ReduceOp.MAX)
    if bounds.tolist() != [start, -start]:
        first, last = -int(bounds[1]), int(bounds[0])
        raise RuntimeError(
            f"ranks start at different steps ({first} to {last}): every rank must see the "
            "same --ckpt-dir"
        )


def warm_up(ddp: nn.Module, batch: int, seq: int, vocab: int, device: torch.device) -> None:
    """One forward and backward pass whose gradients are thrown away, weights untouched.

    DDP sums gradients in buckets laid out in reverse parameter order for the first backward
    pass of a process, then re-lays them out in the order the gradients became ready. With more
    than two ranks, gloo's floating-point sum depends on where an element sits in a bucket, so a
    run resumed at step s would reduce step s with the first layout where the run without a
    fault used the second, and drift apart in the last bits. Taking that first pass here gives every
    training step the same layout, however often the job restarted.
    """
    tokens = torch.zeros(batch, seq + 1, dtype=torch.long, device=device)
    logits = ddp(tokens[:, :-1])
    F.cross_entropy(logits.reshape(-1, vocab), tokens[:, 1:].reshape(-1)).backward()
    for param in ddp.parameters():
        param.grad = None


def train(
    args: argparse.Namespace, rank: int, world: int, distributed: bool, device: torch.device
) -> None:
    torch.manual_seed(args.seed)  # every rank builds the same initial weights
    model = GPT(args.vocab, args.d_model, args.heads, args.layers, args.seq).to(device)
    optim = torch.optim.AdamW(model.parameters(), lr=args.lr)

    start = 0
    ckpt = None if args.no_ckpt else checkpointer(args)
    template = {"model": model.state_dict(), "optim": optim.state_dict()}
    restored = None if ckpt is None else ckpt.load(template)
    if restored is not None:  # the model's tensors were filled in place
        step, state = restored
        model.load_state_dict(state["model"])
        optim.load_state_dict(state["optim"])
        start = step + 1
        if rank == 0:
            print(f"resumed from step {step} ({ckpt and ckpt.restored_from})", flush=True)

    ddp: nn.Module = model
    if distributed:
        same_start(start, device)
        ddp = DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None)
        warm_up(ddp, args.batch, args.seq, args.vocab, device)
    perm = permutation(args.vocab, args.seed)
    # The tokens the whole job trains on in a step (each rank's batch of sequences, every
    # rank): planaria's report and /metrics turn them into tokens/s.
    step_tokens = args.batch * args.seq * world

    for step in range(start, args.steps):
        tokens = batch_for(
            step,
            rank,
            perm=perm,
            seed=args.seed,
            batch=args.batch,
            seq=args.seq,
            noise=args.noise,
        ).to(device)
        logits = ddp(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, args.vocab), tokens[:, 1:].reshape(-1))
        optim.zero_grad(set_to_none=True)
        loss.backward()
        optim.step()

        logged = None  # the loss printed, which planaria's report draws too
        if args.log_every > 0 and step % args.log_every == 0:
            mean = loss.detach().clone()
            if distributed:  # the mean over ranks; it never touches the weights
                dist.all_reduce(mean)
                mean /= world
            if rank == 0:
                logged = mean.item()
                print(f"step {step} loss {logged:.4f} time {time.time():.6f}", flush=True)
        # Every step into shared memory (it also reports the step, its tokens, and the loss
        # when one was logged, to planaria's agent); every --ckpt-every steps to storage too,
        # in the background.
        persist = args.ckpt_every > 0 and (step + 1) % args.ckpt_every == 0
        if ckpt is not None:
            state = {"model": model.state_dict(), "optim": optim.state_dict()}
            if step == args.kill_in_save:
                kill_in_save(args, rank)  # armed last: it fires inside the save's copy
            ckpt.save(step, state, persist, loss=logged, tokens=step_tokens)
        else:
            monitor.step(step, loss=logged, tokens=step_tokens)
        if args.pace > 0:
            time.sleep(args.pace)

    if ckpt is not None:
        ckpt.wait()  # the last persisted step is committed before the job reports success
        ckpt.close()
    if rank == 0:
        if args.out is not None:
            atomic_save(model.state_dict(), args.out)
        print(f"done {args.steps} steps", flush=True)


@record
def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    # No torch.use_deterministic_algorithms(True): the CPU kernels used here are deterministic
    # already (the tests prove it bitwise), and the call imports torch._inductor, which costs
    # ~2 s in every new worker.
    if args.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before CUDA starts
        # warn_only: CUDA's nll_loss (cross_entropy) has no flagged deterministic kernel, though
        # its reduction runs in one block; every op that has one uses it.
        torch.use_deterministic_algorithms(True, warn_only=True)
    device = device_for(args)
    distributed = "RANK" in os.environ
    attention = (
        sdpa_kernel(SDPBackend.MATH)
        if args.deterministic and device.type == "cuda"
        else contextlib.nullcontext()
    )
    if not distributed:
        with attention:
            train(args, 0, 1, distributed=False, device=device)
        return
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    try:
        with attention:
            train(args, dist.get_rank(), dist.get_world_size(), distributed=True, device=device)
    except BaseException as exc:
        # Free the DDP module held by the traceback's frames now (see shut_down), and let no
        # error of the shutdown hide the one that stopped training.
        traceback.clear_frames(exc.__traceback__)
        with contextlib.suppress(Exception):
            shut_down()
        raise
    shut_down()


def shut_down() -> None:
    """Destroy the process group once nothing but torch.distributed holds it.

    Gloo's worker threads keep their last work, tensors included, until the group is destroyed;
    freeing such a tensor takes the GIL. The group's own Python binding releases the GIL while
    it is destroyed, but DDP's reducer also holds the group and does not: if the reducer drops
    the last reference (the DDP module dies after destroy_process_group), the main thread waits
    for the worker threads with the GIL held and the process hangs at exit. So the DDP module
    must be gone (collected) before destroy_process_group drops the last reference.
    """
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
