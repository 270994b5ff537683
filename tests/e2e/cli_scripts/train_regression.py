"""A user's training script as `kubectl ddp run` takes it: one file, torchrun's environment, ddp_trainer for the
resume and the progress report (trainer/README.md, "Port a plain DDP script"), arguments from the command line."""
import argparse
import time

import torch
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

import ddp_trainer

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=4)
parser.add_argument("--step-delay", type=float, default=0.2)
args = parser.parse_args()

session = ddp_trainer.init_session()
ddp_trainer.rng.seed_all(0)
x = torch.randn(1280, 16)
y = x @ torch.linspace(-1, 1, 16).unsqueeze(1) + 0.1 * torch.randn(1280, 1)
data = TensorDataset(x, y)
sampler = ddp_trainer.ResumableDistributedSampler(data, seed=0)
loader = DataLoader(data, batch_size=32, sampler=sampler)
model = DDP(torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1)))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)

run = ddp_trainer.Run(session, model=model, optimizer=optimizer, seed=0)
run.restore()
for epoch in run.epochs(args.epochs):
    sampler.set_epoch(epoch)
    for xb, yb in run.batches(loader):
        loss = torch.nn.functional.mse_loss(model(xb), yb)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        run.step_done(loss=loss, samples=len(xb))
        time.sleep(args.step_delay)
    run.epoch_done(metrics={"lastLoss": loss.item()})
run.finish()
session.close()
