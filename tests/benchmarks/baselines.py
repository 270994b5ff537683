#!/usr/bin/env python3
"""bench-baselines: how stock torchrun fares when a node is lost, set up as a skilled user would.

    .venv/bin/python tests/benchmarks/baselines.py [--quick] [--kills 3] [--record]

Every configuration runs the same plain DDP script (tests/benchmarks/trainer_plain_ddp.py: the digits
model, rank 0 saves a checkpoint every --checkpoint-every steps, every rank loads the newest on start;
no ddp_trainer) as two torchrun agents on loopback, each in its own PID namespace where the machine
allows it (ddp_trainer.testing.LocalCluster, as bench-trainer-recovery and tests/trainer do), with
--max-restarts=100 and --monitor-interval=0.2 throughout. A node is SIGKILLed (agent and workers at
once, as a dying pod) at a chosen step and a replacement agent started at once; that is repeated
--kills times per configuration (a new job replaces one that died). The configurations:

- ``stock``: c10d rendezvous hosted by the first agent, default environment;
- ``share_store_off``: the same + TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1;
- ``keep_alive``: the same + keep_alive_interval=1,keep_alive_max_attempt=2;
- ``host_killed``: as keep_alive, but the killed node is the rendezvous host (the agent holding the
  c10d store), replaced by a new host on the same endpoint;
- ``ddpjob_settings``: DDPJob's own torchrun settings (the operator's environment and keep-alives, a
  dedicated store process, is_host=0 on every agent) with the same plain script: what the environment
  alone gives, to compare with ddp_trainer's peer snapshots (bench-trainer-recovery).

For each: kills survived (training resumed within --wait seconds and the job then finished with exit
code 0 on every node), recovery p50 (kill -> first step logged after the resume) and steps lost
(ddp_trainer.testing.steps_lost: highest step any rank completed before the restore minus the
restored step). Each configuration's outcome is judged against what docs/recovery.md documents for it
(goals_missed): a documented survivor survives every kill, losing at most the --checkpoint-every steps since its
last checkpoint; the others (stock, host_killed) survive none. One kill is one sample, judged as it came: no
configuration is measured again after a miss. Prints one JSON object as its last line (`goals_missed` included) and
exits 1 when an outcome differs from the documented one; --record also writes docs/bench/baselines.json, from which
`make bench-report` writes the table in docs/recovery.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
for _p in (ROOT, ROOT / "trainer"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

from ddp_trainer.testing import ClusterTimeout, LocalCluster, recovery_after_kill  # noqa: E402
from tests.benchmarks import results  # noqa: E402

PLAIN_SCRIPT = str(ROOT / "tests" / "benchmarks" / "trainer_plain_ddp.py")
STEPS_PER_EPOCH = 20  # 2 nodes x batch 32 over digits' 1258 training samples
FIRST_KILL = 25  # past the first checkpoints
GAP = 20  # steps trained after a recovery before the next kill
SHARE_OFF = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
KEEP_ALIVE = {"keep_alive_interval": "1", "keep_alive_max_attempt": "2"}


@dataclass(frozen=True)
class Config:
    name: str
    setting: str  # the row label in docs/recovery.md
    documented_to_survive: bool  # docs/recovery.md says it does; the smoke test holds it to that
    fault_tolerant: bool = False  # LocalCluster's: DDPJob's environment, keep-alives and join timeout
    env: dict[str, str] = field(default_factory=dict)
    rdzv_conf: dict[str, str] = field(default_factory=dict)
    store_process: bool = False
    kill_host: bool = False


CONFIGS = [
    Config("stock", "stock torchrun, `--nnodes=2:2`, default environment", False),
    Config("share_store_off", "same + `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`", True, env=SHARE_OFF),
    Config("keep_alive", "same + `keep_alive_interval=1,keep_alive_max_attempt=2`", True, env=SHARE_OFF,
           rdzv_conf=KEEP_ALIVE),
    Config("host_killed", "same, but the rendezvous host (the agent holding the c10d store) killed", False,
           env=SHARE_OFF, rdzv_conf=KEEP_ALIVE, kill_host=True),
    Config("ddpjob_settings", "plain checkpoint script under DDPJob's torchrun settings (dedicated store, "
           "`is_host=0`)", True, fault_tolerant=True, store_process=True),
]


def run_config(cfg: Config, work: Path, kills: int, epochs: int, delay: float, every: int, wait_s: float) -> dict:
    records: list[dict[str, Any]] = []
    attempt = 0
    while len(records) < kills:
        ckpt = work / f"{cfg.name}-{attempt}-ckpt"
        ckpt.mkdir(parents=True)
        args = ["--checkpoint-dir", str(ckpt), "--checkpoint-every", str(every), "--epochs", str(epochs),
                "--step-delay", str(delay)]
        job: list[dict[str, Any]] = []
        with LocalCluster(work / f"{cfg.name}-{attempt}", module=PLAIN_SCRIPT, args=args, env=cfg.env,
                          rdzv_id=f"bl-{cfg.name}-{attempt}", fault_tolerant=cfg.fault_tolerant,
                          rdzv_conf=cfg.rdzv_conf, store_process=cfg.store_process) as c:
            if cfg.store_process:
                c.start_store()
            live = [c.start_node(), c.start_node()]  # the first hosts the store unless a store process runs
            next_kill, since, alive = FIRST_KILL, float("-inf"), True
            while alive and len(records) + len(job) < kills and epochs * STEPS_PER_EPOCH - next_kill > GAP:
                try:
                    c.wait_for_step(next_kill, timeout=600)
                except ClusterTimeout as e:
                    job.append({"recovered": False, "error": f"no step {next_kill}: {str(e)[:200]}"})
                    alive = False
                    break
                victim = live[0] if cfg.kill_host else live[1]
                killed_at = c.kill(victim)
                replacement = c.start_node(f"{victim.name}-r{len(job) + 1}", is_host=cfg.kill_host)
                live[live.index(victim)] = replacement
                try:
                    rec = recovery_after_kill(c, killed_at, timeout=wait_s, since=since)
                except ClusterTimeout:
                    rec = {"recovered": False, "recovery_s": None, "waited_s": wait_s}
                    alive = False
                else:
                    rec = {"recovered": True, **rec}
                    since = rec.pop("restored_at")
                    next_kill = max(rec["resumed_from"], rec["last_step_before_kill"] or 0) + GAP
                job.append(rec)
                print(f"{cfg.name}: kill {len(records) + len(job)}: {rec}", file=sys.stderr, flush=True)
            completed, ending = False, None
            if alive:
                try:
                    rcs = c.wait_exit(live, timeout=600)
                    completed = set(rcs.values()) == {0}
                    ending = rcs
                except ClusterTimeout as e:
                    ending = str(e)[:2000]
                if not completed:
                    print(f"{cfg.name}: the job did not finish cleanly: {ending}\n{c.dump()[-6000:]}",
                          file=sys.stderr, flush=True)
        for rec in job:
            rec["survived"] = bool(rec.get("recovered")) and completed
            rec["exit_codes"] = ending
        records += job
        attempt += 1
    records = records[:kills]
    times = [r["recovery_s"] for r in records if r["survived"]]
    lost = [r.get("steps_lost") for r in records if r["survived"]]
    return {
        "setting": cfg.setting,
        "documented_to_survive": cfg.documented_to_survive,
        "kills": len(records),
        "survived": sum(1 for r in records if r["survived"]),
        "recovery_s_p50": round(statistics.median(times), 3) if times else None,
        "recovery_s": times,
        "steps_lost_max": max((x for x in lost if x is not None), default=None),
        "steps_lost": lost,
        "waited_s": wait_s,
        "detail": [{k: v for k, v in r.items() if k in ("recovered", "survived", "recovery_s", "steps_lost",
                                                      "resumed_from", "source", "waited_s", "error",
                                                      "exit_codes")}
                   for r in records],
    }


def goals_missed(result: dict[str, Any]) -> list[str]:
    """Every configuration's documented outcome: a survivor survived every kill and lost at most the steps since its
    last checkpoint; the others survived none ([]: all held)."""
    every, out = result["checkpoint_every"], []
    for name, c in result["configs"].items():
        out += results.goal(c["kills"] >= 1, f"{name}: kills", c["kills"], ">= 1")
        survived = f"{c['survived']}/{c['kills']}"
        if not c["documented_to_survive"]:
            out += results.goal(c["survived"] == 0, f"{name}: survived", survived,
                                "none (docs/recovery.md: it does not recover)")
            continue
        out += results.goal(c["survived"] == c["kills"], f"{name}: survived", survived,
                            "every kill (docs/recovery.md: it survives)")
        if c["survived"]:
            lost = c["steps_lost_max"]
            out += results.goal(lost is not None and 0 <= lost <= every, f"{name}: steps_lost_max", lost,
                                f"0..{every} (the steps since the last checkpoint)")
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="1 kill per configuration, short jobs (smoke test)")
    p.add_argument("--kills", type=int, default=3, help="kills per configuration (>= 3 for a p50)")
    p.add_argument("--wait", type=float, default=150.0,
                   help="seconds a kill may take to resume before it counts as not survived")
    p.add_argument("--only", default="", help="comma-separated configuration names (default: all)")
    results.add_record_arg(p)
    a = p.parse_args()
    kills = 1 if a.quick else max(a.kills, 1)
    every, delay = 10, 0.04
    epochs = 3 if a.quick else max(4, -(-(FIRST_KILL + kills * (GAP + every) + GAP) // STEPS_PER_EPOCH))
    chosen = [c for c in CONFIGS if not a.only or c.name in a.only.split(",")]
    t0, load0 = time.time(), round(os.getloadavg()[0], 2)
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="bench-baselines-") as tmp:
        for cfg in chosen:
            # A quick run waits the full time only where the docs promise survival (a slow recovery under
            # load must not read as a death); elsewhere it reports what it saw within 30 s.
            wait = a.wait if (not a.quick or cfg.documented_to_survive) else 30.0
            out[cfg.name] = run_config(cfg, Path(tmp), kills, epochs, delay, every, wait)
    result = {
        "configs": out,
        "kills_per_config": kills,
        "checkpoint_every": every,
        "step_delay_s": delay,
        "epochs": epochs,
        "documented_survivors_survived": all(
            v["survived"] == v["kills"] for k, v in out.items() if next(c for c in CONFIGS if c.name == k).documented_to_survive
        ),
        "loadavg_1m": [load0, round(os.getloadavg()[0], 2)],
        "cpus": os.cpu_count(),
        "quick": a.quick,
        "wall_s": round(time.time() - t0, 1),
    }
    return results.emit_judged("baselines", result, goals_missed(result), mode="quick" if a.quick else "full",
                               record=a.record and not a.only)


if __name__ == "__main__":
    sys.exit(main())
