"""Worker for the store tests: one gloo all_reduce of rank + 1 across the group, printed, then an optional idle
(IDLE_SECONDS) so that a test can act while the group runs."""

import os
import time

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
print(f"allreduce rank={dist.get_rank()} world={dist.get_world_size()} sum={int(t.item())}", flush=True)
time.sleep(float(os.environ.get("IDLE_SECONDS", "0")))
dist.destroy_process_group()
