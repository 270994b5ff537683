"""The plugin's cluster access, kubectl's way: the kubeconfig (`--kubeconfig`, else $KUBECONFIG, else
~/.kube/config), its current context (`--context`) and that context's namespace (`-n` overrides it).

Every read returns plain dicts as the API serves them (what `view` formats); every API error a user can cause
(a job that does not exist, a namespace they may not read) becomes a CliError with kubectl's wording, printed
without a traceback.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from ddp_operator import names

REQUEST_TIMEOUT = 30


class CliError(Exception):
    """A failure to tell the user in one line (exit status 1)."""


def unreachable(e: Exception, host: str) -> CliError:
    """A request that never reached the API server (refused, timed out, TLS), in one line like kubectl's."""
    reason = getattr(e, "reason", None) or e
    # urllib3 nests the cause in a repr ("HTTPSConnection(host=..): Failed to establish a new connection: [Errno
    # 111] Connection refused"): its last clause is the sentence a user can act on.
    detail = " ".join(str(reason).split()).rsplit("): ", 1)[-1]
    return CliError(f"Unable to connect to the server {host}: {detail}")


def server_error(e: ApiException, what: str) -> CliError:
    reason = {403: "Forbidden", 404: "NotFound", 409: "AlreadyExists", 422: "Invalid"}.get(e.status, str(e.status))
    detail = what
    try:
        import json
        detail = json.loads(e.body or "{}").get("message") or what
    except ValueError:
        pass
    return CliError(f"Error from server ({reason}): {detail}")


@dataclass
class Kube:
    api: client.ApiClient
    namespace: str

    @property
    def core(self) -> client.CoreV1Api:
        return client.CoreV1Api(self.api)

    @property
    def custom(self) -> client.CustomObjectsApi:
        return client.CustomObjectsApi(self.api)

    def plain(self, obj: Any) -> Any:
        return self.api.sanitize_for_serialization(obj)

    # --- DDPJobs --------------------------------------------------------------------------------------------------
    def job(self, name: str) -> dict:
        try:
            return self.custom.get_namespaced_custom_object(names.GROUP, names.VERSION, self.namespace, names.PLURAL,
                                                            name, _request_timeout=REQUEST_TIMEOUT)
        except ApiException as e:
            raise server_error(e, f'{names.CRD_NAME} "{name}" not found') from None

    def jobs(self, all_namespaces: bool = False) -> list[dict]:
        try:
            if all_namespaces:
                found = self.custom.list_cluster_custom_object(names.GROUP, names.VERSION, names.PLURAL,
                                                               _request_timeout=REQUEST_TIMEOUT)
            else:
                found = self.custom.list_namespaced_custom_object(names.GROUP, names.VERSION, self.namespace,
                                                                  names.PLURAL, _request_timeout=REQUEST_TIMEOUT)
        except ApiException as e:
            raise server_error(e, f"cannot list {names.PLURAL}") from None
        return sorted(found.get("items") or [], key=lambda j: (j["metadata"].get("namespace", ""),
                                                                j["metadata"]["name"]))

    def create_job(self, body: dict) -> dict:
        try:
            return self.custom.create_namespaced_custom_object(names.GROUP, names.VERSION, self.namespace,
                                                               names.PLURAL, body, _request_timeout=REQUEST_TIMEOUT)
        except ApiException as e:
            raise server_error(e, f"cannot create {names.KIND} {body['metadata']['name']}") from None

    # --- what belongs to a job ------------------------------------------------------------------------------------
    def pods(self, job: str, role: str | None = names.ROLE_TRAINER) -> list[dict]:
        selector = f"{names.LABEL_JOB_NAME}={job}" + (f",{names.LABEL_ROLE}={role}" if role else "")
        try:
            found = self.core.list_namespaced_pod(self.namespace, label_selector=selector,
                                                  _request_timeout=REQUEST_TIMEOUT)
        except ApiException as e:
            raise server_error(e, f"cannot list the pods of {job}") from None
        return [self.plain(p) for p in found.items]

    def events(self, involved: Iterable[str]) -> list[dict]:
        """Events about these objects (the job and its pods), oldest first."""
        wanted = set(involved)
        try:
            found = self.core.list_namespaced_event(self.namespace, _request_timeout=REQUEST_TIMEOUT)
        except ApiException:
            return []  # events are a courtesy: a user who may not list them still gets the rest
        items = [self.plain(e) for e in found.items if e.involved_object and e.involved_object.name in wanted]
        return sorted(items, key=lambda e: e.get("lastTimestamp") or e.get("eventTime") or
                      (e.get("metadata") or {}).get("creationTimestamp") or "")

    def config_map(self, name: str) -> dict | None:
        try:
            return self.plain(self.core.read_namespaced_config_map(name, self.namespace,
                                                                   _request_timeout=REQUEST_TIMEOUT))
        except ApiException as e:
            if e.status == 404:
                return None
            raise server_error(e, f"cannot read ConfigMap {name}") from None

    def create_config_map(self, body: dict) -> None:
        try:
            self.core.create_namespaced_config_map(self.namespace, body, _request_timeout=REQUEST_TIMEOUT)
        except ApiException as e:
            raise server_error(e, f"cannot create ConfigMap {body['metadata']['name']}") from None

    def own(self, kind: str, name: str, job: dict) -> None:
        """Make the job the owner of an object created before it (deleted with the job)."""
        ref = {"apiVersion": names.API_VERSION, "kind": names.KIND, "name": job["metadata"]["name"],
               "uid": job["metadata"]["uid"]}
        patch = {"metadata": {"ownerReferences": [ref]}}
        try:
            if kind == "ConfigMap":
                self.core.patch_namespaced_config_map(name, self.namespace, patch, _request_timeout=REQUEST_TIMEOUT)
            elif kind == "PersistentVolumeClaim":
                self.core.patch_namespaced_persistent_volume_claim(name, self.namespace, patch,
                                                                   _request_timeout=REQUEST_TIMEOUT)
        except ApiException as e:
            raise server_error(e, f"cannot hand {kind} {name} to the job") from None

    def delete(self, kind: str, name: str) -> None:
        try:
            if kind == "ConfigMap":
                self.core.delete_namespaced_config_map(name, self.namespace, _request_timeout=REQUEST_TIMEOUT)
            elif kind == "PersistentVolumeClaim":
                self.core.delete_namespaced_persistent_volume_claim(name, self.namespace,
                                                                    _request_timeout=REQUEST_TIMEOUT)
        except ApiException as e:
            if e.status != 404:
                raise server_error(e, f"cannot delete {kind} {name}") from None

    def create_pvc(self, body: dict) -> None:
        try:
            self.core.create_namespaced_persistent_volume_claim(self.namespace, body,
                                                                _request_timeout=REQUEST_TIMEOUT)
        except ApiException as e:
            raise server_error(e, f"cannot create PersistentVolumeClaim {body['metadata']['name']}") from None


def connect(kubeconfig: str | None = None, context: str | None = None, namespace: str | None = None) -> Kube:
    try:
        contexts, active = config.list_kube_config_contexts(config_file=kubeconfig)
        config.load_kube_config(config_file=kubeconfig, context=context)
    except (config.ConfigException, FileNotFoundError, OSError) as e:
        raise CliError(f"no usable kubeconfig ({e}); set KUBECONFIG or pass --kubeconfig") from None
    if namespace is None:
        chosen = next((c for c in contexts if c.get("name") == context), None) if context else active
        namespace = ((chosen or {}).get("context") or {}).get("namespace") or "default"
    return Kube(client.ApiClient(), namespace)
