"""Helpers for the integration tests: the operator subprocess (tests/support/processes.py), pod-status driving,
waiting (tests/support/waiting.py, with this tier's defaults). A plain module with a unique name (not conftest.py)
so tests import it unambiguously."""

from __future__ import annotations

import json
import os
import pathlib
from datetime import datetime, timezone

import yaml

from tests.support import waiting
from tests.support.processes import OperatorProcess
from tests.support.suite import INTEGRATION_NS_PREFIX, REPO

# The suite passes the cluster fixture's kubeconfig; the default is never an arbitrary $KUBECONFIG.
KUBECONFIG = pathlib.Path(os.environ.get("DDPJOB_TEST_KUBECONFIG") or REPO / ".cluster" / "kubeconfig")
CRD = REPO / "manifests" / "base" / "crd.yaml"
NS_PREFIX = INTEGRATION_NS_PREFIX
GROUP, VERSION, PLURAL = "ddp.dev", "v1alpha1", "ddpjobs"
NOWHERE = {"ddp.dev/test-node": "nowhere"}


def _api(kubeconfig=None):
    """An ApiClient of its own (the global kubernetes config stays untouched)."""
    from kubernetes import client, config
    configuration = client.Configuration()
    config.load_kube_config(config_file=str(kubeconfig or KUBECONFIG), client_configuration=configuration)
    return client.ApiClient(configuration)


def wait_for(predicate, timeout=30.0, interval=0.2, what="condition"):
    """tests.support.waiting.wait_for with this tier's defaults (30 s, polled every 0.2 s) and argument order."""
    return waiting.wait_for(predicate, timeout, what, interval)


class Operator(OperatorProcess):
    """`python -m ddp_operator` as a subprocess against the test cluster, watching ddp-it-*."""

    def __init__(self, log_path: pathlib.Path, kubeconfig=None):
        super().__init__(kubeconfig or KUBECONFIG, NS_PREFIX + "*", log_path, ready_timeout=30)

    def metrics(self) -> dict[str, float] | None:
        """Its ddpjob_* series by name and labels; None while it does not answer."""
        text = self.metrics_text()
        if text is None:
            return None
        out = {}
        for line in text.splitlines():
            if line.startswith("ddpjob_") and " " in line:
                key, value = line.rsplit(" ", 1)
                out[key] = float(value)
        return out


class JobNamespace:
    """Small, explicit helpers over the kubernetes client for one test namespace."""

    def __init__(self, api, namespace: str):
        from kubernetes import client
        self.api, self.ns = api, namespace
        self.core = client.CoreV1Api(api)
        self.custom = client.CustomObjectsApi(api)
        self.policy = client.PolicyV1Api(api)

    # --- DDPJobs -----------------------------------------------------------------------------------
    def job_manifest(self, name="job", nodes=2, **spec):
        body = {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": "DDPJob",
            "metadata": {"name": name, "namespace": self.ns},
            "spec": {
                "nodes": nodes,
                "progressPeriodSeconds": 0,
                "template": {"spec": {"nodeSelector": dict(NOWHERE), "containers": [
                    {"name": "trainer", "image": "localhost/ddp-trainer:0.1.0", "command": ["torchrun", "x.py"]}]}},
            },
        }
        body["spec"].update(spec)
        return body

    def create_job(self, name="job", nodes=2, **spec):
        return self.custom.create_namespaced_custom_object(GROUP, VERSION, self.ns, PLURAL,
                                                           self.job_manifest(name, nodes, **spec))

    def job(self, name="job"):
        return self.custom.get_namespaced_custom_object(GROUP, VERSION, self.ns, PLURAL, name)

    def jobs(self):
        return self.custom.list_namespaced_custom_object(GROUP, VERSION, self.ns, PLURAL)["items"]

    def patch_job(self, name, patch):
        return self.custom.patch_namespaced_custom_object(GROUP, VERSION, self.ns, PLURAL, name, patch,
                                                          _content_type="application/merge-patch+json")

    def status(self, name="job"):
        return self.job(name).get("status") or {}

    def wait_phase(self, phase, name="job", timeout=30.0):
        return wait_for(lambda: self.status(name) if self.status(name).get("phase") == phase else None,
                        timeout, what=f"{name} phase {phase}")

    # --- pods --------------------------------------------------------------------------------------
    def pods(self, role=None):
        selector = "ddp.dev/job-name" + (f",ddp.dev/role={role}" if role else "")
        pods = self.core.list_namespaced_pod(self.ns, label_selector=selector).items
        return {p.metadata.name: p for p in pods}

    def wait_pods(self, names, timeout=30.0):
        names = set(names)
        return wait_for(lambda: (lambda ps: ps if set(ps) == names and not any(
            p.metadata.deletion_timestamp for p in ps.values()) else None)(self.pods()), timeout,
            what=f"pods {sorted(names)}")

    def set_phase(self, name, phase, exit_code=None, message=None, reason=None, disruption=None):
        """Play the kubelet: move pod `name` to `phase` with the trainer container's state."""
        pod = self.core.read_namespaced_pod(name, self.ns)
        now = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        container = pod.spec.containers[0]
        if phase == "Running":
            state = {"running": {"startedAt": now}}
        elif phase in ("Succeeded", "Failed"):
            code = exit_code if exit_code is not None else (0 if phase == "Succeeded" else 1)
            state = {"terminated": {"exitCode": code, "reason": reason or ("Completed" if code == 0 else "Error"),
                                    "startedAt": now, "finishedAt": now}}
            if message is not None:
                state["terminated"]["message"] = message
        else:
            state = {"waiting": {"reason": "ContainerCreating"}}
        conditions = [{"type": "Ready", "status": "True" if phase == "Running" else "False",
                       "lastTransitionTime": now}]
        if disruption:
            conditions.append({"type": "DisruptionTarget", "status": "True", "reason": disruption,
                               "lastTransitionTime": now})
        status = {
            "phase": phase,
            "podIP": "10.255.0.9",
            "podIPs": [{"ip": "10.255.0.9"}],
            "startTime": now,
            "conditions": conditions,
            "containerStatuses": [{"name": container.name, "image": container.image, "imageID": "",
                                   "ready": phase == "Running", "restartCount": 0, "started": phase == "Running",
                                   "state": state}],
        }
        return self.core.patch_namespaced_pod_status(name, self.ns, {"status": status},
                                                     _content_type="application/merge-patch+json")

    def restart_in_place(self, name, exit_code=137, restart_count=1, reason="Error"):
        """Play the kubelet restarting pod `name`'s failed trainer container (restartPolicy OnFailure): the pod
        stays Running, the container runs again with restartCount and lastState.terminated set."""
        pod = self.core.read_namespaced_pod(name, self.ns)
        now = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        container = pod.spec.containers[0]
        status = {
            "phase": "Running",
            "podIP": "10.255.0.9",
            "podIPs": [{"ip": "10.255.0.9"}],
            "startTime": now,
            "conditions": [{"type": "Ready", "status": "True", "lastTransitionTime": now}],
            "containerStatuses": [{"name": container.name, "image": container.image, "imageID": "",
                                   "ready": True, "restartCount": restart_count, "started": True,
                                   "state": {"running": {"startedAt": now}},
                                   "lastState": {"terminated": {"exitCode": exit_code, "reason": reason,
                                                                "startedAt": now, "finishedAt": now}}}],
        }
        return self.core.patch_namespaced_pod_status(name, self.ns, {"status": status},
                                                     _content_type="application/merge-patch+json")

    def run_all(self, job="job"):
        for name in self.pods():
            self.set_phase(name, "Running")

    def events(self):
        return [e for e in self.core.list_namespaced_event(self.ns).items
                if e.involved_object.kind == "DDPJob"]

    def wait_events(self, reason, match=lambda e: True, timeout=10.0):
        """The job's Events of `reason` that `match`, once there is one. The operator posts Events after the status
        write they go with, so a test that has just seen the status waits for them."""
        return wait_for(lambda: [e for e in self.events() if e.reason == reason and match(e)], timeout,
                        what=f"a {reason} Event ({[(e.reason, e.message) for e in self.events()]})")

    def dump(self) -> str:
        out = []
        for job in self.jobs():
            out.append(yaml.safe_dump(job, sort_keys=False))
        for p in self.pods().values():
            out.append(f"pod {p.metadata.name} uid={p.metadata.uid} phase={p.status.phase} "
                       f"deleting={p.metadata.deletion_timestamp} labels={p.metadata.labels}")
        for e in self.core.list_namespaced_event(self.ns).items:
            out.append(f"event {e.involved_object.kind}/{e.involved_object.name} {e.type} {e.reason}: {e.message}")
        return "\n".join(out)


def owner_uids(obj) -> list[str]:
    return [o.uid for o in obj.metadata.owner_references or []]


def dumps(obj) -> str:
    return json.dumps(obj, indent=1, default=str)
