"""`kubectl ddp` as a person uses it (docs/cli.md): through kubectl's plugin lookup (`kubectl ddp`, kubectl-ddp on
PATH), in a real terminal (tmux) for the live views, against real jobs on the cluster.

- A user's script (tests/e2e/cli_scripts/train_regression.py) run with `kubectl ddp run` on 2 nodes, with a pod
  killed midway: the terminal shows the progress line (with the ETA the script's total allows) and the recovery,
  `run` exits 0; `logs -f`, started before the kill, has both ranks' lines in time order and goes on with the
  replacement pod; `plot -o` writes a PNG whose data are exactly the losses rank 0 logged; `describe` and `top`
  (live, in the terminal, and as JSON) show the job, its attempt and its recovery.
- A script that fails (a missing config file): `run` streams the traceback and exits 1, and `describe` shows why.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.e2e import harness as h
from tests.support.waiting import WaitTimeout, wait_for

SCRIPTS = Path(__file__).parent / "cli_scripts"
VENV_BIN = Path(sys.executable).parent


def _env(kubectl) -> dict[str, str]:
    kubectl_dir = str(Path(kubectl.binary).parent)
    return {**os.environ, "KUBECONFIG": kubectl.kubeconfig, "PATH": f"{VENV_BIN}:{kubectl_dir}:{os.environ['PATH']}",
            "COLUMNS": "160"}


def ddp(kubectl, *args: str, timeout: float = 120, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """`kubectl ddp ...` the way a user types it: kubectl finds kubectl-ddp on PATH."""
    return subprocess.run([kubectl.binary, "ddp", *args], env=_env(kubectl), cwd=cwd, capture_output=True, text=True,
                          timeout=timeout)


class Terminal:
    """A tmux session of its own (own server socket), 160x45, running one command."""

    def __init__(self, kubectl, name: str, command: str, cwd: Path):
        self.tmux = shutil.which("tmux")
        assert self.tmux, "tmux is missing: hack/install-deps.sh installs it"
        self.socket = f"ddp-cli-{os.getpid()}-{name}"
        env = _env(kubectl)
        exports = " ".join(f"{k}={env[k]}" for k in ("KUBECONFIG", "PATH"))
        self._tmux("new-session", "-d", "-s", name, "-x", "160", "-y", "45", "-c", str(cwd),
                   f"export {exports}; {command}; echo EXIT=$?; sleep 3600")
        self.name = name

    def _tmux(self, *args: str) -> str:
        return subprocess.run([self.tmux, "-L", self.socket, *args], capture_output=True, text=True, check=True,
                              timeout=30).stdout

    def screen(self, history: bool = False) -> str:
        return self._tmux("capture-pane", "-p", "-t", self.name, *(["-S", "-5000"] if history else []))

    def keys(self, *keys: str) -> None:
        self._tmux("send-keys", "-t", self.name, *keys)

    def wait_for(self, pattern: str, timeout: float, history: bool = False) -> re.Match:
        found: list[re.Match] = []

        def check():
            m = re.search(pattern, self.screen(history), re.MULTILINE)
            if m:
                found.append(m)
            return m is not None
        try:
            wait_for(check, timeout, f"/{pattern}/ on the terminal")
        except WaitTimeout as e:
            raise AssertionError(f"{e}; the terminal shows:\n{self.screen(True)[-4000:]}") from None
        return found[0]

    def close(self) -> None:
        subprocess.run([self.tmux, "-L", self.socket, "kill-server"], capture_output=True, timeout=30)


def _rank0_losses(text: str) -> dict[int, float]:
    """step -> loss from rank 0's step lines (the last one of a step wins: steps redone after a resume)."""
    out = {}
    for m in re.finditer(r"rank=0 event=step step=(\d+) .*?loss=([-\d.e+]+)", text):
        out[int(m.group(1))] = float(m.group(2))
    return out


def test_run_follows_a_script_through_a_killed_pod_and_every_view_shows_it(kubectl, ns, tmp_path):
    shutil.copy(SCRIPTS / "train_regression.py", tmp_path / "train_regression.py")
    term = Terminal(kubectl, "run", f"kubectl ddp run train_regression.py --nodes 2 --name cli -n {ns} "
                                    f"--progress-period 1 -- --epochs 5 --step-delay 0.25", tmp_path)
    follower = None
    try:
        term.wait_for(r"ddpjob\.ddp\.dev/cli created", 60)
        wait_for(lambda: len([p for p in h.trainer_pods(kubectl, ns, "cli") if h.running(p)]) == 2, 120,
                 "both trainer pods running")
        log_file = tmp_path / "logs.txt"
        follower = subprocess.Popen([kubectl.binary, "ddp", "logs", "cli", "-f", "-n", ns], env=_env(kubectl),
                                    stdout=log_file.open("w"), stderr=subprocess.STDOUT)
        # 2 nodes x 20 batches of 32 per epoch, 5 epochs: the script's total is 100 steps.
        line = term.wait_for(r"Running · nodes 2/2 · step (\d+)/100 · epoch \d+ · loss [\d.]+ · [\d,]+ samples/s · "
                             r"ETA \d+", 150).group(0)
        h.wait_rank0_step(kubectl, ns, "cli", 25, timeout=90)
        progress = h.status(kubectl, ns, "cli")["progress"]
        step_at_kill, rank0_pod = int(progress["step"]), progress["pod"]
        assert rank0_pod in ("cli-0", "cli-1"), progress  # the pod that answered as global rank 0
        other = "cli-1" if rank0_pod == "cli-0" else "cli-0"
        h.kill_pod(kubectl, ns, other)
        term.wait_for(r"^EXIT=\d+", 240, history=True)
        screen = term.screen(history=True)
        assert "EXIT=0" in screen, screen[-3000:]
        assert re.search(r"^! recovered from \w+, resumed from (peer|local)", screen, re.MULTILINE), screen[-3000:]
        assert re.search(rf"^\[\d {rank0_pod}\] .*rank=0 event=step step=\d+ .*loss=", screen, re.MULTILINE), \
            "global rank 0's log is the one streamed"
        assert "> Succeeded" in screen, screen[-2000:]

        follower.wait(timeout=90)  # it ends by itself once every pod has ended
        lines = log_file.read_text().splitlines()
        idx = other[-1]
        note = next(i for i, ln in enumerate(lines) if re.match(rf"--- \[{idx} {other}\] replaces {other}", ln))
        before = [ln for ln in lines[:note] if ln.startswith(f"[{idx} {other}]")]
        after = [ln for ln in lines[note:] if ln.startswith(f"[{idx} {other}]")]
        assert before and after, "the killed pod's log goes on with its replacement:\n" + "\n".join(lines[-40:])
        steps0 = [int(m.group(1)) for ln in lines if ln.startswith(f"[{rank0_pod[-1]} {rank0_pod}]")
                  for m in [re.search(r"rank=0 event=step step=(\d+)", ln)] if m]
        # Both ranks' lines, in time order: global rank 0's steps climb from the first to the last.
        assert steps0 and steps0[0] <= step_at_kill and steps0[-1] == 100 and max(steps0) == 100, steps0[:5]

        png = tmp_path / "loss.png"
        p = ddp(kubectl, "plot", "cli", "-n", ns, "-o", str(png))
        assert p.returncode == 0, p.stderr
        from kubectl_ddp.plot import read_png_series
        plotted = read_png_series(png)["loss"]
        logged = _rank0_losses(h.pod_logs(kubectl, ns, rank0_pod))
        assert len(plotted) >= 10 and plotted[-1][0] == 100, plotted
        for step, loss in plotted:
            assert loss == pytest.approx(logged[step], rel=1e-5), (step, loss, logged.get(step))

        text = ddp(kubectl, "describe", "cli", "-n", ns).stdout
        assert re.search(r"^Phase: +Succeeded", text, re.MULTILINE), text
        assert re.search(rf"rank {other[-1]} +{other} on \S+: Infrastructure PodDeleted", text), text
        assert "Last recovery: recovered from" in text, text

        # What the recovery cost, in status.goodput: the share of the wall time that made progress, one recovery.
        st = h.status(kubectl, ns, "cli")
        g = st["goodput"]
        assert 0 < g["ratio"] < 1 and g["recoveries"] == 1, g
        fault = st["lastRecovery"]["fault"]
        assert g["byFault"][fault]["recoveries"] == 1 and g["seconds"]["recovering"] > 0, g
        assert g["wallSeconds"] == pytest.approx(sum(g["seconds"].values()), abs=1.0), g
        wide = kubectl("get", "ddpj", "cli", "-n", ns, "-o", "wide").stdout
        assert re.search(r"\bGOODPUT\b", wide) and str(g["ratio"]) in wide, wide

        rows = json.loads(ddp(kubectl, "top", "cli", "-n", ns, "-o", "json").stdout)
        assert rows["job"][1:3] == ["cli", "Succeeded"] and rows["lastRecovery"].startswith("recovered from")
        top = Terminal(kubectl, "top", f"kubectl ddp top -n {ns} --interval 1", tmp_path)
        try:
            top.wait_for(r"NAME +PHASE +NODES +STEP +LOSS +SAMPLES/S +GOODPUT +RESTARTS +AGE", 30)
            top.wait_for(r"^cli +Succeeded +\S+ +100 ", 30)
            top.keys("C-c")
            top.wait_for(r"^EXIT=0", 30)
        finally:
            top.close()
    finally:
        if follower is not None and follower.poll() is None:
            follower.kill()
        term.close()


def test_run_of_a_failing_script_exits_non_zero_and_says_why(kubectl, ns, tmp_path):
    shutil.copy(SCRIPTS / "fail_config.py", tmp_path / "fail_config.py")
    p = ddp(kubectl, "run", "fail_config.py", "--nodes", "1", "--name", "broken", "-n", ns, "--backoff-limit", "0",
            "--max-restarts", "0", cwd=tmp_path, timeout=240)
    assert p.returncode == 1, p.stdout[-3000:] + p.stderr
    assert "FileNotFoundError" in p.stdout, "rank 0's traceback is streamed"
    assert re.search(r"^broken failed: BackoffLimitExceeded", p.stdout, re.MULTILINE), p.stdout[-2000:]
    failure = h.status(kubectl, ns, "broken")["lastFailure"]
    assert (failure["class"], failure["reason"], failure["rank"], failure["budget"]) == (
        "UserCode", "FileNotFoundError", 0, "backoffLimit"), failure
    assert failure["message"].endswith("No such file or directory: 'config.json'"), failure
    text = ddp(kubectl, "describe", "broken", "-n", ns).stdout
    assert re.search(r"^Phase: +Failed", text, re.MULTILINE), text
    assert "broken-0" in text and "exit 1" in text, text
    assert re.search(r"^Last failure: +UserCode FileNotFoundError, rank 0, pod broken-0", text, re.MULTILINE), text


def test_an_oom_kill_is_the_infrastructures_and_never_spends_the_users_budget(kubectl, ns, tmp_path):
    """backoffLimit 0: one failure of the user's code would fail the job; an OOM kill spends infraBackoffLimit."""
    shutil.copy(SCRIPTS / "oom.py", tmp_path / "oom.py")
    term = Terminal(kubectl, "hog", f"kubectl ddp run oom.py --nodes 1 --name hog -n {ns} --backoff-limit 0 "
                                    f"--max-restarts 0 --memory 256Mi --memory-limit 700Mi", tmp_path)
    try:
        def failed_once():
            st = h.status(kubectl, ns, "hog")
            return st if (st.get("lastFailure") or {}).get("class") else None
        st = wait_for(failed_once, 180, "hog's first failure on record")
        # Ctrl-C detaches: the job keeps running, and the terminal says how to come back or delete it.
        term.keys("C-c")
        term.wait_for(r"^EXIT=130", 30, history=True)
        said = " ".join(term.screen(history=True).split())  # the terminal wraps long lines at spaces
        assert "detached from hog; it keeps running." in said and f"kubectl delete ddpj hog -n {ns}" in said, said
    finally:
        term.close()
    failure = st["lastFailure"]
    assert (failure["class"], failure["budget"]) == ("Infrastructure", "infraBackoffLimit"), failure
    assert failure["reason"] in ("OOMKilled", "Killed"), failure
    assert st.get("restarts", 0) == 0 and st["infraRestarts"] >= 1 and st["phase"] != "Failed", st
    text = ddp(kubectl, "describe", "hog", "-n", ns).stdout
    assert re.search(r"^Budgets: +0/0 backoffLimit .*, [1-9]\d*/50 infraBackoffLimit", text, re.MULTILINE), text
