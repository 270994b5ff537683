"""`kubectl ddp` as a person uses it (docs/cli.md): through kubectl's plugin lookup (`kubectl ddp`, kubectl-ddp on
PATH), in a real terminal (tmux) for the live views, against real jobs on the cluster.

- A user's script (tests/e2e/cli_scripts/train_regression.py) run with `kubectl ddp run` on 2 nodes, with a pod
  killed midway: the terminal shows the progress line (with the ETA the script's total allows) and the recovery,
  `run` exits 0; `logs -f`, started before the kill, has both ranks' lines in time order and goes on with the
  replacement pod; `logs --rank 1` is rank 1's log alone; `plot -o` writes a PNG whose data are exactly the losses
  rank 0 logged, and `plot` without -o draws the same points on the terminal; `describe` and `top` (live, in the
  terminal, and as JSON) show the job, its pods, its attempt and its recovery.
- A script that fails (a missing config file): `run` streams the traceback and exits 1, and `describe` shows why.
- A script that the OOM killer ends, restarted in place: `logs --previous` is the killed container's log.

With DDPJOB_TEST_ARTIFACTS naming a directory, what the user saw is copied there as evidence: the live `run` view
when its progress line is asserted (run-view.txt), `top` of the job and of the namespace (top.txt, top-jobs.txt), the
terminal chart (plot.txt) and the PNG (loss.png).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from decimal import Decimal
from pathlib import Path

import pytest

from ddp_operator import names
from tests.e2e import harness as h
from tests.support.waiting import WaitTimeout, wait_for

SCRIPTS = Path(__file__).parent / "cli_scripts"
VENV_BIN = Path(sys.executable).parent
ARTIFACTS = "DDPJOB_TEST_ARTIFACTS"


def keep(name: str, what: str | Path) -> None:
    """With DDPJOB_TEST_ARTIFACTS set: a copy of what the user saw (a captured pane, a PNG) in that directory."""
    folder = os.environ.get(ARTIFACTS)
    if not folder:
        return
    Path(folder).mkdir(parents=True, exist_ok=True)
    if isinstance(what, Path):
        shutil.copyfile(what, Path(folder) / name)
    else:
        (Path(folder) / name).write_text(what)


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
        bottoms: list[str] = []  # the last line of each screen that differed from the one before (the live line)

        def check():
            screen = self.screen(history)
            m = re.search(pattern, screen, re.MULTILINE)
            if m:
                found.append(m)
            bottom = next((ln for ln in reversed(screen.splitlines()) if ln.strip()), "")
            if not bottoms or bottoms[-1] != bottom:
                bottoms.append(bottom)
            return m is not None
        try:
            wait_for(check, timeout, f"/{pattern}/ on the terminal")
        except WaitTimeout as e:
            seen = "\n".join(bottoms[-30:])
            raise AssertionError(f"{e}; its last line was, in turn:\n{seen}\nthe terminal shows:\n"
                                 f"{self.screen(True)[-4000:]}") from None
        return found[0]

    def wait_all(self, patterns: list[str], timeout: float) -> str:
        """The first screen on which every pattern matches: a live view redraws, so one capture shows them all."""
        shown = [""]

        def check():
            shown[0] = self.screen()
            return all(re.search(p, shown[0], re.MULTILINE) for p in patterns)
        try:
            wait_for(check, timeout, f"{len(patterns)} patterns on one screen")
        except WaitTimeout as e:
            missing = [p for p in patterns if not re.search(p, shown[0], re.MULTILINE)]
            raise AssertionError(f"{e}; missing {missing}; the terminal shows:\n{shown[0]}") from None
        return shown[0]

    def close(self) -> None:
        subprocess.run([self.tmux, "-L", self.socket, "kill-server"], capture_output=True, timeout=30)


class StatusTimeline:
    """What the job's status said, sampled twice a second while a wait runs: (wall time, phase, nodesReady, step,
    the report's time) each time one of them changed. A failed wait for the terminal shows it beside the screen: the
    operator's writes and the client's view told apart."""

    def __init__(self, kubectl, namespace: str, name: str):
        self.rows: list[tuple] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, args=(kubectl, namespace, name), daemon=True)
        self._thread.start()

    def _sample(self, kubectl, namespace: str, name: str) -> None:
        while not self._stop.wait(0.5):
            try:
                st = h.status(kubectl, namespace, name)
            except Exception:  # noqa: BLE001 - a sample missed is a gap in the timeline, nothing more
                continue
            p = st.get("progress") or {}
            row = (st.get("phase"), st.get("nodesReady"), p.get("step"), p.get("time"))
            if not self.rows or self.rows[-1][1:] != row:
                self.rows.append((time.strftime("%H:%M:%S"), *row))

    def stop(self) -> str:
        self._stop.set()
        self._thread.join(10)
        return "\n".join(" ".join(map(str, r)) for r in self.rows)


def _lines(text: str) -> list[str]:
    """A log's lines as written (a last line without its newline is one; a carriage return ends none)."""
    lines = text.split("\n")
    return [ln.removesuffix("\r") for ln in (lines[:-1] if lines[-1] == "" else lines)]


def _pod_row(pod: dict) -> str:
    """The row `top JOB` shows for a pod, as the pod has it: name, rank (node index), node, the trainer's state."""
    trainer = next(c for c in pod["status"]["containerStatuses"] if c["name"] == names.TRAINER_CONTAINER)
    kind, detail = next(iter(trainer["state"].items()))
    state = "Running" if kind == "running" else detail.get("reason") or kind.capitalize()
    return (rf"^{pod['metadata']['name']} +{pod['metadata']['labels'][names.LABEL_NODE_INDEX]} +"
            rf"{re.escape(pod['spec']['nodeName'])} +{re.escape(state)} +\d+ +\S+")


def _chart_axes(chart: str) -> tuple[list[str], list[int]]:
    """The y axis' labels (top first) and the x axis' step ticks of a plotext chart."""
    ys = re.findall(r"^ *([-+]?\d[\d.]*(?:e[-+]?\d+)?) *┤", chart, re.MULTILINE)
    lines = chart.splitlines()
    below = next(i for i, ln in enumerate(lines) if ln.lstrip().startswith("└"))
    return ys, [int(t) for t in lines[below + 1].split()]


def _label_shows(label: str, value: float) -> bool:
    """An axis label is the value rounded to the label's last digit."""
    return abs(float(label) - value) <= 10.0 ** Decimal(label).as_tuple().exponent


def _trainer_restarts(kubectl, namespace: str, pod: str) -> int:
    p = kubectl.json("get", "pod", pod, "-n", namespace)
    return next((c.get("restartCount", 0) for c in p["status"].get("containerStatuses") or []
                 if c["name"] == names.TRAINER_CONTAINER), 0)


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
        timeline = StatusTimeline(kubectl, ns, "cli")
        try:
            # an 80-column console leaves samples/s out of the live line (view.progress_line)
            progress_line = term.wait_for(r"Running · nodes 2/2 · step (\d+)/100 · epoch \d+ · loss [\d.]+ · "
                                          r"([\d,]+ samples/s · )?ETA \d+", 150)
        except AssertionError as e:
            raise AssertionError(f"{e}\nthe job's status meanwhile (phase, nodesReady, step, report time):\n"
                                 f"{timeline.stop()}") from None
        timeline.stop()
        keep("run-view.txt", progress_line.string)  # the pane as it was when the progress line matched
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

        # --rank 1: the pod of node index 1 alone (after the kill: the one running now), all of its log, every line
        # under its own prefix.
        p = ddp(kubectl, "logs", "cli", "--rank", "1", "-n", ns)
        assert p.returncode == 0, p.stderr
        shown = _lines(p.stdout)
        assert shown and all(ln.startswith("[1 cli-1] ") for ln in shown), shown[:10]
        assert [ln.removeprefix("[1 cli-1] ") for ln in shown] == _lines(h.pod_logs(kubectl, ns, "cli-1")), \
            shown[-10:]

        png = tmp_path / "loss.png"
        p = ddp(kubectl, "plot", "cli", "-n", ns, "-o", str(png))
        assert p.returncode == 0, p.stderr
        from kubectl_ddp.plot import read_png_series
        plotted = read_png_series(png)["loss"]
        logged = _rank0_losses(h.pod_logs(kubectl, ns, rank0_pod))
        assert len(plotted) >= 10 and plotted[-1][0] == 100, plotted
        for step, loss in plotted:
            assert loss == pytest.approx(logged[step], rel=1e-5), (step, loss, logged.get(step))
        keep("loss.png", png)

        # Without -o, the same points as a chart on the terminal: its title and x axis span the run's steps, its y
        # axis the losses' range, and the lines under it give the first and last loss.
        p = ddp(kubectl, "plot", "cli", "-n", ns)
        assert p.returncode == 0, p.stderr
        chart = p.stdout
        keep("plot.txt", chart)
        (first, first_loss), (last, last_loss) = plotted[0], plotted[-1]
        assert f"loss vs step ({len(plotted)} points, steps {first}–{last})" in chart, chart
        y_labels, x_ticks = _chart_axes(chart)
        losses = [loss for _, loss in plotted]
        assert _label_shows(y_labels[0], max(losses)) and _label_shows(y_labels[-1], min(losses)), (y_labels, chart)
        assert x_ticks == sorted(x_ticks) and first <= x_ticks[0] and x_ticks[-1] == 100, (x_ticks, chart)
        assert f"loss: first {first_loss:.4g} (step {first}), last {last_loss:.4g} (step {last})" in chart, chart

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
        # `top cli`, live: a row per pod as the pods themselves say (name, rank, node, the trainer's state), the
        # attempts timeline with a line per status.attempts entry (the kill among them), and the last recovery.
        pods = h.trainer_pods(kubectl, ns, "cli")
        assert [p["metadata"]["name"] for p in pods] == ["cli-0", "cli-1"], pods
        attempts = st.get("attempts") or []
        assert attempts, st
        top = Terminal(kubectl, "top-job", f"kubectl ddp top cli -n {ns} --interval 1", tmp_path)
        try:
            screen = top.wait_all(
                [rf"^{ns}/cli +Succeeded\b", r"^POD +RANK +NODE +STATE +RESTARTS +AGE",
                 *map(_pod_row, pods), r"^Attempts \(oldest first\)",
                 *(rf"^ *\S+ ago +rank {a.get('index', '-')} +{re.escape(str(a.get('pod', '-')))} on "
                   rf"{re.escape(a.get('node') or '-')}: " for a in attempts),
                 rf"ago +rank {other[-1]} +{other} on \S+: Infrastructure PodDeleted",
                 r"^Last recovery: recovered from \w+"], 30)
            keep("top.txt", screen)
            top.keys("C-c")
            top.wait_for(r"^EXIT=0", 30)
        finally:
            top.close()
        top = Terminal(kubectl, "top", f"kubectl ddp top -n {ns} --interval 1", tmp_path)
        try:
            top.wait_for(r"NAME +PHASE +NODES +STEP +LOSS +SAMPLES/S +GOODPUT +RESTARTS +AGE", 30)
            keep("top-jobs.txt", top.wait_for(r"^cli +Succeeded +\S+ +100 ", 30).string)
            top.keys("C-c")
            top.wait_for(r"^EXIT=0", 30)
        finally:
            top.close()
    finally:
        if follower is not None and follower.poll() is None:
            follower.kill()
        term.close()


def test_run_of_a_failing_script_exits_non_zero_and_says_why(kubectl, ns, tmp_path):
    """Two nodes of plain torchrun, backoffLimit 1: the first failure closes the rendezvous (torchrun's agent gives
    up, --max-restarts 0) and the restarted agents meet it closed; the operator makes the store anew (not counted),
    the script runs and fails again, and the second failure of the user's code ends the job. Without the store's
    renewal the job crash-looped on the closed rendezvous, each restart an infrastructure NetworkError."""
    shutil.copy(SCRIPTS / "fail_config.py", tmp_path / "fail_config.py")
    p = ddp(kubectl, "run", "fail_config.py", "--nodes", "2", "--name", "broken", "-n", ns, "--backoff-limit", "1",
            "--max-restarts", "0", cwd=tmp_path, timeout=360)
    assert p.returncode == 1, p.stdout[-3000:] + p.stderr
    assert "FileNotFoundError" in p.stdout, "rank 0's traceback is streamed"
    assert re.search(r"^broken failed: BackoffLimitExceeded", p.stdout, re.MULTILINE), p.stdout[-2000:]
    status = h.status(kubectl, ns, "broken")
    failure = status["lastFailure"]
    assert (failure["class"], failure["reason"], failure["budget"]) == (
        "UserCode", "FileNotFoundError", "backoffLimit"), failure
    assert failure["rank"] in (0, 1) and failure["message"].endswith("No such file or directory: 'config.json'"), \
        failure
    reasons = [a.get("cause") or a["reason"] for a in status["attempts"]]
    assert "NetworkError" not in reasons and status.get("infraRestarts", 0) == 0, status["attempts"]
    assert names.REASON_RDZV_RESET in reasons, f"the store was never made anew: {status['attempts']}"
    text = ddp(kubectl, "describe", "broken", "-n", ns).stdout
    assert re.search(r"^Phase: +Failed", text, re.MULTILINE), text
    assert "exit 1" in text and names.REASON_RDZV_RESET in text, text
    assert re.search(r"^Last failure: +UserCode FileNotFoundError, rank [01], pod broken-[01]", text, re.MULTILINE), \
        text


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

    # The kubelet restarted the killed trainer in place (restartPolicy OnFailure): `logs --previous` is that
    # container's log, line for line what `kubectl logs --previous` gives, under the pod's prefix. Read again when
    # a further restart came between the two reads (the previous container is then another).
    seen: dict = {}

    def previous_alike() -> bool:
        if _trainer_restarts(kubectl, ns, "hog-0") < 1:
            return False
        p = ddp(kubectl, "logs", "hog", "--previous", "-n", ns)
        seen.update(rc=p.returncode, ours=_lines(p.stdout), err=p.stderr,
                    theirs=_lines(h.pod_logs(kubectl, ns, "hog-0", previous=True)))
        return (p.returncode == 0 and all(ln.startswith("[0 hog-0] ") for ln in seen["ours"])
                and [ln.removeprefix("[0 hog-0] ") for ln in seen["ours"]] == seen["theirs"])
    try:
        wait_for(previous_alike, 60, "logs --previous of hog-0 as kubectl logs --previous has it")
    except WaitTimeout as e:
        raise AssertionError(f"{e}: {seen}") from None
    text = ddp(kubectl, "describe", "hog", "-n", ns).stdout
    assert re.search(r"^Budgets: +0/0 backoffLimit .*, [1-9]\d*/50 infraBackoffLimit", text, re.MULTILINE), text
