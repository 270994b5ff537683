"""An upgrade while a job trains: the previous release installed from the registry, upgraded to this one with
`helm upgrade`, and the job sees nothing but a newer operator.

The previous release is PREVIOUS (the commit of the first release, 0.1.0), rebuilt by `hack/release.py --ref` into
the local registry (its operator image only: the job runs this tree's trainer image, and rebuilding an earlier
trainer image costs GBs of disk); this one is the working tree's, as test_release.py makes it. The release installs with the CRD
(crds.enabled, --take-ownership: the cluster's CRD may belong to another release, e.g. the shared one, which takes it
back the same way), watching one namespace of its own (ddp-rel-*: no other operator handles it). The test shows:
- the CRD is the new one after the upgrade (a field that only this release's schema has), and the job's status
  gains the field only this release writes (status.operatorVersion), without a restart of any pod;
- no pod is recreated by the new operator (every UID of before the upgrade is still there);
- a pod created after the upgrade carries this release's pod-template hash (`ddp.dev/template-hash`): the store pod,
  lost after the upgrade, comes back on this release's store image with another hash than the one it had, while the
  trainers keep theirs: mixed shapes in one job are visible (`kubectl get pods -L ddp.dev/template-hash`);
- the trainers survive the lost store with <= 1 step lost and the job Succeeds;
- the job's NetworkPolicy, edited by hand after the upgrade, is put back.
It runs in stage 3a with the chart tests: it replaces the cluster-wide CRD, which nothing else may see meanwhile.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import time

import pytest
import yaml

from ddp_operator import __version__, names
from tests.chart.conftest import CHART, REPO, TEST_TAG, _timed
from tests.e2e import harness
from tests.support.kube import create_test_namespace, dump_namespace, foreign_operators_paused_in
from tests.support.suite import RELEASE_NS_PREFIX
from tests.support.waiting import wait_for

pytestmark = pytest.mark.cluster

# The first release, 0.1.0 (CHANGELOG.md): its chart carries the CRD, its pods a template hash; its operator writes
# no status.operatorVersion and its store pod runs the trainer's image.
PREVIOUS = "9c125d5a635455fa1674d30a58aec31b978c6782"
JOB = "upgraded"
HASH = names.LABEL_TEMPLATE_HASH


def _release(version: str, registry: str, ref: str) -> dict:
    p = subprocess.run([str(REPO / ".venv" / "bin" / "python"), "hack/release.py", version, "--registry", registry,
                        "--ref", ref, "--images", "operator"], cwd=REPO, capture_output=True, text=True, timeout=1800,
                       env={**os.environ, "PYTHONPATH": str(REPO)})
    assert p.returncode == 0, f"the release of {ref} failed:\n{p.stderr[-4000:]}"
    return json.loads(p.stdout.strip().splitlines()[-1])


def _pods(kubectl, ns: str) -> dict[str, dict]:
    return {p["metadata"]["name"]: p for p in
            kubectl.json("get", "pods", "-n", ns, "-l", f"{names.LABEL_JOB_NAME}={JOB}")["items"]
            if not p["metadata"].get("deletionTimestamp")}


def _uids(pods: dict[str, dict]) -> dict[str, str]:
    return {n: p["metadata"]["uid"] for n, p in pods.items()}


def test_helm_upgrade_under_a_training_job(released, kubectl, helm):
    record, registry = released
    times: dict[str, float] = {}
    previous = _timed(times, "previous release", _release,
                      f"{yaml.safe_load((CHART / 'Chart.yaml').read_text())['version']}{TEST_TAG}prev.{int(time.time())}",
                      registry, PREVIOUS)
    ns = create_test_namespace(kubectl, f"{RELEASE_NS_PREFIX}up-{secrets.token_hex(3)}")
    release = f"up-{secrets.token_hex(3)}"
    scoped = ["--plain-http", "-n", ns, "--set", f"watch.namespaces={{{ns}}}", "--set", "rbac.scope=namespace",
              "--set", "crds.enabled=true", "--take-ownership", "--wait", "--timeout", "180s"]
    try:
        with foreign_operators_paused_in(kubectl, ns):
            _timed(times, "helm install previous", helm, "install", release, previous["chart"]["ref"], "--version",
                   previous["version"], *scoped)
            job = harness.digits_job(JOB, nodes=2, step_delay=0.3, epochs=4)
            harness.apply(kubectl, ns, job)
            harness.wait_rank0_step(kubectl, ns, JOB, 10, 240)
            before = _pods(kubectl, ns)
            assert "operatorVersion" not in harness.status(kubectl, ns, JOB), "the previous release wrote it?"
            store = f"{JOB}-{names.RDZV_POD_SUFFIX}"
            old_store_hash = before[store]["metadata"]["labels"].get(HASH)

            _timed(times, "helm upgrade", helm, "upgrade", release, record["chart"]["ref"], "--version",
                   record["version"], *scoped)
            # The new CRD: its schema has spec.rendezvous.image, the previous one had not.
            schema = kubectl.json("get", "crd", names.CRD_NAME)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
            assert "image" in schema["properties"]["spec"]["properties"]["rendezvous"]["properties"], \
                "helm upgrade left the previous CRD"
            # The new operator's first pass writes the field only it knows, and recreates nothing.
            wait_for(lambda: harness.status(kubectl, ns, JOB).get("operatorVersion") == __version__, 60,
                     "status.operatorVersion from the upgraded operator")
            after = _pods(kubectl, ns)
            assert _uids(after) == _uids(before), f"pods recreated by the upgrade: {_uids(before)} -> {_uids(after)}"

            # The job's NetworkPolicy, emptied by hand, is put back by the upgraded operator.
            policy = kubectl.json("get", "networkpolicy", "-n", ns, "-l", f"{names.LABEL_JOB_NAME}={JOB}")["items"][0]
            kubectl("patch", "networkpolicy", policy["metadata"]["name"], "-n", ns, "--type=merge",
                    "-p", json.dumps({"spec": {"ingress": []}}))
            wait_for(lambda: kubectl.json("get", "networkpolicy", policy["metadata"]["name"], "-n", ns)["spec"].get(
                "ingress") == policy["spec"]["ingress"], 60, "the NetworkPolicy put back")

            # The store pod lost after the upgrade: its replacement is this release's shape, the trainers keep theirs.
            logged = harness.job_events(kubectl, ns, JOB)  # the trainers restart in place: their logs, kept
            killed_at = harness.kill_pod(kubectl, ns, store)
            rec = harness.recovery_after(kubectl, ns, JOB, killed_at, timeout=180, previous=True, before=logged)
            assert rec.steps_lost is not None and rec.steps_lost <= 1, rec
            now = _pods(kubectl, ns)
            table = kubectl("get", "pods", "-n", ns, "-L", HASH).stdout
            print(table)
            assert now[store]["metadata"]["uid"] != before[store]["metadata"]["uid"]
            assert now[store]["metadata"]["labels"].get(HASH) not in (None, old_store_hash), table
            assert now[store]["spec"]["containers"][0]["image"].startswith(f"{registry}/ddp-store"), \
                now[store]["spec"]["containers"][0]["image"]
            for name, pod in now.items():
                if name != store:
                    assert pod["metadata"]["uid"] == before[name]["metadata"]["uid"], f"{name} was recreated"
                    assert pod["metadata"]["labels"].get(HASH) == before[name]["metadata"]["labels"].get(HASH)

            st = harness.wait_phase(kubectl, ns, JOB, "Succeeded", 300)
            assert st["restarts"] == 0 and st.get("infraRestarts") == 1, st
            print(f"upgrade {previous['version']} -> {record['version']} under a training job: {json.dumps(times)}; "
                  f"the lost store's recovery {rec}")
    except AssertionError:
        print(dump_namespace(kubectl, ns))
        raise
    finally:
        helm("uninstall", release, "-n", ns, "--wait", "--timeout", "120s", check=False)
        kubectl("delete", "namespace", ns, "--wait=false", "--ignore-not-found", check=False)
        subprocess.run(["rm", "-rf", str(REPO / "dist" / previous["version"])], check=False)
