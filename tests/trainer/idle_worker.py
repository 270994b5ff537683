"""Worker for the rendezvous tests: says which pod it runs in and in what world, then idles (no torch import,
no collectives), so that only the rendezvous decides when workers are (re)started."""

import os
import time

print(f"worker-start pod={os.environ.get('DDPJOB_POD_INDEX')} rank={os.environ['RANK']} "
      f"world={os.environ['WORLD_SIZE']}", flush=True)
time.sleep(float(os.environ.get("IDLE_SECONDS", "30")))
