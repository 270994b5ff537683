"""The shape of spec.template: every field of it that the parser (spec.py) or the renderers (pod.py, rdzv.py,
kueue.py) read, type-checked once at the edge, the first wrong one named by its JSON path.

The CRD keeps the pod template schemaless (x-kubernetes-preserve-unknown-fields), so the API server admits
`resources: "x"` or `ports: [29500]`; without this check such a value reaches code that expects an object or a
list and the pass fails on it forever instead of reporting it. Pure: `template_problem(template)` returns the
(path, message) of the first problem, or None; spec.py raises it as a SpecError. A JSON null is taken as absent
(as the API server takes it), except where the renderers fill a field in.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

PREFIX = "spec.template"

# Pod spec fields the rendezvous-store pod copies (rdzv.py) or the renderers read, by the type they must have.
_POD_STRINGS = ("restartPolicy", "hostname", "subdomain", "priorityClassName", "schedulerName", "serviceAccountName",
                "dnsPolicy", "runtimeClassName")
_POD_BOOLS = ("automountServiceAccountToken", "hostUsers")
_POD_OBJECTS = ("securityContext", "dnsConfig")
_POD_OBJECT_LISTS = ("tolerations", "imagePullSecrets", "topologySpreadConstraints")
# The affinity placement.py reads (pod affinity terms) and plan/avoid.py adds a preferred node affinity term to.
_AFFINITY_KINDS = ("nodeAffinity", "podAffinity", "podAntiAffinity")
_PREFERRED = "preferredDuringSchedulingIgnoredDuringExecution"
_REQUIRED = "requiredDuringSchedulingIgnoredDuringExecution"
# Container fields (the trainer's are read by pod.py and rdzv.py; every container's name by spec.py).
_CONTAINER_STRINGS = ("image", "imagePullPolicy", "terminationMessagePolicy", "workingDir")
_CONTAINER_STRING_LISTS = ("command", "args")
# The trainer's securityContext keys the store pod copies (rdzv._RESTRICTING_KEYS), by type.
_SECURITY_INTS = ("runAsUser", "runAsGroup")
_SECURITY_BOOLS = ("runAsNonRoot", "allowPrivilegeEscalation", "readOnlyRootFilesystem", "privileged")
_SECURITY_OBJECTS = ("seccompProfile", "appArmorProfile", "seLinuxOptions", "capabilities")


class _Problem(Exception):
    def __init__(self, path: str, message: str):
        super().__init__(path, message)
        self.path, self.message = path, message


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _fail(path: str, what: str, value: Any) -> None:
    raise _Problem(path, f"must be {what}, got {_show(value)}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _object(value: Any, path: str, *, required: bool = False) -> Mapping[str, Any]:
    if value is None and not required:
        return {}
    if not isinstance(value, Mapping):
        _fail(path, "an object", value)
    return value


def _list(value: Any, path: str) -> list:
    if value is None:
        return []
    if not isinstance(value, list):
        _fail(path, "a list", value)
    return value


def _string(value: Any, path: str, *, required: bool = False) -> None:
    if value is None and not required:
        return
    if not isinstance(value, str) or (required and not value):
        _fail(path, "a non-empty string" if required else "a string", value)


def _of(section: Mapping[str, Any], keys: tuple[str, ...], path: str, check: Callable[[Any, str], Any]) -> None:
    for key in keys:
        check(section.get(key), f"{path}.{key}")


def _bool(value: Any, path: str) -> None:
    if value is not None and not isinstance(value, bool):
        _fail(path, "true or false", value)


def _int(value: Any, path: str) -> None:
    if value is not None and not _is_int(value):
        _fail(path, "an integer", value)


def _string_map(value: Any, path: str) -> None:
    for key, item in _object(value, path).items():
        if not isinstance(item, str):
            _fail(f"{path}[{key}]", "a string", item)


def _string_list(value: Any, path: str) -> None:
    for i, item in enumerate(_list(value, path)):
        _string(item, f"{path}[{i}]", required=True)


def _object_list(value: Any, path: str) -> list[Mapping[str, Any]]:
    items = _list(value, path)
    for i, item in enumerate(items):
        _object(item, f"{path}[{i}]", required=True)
    return items


def _quantities(value: Any, path: str) -> None:
    for key, quantity in _object(value, path).items():
        if isinstance(quantity, bool) or not isinstance(quantity, (str, int, float)):
            _fail(f"{path}[{key}]", 'a quantity such as "2", "500m" or "4Gi"', quantity)


def _named(items: list[Mapping[str, Any]], path: str) -> list[tuple[str, Mapping[str, Any]]]:
    """Each item with its path; every one needs a string name."""
    out = []
    for i, item in enumerate(items):
        _string(item.get("name"), f"{path}[{i}].name", required=True)
        out.append((f"{path}[{item['name']}]", item))
    return out


def _env(value: Any, path: str) -> None:
    for item_path, item in _named(_object_list(value, path), path):
        _string(item.get("value"), f"{item_path}.value")
        _object(item.get("valueFrom"), f"{item_path}.valueFrom")


def _container(c: Mapping[str, Any], path: str) -> None:
    _of(c, _CONTAINER_STRINGS, path, _string)
    _of(c, _CONTAINER_STRING_LISTS, path, _string_list)
    _env(c.get("env"), f"{path}.env")
    _object_list(c.get("envFrom"), f"{path}.envFrom")
    for i, mount in enumerate(_object_list(c.get("volumeMounts"), f"{path}.volumeMounts")):
        _string(mount.get("name"), f"{path}.volumeMounts[{i}].name", required=True)
        _string(mount.get("mountPath"), f"{path}.volumeMounts[{i}].mountPath", required=True)
    for i, port in enumerate(_object_list(c.get("ports"), f"{path}.ports")):
        number = port.get("containerPort")
        if not _is_int(number) or not 1 <= number <= 65535:
            _fail(f"{path}.ports[{i}].containerPort", "a port number between 1 and 65535", number)
        _string(port.get("name"), f"{path}.ports[{i}].name")
        _string(port.get("protocol"), f"{path}.ports[{i}].protocol")
    if "resources" in c and c["resources"] is None:  # pod.py fills it in
        _fail(f"{path}.resources", "an object", None)
    resources = _object(c.get("resources"), f"{path}.resources")
    for kind in ("limits", "requests"):
        _quantities(resources.get(kind), f"{path}.resources.{kind}")
    security = _object(c.get("securityContext"), f"{path}.securityContext")
    _of(security, _SECURITY_INTS, f"{path}.securityContext", _int)
    _of(security, _SECURITY_BOOLS, f"{path}.securityContext", _bool)
    _of(security, _SECURITY_OBJECTS, f"{path}.securityContext", _object)
    capabilities = _object(security.get("capabilities"), f"{path}.securityContext.capabilities")
    _of(capabilities, ("add", "drop"), f"{path}.securityContext.capabilities", _string_list)
    _of(c, ("readinessProbe", "livenessProbe", "startupProbe", "lifecycle"), path, _object)


def _affinity(value: Any, path: str) -> None:
    affinity = _object(value, path)
    for kind in _AFFINITY_KINDS:
        section = _object(affinity.get(kind), f"{path}.{kind}")
        _object_list(section.get(_PREFERRED), f"{path}.{kind}.{_PREFERRED}")
        if kind != "nodeAffinity":  # a node affinity's requirement is one object (node selector terms)
            _object_list(section.get(_REQUIRED), f"{path}.{kind}.{_REQUIRED}")


def _check(template: Any) -> None:
    template = _object(template, PREFIX, required=True)
    meta = _object(template.get("metadata"), f"{PREFIX}.metadata")
    _string_map(meta.get("labels"), f"{PREFIX}.metadata.labels")
    _string_map(meta.get("annotations"), f"{PREFIX}.metadata.annotations")
    path = f"{PREFIX}.spec"
    pod = _object(template.get("spec"), path, required=True)
    _of(pod, _POD_STRINGS, path, _string)
    _of(pod, _POD_BOOLS, path, _bool)
    _of(pod, _POD_OBJECTS, path, _object)
    _of(pod, _POD_OBJECT_LISTS, path, _object_list)
    _affinity(pod.get("affinity"), f"{path}.affinity")
    _string_map(pod.get("nodeSelector"), f"{path}.nodeSelector")
    _named(_object_list(pod.get("volumes"), f"{path}.volumes"), f"{path}.volumes")
    for key in ("containers", "initContainers"):
        for c_path, c in _named(_object_list(pod.get(key), f"{path}.{key}"), f"{path}.{key}"):
            _container(c, c_path)


def template_problem(template: Any) -> tuple[str, str] | None:
    """The (JSON path, message) of the first field of spec.template whose type the operator cannot use, or None."""
    try:
        _check(template)
    except _Problem as p:
        return p.path, p.message
    return None

