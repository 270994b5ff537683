"""Silent stalls of plain torchrun scripts on real pods (docs/diagnostics.md): three users' scripts, side by side.

Each is the usual shape (argparse, `init_process_group("gloo")`, a small model in DDP, no ddp_trainer), run by stock
`torchrun`, and carries one common mistake. The pods' diagnostics sidecars (py-spy on the workers) tell the operator
what each rank is doing; nothing is reported by the scripts themselves.

- `twice`: the global rank taken from LOCAL_RANK (a one-machine habit): on two nodes both workers claim rank 0 and
  rank 1 never joins. Past processGroupTimeoutSeconds the job is Stalled (reason ProcessGroupNeverFormed, a Warning
  Event naming the missing and the duplicate rank, the stuck frame in status.diagnosis), its pods are restarted
  once, and the same diagnosis again fails the job as the user's code.
- `waits`: rank 1 waits before init for a file nobody writes: "global rank 1 of 2 never joined", its frame the
  user's `wait_for_data`; failed the same way after the second diagnosis.
- `blocks`: a slow but healthy start (a sleep before init, a long first step: neither may trigger anything; the
  deadline counts from the first rank waiting in init_process_group, not from the pods running), then after some
  steps rank 1 blocks in its own code while rank 0 waits in the all-reduce.
  The hang rule for scripts that report no progress (stacks and CPU time standing still for hangTimeoutSeconds)
  replaces rank 1's pod (attempt reason Hang, its frame `stuck_on_io` in status.diagnosis), and the script resumes
  from its own checkpoint and succeeds.
No 30-minute collective timeout is waited for anywhere: the figures printed are the seconds from the first rank
calling init_process_group (each script prints a line before it, read with its runtime timestamp) to the Stalled
condition, and from every pod running to the failure.
"""

from __future__ import annotations

import copy
import shutil
import time

from tests.e2e import harness as h

# Six pods import torch at once on two cores beside another tier's tests (make test): a worker may still be importing
# 15 s after its pod runs, which is not the mistake under test.
PG_TIMEOUT = 30
HANG_TIMEOUT = 15
# A diagnosis is acted on within a poll (2 s here) and a probe deadline of the deadline; pods of three jobs start
# side by side on two cores.
ACT_WITHIN = 20
FAIL_TIMEOUT = 300
SUCCEED_TIMEOUT = 300
BLOCK_AT_STEP = 12
STEPS = 30

COMMON = '''\
import argparse, os, sys, time
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

CKPT = "/checkpoints/plain.pt"


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=%(steps)d)
    return p.parse_args()


def train(args, on_step=None):
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    start = 0
    if os.path.exists(CKPT):
        state = torch.load(CKPT)
        model.load_state_dict(state["model"]); opt.load_state_dict(state["opt"]); start = state["step"]
    print(f"rank {dist.get_rank()}: starting at step {start}", flush=True)
    for step in range(start, args.steps):
        x = torch.randn(512, 64)
        for _ in range(20):  # a little real work per step: a healthy script's CPU time grows
            torch.mm(torch.randn(256, 256), torch.randn(256, 256))
        loss = model(x).pow(2).mean()
        opt.zero_grad(); loss.backward(); opt.step()
        if on_step is not None:
            on_step(step, start)
        if dist.get_rank() == 0 and os.path.isdir(os.path.dirname(CKPT)) and (step + 1) %% 4 == 0:
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step + 1}, CKPT + ".tmp")
            os.replace(CKPT + ".tmp", CKPT)
        print(f"rank {dist.get_rank()} step {step + 1} loss {loss.item():.4f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
''' % {"steps": STEPS}

SCRIPTS = {
    "twice": COMMON + '''

def main():
    args = parse()
    rank = int(os.environ["LOCAL_RANK"])  # the local rank taken for the global one: 0 on every node
    print(f"rank {rank}: init_process_group", flush=True)
    dist.init_process_group("gloo", rank=rank, world_size=int(os.environ["WORLD_SIZE"]))
    train(args)


main()
''',
    "waits": COMMON + '''

def wait_for_data(path):
    while not os.path.exists(path):
        time.sleep(0.5)


def main():
    args = parse()
    if int(os.environ["RANK"]) == 1:
        wait_for_data("/data/ready")  # written by a preparation job that never ran
    print(f"rank {os.environ['RANK']}: init_process_group", flush=True)
    dist.init_process_group("gloo")
    train(args)


main()
''',
    "blocks": COMMON + '''

def stuck_on_io(step):
    print(f"rank 1: reading shard {step} from a mount that stopped answering", flush=True)
    while True:
        time.sleep(3600)


def on_step(step, start):
    if step == 0:
        time.sleep(5)  # a long first step (compilation, a cold cache): not a hang
    if step == %(block)d and start == 0 and dist.get_rank() == 1:
        stuck_on_io(step)


def main():
    args = parse()
    time.sleep(10)  # slow data loading before init: never a stall
    print(f"rank {os.environ['RANK']}: init_process_group", flush=True)
    dist.init_process_group("gloo")
    train(args, on_step)


main()
''' % {"block": BLOCK_AT_STEP},
}


def _plain_job(name: str, host_dir: str | None = None) -> dict:
    job = h.digits_job(name, nodes=2, spec={
        "failurePolicy": {"processGroupTimeoutSeconds": PG_TIMEOUT, "hangTimeoutSeconds": HANG_TIMEOUT},
        "torchrun": {"maxRestarts": 3}})
    if host_dir is not None:
        job = h.with_disk_checkpoint(job, host_dir)
    pod = job["spec"]["template"]["spec"]
    trainer = next(c for c in pod["containers"] if c["name"] == "trainer")
    trainer["command"] = ["torchrun", "/script/train.py"]  # stock torchrun, the user's script
    trainer["volumeMounts"] = copy.deepcopy(trainer.get("volumeMounts") or []) + \
        [{"name": "script", "mountPath": "/script"}]
    pod["volumes"] = (pod.get("volumes") or []) + [{"name": "script", "configMap": {"name": f"{name}-script"}}]
    return job


def _condition(st: dict, kind: str) -> dict | None:
    return next((c for c in st.get("conditions") or [] if c.get("type") == kind), None)


def _first_init_at(kubectl, ns: str, jobs: tuple[str, ...]) -> dict[str, float]:
    """When each job's first rank called init_process_group: the runtime's stamp of the line the script prints before
    it (read while the pods still stand, before the deadline)."""
    seen: dict[str, float] = {}

    def look():
        for name in jobs:
            if name in seen:
                continue
            stamps = [t for p in h.trainer_pods(kubectl, ns, name)
                      for t, line in h.pod_log_lines(kubectl, ns, p["metadata"]["name"])
                      if line.endswith(": init_process_group")]
            if stamps:
                seen[name] = min(stamps)
        return seen if len(seen) == len(jobs) else None
    return h.wait_for(look, 180, f"{jobs}: a rank calling init_process_group", interval=1.0)


def _all_running_at(kubectl, ns: str, name: str) -> float:
    pods = h.wait_for(lambda: (lambda ps: ps if len(ps) == 2 and all(h.running(p) for p in ps) else None)(
        h.trainer_pods(kubectl, ns, name)), 180, f"{name}: both pods running")
    starts = [h.parse_rfc3339(s.get("state", {}).get("running", {}).get("startedAt"))
              for p in pods for s in p["status"].get("containerStatuses") or [] if s["name"] == "trainer"]
    return max(t for t in starts if t is not None)


def test_plain_scripts_that_never_form_the_group_or_block_a_rank_are_diagnosed(kubectl, ns, cluster):
    host_dir = f"{h.SHARED_HOST_DIR}/{ns}-blocks"
    for name, script in SCRIPTS.items():
        kubectl.apply({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": f"{name}-script"},
                       "data": {"train.py": script}}, ns)
    h.apply(kubectl, ns, [_plain_job("twice"), _plain_job("waits"), _plain_job("blocks", host_dir)])
    try:
        running = {name: _all_running_at(kubectl, ns, name) for name in ("twice", "waits")}
        init_at = _first_init_at(kubectl, ns, ("twice", "waits"))

        # Never formed: Stalled with the ranks named, within the deadline; restarted once; failed the second time.
        for name, expect in (("twice", ("global rank 1 of 2 never joined", "rank 0 claimed twice")),
                             ("waits", ("global rank 1 of 2 never joined", "wait_for_data"))):
            st = h.wait_for(lambda: (lambda s: s if (_condition(s, "Stalled") or {}).get("status") == "True"
                                     or s.get("phase") == "Failed" else None)(h.status(kubectl, ns, name)),
                            PG_TIMEOUT + ACT_WITHIN + 60, f"{name}: Stalled")
            stalled = _condition(st, "Stalled")
            took = h.parse_rfc3339(stalled["lastTransitionTime"]) - init_at[name]
            assert stalled["reason"] == "ProcessGroupNeverFormed", stalled
            assert all(e in stalled["message"] for e in expect), stalled["message"]
            # never before the deadline, and within a poll and a probe of it
            assert PG_TIMEOUT - 2 <= took <= PG_TIMEOUT + ACT_WITHIN, \
                f"{name}: Stalled {took:.1f} s after its first rank called init_process_group"
            # the ranks that joined stand in torch's init_process_group (gloo's mesh, or the store before it)
            ranks = (st.get("diagnosis") or {}).get("ranks") or []
            joined = [r for r in ranks if r.get("phase") == "init"]
            assert joined and all("torch/distributed/" in (r.get("frame") or "") for r in joined), ranks
            h.wait_job_event(kubectl, ns, name,
                             lambda e: (e.get("type"), e.get("reason")) == ("Warning", "ProcessGroupNeverFormed")
                             and expect[0] in e.get("message", ""),
                             f"Warning ProcessGroupNeverFormed naming {expect[0]!r}")
            print(f"{name}: Stalled {took:.1f} s after its first rank called init_process_group "
                  f"({init_at[name] - running[name]:.1f} s after every pod ran): {stalled['message']}")

        for name in ("twice", "waits"):
            st = h.wait_phase(kubectl, ns, name, "Failed", FAIL_TIMEOUT)
            assert st.get("reason") == "ProcessGroupNeverFormed", st
            attempts = [a for a in st.get("attempts") or [] if a.get("reason") == "ProcessGroupNeverFormed"]
            assert len(attempts) >= 1, st.get("attempts")
            failed = _condition(st, "Failed")
            took = h.parse_rfc3339(failed["lastTransitionTime"]) - running[name]
            assert took < 4 * (PG_TIMEOUT + ACT_WITHIN) + 60, f"{name}: failed {took:.1f} s after it first ran"
            print(f"{name}: Failed {took:.1f} s after every pod first ran: {st.get('message')}")

        # A slow start and a long first step trigger nothing; rank 1 blocked in its own code is replaced.
        st = h.wait_phase(kubectl, ns, "blocks", "Succeeded", SUCCEED_TIMEOUT)
        hang = [a for a in st.get("attempts") or [] if a.get("reason") == "Hang"]
        assert not [a for a in st.get("attempts") or [] if a.get("reason") == "ProcessGroupNeverFormed"], st
        # global ranks are the rendezvous' to give: the pod replaced is the one whose worker was rank 1
        ranks = (st.get("diagnosis") or {}).get("ranks") or []
        stuck = [r for r in ranks if r.get("rank") == 1]
        assert stuck and "stuck_on_io" in f"{stuck[0].get('frame')} {stuck[0].get('userFrame')}", st.get("diagnosis")
        assert len(hang) == 1 and hang[0]["pod"] == stuck[0]["pod"], (st.get("attempts"), ranks)
        waiting = [r for r in ranks if r.get("rank") == 0]
        assert waiting and waiting[0].get("phase") == "collective", st.get("diagnosis")
        # the stall began when rank 0 finished the step after which rank 1 blocked (its next backward waits)
        survivor = next(pod for pod in ("blocks-0", "blocks-1") if pod != hang[0]["pod"])
        lines = h.pod_log_lines(kubectl, ns, survivor)
        blocked_at = next((t for t, line in lines if f"rank 0 step {BLOCK_AT_STEP + 1} " in line), None)
        assert blocked_at is not None, lines[-40:]
        detected = h.parse_rfc3339(hang[0]["time"]) - blocked_at
        assert detected <= HANG_TIMEOUT + ACT_WITHIN, f"the hang was acted on {detected:.1f} s after it began"
        # in time order across both pods: either pod's worker may be rank 0 in either incarnation
        stamped = sorted(line for pod in ("blocks-0", "blocks-1") for line in h.pod_log_lines(kubectl, ns, pod))
        logs = "\n".join(line for _, line in stamped)
        resumed = [int(line.rsplit(" ", 1)[1]) for line in logs.splitlines() if "rank 0: starting at step" in line]
        assert resumed and resumed[-1] >= BLOCK_AT_STEP - 4 and resumed[-1] > 0, logs[-3000:]
        assert f"rank 0 step {STEPS} " in logs, logs[-2000:]
        print(f"blocks: replaced rank 1's pod {hang[0]['pod']} {detected:.1f} s after it blocked, resumed from step "
              f"{resumed[-1]}: {st['diagnosis']['message']}")
    finally:
        shutil.rmtree(host_dir, ignore_errors=True)
