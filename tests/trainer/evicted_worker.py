"""Worker for the eviction tests: a pod's agent stopped by SIGTERM (an eviction, a drain, a preemption) stops every
worker of the pod at once. SLOW_TERMINATE_S makes the SIGTERM work before the checkpoint take that long (a large
model's state written to slow storage), so that the peers' exit and rank 0's failed collective come first."""

import os
import time

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import ddp_trainer

STEPS = int(os.environ.get("WORKER_STEPS", "400"))
session = ddp_trainer.init_session()
ddp_trainer.rng.seed_all(0)
model = DDP(torch.nn.Linear(64, 8))
opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
run = ddp_trainer.Run(session, model=model, optimizer=opt, progress_port=0)  # checkpoints: DDPJOB_CHECKPOINT_*
slow = float(os.environ.get("SLOW_TERMINATE_S", "0"))
if slow and session.rank == 0:  # rank 0 alone writes the checkpoint; the others exit at once
    session.on_terminate(lambda: time.sleep(slow))  # registered after the Run's callbacks: runs before them
run.restore()
print(f"ready rank={session.rank} pid={os.getpid()}", flush=True)
for _ in run.epochs(1):
    for _ in run.batches(range(STEPS)):
        time.sleep(0.03)
        loss = model(torch.randn(8, 64)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        run.step_done(loss=loss)
    run.epoch_done()
run.finish()
session.close()
