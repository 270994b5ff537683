"""A pass that creates or deletes many pods sends them side by side (issue 28: a 1,000-node job's pods created in
<= 10 s; 50 lost nodes' pods replaced in <= nodeLostTimeoutSeconds + 10 s): one write at a time cost a round trip per
pod, so N pods took N round trips in one pass."""

from __future__ import annotations

import time

from ddp_builders import job_body
from fake_api import fake_reconciler

from ddp_operator import reconciler as recmod


def test_a_pass_creates_a_large_jobs_pods_side_by_side():
    r = fake_reconciler(job_body(nodes=64, progressPeriodSeconds=0))
    real = r.api.create

    def slow(body):
        time.sleep(0.02)  # one round trip to the API server
        return real(body)
    r.api.create = slow
    started = time.monotonic()
    r.reconcile("ml", "mnist")
    took = time.monotonic() - started
    pods = sorted(name for kind, name in r.api.creates if kind == "Pod")
    assert pods == sorted([f"mnist-{i}" for i in range(64)] + ["mnist-rdzv"])
    assert took < 66 * 0.02 / 3, f"{took:.2f} s for 65 pod creates of 20 ms: one at a time"
    assert recmod.POD_WRITERS >= 4


def test_a_refused_create_among_many_is_still_retried_alone():
    from kubernetes.client.exceptions import ApiException
    r = fake_reconciler(job_body(nodes=16, progressPeriodSeconds=0))
    real = r.api.create

    def refuse_one(body):
        if body["metadata"]["name"] == "mnist-7":
            raise ApiException(status=422, reason="Unprocessable Entity")
        return real(body)
    r.api.create = refuse_one
    r.reconcile("ml", "mnist")
    pods = {name for kind, name in r.api.creates if kind == "Pod"}
    assert "mnist-7" not in pods and len(pods) == 16  # 15 trainers and the store
    assert r.backoff.backing_off(("ml", "mnist"), "mnist-7")


def test_a_pass_deletes_many_pods_side_by_side():
    from fake_api import running_job
    r = fake_reconciler()
    key, body, _ = running_job(r, "big", nodes=64, progressPeriodSeconds=0)

    def slow(namespace, name, uid, force=False, grace_seconds=None):
        time.sleep(0.02)  # one round trip to the API server
        r.api.deleted.append(name)
    r.api.delete_pod = slow
    body["spec"]["runPolicy"] = {"suspend": True}  # every pod of the job goes
    started = time.monotonic()
    r.reconcile(*key)
    took = time.monotonic() - started
    assert sorted(r.api.deleted) == sorted([f"big-{i}" for i in range(64)] + ["big-rdzv"])
    assert took < 65 * 0.02 / 3, f"{took:.2f} s for 65 pod deletes of 20 ms: one at a time"
