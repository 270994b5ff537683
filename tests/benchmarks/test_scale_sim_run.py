"""The kwok simulation of the control plane (tests/benchmarks/scale_sim.py) in quick mode: one DDPJob of 100 fake
nodes and five of its pods deleted one after the other, against the embedded cluster, with an operator of its own
(namespaces ddp-sim-*, which the e2e tier's shared operator leaves alone, so this runs beside it). Its outcomes are
judged (every pod created once, creates <= N + 3 and status writes <= 6, every deleted pod replaced, every fake pod
IP on loopback, the operator's RSS within its goal), its times never (`make bench-scale-sim` records them)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hack import kwok

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]

pytestmark = [pytest.mark.slow, pytest.mark.cluster]


def test_scale_sim_quick(cluster):
    if not cluster.embedded:
        pytest.skip("the kwok simulation runs against the embedded cluster only (hack/kwok.py)")
    if not kwok.binary().exists():  # cached by version: built once per machine
        subprocess.run([str(REPO / "hack" / "build-binaries.sh"), "kwok"], check=True, timeout=1200)
    proc = subprocess.run([sys.executable, str(HERE / "scale_sim.py"), "--quick"], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "KUBECONFIG": cluster.kubeconfig}, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["goals_missed"] == [], r["goals_missed"]
    for key in ("pods_per_s_by_nodes", "creates_per_job_by_nodes", "status_writes_per_job_by_nodes",
                "created_s_by_nodes", "operator_cpu_s_by_nodes"):
        assert set(r[key]) == {"100"} and r[key]["100"] is not None, (key, r[key])
    assert 0 < r["creates_per_job_by_nodes"]["100"] <= 103, r["creates_per_job_by_nodes"]
    assert r["deletions"]["deleted"] == r["deletions"]["replaced"] == 5, r["deletions"]
    assert r["replacement_p99_s"] is not None and r["non_loopback_ips"] == []
    assert r["operator_rss_mib_max"] is not None and r["operator_rss_mib_max"] <= 400
