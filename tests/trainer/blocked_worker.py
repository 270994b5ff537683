"""Worker for the SIGTERM test: rank 0 blocks in a collective that rank 1 never joins."""

import os
import time

import torch
import torch.distributed as dist

import ddp_trainer

session = ddp_trainer.init_session(timeout_s=600)
session.on_terminate(lambda: print(f"terminate-callback rank={session.rank}", flush=True))
print(f"ready rank={session.rank} pid={os.getpid()}", flush=True)
if session.rank == 0:
    dist.all_reduce(torch.ones(1))
else:
    time.sleep(600)
