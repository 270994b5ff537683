"""Worker for the resident-state SIGTERM tests: every optimizer step takes seconds, so SIGTERM lands inside one; with
BLOCK_AFTER_STEP=N the loop blocks after its N-th optimizer step, before that step's save point (as in a collective
whose peer is gone)."""

import os
import time

import torch

import ddp_trainer


class SlowSGD(torch.optim.SGD):
    def step(self, closure=None):
        print(f"in-step after={run.step} pid={os.getpid()}", flush=True)
        time.sleep(2.0)  # the pre-hook has run: the resident state is invalid until the save point
        return super().step(closure)


session = ddp_trainer.init_session()
torch.manual_seed(0)
model = torch.nn.Linear(16, 4)
opt = SlowSGD(model.parameters(), lr=0.1, momentum=0.9)
run = ddp_trainer.Run(session, model=model, optimizer=opt, checkpoint_dir=None, progress_port=0)
run.restore()
for _ in run.epochs(1):
    for _ in run.batches(range(100)):
        model(torch.randn(8, 16)).pow(2).mean().backward()
        opt.step()
        if run.step + 1 == int(os.environ.get("BLOCK_AFTER_STEP", "0")):
            print(f"blocked after={run.step + 1} pid={os.getpid()}", flush=True)
            time.sleep(600)
        opt.zero_grad()
        run.step_done()
