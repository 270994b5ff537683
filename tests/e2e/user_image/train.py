"""Train a small regression model with DistributedDataParallel under torchrun.

A plain DDP script: torchrun starts one process per GPU (or CPU slot) and sets RANK, LOCAL_RANK, WORLD_SIZE,
MASTER_ADDR and MASTER_PORT. Rank 0 saves a snapshot (model, optimizer, epochs done) every --save-every epochs;
when torchrun restarts the processes (a node left or joined), every rank loads the snapshot and goes on from there.

    torchrun --standalone --nproc-per-node=2 train.py --epochs 10 --snapshot-path /tmp/snapshot.pt
"""

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


class Regressor(nn.Module):
    def __init__(self, features: int = 20, hidden: int = 64):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(features, hidden), nn.ReLU(), nn.Linear(hidden, 1))

    def forward(self, x):
        return self.net(x)


def synthetic_data(samples: int = 2048, features: int = 20) -> TensorDataset:
    gen = torch.Generator().manual_seed(1234)  # the same data on every rank
    x = torch.randn(samples, features, generator=gen)
    w = torch.randn(features, 1, generator=gen)
    y = x @ w + 0.1 * torch.randn(samples, 1, generator=gen)
    return TensorDataset(x, y)


class Trainer:
    def __init__(self, model, data, optimizer, args):
        self.rank = int(os.environ["RANK"])
        self.local_rank = int(os.environ["LOCAL_RANK"])
        self.device = torch.device("cuda", self.local_rank) if torch.cuda.is_available() else torch.device("cpu")
        self.args = args
        self.sampler = DistributedSampler(data, shuffle=True, seed=0)
        self.loader = DataLoader(data, batch_size=args.batch_size, sampler=self.sampler)
        self.model = model.to(self.device)
        self.optimizer = optimizer
        self.epochs_run = 0
        if os.path.exists(args.snapshot_path):
            self.load_snapshot(args.snapshot_path)
        self.model = DDP(self.model, device_ids=[self.local_rank] if self.device.type == "cuda" else None)

    def load_snapshot(self, path):
        snapshot = torch.load(path, map_location=self.device)
        self.model.load_state_dict(snapshot["model"])
        self.optimizer.load_state_dict(snapshot["optimizer"])
        self.epochs_run = snapshot["epochs_run"]
        print(f"[rank {self.rank}] Resuming training from snapshot at epoch {self.epochs_run}", flush=True)

    def save_snapshot(self, epoch):
        snapshot = {"model": self.model.module.state_dict(), "optimizer": self.optimizer.state_dict(),
                    "epochs_run": epoch + 1}
        tmp = self.args.snapshot_path + ".tmp"
        torch.save(snapshot, tmp)
        os.replace(tmp, self.args.snapshot_path)  # a crash mid-save leaves the previous snapshot whole
        print(f"Epoch {epoch} | snapshot saved at {self.args.snapshot_path}", flush=True)

    def run_epoch(self, epoch):
        self.sampler.set_epoch(epoch)
        total, batches = 0.0, 0
        for x, y in self.loader:
            x, y = x.to(self.device), y.to(self.device)
            self.optimizer.zero_grad()
            loss = F.mse_loss(self.model(x), y)
            loss.backward()
            self.optimizer.step()
            total, batches = total + loss.item(), batches + 1
            if self.args.sleep_per_batch:
                time.sleep(self.args.sleep_per_batch)  # stands in for a bigger model's compute
        return total / max(batches, 1)

    def train(self):
        loss = float("nan")
        for epoch in range(self.epochs_run, self.args.epochs):
            loss = self.run_epoch(epoch)
            if self.rank == 0:
                print(f"Epoch {epoch} | loss {loss:.4f} | world size {dist.get_world_size()}", flush=True)
                if epoch % self.args.save_every == 0 or epoch == self.args.epochs - 1:
                    self.save_snapshot(epoch)
        return loss


def main():
    parser = argparse.ArgumentParser(description="DDP regression example")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--save-every", type=int, default=1, help="epochs between snapshots")
    parser.add_argument("--batch-size", type=int, default=32, help="per process")
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--snapshot-path", default=os.environ.get("SNAPSHOT_PATH", "snapshot.pt"))
    parser.add_argument("--sleep-per-batch", type=float, default=0.0)
    args = parser.parse_args()

    dist.init_process_group(backend="nccl" if torch.cuda.is_available() else "gloo")
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    torch.manual_seed(0)  # the same initial weights on every rank
    model = Regressor()
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    trainer = Trainer(model, synthetic_data(), optimizer, args)
    if trainer.rank == 0:
        print(f"Training on {dist.get_world_size()} processes ({trainer.device.type}), "
              f"from epoch {trainer.epochs_run} of {args.epochs}", flush=True)
    loss = trainer.train()
    if trainer.rank == 0:
        print(f"Training finished: {args.epochs} epochs, final loss {loss:.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
