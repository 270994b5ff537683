"""The diagnostics sidecar's server (operator/ddp_operator/sidecar/diagnose.py) against real torchrun workers on
loopback (issue 36): plain DDP scripts, each with one common mistake, read by the real py-spy and answered over HTTP
as the operator would ask (docs/diagnostics.md, "The sidecar").

(a) every worker passes its LOCAL rank where the global one belongs: both claim rank 0 and wait in init;
(b) rank 1 waits for data before init_process_group: rank 0 waits in init, rank 1 runs in wait_for_data;
(c) after a few healthy steps rank 1 blocks in its data loading while rank 0 waits in backward's all-reduce: their
    stacks and CPU time stand still between two samples;
(d) `?log=<reason>` prints every worker's full stacks to the server's stdout;
(e) as (b) under ddp_trainer.launch, whose workers are forked (their /proc environ is the agent's): found, with their
    ranks read from their stacks.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest
from ddp_operator import stall
from ddp_trainer.testing import free_port
from ddp_trainer.testing_processes import descendants
from tests.support.waiting import wait_for

REPO = Path(__file__).resolve().parents[2]
SERVER = REPO / "operator" / "ddp_operator" / "sidecar" / "diagnose.py"
PY_SPY = Path(sys.executable).with_name("py-spy")
TIMEOUT_S = 30

HEAD = '''\
import argparse
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
'''

WRONG_RANK = HEAD + '''

def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    # the mistake: the node-local rank (here modulo one process per node) where the global rank belongs
    dist.init_process_group(backend="gloo", rank=int(os.environ["LOCAL_RANK"]) % 1)
    model = DDP(torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(args.steps):
        opt.zero_grad()
        model(torch.randn(8, 4)).sum().backward()
        opt.step()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
'''

NEVER_JOINS = HEAD + '''

def wait_for_data(path):
    while not os.path.exists(path):  # the mistake: a path only rank 0's node has
        time.sleep(0.5)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", default="/nonexistent/ddpjob-data")
    args = parser.parse_args()
    if os.environ["RANK"] == "1":
        wait_for_data(args.data)
    dist.init_process_group(backend="gloo")
    DDP(torch.nn.Linear(4, 1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
'''

HANGS = HEAD + '''

def load_batch(rank, step):
    if rank == 1 and step == 3:
        time.sleep(3600)  # the mistake: a read that never returns, on one rank
    return torch.randn(8, 4)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    dist.init_process_group(backend="gloo")
    rank = dist.get_rank()
    model = DDP(torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(args.steps):
        opt.zero_grad()
        model(load_batch(rank, step)).sum().backward()
        opt.step()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
'''

SLEEP_LINE = next(i for i, line in enumerate(HANGS.splitlines(), 1) if "time.sleep(3600)" in line)


@dataclass
class Run:
    port: int
    server_log: Path
    torchrun_log: Path

    def diagnosis(self, query: str = "") -> dict:
        url = f"http://127.0.0.1:{self.port}/diagnosis{query}"
        with urllib.request.urlopen(url, timeout=10) as resp:
            return json.loads(resp.read())

    def by_env_rank(self, report: dict) -> dict:
        return {w["envRank"]: w for w in report["workers"]}

    def wait(self, check, what: str) -> dict:
        """The first answer for which check(workers by env rank) holds."""
        seen: list[dict] = []

        def probe():
            seen[:] = [self.diagnosis()]
            return seen[0] if check(self.by_env_rank(seen[0])) else None
        try:
            return wait_for(probe, TIMEOUT_S, what, interval=0.5)
        except AssertionError as e:
            raise AssertionError(f"{e}\nlast answer: {seen}\n--- torchrun:\n{self.torchrun_log.read_text()[-3000:]}"
                                 f"\n--- server:\n{self.server_log.read_text()[-3000:]}") from None


@contextlib.contextmanager
def diagnosed(work: Path, script: str, launcher: str = "torch.distributed.run"):
    """torchrun (`python -m launcher`) --standalone --nproc-per-node 2 running `script`, and the server watching its
    workers."""
    work.mkdir(parents=True, exist_ok=True)
    (work / "train.py").write_text(script)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "TORCHELASTIC_", "DDPJOB_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO / "trainer"))
    run = Run(free_port(), work / "server.log", work / "torchrun.log")
    with open(run.torchrun_log, "wb") as tlog, open(run.server_log, "wb") as slog:
        torchrun = subprocess.Popen([sys.executable, "-m", launcher, "--standalone",
                                     "--nproc-per-node", "2", "train.py"], cwd=work, env=env, stdout=tlog,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        server = subprocess.Popen([sys.executable, str(SERVER), "--host", "127.0.0.1", "--port", str(run.port),
                                   "--py-spy", str(PY_SPY), "--root-pid", str(torchrun.pid)],
                                  stdout=slog, stderr=subprocess.STDOUT)
    try:
        yield run
    finally:
        server.kill()
        workers = descendants(torchrun.pid)  # each in a session of its own: the agent's group is not theirs
        with contextlib.suppress(ProcessLookupError):
            os.killpg(torchrun.pid, signal.SIGKILL)
        for pid in workers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        torchrun.wait(10)
        server.wait(10)


def _one_line(report: dict) -> str:
    return json.dumps(report, sort_keys=True)


def test_a_rank_claimed_twice_shows_both_workers_in_init_claiming_rank_0(tmp_path):
    with diagnosed(tmp_path, WRONG_RANK) as run:
        report = run.wait(lambda w: len(w) == 2 and all(x["phase"] == "init" for x in w.values()),
                          "both workers in init")
        print("scenario a:", _one_line(report))
    assert report["version"] == 1 and report["stacks"] == "ok"
    assert stall.valid_diagnosis(report)[1] == (), "every field as the operator reads it"
    workers = run.by_env_rank(report)
    assert sorted(workers) == [0, 1]
    for env_rank, w in workers.items():
        assert (w["rank"], w["worldSize"], w["localRank"]) == (0, 2, env_rank), w  # the claim, not the env
        assert w["frame"].startswith("_new_process_group_helper (torch/distributed/distributed_c10d.py:"), w
        assert w["userFrame"].startswith("main (train.py:"), w
        assert w["cpuSeconds"] > 0 and len(w["digest"]) == 16, w


def test_a_rank_that_never_joins_runs_in_its_own_code_while_the_other_waits_in_init(tmp_path):
    with diagnosed(tmp_path, NEVER_JOINS) as run:
        report = run.wait(lambda w: len(w) == 2 and w[0]["phase"] == "init" and
                          (w[1]["userFrame"] or "").startswith("wait_for_data ("), "rank 0 in init, rank 1 waiting")
        print("scenario b:", _one_line(report))
    workers = run.by_env_rank(report)
    assert report["stacks"] == "ok"
    assert (workers[0]["rank"], workers[0]["worldSize"]) == (0, 2)
    assert workers[0]["frame"].startswith("_new_process_group_helper (torch/distributed/distributed_c10d.py:")
    assert (workers[1]["rank"], workers[1]["worldSize"]) == (1, 2)  # not in init: its environment's
    assert workers[1]["phase"] == "running" and workers[1]["userFrame"].startswith("wait_for_data (train.py:1")


@pytest.fixture(scope="module")
def hung(tmp_path_factory):
    """The HANGS script once rank 1 blocks in load_batch (rank 0 then waits in backward's all-reduce for good)."""
    with diagnosed(tmp_path_factory.mktemp("hung"), HANGS) as run:
        report = run.wait(lambda w: len(w) == 2 and w[1]["frame"] == f"load_batch (train.py:{SLEEP_LINE})" and
                          w[0]["frame"].startswith("_engine_run_backward ("), "rank 1 blocked, rank 0 in backward")
        yield run, report


def test_a_silent_hang_stands_still_rank_0_in_the_collective_rank_1_in_its_loader(hung):
    run, first = hung
    print("scenario c:", _one_line(first))
    wait_for(lambda: time.time() - first["time"] > 1.5, 5, "the sample cache to expire", interval=0.1)
    second = run.diagnosis()
    print("scenario c, again:", _one_line(second))
    assert second["time"] > first["time"], "a fresh sample, not the cached one"
    before, after = run.by_env_rank(first), run.by_env_rank(second)
    assert before[0]["phase"] == "collective", before[0]
    assert before[0]["frame"].startswith("_engine_run_backward (torch/autograd/graph.py:"), before[0]
    assert before[0]["userFrame"].startswith("main (train.py:"), before[0]
    assert before[1]["phase"] == "running", before[1]
    assert before[1]["userFrame"] == f"load_batch (train.py:{SLEEP_LINE})", before[1]
    interval = second["time"] - first["time"]
    for rank in (0, 1):
        assert after[rank]["phase"] == before[rank]["phase"]
        assert after[rank]["digest"] == before[rank]["digest"], (before[rank], after[rank])
        # flat: well under the tenth of a core over the interval that restarts the operator's hang clock
        assert after[rank]["cpuSeconds"] - before[rank]["cpuSeconds"] < 0.1 * interval, (before[rank], after[rank])


def test_log_prints_every_workers_full_stacks_to_the_servers_stdout(hung):
    run, _ = hung
    assert run.diagnosis("?log=x")["stacks"] == "ok"

    def logged() -> str | None:
        text = run.server_log.read_text()
        return text if "=== end of stacks" in text else None
    out = wait_for(logged, 10, "the stacks in the server's log", interval=0.2)
    assert "py-spy 0.4.3" in out.splitlines()[0]  # the start-up line
    log = out[out.index("=== stacks: x"):]
    assert log.count("--- worker pid") == 2
    assert "load_batch (train.py:" in log and "_engine_run_backward (torch/autograd/graph.py:" in log
    # torch's locals are shown, the script's own are not (they may hold its secrets)
    assert "inputs = " in log or "t_outputs = " in log, log
    assert "step = 3" not in log, log


def test_workers_forked_by_ddp_trainer_launch_are_found_with_their_ranks(tmp_path):
    with diagnosed(tmp_path, NEVER_JOINS, launcher="ddp_trainer.launch") as run:
        report = run.wait(lambda w: len(w) == 2 and w[0]["phase"] == "init" and
                          (w[1]["userFrame"] or "").startswith("wait_for_data ("), "rank 0 in init, rank 1 waiting")
        print("scenario e:", _one_line(report))
    workers = run.by_env_rank(report)
    assert [(w["rank"], w["localRank"], w["worldSize"]) for w in workers.values()] == [(0, 0, 2), (1, 1, 2)]
    assert workers[0]["userFrame"].startswith("main (train.py:")
