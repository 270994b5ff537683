"""The operator's only Kubernetes I/O (besides kopf's watches): create, delete, patch status, Events, Leases.

Every call is idempotent at this level: a create that meets an existing object (409) and a delete that meets
a missing or replaced object (404/409 with a UID precondition) are successes.
"""

from __future__ import annotations

import json
import logging
import os
import socket
from datetime import datetime, timezone
from typing import Any, Mapping

from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from ddp_operator import metrics, names

log = logging.getLogger(__name__)
MERGE_PATCH = "application/merge-patch+json"


def describe_error(e: Exception) -> str:
    """A one-line description of an API error (the client's str() dumps every header)."""
    if isinstance(e, ApiException):
        message = ""
        try:
            message = json.loads(e.body or "{}").get("message", "")
        except ValueError:
            pass
        return f"{e.status} {e.reason}: {message}".rstrip(": ")
    return f"{type(e).__name__}: {e}"


class Api:
    def __init__(self) -> None:
        try:
            config.load_incluster_config()
        except config.ConfigException:
            config.load_kube_config(config_file=os.environ.get("KUBECONFIG"))
        self.client = client.ApiClient()
        self.core = client.CoreV1Api(self.client)
        self.custom = client.CustomObjectsApi(self.client)
        self.coordination = client.CoordinationV1Api(self.client)
        self.networking = client.NetworkingV1Api(self.client)
        self._nodes_forbidden = False

    def _dict(self, obj: Any) -> dict:
        return self.client.sanitize_for_serialization(obj)

    # --- children ---------------------------------------------------------------------------------
    def create(self, body: Mapping[str, Any]) -> dict | None:
        """Create a Pod, Service or NetworkPolicy; None if it already exists."""
        ns, kind = body["metadata"]["namespace"], body["kind"]
        metrics.API_WRITES.labels("create", kind).inc()
        try:
            if kind == "Pod":
                return self._dict(self.core.create_namespaced_pod(ns, body))
            if kind == "Service":
                return self._dict(self.core.create_namespaced_service(ns, body))
            if kind == "NetworkPolicy":
                return self._dict(self.networking.create_namespaced_network_policy(ns, body))
            raise ValueError(f"unsupported kind {kind}")
        except ApiException as e:
            if e.status == 409:
                return None
            if e.status == 403 and "NamespaceTerminating" in (e.body or ""):
                return None  # the job goes away with its namespace
            raise

    def delete_pod(self, namespace: str, name: str, uid: str | None, *, force: bool = False) -> None:
        metrics.API_WRITES.labels("force-delete" if force else "delete", "Pod").inc()
        body: dict[str, Any] = {}
        if uid:
            body["preconditions"] = {"uid": uid}
        if force:
            body["gracePeriodSeconds"] = 0
        try:
            self.core.delete_namespaced_pod(name, namespace, body=body)
        except ApiException as e:
            if e.status not in (404, 409):
                raise

    def delete_network_policy(self, namespace: str, name: str, uid: str | None) -> None:
        metrics.API_WRITES.labels("delete", "NetworkPolicy").inc()
        body = {"preconditions": {"uid": uid}} if uid else {}
        try:
            self.networking.delete_namespaced_network_policy(name, namespace, body=body)
        except ApiException as e:
            if e.status not in (404, 409):
                raise

    def delete_job(self, namespace: str, name: str, uid: str) -> None:
        metrics.API_WRITES.labels("delete", names.KIND).inc()
        try:
            self.custom.delete_namespaced_custom_object(
                names.GROUP, names.VERSION, namespace, names.PLURAL, name,
                body={"preconditions": {"uid": uid}, "propagationPolicy": "Background"})
        except ApiException as e:
            if e.status not in (404, 409):
                raise

    # --- the DDPJob -------------------------------------------------------------------------------
    def patch_status(self, namespace: str, name: str, status: Mapping[str, Any]) -> None:
        """Merge-patch status; keys mapped to None are removed."""
        metrics.API_WRITES.labels("patch-status", names.KIND).inc()
        try:
            self.custom.patch_namespaced_custom_object_status(
                names.GROUP, names.VERSION, namespace, names.PLURAL, name, {"status": dict(status)},
                _content_type=MERGE_PATCH)
        except ApiException as e:
            if e.status != 404:  # deleted meanwhile: nothing to report on
                raise

    def post_event(self, job: Mapping[str, Any], type_: str, reason: str, message: str, component: str) -> None:
        meta = job["metadata"]
        now = datetime.now(timezone.utc)
        metrics.API_WRITES.labels("create", "Event").inc()
        event = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
            "involvedObject": {"apiVersion": names.API_VERSION, "kind": names.KIND, "name": meta["name"],
                               "namespace": meta["namespace"], "uid": meta.get("uid"),
                               "resourceVersion": meta.get("resourceVersion")},
            "type": type_,
            "reason": reason,
            "message": message[:1024],
            "source": {"component": component},
            "reportingComponent": component,
            "reportingInstance": socket.gethostname(),
            "action": reason,
            "firstTimestamp": now.strftime("%Y-%m-%dT%H:%M:%SZ"),
            "lastTimestamp": now.strftime("%Y-%m-%dT%H:%M:%SZ"),
            "eventTime": now.strftime("%Y-%m-%dT%H:%M:%S.%fZ"),
            "count": 1,
        }
        try:
            self.core.create_namespaced_event(meta["namespace"], event)
        except ApiException as e:  # Events are best effort
            log.warning("could not post event %s for %s/%s: %s", reason, meta["namespace"], meta["name"], e.reason)

    # --- nodes ------------------------------------------------------------------------------------
    def node_ready(self, name: str) -> bool | None:
        """False if the node is gone or its Ready condition is not True; None if Nodes may not be read.

        Namespace-scoped RBAC (the chart's rbac.scope=namespace) grants no Node read. The node's state is then
        unknown, which the plan treats as "do not force-delete"; after the first 403 no more reads are tried,
        so a stuck pod does not turn into a stream of failing requests and retried passes.
        """
        if self._nodes_forbidden:
            return None
        try:
            node = self.core.read_node(name)
        except ApiException as e:
            if e.status == 404:
                return False
            if e.status == 403:
                self._nodes_forbidden = True
                log.info("no permission to read Nodes (%s): pods stuck Terminating are waited for, never "
                         "force-deleted", describe_error(e))
                return None
            raise
        return any(c.type == "Ready" and c.status == "True" for c in node.status.conditions or [])

    # --- leader election --------------------------------------------------------------------------
    def read_lease(self, namespace: str, name: str) -> dict | None:
        try:
            return self._dict(self.coordination.read_namespaced_lease(name, namespace))
        except ApiException as e:
            if e.status == 404:
                return None
            raise

    def write_lease(self, namespace: str, body: Mapping[str, Any], *, create: bool) -> bool:
        """Create or replace (optimistically, by resourceVersion) a Lease; False on a lost race."""
        try:
            if create:
                self.coordination.create_namespaced_lease(namespace, body)
            else:
                self.coordination.replace_namespaced_lease(body["metadata"]["name"], namespace, body)
            return True
        except ApiException as e:
            if e.status == 409:
                return False
            raise
