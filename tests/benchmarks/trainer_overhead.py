"""bench-overhead: what ddp_trainer costs per step, against a bare DDP loop on the same model.

One 2-process torchrun job (gloo, CPU) trains the digits ConvNet in interleaved segments of the same
length, rotating their order each round so machine load hits all of them alike:

- ``bare``: a plain DDP loop (forward, backward, optimizer step);
- ``run``: the same loop driven by ``ddp_trainer.Run`` with snapshots and checkpoints off (RNG reseeding,
  step accounting, progress, step log line);
- ``full``: ``Run`` with a peer snapshot every step, a disk checkpoint every 50 steps and the progress
  server on.

Reports median samples/s per segment kind, ``ratio`` = full / bare and ``snapshot_overhead_pct`` =
how much slower ``full`` is than ``run`` (the cost of snapshots and checkpoints), each the median of
per-round ratios of back-to-back segments (load swings on a shared machine cancel out). The same
ratios in CPU time of rank 0 per step (``cpu_*``) are less sensitive to other processes, and
``snapshot_write_us`` times one snapshot write directly. Prints one JSON object as its last line.

    .venv/bin/python tests/benchmarks/trainer_overhead.py [--quick] [--record] [--rounds 30 --steps 60]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "trainer"))
sys.path.insert(0, str(ROOT))
from tests.benchmarks import results  # noqa: E402


def worker(rounds: int, steps: int, workdir: str) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, TensorDataset

    import ddp_trainer
    from ddp_trainer.examples.digits import DigitsNet, load_data
    from ddp_trainer.testing import free_port

    session = ddp_trainer.init_session()
    torch.manual_seed(0)
    x, y = load_data()["train"]
    reps = (steps * 32 * session.world_size) // len(y) + 1
    data = TensorDataset(x.repeat(reps, 1, 1, 1), y.repeat(reps))
    sampler = ddp_trainer.ResumableDistributedSampler(data, seed=0)
    loader = DataLoader(data, batch_size=32, sampler=sampler)
    net = ddp_trainer.convert_sync_batchnorm(DigitsNet(), session.device)
    model = DDP(net)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    # /dev/shm as in a pod (the operator mounts a memory-backed emptyDir there)
    shm_root = "/dev/shm" if os.path.isdir("/dev/shm") else workdir
    shm = os.path.join(shm_root, f"bench-overhead-{os.getppid()}-{session.local_rank}")
    port = free_port() if session.is_main else 0
    runs = {
        "run": ddp_trainer.Run(
            session, model=model, optimizer=opt, checkpoint_dir=None, snapshot_every=0, progress_port=0
        ),
        "full": ddp_trainer.Run(
            session,
            model=model,
            optimizer=opt,
            checkpoint_dir=os.path.join(workdir, "ckpt"),
            checkpoint_every=50,
            snapshot_dir=shm,
            snapshot_every=1,
            progress_port=port,
        ),
    }

    def train_step(xb, yb):
        loss = F.cross_entropy(model(xb), yb)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss

    def segment(kind: str) -> tuple[float, float]:
        sampler.set_epoch(0)
        dist.barrier()
        c0 = time.process_time()
        t0 = time.perf_counter()
        if kind == "bare":
            for i, (xb, yb) in enumerate(loader):
                if i == steps:
                    break
                train_step(xb, yb)
        else:
            run = runs[kind]
            run.position.batch = 0
            for i, (xb, yb) in enumerate(run.batches(loader)):
                if i == steps:
                    break
                run.step_done(loss=train_step(xb, yb), samples=len(xb))
        cpu = time.process_time() - c0
        dist.barrier()
        return steps * 32 * session.world_size / (time.perf_counter() - t0), cpu / steps

    kinds = ["bare", "run", "full"]
    for kind in kinds:  # warm-up: allocator, DDP bucket rebuild, file creation
        segment(kind)
    rates: dict[str, list[float]] = {k: [] for k in kinds}
    cpu: dict[str, list[float]] = {k: [] for k in kinds}
    for r in range(rounds):
        order = kinds[r % 3 :] + kinds[: r % 3]
        for kind in order:
            rate, cpu_per_step = segment(kind)
            rates[kind].append(rate)
            cpu[kind].append(cpu_per_step)
    # the price of one snapshot write, measured directly on this model
    snaps = runs["full"].snapshots
    write_us = None
    if snaps is not None and session.local_rank == 0:
        comp = runs["full"].components
        t0 = time.perf_counter()
        for i in range(200):
            snaps.write(i, comp.state_dict(runs["full"].position))
        write_us = (time.perf_counter() - t0) / 200 * 1e6
    if session.is_main:
        print("OVERHEAD " + json.dumps({"rates": rates, "cpu": cpu, "snapshot_write_us": write_us}), flush=True)
    runs["full"].finish()
    session.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="2 short rounds (smoke test)")
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--workdir", default="", help=argparse.SUPPRESS)
    results.add_record_arg(p)
    opts = p.parse_args()
    rounds, steps = (3, 30) if opts.quick else (opts.rounds, opts.steps)
    if opts.worker:
        worker(rounds, steps, opts.workdir)
        return 0
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="bench-overhead-") as tmp:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("DDPJOB_", "PET_"))}
        env.update(
            {
                "OMP_NUM_THREADS": "1",
                "PYTHONUNBUFFERED": "1",
                "PYTHONPATH": str(ROOT / "trainer"),
                "DDPJOB_LOG_EVERY": "1",
            }
        )
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
            __file__, "--worker", "--workdir", tmp, "--rounds", str(rounds), "--steps", str(steps),
        ]  # fmt: skip
        if opts.quick:
            cmd.append("--quick")
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("OVERHEAD ")), None)
        if proc.returncode != 0 or line is None:
            print(proc.stdout[-3000:], proc.stderr[-3000:], file=sys.stderr)
            raise SystemExit(f"worker job failed with exit code {proc.returncode}")
    raw = json.loads(line.removeprefix("OVERHEAD "))
    rates, cpu = raw["rates"], raw["cpu"]
    med = {k: statistics.median(v) for k, v in rates.items()}
    # Ratios of segments run back to back in the same round cancel most of the machine's load swings.
    ratio = statistics.median(f / b for f, b in zip(rates["full"], rates["bare"]))
    snap_pct = statistics.median(100.0 * (r / f - 1.0) for r, f in zip(rates["run"], rates["full"]))
    cpu_med = {k: statistics.median(v) for k, v in cpu.items()}
    result = {
        "bare_samples_per_s": round(med["bare"], 1),
        "run_samples_per_s": round(med["run"], 1),
        "full_samples_per_s": round(med["full"], 1),
        "ratio": round(ratio, 4),
        "snapshot_overhead_pct": round(snap_pct, 2),
        "cpu_ms_per_step": {k: round(v * 1e3, 3) for k, v in cpu_med.items()},
        "cpu_ratio": round(cpu_med["bare"] / cpu_med["full"], 4),
        "cpu_snapshot_overhead_pct": round(100.0 * (cpu_med["full"] / cpu_med["run"] - 1.0), 2),
        "loadavg_1m": round(os.getloadavg()[0], 2),
        "snapshot_write_us": round(raw["snapshot_write_us"], 1) if raw["snapshot_write_us"] else None,
        "rounds": rounds,
        "steps_per_segment": steps,
        "samples_per_s": {k: [round(x, 1) for x in v] for k, v in raw["rates"].items()},
        "quick": opts.quick,
        "wall_s": round(time.time() - t0, 1),
    }
    results.emit("trainer_overhead", result, mode="quick" if opts.quick else "full", record=opts.record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
