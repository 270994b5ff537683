"""bench-overhead: what ddp_trainer costs per step, on the digits model and across model sizes.

One 2-process torchrun job (gloo, CPU, one thread per process).

Part 1, digits (the ConvNet of the examples) in interleaved segments of the same length, rotating their
order each round so machine load hits all of them alike:

- ``bare``: a plain DDP loop (forward, backward, optimizer step);
- ``run``: the same loop driven by ``ddp_trainer.Run`` with snapshots and checkpoints off (RNG reseeding,
  step accounting, progress, step log line);
- ``full``: ``Run`` with everything on: resident state (``ddp_trainer.resident``: parameters and optimizer
  state live in ``/dev/shm``, sealed at every step), peer snapshot copies at the adaptive interval K
  (``DDPJOB_SNAPSHOT_EVERY=auto``, budget ``DDPJOB_SNAPSHOT_BUDGET_PCT``, default 2 %), a disk checkpoint
  every 50 steps and the progress server. (A job's default is K = 1.)

``ratio`` = full / bare samples/s, the median of per-round ratios of back-to-back segments (load swings
on a shared machine cancel out), with their spread (``ratio_p25``/``ratio_p75``, min, max);
``snapshot_overhead_pct`` = how much slower ``full`` is than ``run``.

Part 2, the sweep: an MLP family (``MLP(width)``: 256 inputs, 4 hidden layers, 10 outputs, Adam) at about
1M, 10M and 100M parameters. Per size, paired rounds of ``run`` (no snapshots) and ``full`` (adaptive
snapshots, no disk checkpoints, so only the snapshot is measured) segments of whole K-cycles; reported per
size (medians over the rounds): step time without snapshots, the snapshot's copy time (save-point part +
background copy) and how long training stalled for it, overhead % (full vs run step time, per-round
ratio), the snapshot's bytes and bytes per step copied (bytes / K), K, and the resident state's bytes
(updated in place, never copied). The steps a failure may lose (``steps_lost_bound``) are 1 with resident
state (the newest completed step is sealed on every rank that is not inside its optimizer step) and K
without; K still bounds a failure that catches every rank inside its optimizer step. Also per size: whether
the copy and the resident state read back equal the live state (``snapshot_exact``, ``resident_exact``: in a
real DDP job) and what sending half the snapshot to the other rank costs (``buddy_transfer_s``: what a
sharded scheme would add per snapshot; see docs/recovery.md for the decision). Both kinds of segment train
the same model, so once ``full`` laid the resident state out, ``run`` trains on the same ``/dev/shm`` pages:
where the tensors live is not part of the overhead measured (``resident_vs_anonymous_pct`` measures it alone:
the optimizer step on resident tensors vs on ordinary process memory). Prints one JSON object as its last line.

    .venv/bin/python tests/benchmarks/trainer_overhead.py [--quick] [--record] [--rounds 20 --steps 60]
        [--sizes 1e6,1e7,1e8 --sweep-rounds 16 --segment-s 3 --size-budget-s 150]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
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


INPUTS, OUTPUTS, HIDDEN_LAYERS = 256, 10, 4
MIN_SWEEP_ROUNDS = 11  # paired rounds per size, however long a size's K-cycle (quick runs excepted)


def mlp_params(width: int) -> int:
    return INPUTS * width + width + (HIDDEN_LAYERS - 1) * (width * width + width) + width * OUTPUTS + OUTPUTS


def mlp_width(params: float) -> int:
    """The width whose MLP has about ``params`` parameters."""
    lo, hi = 1, 1 << 16
    while lo < hi:
        mid = (lo + hi) // 2
        if mlp_params(mid) < params:
            lo = mid + 1
        else:
            hi = mid
    return lo


def worker(rounds: int, steps: int, workdir: str, sizes: list[float], sweep_rounds: int, segment_s: float,
           size_budget_s: float) -> None:
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
            snapshot_every="auto",
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
            run._last_step_time = None  # the gap between segments is no step
            for i, (xb, yb) in enumerate(run.batches(loader)):
                if i == steps:
                    break
                run.step_done(loss=train_step(xb, yb), samples=len(xb))
            if run.snapshots is not None:
                run.snapshots.wait()  # a copy still in flight belongs to this segment
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
    # the price of one snapshot write, measured directly on this model (synchronous: the whole copy)
    snaps = runs["full"].snapshots
    write_us = None
    if snaps is not None and session.local_rank == 0:
        comp = runs["full"].components
        t0 = time.perf_counter()
        for i in range(200):
            snaps.write(i, comp.state_dict(runs["full"].position))
        write_us = (time.perf_counter() - t0) / 200 * 1e6
    digits_k = runs["full"].snapshot_every
    runs["full"].finish()
    runs["run"].finish()
    sweep = [sweep_size(session, int(n), workdir, sweep_rounds, segment_s, size_budget_s) for n in sizes]
    if session.is_main:
        out = {"rates": rates, "cpu": cpu, "snapshot_write_us": write_us, "digits_k": digits_k, "sweep": sweep}
        print("OVERHEAD " + json.dumps(out), flush=True)
    session.close()


def sweep_size(session, target: int, workdir: str, rounds: int, segment_s: float, size_budget_s: float) -> dict:
    """Paired rounds of `run` (no snapshots) and `full` (adaptive snapshots) on an MLP of ~target params."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    import ddp_trainer

    width = mlp_width(target)
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(INPUTS, width), nn.ReLU()]
    for _ in range(HIDDEN_LAYERS - 1):
        layers += [nn.Linear(width, width), nn.ReLU()]
    net = nn.Sequential(*layers, nn.Linear(width, OUTPUTS))
    params = sum(p.numel() for p in net.parameters())
    model = DDP(net, gradient_as_bucket_view=True)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(session.rank)
    batches = [(torch.randn(32, INPUTS, generator=g), torch.randint(0, OUTPUTS, (32,), generator=g)) for _ in range(8)]
    shm_root = "/dev/shm" if os.path.isdir("/dev/shm") else workdir
    shm = os.path.join(shm_root, f"bench-overhead-{os.getppid()}-{session.local_rank}-{params}")
    common = dict(model=model, optimizer=opt, checkpoint_dir=None, progress_port=0, log_every=0)
    runs = {
        "run": ddp_trainer.Run(session, snapshot_every=0, **common),
        "full": ddp_trainer.Run(session, snapshot_dir=shm, snapshot_every="auto", **common),
    }
    runs["full"].restore()  # the first save point: one measured copy before training
    snaps = runs["full"].snapshots
    copies: list[float] = []
    copies_wall: list[float] = []
    stalls: list[float] = []

    cpu_times: dict[str, list[float]] = {"run": [], "full": []}

    def segment(kind: str, n: int) -> float:
        run = runs[kind]
        data = [batches[i % len(batches)] for i in range(n)]
        run.position.batch = 0
        run._last_step_time = None  # the gap between segments is no step
        stall0 = snaps.stall_s if snaps is not None else 0.0
        dist.barrier()
        c0 = time.process_time()  # this process, the snapshot thread included
        t0 = time.perf_counter()
        for xb, yb in run.batches(data):
            last = snaps.last_step if snaps is not None else None
            loss = F.cross_entropy(model(xb), yb)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            run.step_done()
            if kind == "full" and snaps is not None and snaps.last_step != last and snaps.last_copy_s:
                copies.append(snaps.last_copy_s)  # a copy completed during this step
                copies_wall.append(snaps.last_copy_wall_s or 0.0)
        if kind == "full" and snaps is not None:
            snaps.wait()  # a copy still in flight belongs to this segment
            stalls.append(snaps.stall_s - stall0)
        dt = time.perf_counter() - t0
        cpu_times[kind].append((time.process_time() - c0) / n)
        dist.barrier()
        return dt / n

    # warm-up: allocator, DDP buckets, and K settling on measured copy and step times
    segment("run", 3)
    warm = segment("full", 6)
    guess = torch.tensor([max(segment("run", 3), 1e-4)], dtype=torch.float64)
    dist.broadcast(guess, src=0)  # every length below derives from it: all ranks must agree
    step_guess = float(guess.item())
    segment("full", max(6, min(60, int(2 * segment_s / step_guess))))
    k = runs["full"].snapshot_every
    # segments of whole K-cycles, about segment_s long; every rank must agree on the length
    n_steps = max(k, round(segment_s / step_guess / k) * k)
    # big models have long K-cycles: fewer rounds keep the sweep within minutes, but never fewer than
    # MIN_SWEEP_ROUNDS (the step time of ~100M drifts by +-20 % within minutes here: the median of 5 pairs was
    # off by several percent)
    floor = MIN_SWEEP_ROUNDS if rounds >= MIN_SWEEP_ROUNDS else 3
    rounds = max(floor, min(rounds, int(size_budget_s / (2 * n_steps * step_guess))))
    n = torch.tensor([n_steps, rounds], dtype=torch.int64)
    dist.broadcast(n, src=0)
    n_steps, rounds = int(n[0]), int(n[1])
    del warm
    times: dict[str, list[float]] = {"run": [], "full": []}
    ks: list[int] = []
    copies.clear()
    copies_wall.clear()
    for v in cpu_times.values():
        v.clear()
    for r in range(rounds):
        for kind in (("run", "full") if r % 2 == 0 else ("full", "run")):
            times[kind].append(segment(kind, n_steps))
        ks.append(runs["full"].snapshot_every)
    # outcome: a snapshot written asynchronously in this job holds exactly the live state of its step, and so does
    # the resident state (after a `full` segment: a `run` segment's optimizer steps leave it unsealed)
    if snaps is not None:
        kept = len(cpu_times["full"]), len(copies), len(copies_wall), len(stalls)
        segment("full", 2)  # not measured: its figures are dropped
        del cpu_times["full"][kept[0]:], copies[kept[1]:], copies_wall[kept[2]:], stalls[kept[3]:]
    exact = None
    if snaps is not None:
        snaps.wait()
        full = runs["full"]
        full._snapshot(full.position.step)
        snaps.wait()
        got = snaps.read_latest()
        live = full.components.state_dict(full.position)
        from ddp_trainer.state import flatten

        a, b = flatten(live)[1], flatten(got.state)[1] if got is not None else []
        exact = got is not None and got.step == full.position.step and len(a) == len(b) and all(
            torch.equal(x, y) for x, y in zip(a, b)
        )
    resident = runs["full"].resident
    resident_exact = None
    if resident is not None:
        full = runs["full"]
        got = resident.read()
        a = flatten(full.components.state_dict(full.position))[1]
        b = flatten(got.state)[1] if got is not None else []
        resident_exact = got is not None and got.step == full.position.step and len(a) == len(b) and all(
            torch.equal(x, y) for x, y in zip(a, b)
        )
        del got, a, b
    # what a sharded scheme would add per snapshot: sending half the snapshot to a buddy
    nbytes = torch.tensor([snaps.last_bytes if snaps is not None else 0], dtype=torch.int64)
    dist.broadcast(nbytes, src=0)
    half = torch.empty(int(nbytes.item()) // 2 // 4, dtype=torch.float32)
    dist.barrier()
    t0 = time.perf_counter()
    dist.broadcast(half, src=0)
    buddy_s = time.perf_counter() - t0
    result = {
        "params": params,
        "width": width,
        "steps_per_segment": n_steps,
        "rounds": rounds,
        "run_step_s": times["run"],
        "full_step_s": times["full"],
        "run_cpu_s": cpu_times["run"],
        "full_cpu_s": cpu_times["full"],
        "copy_s": copies,
        "copy_wall_s": copies_wall,
        "stall_s": stalls,
        "k": ks,
        "k_max": max(ks + [k]),
        "snapshot_bytes": snaps.last_bytes if snaps is not None else None,
        "snapshot_exact": exact,
        "resident": resident is not None,
        "resident_bytes": resident.resident_bytes if resident is not None else 0,
        "resident_copied_bytes": resident.copied_bytes if resident is not None else None,
        "resident_exact": resident_exact,
        "buddy_transfer_s": buddy_s,
    }
    for run in runs.values():
        run.finish()
    # The exactness check above wrote a copy on every rank; finish removes only the writer's (local rank 0's).
    shutil.rmtree(shm, ignore_errors=True)
    # after finish (no hooks left): the parameters are still the resident file's pages. Rank 0 alone, the other
    # ranks waiting: two ranks timing the same memory-bound step on two cores measured each other (±15 %).
    dist.barrier()
    location = resident_vs_anonymous_pct(opt) if resident is not None and session.rank == 0 else None
    dist.barrier()
    result["resident_vs_anonymous_pct"], result["resident_vs_anonymous_pct_iqr"] = location or (None, None)
    del runs, model, opt, net, half, batches
    gc.collect()
    return result


def resident_vs_anonymous_pct(opt, rounds: int = 25) -> tuple[float, list[float]]:
    """How much slower the optimizer step is on resident tensors (views into a /dev/shm file) than on the same
    tensors in ordinary process memory: median of paired rounds in %, and its p25 and p75. Leaves the optimizer as
    it was."""
    import torch

    params = [p for g in opt.param_groups for p in g["params"]]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    saved = [(p, p.data) for p in params]
    states = [(st, k, v) for st in opt.state.values() for k, v in st.items() if isinstance(v, torch.Tensor)]
    anon = [p.data.clone() for p in params]
    anon_states = [v.clone() for _, _, v in states]

    def timed(use_anon: bool) -> float:
        for (p, data), a in zip(saved, anon):
            p.data = a if use_anon else data
        for (st, k, v), a in zip(states, anon_states):
            st[k] = a if use_anon else v
        t0 = time.process_time()
        opt.step()
        return time.process_time() - t0

    pcts = []
    for r in range(rounds):
        order = (True, False) if r % 2 else (False, True)
        t = {kind: timed(kind) for kind in order}
        pcts.append(100.0 * (t[False] / t[True] - 1.0))
    for p, data in saved:
        p.data = data
    for st, k, v in states:
        st[k] = v
    quart = statistics.quantiles(pcts, n=4)
    return round(statistics.median(pcts), 2), [round(quart[0], 2), round(quart[2], 2)]


def summarize(sz: dict) -> dict:
    """One size's medians; overhead is the median of per-round (full / run step time - 1)."""
    med = statistics.median
    run, full = sz["run_step_s"], sz["full_step_s"]
    k = max(sz["k"]) if sz["k"] else sz["k_max"]
    return {
        "params": sz["params"],
        "width": sz["width"],
        "step_ms": round(med(run) * 1e3, 3),
        "step_ms_with_snapshots": round(med(full) * 1e3, 3),
        "copy_ms": round(med(sz["copy_s"]) * 1e3, 3) if sz["copy_s"] else None,  # its cost (CPU time), K's input
        "copy_wall_ms": round(med(sz["copy_wall_s"]) * 1e3, 3) if sz["copy_wall_s"] else None,
        "stall_ms_per_segment": round(med(sz["stall_s"]) * 1e3, 3) if sz["stall_s"] else None,
        # wall time per step: full vs run, per round (what the issue defines; on a shared machine other
        # processes' load swings each round by tens of percent), and the quietest segment of each kind
        "wall_overhead_pct": round(med(100.0 * (f / r - 1.0) for f, r in zip(full, run)), 2),
        "wall_overhead_pct_quietest": round(100.0 * (min(full) / min(run) - 1.0), 2),
        "run_step_ms_rounds": [round(x * 1e3, 2) for x in run],
        "full_step_ms_rounds": [round(x * 1e3, 2) for x in full],
        "wall_overhead_pct_rounds": [round(100.0 * (f / r - 1.0), 2) for f, r in zip(full, run)],
        # rank 0's CPU time per step, its snapshot thread included: what the copy takes from the machine,
        # much less sensitive to other processes than wall time
        "overhead_pct": round(med(100.0 * (f / r - 1.0) for f, r in zip(sz["full_cpu_s"], sz["run_cpu_s"])), 2),
        "overhead_pct_rounds_cpu": [round(100.0 * (f / r - 1.0), 2) for f, r in zip(sz["full_cpu_s"], sz["run_cpu_s"])],
        "snapshot_bytes": sz["snapshot_bytes"],
        "bytes_per_step": round(sz["snapshot_bytes"] / k) if sz["snapshot_bytes"] else None,
        "k": k,
        "resident": sz["resident"],
        "resident_bytes": sz["resident_bytes"],
        "resident_copied_bytes": sz["resident_copied_bytes"],
        "resident_exact": sz["resident_exact"],
        "resident_vs_anonymous_pct": sz["resident_vs_anonymous_pct"],
        "resident_vs_anonymous_pct_iqr": sz.get("resident_vs_anonymous_pct_iqr"),
        "steps_lost_bound": 1 if sz["resident"] else k,
        "k_rounds": sz["k"],
        "steps_per_segment": sz["steps_per_segment"],
        "rounds": sz["rounds"],
        "snapshot_exact": sz["snapshot_exact"],
        "buddy_transfer_ms": round(sz["buddy_transfer_s"] * 1e3, 3),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="2 short rounds (smoke test)")
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--sizes", default="1e6,1e7,1e8", help="approximate parameter counts of the sweep")
    p.add_argument("--sweep-rounds", type=int, default=16)
    p.add_argument("--segment-s", type=float, default=3.0, help="seconds per sweep segment (whole K-cycles)")
    p.add_argument("--size-budget-s", type=float, default=150.0, help="seconds of measured rounds per size")
    p.add_argument("--resident", choices=("auto", "1", "0"), default=None,
                   help="DDPJOB_SNAPSHOT_RESIDENT for `full` (default auto; --quick: 1, so that its small sizes, where "
                        "the trial turns it off, still check the resident state)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--workdir", default="", help=argparse.SUPPRESS)
    results.add_record_arg(p)
    opts = p.parse_args()
    rounds, steps = (3, 30) if opts.quick else (opts.rounds, opts.steps)
    sizes = [1e5, 1e6] if opts.quick else [float(x) for x in opts.sizes.split(",")]
    sweep_rounds, segment_s = (2, 0.5) if opts.quick else (opts.sweep_rounds, opts.segment_s)
    if opts.worker:
        worker(rounds, steps, opts.workdir, sizes, sweep_rounds, segment_s, opts.size_budget_s)
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
                "DDPJOB_SNAPSHOT_RESIDENT": opts.resident or ("1" if opts.quick else "auto"),
            }
        )
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
            __file__, "--worker", "--workdir", tmp, "--rounds", str(rounds), "--steps", str(steps),
            "--sizes", ",".join(str(x) for x in sizes), "--sweep-rounds", str(sweep_rounds),
            "--segment-s", str(segment_s), "--size-budget-s", str(opts.size_budget_s),
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
    ratios = sorted(f / b for f, b in zip(rates["full"], rates["bare"]))
    ratio = statistics.median(ratios)
    quart = statistics.quantiles(ratios, n=4) if len(ratios) >= 2 else [ratios[0]] * 3
    snap_pct = statistics.median(100.0 * (r / f - 1.0) for r, f in zip(rates["run"], rates["full"]))
    cpu_med = {k: statistics.median(v) for k, v in cpu.items()}
    result = {
        "bare_samples_per_s": round(med["bare"], 1),
        "run_samples_per_s": round(med["run"], 1),
        "full_samples_per_s": round(med["full"], 1),
        "ratio": round(ratio, 4),
        "ratio_p25": round(quart[0], 4),
        "ratio_p75": round(quart[2], 4),
        "ratio_min": round(ratios[0], 4),
        "ratio_max": round(ratios[-1], 4),
        "ratio_spread": round(quart[2] - quart[0], 4),
        "digits_snapshot_every": raw["digits_k"],
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
    }
    sweep = [summarize(sz) for sz in raw["sweep"]]
    result["sweep"] = sweep
    # overhead: rank 0's CPU time per step (the rank whose pod writes the snapshot; its writer thread
    # included), full vs run, median of paired rounds. Wall time alongside: on this shared 2-core machine
    # its per-round ratios swing by tens of percent with other processes' load.
    result["overhead_pct_by_params"] = {str(sz["params"]): sz["overhead_pct"] for sz in sweep}
    result["wall_overhead_pct_by_params"] = {str(sz["params"]): sz["wall_overhead_pct"] for sz in sweep}
    result["steps_lost_bound_by_params"] = {str(sz["params"]): sz["steps_lost_bound"] for sz in sweep}
    result["snapshot_every_by_params"] = {str(sz["params"]): sz["k"] for sz in sweep}
    result["resident_exact_by_params"] = {str(sz["params"]): sz["resident_exact"] for sz in sweep}
    result["snapshot_exact_by_params"] = {str(sz["params"]): sz["snapshot_exact"] for sz in sweep}
    result["snapshot_budget_pct"] = float(os.environ.get("DDPJOB_SNAPSHOT_BUDGET_PCT") or 2.0)
    result["wall_s"] = round(time.time() - t0, 1)
    results.emit("trainer_overhead", result, mode="quick" if opts.quick else "full", record=opts.record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
