"""The cluster benchmarks run in quick mode against the cluster under test; their outcomes are judged (a
kill not survived or more than one step lost fails; a goal in a benchmark's `goals_missed` fails: the benchmark
exits 1 then, and the list must be there and empty), their times never (`make bench-*` runs them in full
and records them)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e import harness

HERE = Path(__file__).resolve().parent

pytestmark = [pytest.mark.slow, pytest.mark.cluster]


@pytest.fixture(scope="module")
def bench_env(cluster):
    """The environment of every benchmark program: the cluster under test and, in helm mode, the session's operator
    (tests/conftest.py `shared_operator`, which each would otherwise install and remove itself)."""
    env = {**os.environ, "KUBECONFIG": cluster.kubeconfig}
    if harness.operator_mode() == "helm":
        env["DDPJOB_OPERATOR"] = "installed"
    return env


@pytest.fixture(scope="module", autouse=True)
def _operator_running(request):
    if harness.operator_mode() == "helm":
        request.getfixturevalue("shared_operator")


def _run(env: dict, script: str, *args: str, timeout: float = 900) -> dict:
    proc = subprocess.run([sys.executable, str(HERE / script), "--quick", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_e2e_recovery_quick(bench_env):
    r = _run(bench_env, "e2e_recovery.py")  # exits non-zero (failing _run) when a kill was not survived
    assert {"kills", "survived", "recovery_s_p50", "rank0_recovery_s_p50", "steps_lost_max"} <= set(r), r
    assert r["kills"] == 3, r  # one non-rank-0, one rank-0, one member of a job with a hot spare
    assert r["spares_used"] == 1, r  # the spare took the killed member's place
    assert r["all_survived"] is True and r["survived"] == r["kills"], r
    assert all(d.get("source") == "peer" for d in r["detail"]), r
    # rank 0 survives a worker kill, so that one is always measured; every measured loss is at most 1 step
    assert r["worker_steps_lost_max"] is not None and 0 <= r["worker_steps_lost_max"] <= 1, r
    assert r["steps_lost_max"] is not None and r["steps_lost_max"] <= 1, r
    # every phase of the breakdown was seen by the component that owns it (a replacement pod on every kill)
    assert r["phases"] and all(v is not None for v in r["phases"].values()), r["phases"]


def test_startup_quick(bench_env):
    """Every child made exactly once by the operator, none restarted, and the first step reached in every round
    (startup.goals_missed)."""
    r = _run(bench_env, "startup.py")
    assert {"apply_to_running_s", "apply_to_first_step_s", "baseline_first_step_s", "delta_s"} <= set(r), r
    assert r["goals_missed"] == [], r["goals_missed"]
    assert len(r["rounds"]) == 1 and len(r["children_expected"]) == r["nodes"] + 2, r  # Service, store, N pods
    assert r["apply_to_first_step_s"] > 0 and r["baseline_first_step_s"] > 0


def test_kueue_queue_quick(bench_env, request):
    """Against the session's Kueue and operator with its Kueue integration on (tests/conftest.py `kueue_operator`)."""
    if harness.operator_mode() == "helm":
        request.getfixturevalue("kueue_operator")
    r = _run(bench_env, "kueue_queue.py")
    assert {"queued_first_step_s", "baseline_first_step_s", "admission_delay_s", "handoff_s"} <= set(r), r
    # the queued job seen waiting with no pod, then run to its first step (kueue_queue.goals_missed)
    assert r["goals_missed"] == [], r["goals_missed"]
    assert r["rounds"][0]["waiting_looks"] >= 1 and r["rounds"][0]["waiting_pods_max"] == 0, r["rounds"]
    assert r["queued_first_step_s"] > 0 and r["baseline_first_step_s"] > 0 and r["handoff_s"] > 0, r


def test_api_writes_quick(bench_env, cluster):
    if not cluster.embedded and not os.environ.get("DDPJOB_AUDIT_LOG"):
        pytest.skip("needs the API server's audit log (the embedded cluster keeps one)")
    extra = ["--audit-log", os.environ["DDPJOB_AUDIT_LOG"]] if os.environ.get("DDPJOB_AUDIT_LOG") else []
    r = _run(bench_env, "api_writes.py", *extra)
    assert {"nodes", "creates", "status_writes", "steady_state_writes_per_min", "progress_writes_per_min",
            "at_progress_period"} <= set(r), r
    assert r["creates"] >= r["nodes"]  # the filter found the operator's writes
    assert set(r["at_progress_period"]) == {str(r["default_progress_period_s"]), "5"}, r
    # creates <= N + 3, no write while healthy, at most one progress write per period, at both periods
    assert r["goals_missed"] == [], r["goals_missed"]


def test_scale_quick(bench_env):
    """Every child of every job made exactly once and the operator's RSS measured and within 200 MiB
    (scale.goals_missed); the time is not judged."""
    r = _run(bench_env, "scale.py")
    assert {"jobs", "all_children_created_s", "operator_rss_mib"} <= set(r), r
    assert r["jobs"] == 20
    assert r["goals_missed"] == [], r["goals_missed"]
    assert r["children_found"]["pods"] == 40 and r["children_found"]["services"] == 20, r


def test_faults_quick(bench_env, cluster):
    """agent_kill and worker_kill, one fresh job each: every one survived with at most one step lost, resumed from a
    snapshot, not from step 0, and status.lastRecovery.fault named it (TrainerRestarted, WorkerRestart); faults.py
    --quick, the times are not judged. The store loss is tests/e2e/test_e2e_store_loss.py's, with more checks."""
    if not cluster.embedded:
        pytest.skip("agent_kill and worker_kill signal container processes from the host (embedded cluster)")
    faults = ["agent_kill", "worker_kill"]
    proc = subprocess.run([sys.executable, str(HERE / "faults.py"), "--quick", "--faults", ",".join(faults)],
                          capture_output=True, text=True, timeout=900, env=bench_env)
    lines = proc.stdout.strip().splitlines()
    assert lines, proc.stderr[-6000:]
    r = json.loads(lines[-1])
    assert r["faults"] == faults, r
    bad = {f: {**r[f], **{k: r["detail"][f].get(k) for k in ("error", "violations", "restores")}}
           for f in r["faults"]
           if not (r[f]["survived"] and r[f]["steps_lost"] is not None and r[f]["steps_lost"] <= 1
                   and r[f]["resumed_from"] not in ("start", None))}
    assert not bad, f"faults not survived as required: {json.dumps(bad, indent=1)}\n{proc.stderr[-4000:]}"
    assert r["all_survived"] is True and proc.returncode == 0, r


def test_faults_of_the_control_plane_and_the_node(bench_env, cluster):
    """operator_kill, apiserver_restart and node_notready, one fresh job each: every job Succeeded and every check
    of the fault held -- at most one live pod per index and no failure counted twice while the operator was
    replaced, the operator not restarted by an API server restart, the NotReady node's pods treated as lost
    (faults.py --quick; the times are not judged). On this one-node cluster node_notready loses every pod, so
    its steps lost are not held against it (docs/recovery.md)."""
    if not cluster.embedded:
        pytest.skip("apiserver_restart and node_notready restart components of the embedded cluster")
    faults = ["operator_kill", "apiserver_restart", "node_notready"]
    proc = subprocess.run([sys.executable, str(HERE / "faults.py"), "--quick", "--faults", ",".join(faults)],
                          capture_output=True, text=True, timeout=1200, env=bench_env)
    lines = proc.stdout.strip().splitlines()
    assert lines, proc.stderr[-6000:]
    r = json.loads(lines[-1])
    assert r["faults"] == faults, r
    detail = r["detail"]
    bad = {f: {**r[f], **{k: detail[f].get(k) for k in ("error", "violations", "why_not_survived")}}
           for f in faults if not r[f]["survived"]}
    assert not bad, f"faults not survived as required: {json.dumps(bad, indent=1)}\n{proc.stderr[-4000:]}"
    assert r["operator_kill"]["steps_lost"] is not None and r["operator_kill"]["steps_lost"] <= 1, r
    assert r["operator_kill"]["resumed_from"] == "peer", r
    assert detail["apiserver_restart"]["operator_after"] == detail["apiserver_restart"]["operator_before"], detail
    assert any(a["reason"] == "NodeLost" for a in detail["node_notready"]["attempts"]), detail["node_notready"]
    assert r["all_survived"] is True and proc.returncode == 0, r
