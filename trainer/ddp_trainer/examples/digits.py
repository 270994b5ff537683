"""The example job: a small ConvNet on scikit-learn's bundled digits (no download), elastic and exact.

    torchrun --standalone --nproc-per-node=2 -m ddp_trainer.examples.digits [--epochs 10 ...]

Every flag falls back to an environment variable (``DIGITS_*`` for the model, ``DDPJOB_*`` for what the
operator sets), so the same command runs unchanged in a DDPJob pod. The run is deterministic for a
fixed seed and world size: killed and resumed, it ends with the same weights bit for bit.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

import ddp_trainer
from ddp_trainer import env as envmod
from ddp_trainer.env import ConfigError

SPLIT_SEED = 1234  # the train/val/test split is part of the data set, not of the run's seed


def _env_default(name: str, default: Any, kind: type) -> Any:
    if kind is int:
        return envmod.get_int(name, default)
    if kind is float:
        return envmod.get_float(name, default)
    return envmod.get_str(name, default)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Flags override environment variables, which override defaults; ConfigError on bad values."""
    p = argparse.ArgumentParser(prog="ddp_trainer.examples.digits", description=__doc__.split("\n")[0])
    opts: list[tuple[str, str, Any, type, str]] = [
        ("--epochs", "DIGITS_EPOCHS", 10, int, "maximum number of epochs"),
        ("--lr", "DIGITS_LR", 3e-3, float, "Adam learning rate"),
        ("--batch-size", "DIGITS_BATCH_SIZE", 32, int, "samples per rank per step"),
        ("--seed", "DIGITS_SEED", 0, int, "seed of model init, data order and dropout"),
        ("--patience", "DIGITS_PATIENCE", 3, int, "epochs without validation improvement before stopping"),
        ("--checkpoint-dir", envmod.CHECKPOINT_DIR, None, str, "disk checkpoint directory (unset: none)"),
        ("--checkpoint-every", envmod.CHECKPOINT_EVERY, 50, int, "steps between disk checkpoints"),
        ("--snapshot-every", envmod.SNAPSHOT_EVERY, envmod.DEFAULT_SNAPSHOT_EVERY, str,
         "steps between peer snapshots (auto: adaptive within DDPJOB_SNAPSHOT_BUDGET_PCT; 0: off)"),
        ("--step-delay", "DIGITS_STEP_DELAY", 0.0, float, "seconds to sleep per step (slow runs for kill tests)"),
        ("--amp", "DIGITS_AMP", "auto", str, "mixed precision: auto (CUDA only), off, bf16, fp16"),
        ("--final-weights", "DIGITS_FINAL_WEIGHTS", None, str, "rank 0 saves the final state dict here"),
    ]
    for flag, var, default, kind, help_ in opts:
        p.add_argument(flag, type=kind, default=_env_default(var, default, kind), help=f"{help_} (env {var})")
    args = p.parse_args(argv)
    for name in ("epochs", "batch_size"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1")
    envmod.parse_every("--snapshot-every", args.snapshot_every)  # ConfigError on a bad value
    for name in ("patience", "checkpoint_every"):
        if getattr(args, name) < 0:
            raise ConfigError(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 0")
    if args.lr <= 0 or args.step_delay < 0:
        raise ConfigError("--lr must be > 0 and --step-delay >= 0")
    if args.amp not in ("auto", "off", "bf16", "fp16"):
        raise ConfigError(f"--amp={args.amp!r}: expected auto, off, bf16 or fp16")
    return args


class DigitsNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1),
            nn.BatchNorm2d(16),
            nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1),
            nn.BatchNorm2d(32),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.classifier = nn.Sequential(
            nn.Flatten(),
            nn.Dropout(0.25),
            nn.Linear(32 * 4 * 4, 64),
            nn.ReLU(),
            nn.Dropout(0.25),
            nn.Linear(64, 10),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


def _digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's bundled digits, read straight from its CSV: importing sklearn costs ~1 s per
    worker start, which every recovery pays."""
    import gzip
    import importlib.util

    spec = importlib.util.find_spec("sklearn")
    if spec is not None and spec.submodule_search_locations:
        path = os.path.join(list(spec.submodule_search_locations)[0], "datasets", "data", "digits.csv.gz")
        if os.path.exists(path):
            with gzip.open(path, "rt") as f:
                data = np.loadtxt(f, delimiter=",")
            return data[:, :-1].reshape(-1, 8, 8), data[:, -1].astype(np.int64)
    from sklearn.datasets import load_digits

    digits = load_digits()
    return digits.images, digits.target


def load_data() -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    images, target = _digits_arrays()
    x = torch.tensor(images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(target, dtype=torch.int64)
    order = torch.from_numpy(np.random.RandomState(SPLIT_SEED).permutation(len(y)))
    n_test, n_val = len(y) // 5, len(y) // 10
    test, val, train = order[:n_test], order[n_test : n_test + n_val], order[n_test + n_val :]
    return {"train": (x[train], y[train]), "val": (x[val], y[val]), "test": (x[test], y[test])}


def amp_settings(mode: str, device: torch.device) -> tuple[bool, torch.dtype, bool]:
    """(enabled, dtype, needs GradScaler). CPU stays fp32 by default: bf16 there is slower and lossy."""
    if mode == "off" or (mode == "auto" and device.type != "cuda"):
        return False, torch.float32, False
    if mode == "fp16" or (mode == "auto" and not torch.cuda.is_bf16_supported()):
        return True, torch.float16, device.type == "cuda"
    return True, torch.bfloat16, False


@torch.no_grad()
def evaluate(module: nn.Module, data: tuple[torch.Tensor, torch.Tensor], session: ddp_trainer.Session) -> float:
    """Accuracy over the whole split, each rank scoring every world_size-th sample."""
    x, y = data
    x, y = x[session.rank :: session.world_size], y[session.rank :: session.world_size]
    was_training = module.training
    module.eval()
    correct = (module(x.to(session.device)).argmax(1) == y.to(session.device)).sum().item() if len(y) else 0
    module.train(was_training)
    counts = torch.tensor([float(correct), float(len(y))], dtype=torch.float64)
    if session.backend == "nccl":
        counts = counts.to(session.device)
    dist.all_reduce(counts)
    return float(counts[0] / counts[1])


def train(args: argparse.Namespace, session: ddp_trainer.Session) -> dict[str, Any]:
    device = session.device
    torch.use_deterministic_algorithms(True, warn_only=True)
    data = load_data()
    train_set = TensorDataset(*data["train"])
    sampler = ddp_trainer.ResumableDistributedSampler(train_set, shuffle=True, seed=args.seed, drop_last=False)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)

    ddp_trainer.rng.seed_all(args.seed)  # identical initial weights on every rank
    net = ddp_trainer.convert_sync_batchnorm(DigitsNet(), device).to(device)
    # Above two ranks DDP must keep one gradient bucket layout for the whole run, or a restarted worker's first step
    # rounds differently from the uninterrupted run's (trainer/README.md, "Rules that keep resume exact"); torch warns
    # once per rank that no parameter went unused, which is expected here.
    model = DDP(net, device_ids=[device.index] if device.type == "cuda" else None,
                find_unused_parameters=session.world_size > 2)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs)
    amp_on, amp_dtype, use_scaler = amp_settings(args.amp, device)
    scaler = torch.amp.GradScaler("cuda") if use_scaler else None
    extra: dict[str, Any] = {"best_val": -1.0, "bad_epochs": 0}

    run = ddp_trainer.Run(
        session,
        model=model,
        optimizer=optimizer,
        scaler=scaler,
        scheduler=scheduler,
        extra=extra,
        seed=args.seed,
        checkpoint_dir=args.checkpoint_dir,
        checkpoint_every=args.checkpoint_every,
        snapshot_every=args.snapshot_every,
    )
    session.log(
        "config",
        epochs=args.epochs,
        lr=args.lr,
        batch_size=args.batch_size,
        seed=args.seed,
        amp=str(amp_dtype).removeprefix("torch.") if amp_on else "off",
        train_samples=len(train_set),
        steps_per_epoch=len(loader),
        checkpoint_dir=args.checkpoint_dir,
        checkpoint_every=args.checkpoint_every,
    )
    run.restore()
    for epoch in run.epochs(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for x, y in run.batches(loader):
            if args.step_delay:
                time.sleep(args.step_delay)
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            autocast = torch.autocast(device.type, dtype=amp_dtype) if amp_on else contextlib.nullcontext()
            with autocast:
                loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            if scaler is not None:
                scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()
            else:
                loss.backward()
                optimizer.step()
            run.step_done(loss=loss, samples=len(x))
        # Restored after this epoch's last batch (killed during its validation), the loop above had no batch: what
        # follows is the epoch's end, once, as in an uninterrupted run. So nothing here may assume the loop ran.
        scheduler.step()
        val_acc = evaluate(net, data["val"], session)
        if val_acc > extra["best_val"]:
            extra["best_val"], extra["bad_epochs"] = val_acc, 0
        else:
            extra["bad_epochs"] += 1
        # Rank 0 decides; everybody follows (all_reduce), so no rank trains on alone.
        stop = session.decide_on_main(args.patience > 0 and extra["bad_epochs"] >= args.patience)
        run.epoch_done(metrics={"valAccuracy": round(val_acc, 4), "lr": scheduler.get_last_lr()[0]}, stop=stop)
    test_acc = evaluate(net, data["test"], session)
    digest = ddp_trainer.model_digest(net)
    if session.is_main and args.final_weights:
        torch.save(net.state_dict(), args.final_weights)
    session.log("final", test_accuracy=round(test_acc, 4), weights_sha256=digest, step=run.step)
    if session.is_main:
        print(f"test accuracy: {test_acc:.4f}", flush=True)
    return run.finish(metrics={"testAccuracy": round(test_acc, 4), "valAccuracy": extra["best_val"]})


def main(argv: Sequence[str] | None = None) -> int:
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS, before CUDA init
    try:
        args = parse_args(argv)
        session = ddp_trainer.init_session()
    except ConfigError as exc:
        print(f"digits: configuration error: {exc}", file=sys.stderr, flush=True)
        return 2
    try:
        train(args, session)
    except ConfigError as exc:
        print(f"digits: configuration error: {exc}", file=sys.stderr, flush=True)
        return 2
    session.close()
    return 0


if __name__ == "__main__":
    code = main()
    # Everything is flushed and closed explicitly above; skipping interpreter teardown avoids C++ static
    # destructors (gloo/c10d threads) that can abort a worker after training completed, which would make
    # its torchrun agent start a rendezvous nobody joins.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
