"""The operator's only Kubernetes I/O (besides kopf's watches): create, delete, patch status, Events, Leases, the
metric history's ConfigMap.

Every call is idempotent at this level: a create that meets an existing object (409) that this job owns, and a
delete that meets a missing or replaced object (404/409 with a UID precondition) are successes. An existing
object owned by anything else is a ChildConflict: it is not ours to use or delete.

Every call carries a request timeout (REQUEST_TIMEOUT_SECONDS, or a shorter one given by the caller), so a
hung connection to the API server can never hold a reconcile pass, the ticker or a Lease renewal.
"""

from __future__ import annotations

import json
import logging
import os
import socket
from datetime import datetime, timezone
from typing import Any, Callable, Iterator, Mapping

from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from ddp_operator import jsondoc, metrics, names
from ddp_operator.observed import NodeState, observe_node

log = logging.getLogger(__name__)

MERGE_PATCH = "application/merge-patch+json"
REQUEST_TIMEOUT_SECONDS = 30.0
CONNECTIONS = 64  # kept open to the API server (see Api.__init__)
NODE_PAGE = 500  # Nodes per page of a listing (node_watch.py keeps a few bytes of each)


class ChildConflict(Exception):
    """A child's name is taken by an object the job does not own; the message says what to do."""

    def __init__(self, kind: str, namespace: str, name: str, owners: list[str]):
        held = f"owned by {', '.join(owners)}" if owners else "owned by nothing"
        super().__init__(f"{kind.lower()} {namespace}/{name} already exists and is not owned by this DDPJob "
                         f"({held}); delete or rename it and the operator creates its own")
        self.kind, self.namespace, self.name = kind, namespace, name


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


def _json(response: Any) -> dict:
    """The object an API call answered, read from its raw response (`_preload_content=False`): the client's models
    would validate it, build one object per field and turn it back into a dict, about 2 ms of a pod's create."""
    return jsondoc.loads(response.data)


def _read_out(response: Any) -> None:
    """Read a write's raw answer (`_preload_content=False`) to its end, which gives its connection back to the pool,
    and drop it: the client would build models of the deleted or patched pod (about 1.2 ms of a pod), for nothing."""
    response.data  # noqa: B018 (read for its effect)


class NotLeading(Exception):
    """This replica may not write: its leadership (leader.py) is not known to hold now."""


class Api:
    """`fence` (with leader election): how many seconds this replica's leadership still holds; every write is
    refused (NotLeading) once it is <= 0 and is given at most that long, so a replica that lost or could not renew
    its Lease -- paused, partitioned, slow to notice -- never writes over the new leader's work."""
    fence: Callable[[], float] | None = None

    def __init__(self, fence: Callable[[], float] | None = None) -> None:
        try:
            config.load_incluster_config()
        except config.ConfigException:
            config.load_kube_config(config_file=os.environ.get("KUBECONFIG"))
        configuration = client.Configuration.get_default_copy()
        # At most CONNECTIONS requests in flight, each on a connection kept open: the client's default pool (5 per
        # core) opened a connection for every request past it and dropped it after, each paying a TLS handshake, and
        # the passes' pod writers side by side (writers.POD_WRITERS each) could put hundreds of requests on an API
        # server at once; a thread past the limit waits for a connection instead (urllib3's blocking pool).
        configuration.connection_pool_maxsize = CONNECTIONS
        self.client = client.ApiClient(configuration)
        self.client.rest_client.pool_manager.connection_pool_kw["block"] = True
        self.core = client.CoreV1Api(self.client)
        self.custom = client.CustomObjectsApi(self.client)
        self.coordination = client.CoordinationV1Api(self.client)
        self.networking = client.NetworkingV1Api(self.client)
        self._nodes_forbidden = False
        self.fence = fence

    def _write(self, verb: str, kind: str) -> float:
        """Before every write: the fence, the write counted, and its request timeout."""
        left = self.fence() if self.fence is not None else REQUEST_TIMEOUT_SECONDS
        if left <= 0:
            raise NotLeading(f"{verb} {kind} refused: this replica's leader Lease is not renewed (another replica may "
                             f"lead); it exits and rejoins as a standby")
        metrics.API_WRITES.labels(verb, kind).inc()
        return min(REQUEST_TIMEOUT_SECONDS, left)

    def _dict(self, obj: Any) -> dict:
        return self.client.sanitize_for_serialization(obj)

    # --- children ---------------------------------------------------------------------------------
    def create(self, body: Mapping[str, Any]) -> dict | None:
        """Create a Pod, Service or NetworkPolicy; None if this job's own object already exists.

        Raises ChildConflict if an object of the same name exists that the job (by the UID in the body's owner
        reference) does not own."""
        ns, kind = body["metadata"]["namespace"], body["kind"]
        t = self._write("create", kind)
        try:
            if kind == "Pod":
                return _json(self.core.create_namespaced_pod(ns, body, _request_timeout=t, _preload_content=False))
            if kind == "Service":
                return _json(self.core.create_namespaced_service(ns, body, _request_timeout=t,
                                                                 _preload_content=False))
            if kind == "NetworkPolicy":
                return _json(self.networking.create_namespaced_network_policy(ns, body, _request_timeout=t,
                                                                              _preload_content=False))
            if kind == names.WORKLOAD_KIND:
                return dict(self.custom.create_namespaced_custom_object(
                    names.KUEUE_GROUP, names.KUEUE_VERSION, ns, names.WORKLOAD_PLURAL, body, _request_timeout=t))
            raise ValueError(f"unsupported kind {kind}")
        except ApiException as e:
            if e.status == 409:
                self._check_owner(body)
                return None
            if e.status == 403 and "NamespaceTerminating" in (e.body or ""):
                return None  # the job goes away with its namespace
            raise

    def _check_owner(self, body: Mapping[str, Any]) -> None:
        """After a 409: fine if the existing object is ours, ChildConflict if it belongs to anything else."""
        meta, kind = body["metadata"], body["kind"]
        try:
            refs = self._child_owners(kind, meta["namespace"], meta["name"])
        except ApiException as e:
            if e.status == 404:
                return  # gone meanwhile: the next pass creates it
            raise
        if refs is None:
            return
        ours = {o["uid"] for o in meta.get("ownerReferences") or []}
        if not ours or any(o["uid"] in ours for o in refs):
            return
        raise ChildConflict(kind, meta["namespace"], meta["name"], [f"{o['kind']} {o['name']}" for o in refs])

    def _child_owners(self, kind: str, namespace: str, name: str) -> list[dict] | None:
        """The owner references of an existing child (uid, kind, name); None if it is gone."""
        if kind == names.WORKLOAD_KIND:
            found = self.custom.get_namespaced_custom_object(names.KUEUE_GROUP, names.KUEUE_VERSION, namespace,
                                                             names.WORKLOAD_PLURAL, name,
                                                             _request_timeout=REQUEST_TIMEOUT_SECONDS)
            return list((found.get("metadata") or {}).get("ownerReferences") or [])
        existing = self._read_child(kind, namespace, name)
        if existing is None:
            return None
        return [{"uid": o.uid, "kind": o.kind, "name": o.name} for o in existing.metadata.owner_references or []]

    def _read_child(self, kind: str, namespace: str, name: str) -> Any:
        t = REQUEST_TIMEOUT_SECONDS
        if kind == "Pod":
            return self.core.read_namespaced_pod(name, namespace, _request_timeout=t)
        if kind == "Service":
            return self.core.read_namespaced_service(name, namespace, _request_timeout=t)
        # NetworkPolicies: list (which the operator may do for its watch) instead of a get it is not granted.
        items = self.networking.list_namespaced_network_policy(
            namespace, field_selector=f"metadata.name={name}", _request_timeout=t).items
        return items[0] if items else None

    def delete_pod(self, namespace: str, name: str, uid: str | None, *, force: bool = False,
                   grace_seconds: int | None = None) -> None:
        """Delete a pod (only this UID); `force`: at once, without waiting for the kubelet; `grace_seconds`: a
        grace period shorter than the pod's own."""
        t = self._write("force-delete" if force else "delete", "Pod")
        body: dict[str, Any] = {}
        if uid:
            body["preconditions"] = {"uid": uid}
        if force:
            body["gracePeriodSeconds"] = 0
        elif grace_seconds is not None:
            body["gracePeriodSeconds"] = grace_seconds
        try:
            _read_out(self.core.delete_namespaced_pod(name, namespace, body=body, _request_timeout=t,
                                                      _preload_content=False))
        except ApiException as e:
            if e.status not in (404, 409):
                raise

    def patch_pod(self, namespace: str, name: str, uid: str | None, patch: Mapping[str, Any]) -> None:
        """Merge-patch a pod's metadata (only this UID: the UID in the patch is the API server's precondition)."""
        t = self._write("patch", "Pod")
        body = {**patch, "metadata": {**(patch.get("metadata") or {}), **({"uid": uid} if uid else {})}}
        try:
            _read_out(self.core.patch_namespaced_pod(name, namespace, body, _content_type=MERGE_PATCH,
                                                     _request_timeout=t, _preload_content=False))
        except ApiException as e:
            if e.status not in (404, 409):  # gone, or a newer pod of that name: the next pass sees it
                raise

    def patch_network_policy(self, namespace: str, name: str, uid: str | None, patch: Mapping[str, Any]) -> None:
        """Merge-patch the job's NetworkPolicy (only this UID: never a newer policy of that name); gone is fine."""
        t = self._write("patch", "NetworkPolicy")
        body = {**patch, "metadata": {**(patch.get("metadata") or {}), **({"uid": uid} if uid else {})}}
        try:
            _read_out(self.networking.patch_namespaced_network_policy(
                name, namespace, body, _content_type=MERGE_PATCH, _request_timeout=t, _preload_content=False))
        except ApiException as e:
            if e.status not in (404, 409):  # gone, or a newer policy of that name: the next pass sees it
                raise

    def read_config_map(self, namespace: str, name: str) -> dict | None:
        """A ConfigMap (the job's metric history); None if there is none."""
        try:
            return self._dict(self.core.read_namespaced_config_map(name, namespace,
                                                                  _request_timeout=REQUEST_TIMEOUT_SECONDS))
        except ApiException as e:
            if e.status == 404:
                return None
            raise

    def write_config_map(self, body: Mapping[str, Any], *, replace: bool) -> bool:
        """Create a ConfigMap, or `replace` it (the body's resourceVersion is the precondition); False when another
        writer came first (409) or the one to replace is gone (404): the caller reads it again."""
        meta = body["metadata"]
        t = self._write("replace" if replace else "create", "ConfigMap")
        try:
            if replace:
                _read_out(self.core.replace_namespaced_config_map(meta["name"], meta["namespace"], body,
                                                                  _request_timeout=t, _preload_content=False))
            else:
                _read_out(self.core.create_namespaced_config_map(meta["namespace"], body, _request_timeout=t,
                                                                 _preload_content=False))
            return True
        except ApiException as e:
            if e.status in (404, 409):
                return False
            raise

    def delete_network_policy(self, namespace: str, name: str, uid: str | None) -> None:
        t = self._write("delete", "NetworkPolicy")
        body = {"preconditions": {"uid": uid}} if uid else {}
        try:
            _read_out(self.networking.delete_namespaced_network_policy(name, namespace, body=body, _request_timeout=t,
                                                                       _preload_content=False))
        except ApiException as e:
            if e.status not in (404, 409):
                raise

    def delete_job(self, namespace: str, name: str, uid: str) -> None:
        t = self._write("delete", names.KIND)
        try:
            self.custom.delete_namespaced_custom_object(
                names.GROUP, names.VERSION, namespace, names.PLURAL, name,
                body={"preconditions": {"uid": uid}, "propagationPolicy": "Background"},
                _request_timeout=t)
        except ApiException as e:
            if e.status not in (404, 409):
                raise

    # --- Kueue (kueue.py) -------------------------------------------------------------------------
    def delete_workload(self, namespace: str, name: str, uid: str | None) -> None:
        t = self._write("delete", names.WORKLOAD_KIND)
        try:
            self.custom.delete_namespaced_custom_object(
                names.KUEUE_GROUP, names.KUEUE_VERSION, namespace, names.WORKLOAD_PLURAL, name,
                body={"preconditions": {"uid": uid}} if uid else {}, _request_timeout=t)
        except ApiException as e:
            if e.status not in (404, 409):
                raise

    def patch_workload(self, namespace: str, name: str, uid: str | None, patch: Mapping[str, Any], *,
                       status: bool = False) -> bool:
        """Merge-patch a Workload's spec (or, with `status`, its status subresource). The patch may carry a
        resourceVersion (optimistic: False when Kueue wrote in between; the next pass computes it again)."""
        t = self._write("patch-status" if status else "patch", names.WORKLOAD_KIND)
        body = {**patch, "metadata": {**(patch.get("metadata") or {}), **({"uid": uid} if uid else {})}}
        try:
            if status:
                self.custom.patch_namespaced_custom_object_status(
                    names.KUEUE_GROUP, names.KUEUE_VERSION, namespace, names.WORKLOAD_PLURAL, name, body,
                    _content_type=MERGE_PATCH, _request_timeout=t)
            else:
                self.custom.patch_namespaced_custom_object(
                    names.KUEUE_GROUP, names.KUEUE_VERSION, namespace, names.WORKLOAD_PLURAL, name, body,
                    _content_type=MERGE_PATCH, _request_timeout=t)
            return True
        except ApiException as e:
            if e.status in (404, 409):
                return False
            raise

    def resource_flavor(self, name: str) -> Mapping[str, Any] | None:
        """A ResourceFlavor's spec (node labels, tolerations), or None if there is none."""
        try:
            found = self.custom.get_cluster_custom_object(names.KUEUE_GROUP, names.KUEUE_VERSION,
                                                          names.RESOURCE_FLAVOR_PLURAL, name,
                                                          _request_timeout=REQUEST_TIMEOUT_SECONDS)
        except ApiException as e:
            if e.status == 404:
                return None
            raise
        return dict(found.get("spec") or {})

    def workload_priority(self, name: str) -> tuple[str, int] | str:
        """A WorkloadPriorityClass as (name, value), or why it cannot be used."""
        try:
            found = self.custom.get_cluster_custom_object(
                names.KUEUE_GROUP, names.KUEUE_VERSION, names.WORKLOAD_PRIORITY_CLASS_PLURAL, name,
                _request_timeout=REQUEST_TIMEOUT_SECONDS)
        except ApiException as e:
            if e.status == 404:
                return (f"WorkloadPriorityClass {name} (metadata.labels[{names.LABEL_PRIORITY_CLASS}]) does not "
                        f"exist; create it or remove the label")
            raise
        return name, int(found.get("value") or 0)

    # --- the DDPJob -------------------------------------------------------------------------------
    def patch_status(self, namespace: str, name: str, status: Mapping[str, Any]) -> None:
        """Merge-patch status; keys mapped to None are removed."""
        t = self._write("patch-status", names.KIND)
        try:
            self.custom.patch_namespaced_custom_object_status(
                names.GROUP, names.VERSION, namespace, names.PLURAL, name, {"status": dict(status)},
                _content_type=MERGE_PATCH, _request_timeout=t)
        except ApiException as e:
            if e.status != 404:  # deleted meanwhile: nothing to report on
                raise

    def post_event(self, job: Mapping[str, Any], type_: str, reason: str, message: str, component: str) -> None:
        meta = job["metadata"]
        now = datetime.now(timezone.utc)
        t = self._write("create", "Event")
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
            _read_out(self.core.create_namespaced_event(meta["namespace"], event, _request_timeout=t,
                                                        _preload_content=False))
        except ApiException as e:  # Events are best effort
            log.warning("could not post event %s for %s/%s: %s", reason, meta["namespace"], meta["name"], e.reason)

    # --- nodes ------------------------------------------------------------------------------------
    def node_state(self, name: str) -> NodeState | None:
        """The node's readiness and since when (observed.observe_node); None if Nodes may not be read.

        Namespace-scoped RBAC (the chart's rbac.scope=namespace) grants no Node read. The node's state is then
        unknown, which the plan treats as "do not force-delete"; after the first 403 no more reads are tried,
        so a stuck pod does not turn into a stream of failing requests and retried passes.
        """
        if self._nodes_forbidden:
            return None
        try:  # read raw (_json): a Node is large, and the client's models cost ms of CPU for one condition
            node = _json(self.core.read_node(name, _request_timeout=REQUEST_TIMEOUT_SECONDS, _preload_content=False))
        except ApiException as e:
            if e.status == 404:
                return observe_node(None)
            if e.status == 403:
                self._nodes_forbidden = True
                log.info("no permission to read Nodes (%s): pods on NotReady nodes and pods stuck Terminating "
                         "are waited for, never force-deleted", describe_error(e))
                return None
            raise
        return observe_node(node)

    def list_nodes(self, after: str = "") -> tuple[list, str, str]:
        """One page of the Nodes, raw: (items, the listing's resourceVersion, the next page's token or "")."""
        doc = _json(self.core.list_node(limit=NODE_PAGE, _continue=after or None,
                                        _request_timeout=REQUEST_TIMEOUT_SECONDS, _preload_content=False))
        doc = doc if isinstance(doc, dict) else {}
        meta = doc.get("metadata") if isinstance(doc.get("metadata"), dict) else {}
        items = doc.get("items")
        return items if isinstance(items, list) else [], str(meta.get("resourceVersion") or ""), \
            str(meta.get("continue") or "")

    def watch_nodes(self, resource_version: str, seconds: int) -> Iterator[bytes]:
        """The lines (one JSON event each) of a watch of the Nodes from `resource_version`, with bookmarks; the API
        server ends it after `seconds`, and a connection silent past that is dropped (the read timeout)."""
        response = self.core.list_node(watch=True, resource_version=resource_version, allow_watch_bookmarks=True,
                                       timeout_seconds=seconds, _preload_content=False,
                                       _request_timeout=(REQUEST_TIMEOUT_SECONDS, seconds + 15))
        try:
            rest = b""
            for chunk in response.stream(amt=None, decode_content=False):
                *lines, rest = (rest + chunk).split(b"\n")
                yield from (line for line in lines if line.strip())
            if rest.strip():
                yield rest
        finally:
            response.release_conn()

    # --- leader election --------------------------------------------------------------------------
    def read_lease(self, namespace: str, name: str, *, timeout: float = REQUEST_TIMEOUT_SECONDS) -> dict | None:
        try:
            return self._dict(self.coordination.read_namespaced_lease(name, namespace, _request_timeout=timeout))
        except ApiException as e:
            if e.status == 404:
                return None
            raise

    def write_lease(self, namespace: str, body: Mapping[str, Any], *, create: bool,
                    timeout: float = REQUEST_TIMEOUT_SECONDS) -> bool:
        """Create or replace (optimistically, by resourceVersion) a Lease; False on a lost race."""
        try:
            if create:
                self.coordination.create_namespaced_lease(namespace, body, _request_timeout=timeout)
            else:
                self.coordination.replace_namespaced_lease(body["metadata"]["name"], namespace, body,
                                                           _request_timeout=timeout)
            return True
        except ApiException as e:
            if e.status == 409:
                return False
            raise
