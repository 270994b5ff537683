"""The control plane's own rate for a job's objects: the baseline that scale_sim.py's scenario a is read against.

The same objects the operator makes for a DDPJob of N nodes (its NetworkPolicy, its headless Service, the rdzv pod
and N trainer pods, rendered by the operator's own functions, without the owner reference a job that does not exist
would have collected) are created by a minimal client in the operator's order and with the operator's concurrency
(`writers.POD_WRITERS` creates in flight, each read from the raw response), while no operator runs; "created" is
what it is in scenario a: the watch has seen every pod. What the operator adds (its watches, its passes, its status
writes) is the difference between the two figures, taken in the same run on the same fake nodes.
"""

from __future__ import annotations

import copy
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

from kubernetes import client as kclient

from ddp_operator.netpol import NetworkPolicyConfig, render_network_policy
from ddp_operator.pod import render_trainer_pod
from ddp_operator.pod_hash import with_template_hash
from ddp_operator.rdzv import render_rdzv_pod
from ddp_operator.writers import POD_WRITERS
from ddp_operator.service import render_service
from ddp_operator.spec import parse_job


def job_objects(job_body: dict, namespace: str) -> tuple[list[dict], list[dict]]:
    """(the NetworkPolicy and the Service, the pods: rdzv first) the operator makes for `job_body`, ownerless."""
    body = copy.deepcopy(job_body)
    body["metadata"].update(namespace=namespace, uid=str(uuid.uuid4()))
    job = parse_job(body)
    children = [render_network_policy(job, NetworkPolicyConfig()), render_service(job)]
    pods = [with_template_hash(render_rdzv_pod(job, 0))]
    pods += [with_template_hash(render_trainer_pod(job, i, 0)) for i in range(job.spec.nodes)]
    for obj in children + pods:
        obj["metadata"].pop("ownerReferences", None)
    return children, pods


def create_as_the_operator(api_client: kclient.ApiClient, children: list[dict], pods: list[dict]) -> float:
    """Create `children`, then `pods` POD_WRITERS at a time; the seconds the requests took."""
    core, net = kclient.CoreV1Api(api_client), kclient.NetworkingV1Api(api_client)
    t0 = time.time()
    for obj in children:
        ns = obj["metadata"]["namespace"]
        if obj["kind"] == "NetworkPolicy":
            net.create_namespaced_network_policy(ns, obj, _preload_content=False).data
        else:
            core.create_namespaced_service(ns, obj, _preload_content=False).data
    with ThreadPoolExecutor(POD_WRITERS) as pool:
        list(pool.map(lambda p: core.create_namespaced_pod(p["metadata"]["namespace"], p,
                                                           _preload_content=False).data, pods))
    return time.time() - t0
