"""Baseline for bench-trainer-recovery: a plain DDP script as people write it without ddp_trainer.

Rank 0 saves a checkpoint every N steps; on start every rank loads the newest one and skips the
batches already done. No peer snapshots, no SIGTERM handling, default process-group timeout. It prints
the same structured step/resume/start lines as ddp_trainer (only to let the benchmarks measure it; the step
line comes before the step's checkpoint, as in ddp_trainer, so steps lost is never negative).

    torchrun ... tests/benchmarks/trainer_plain_ddp.py --checkpoint-dir DIR --checkpoint-every 10
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from ddp_trainer.examples.digits import DigitsNet, load_data
from ddp_trainer.log import Logger


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--checkpoint-dir", required=True)
    p.add_argument("--checkpoint-every", type=int, default=10)
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--step-delay", type=float, default=0.0)
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    log = Logger(rank)
    torch.manual_seed(0)
    data = load_data()
    train_set = TensorDataset(*data["train"])
    sampler = DistributedSampler(train_set, seed=0)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)
    model = DDP(DigitsNet())
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    step = 0
    path = os.path.join(args.checkpoint_dir, "checkpoint.pt")
    if os.path.exists(path):
        ckpt = torch.load(path, weights_only=False)
        model.module.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])
        step = ckpt["step"]
        log("resume", source="checkpoint", step=step)
    else:
        log("start", source="fresh")
    steps_per_epoch = len(loader)
    for epoch in range(step // steps_per_epoch, args.epochs):
        sampler.set_epoch(epoch)
        for i, (x, y) in enumerate(loader):
            if epoch * steps_per_epoch + i < step:
                continue
            if args.step_delay:
                time.sleep(args.step_delay)
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            step += 1
            log("step", step=step, epoch=epoch, loss=float(loss))
            if rank == 0 and step % args.checkpoint_every == 0:
                tmp = path + ".tmp"
                torch.save({"model": model.module.state_dict(), "optimizer": opt.state_dict(), "step": step}, tmp)
                os.replace(tmp, path)
    log("final", step=step)
    # As a careful user ends a DDP script: no rank leaves (and takes its agent, which may host the store) while
    # another is still finishing its last step or rank 0's checkpoint.
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
