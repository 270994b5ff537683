"""The diagnostics sidecar as the operator renders it (docs/diagnostics.md): `spec.diagnostics` parsed, and what it
adds to every trainer pod. Pure.

With `spec.diagnostics.enabled` (the default) a trainer pod gets
- `shareProcessNamespace: true`, so that a container of the pod sees the trainer container's processes;
- the init container DIAGNOSTICS_TOOLS_CONTAINER, from the tools image (the operator's own unless the operator is
  told otherwise: `Tools`, from DDPJOB_DIAGNOSTICS_IMAGE), that copies py-spy and the server into the emptyDir
  DIAGNOSTICS_VOLUME, with tiny resources and a hardened securityContext (it only runs `cp`);
- the container DIAGNOSTICS_CONTAINER, which runs the server with the trainer image's `python3`, as the trainer
  container's user and with no fewer capabilities than it (its runAsUser/runAsGroup/runAsNonRoot and capabilities
  copied; a pod-level securityContext applies to both anyway): that is what lets py-spy read the workers' memory
  without privileges on most nodes. `spec.diagnostics.ptrace` adds SYS_PTRACE for nodes whose Yama ptrace_scope
  refuses it otherwise;
- the annotation `kubectl.kubernetes.io/default-container: trainer`, so `kubectl logs <pod>` shows the training.
The rendezvous-store pod (rdzv.py) gets none of it: it runs no workers.

A template may not take what the sidecar needs: its container and volume names, its port, `shareProcessNamespace:
false` or `hostPID: true` (the pod would see, and the sidecar diagnose, every worker on the node).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Mapping

from ddp_operator import __version__, names
from ddp_operator.spec_fields import SpecError, boolean

# The tools image when the operator is told none (it runs outside the cluster): the operator image that `make
# images` builds, as the chart's default (diagnostics.image: the operator's own image).
DEFAULT_TOOLS_IMAGE = f"localhost/ddp-operator:{__version__}"
# Where the operator image (operator/Dockerfile) holds the two files the init container copies.
TOOLS_PY_SPY = "/opt/venv/bin/py-spy"
TOOLS_SERVER = "/opt/ddp/ddp_operator/sidecar/diagnose.py"
SERVER = f"{names.DIAGNOSTICS_DIR}/diagnose.py"
PY_SPY = f"{names.DIAGNOSTICS_DIR}/py-spy"
PORT_NAME = "diagnostics"
# py-spy (a static binary, about 10 MB) and the server: the volume holds nothing else.
VOLUME_SIZE_LIMIT = "64Mi"
# Fixed and small: the server answers a poll every few seconds; py-spy reads a worker's stack in milliseconds.
SIDECAR_RESOURCES = {"requests": {"cpu": "10m", "memory": "32Mi"}, "limits": {"memory": "256Mi"}}
TOOLS_RESOURCES = {"requests": {"cpu": "10m", "memory": "16Mi"}, "limits": {"memory": "64Mi"}}
# The operator image's own user (operator/Dockerfile: USER 1000:1000); the files it copies are world-readable.
TOOLS_USER = 1000
PTRACE = "SYS_PTRACE"
_ADMIN = "CAP_SYS_ADMIN"  # the one spelling the API server checks against allowPrivilegeEscalation: false
# The trainer container's securityContext keys the sidecar copies: who it runs as, and what confines it.
_COPIED_SECURITY = ("runAsUser", "runAsGroup", "runAsNonRoot", "seccompProfile", "appArmorProfile",
                    "seLinuxOptions")


@dataclass(frozen=True)
class Tools:
    """Where the init container gets py-spy and the server: the operator's setting (DDPJOB_DIAGNOSTICS_IMAGE,
    DDPJOB_DIAGNOSTICS_IMAGE_PULL_POLICY), not the job's. The shell puts it into every job it parses (jobs.py),
    so the renderers stay pure."""
    image: str = DEFAULT_TOOLS_IMAGE
    pull_policy: str | None = None


@dataclass(frozen=True)
class Diagnostics:
    """spec.diagnostics, and the operator's tools image."""
    enabled: bool = True
    ptrace: bool = False
    tools: Tools = field(default_factory=Tools)


def parse_diagnostics(section: Mapping[str, Any], pod: Mapping[str, Any], defaults: Mapping[str, Any]) -> Diagnostics:
    """spec.diagnostics (`section`), checked against the template's pod spec (`pod`); raises SpecError."""
    enabled = boolean(section, "enabled", "spec.diagnostics.enabled", default=defaults["enabled"])
    ptrace = boolean(section, "ptrace", "spec.diagnostics.ptrace", default=defaults["ptrace"])
    if enabled:
        _template_leaves_room(pod)
    return Diagnostics(enabled=enabled, ptrace=ptrace)


_OFF = "; rename it, or set spec.diagnostics.enabled: false"


def _template_leaves_room(pod: Mapping[str, Any]) -> None:
    """The template takes nothing the sidecar needs (template.py has checked the types of what is read here)."""
    ours = (names.DIAGNOSTICS_CONTAINER, names.DIAGNOSTICS_TOOLS_CONTAINER)
    for key in ("containers", "initContainers"):
        for c in pod.get(key) or []:
            if c["name"] in ours:
                raise SpecError(f"spec.template.spec.{key}", f"container name {c['name']} is reserved for the "
                                                             f"diagnostics sidecar (spec.diagnostics){_OFF}")
            if any(p.get("containerPort") == names.DIAGNOSTICS_PORT for p in c.get("ports") or []):
                raise SpecError(f"spec.template.spec.{key}[{c['name']}].ports",
                                f"port {names.DIAGNOSTICS_PORT} is the diagnostics sidecar's (spec.diagnostics); "
                                f"use another, or set spec.diagnostics.enabled: false")
    if any(v["name"] == names.DIAGNOSTICS_VOLUME for v in pod.get("volumes") or []):
        raise SpecError("spec.template.spec.volumes", f"volume name {names.DIAGNOSTICS_VOLUME} is reserved for the "
                                                      f"diagnostics sidecar (spec.diagnostics){_OFF}")
    if pod.get("shareProcessNamespace") is False:
        raise SpecError("spec.template.spec.shareProcessNamespace",
                        "false keeps the diagnostics sidecar from seeing the workers; remove it, or set "
                        "spec.diagnostics.enabled: false")
    if pod.get("hostPID") is True:
        raise SpecError("spec.template.spec.hostPID",
                        "true would let the diagnostics sidecar see every worker on the node, not the pod's own; "
                        "set spec.diagnostics.enabled: false to keep hostPID")


# --- rendering ------------------------------------------------------------------------------------
def sidecar_security_context(trainer_security: Mapping[str, Any] | None, ptrace: bool) -> dict:
    """The sidecar's securityContext: the trainer container's user and confinement, its capabilities (no fewer:
    py-spy may only read a process whose capabilities it has), SYS_PTRACE added with `ptrace`, no privilege escalation
    (unless the trainer adds CAP_SYS_ADMIN, which the API server refuses beside it) and a read-only root filesystem.
    A privileged trainer is not copied: its workers' stacks then need `ptrace`."""
    trainer_security = trainer_security or {}
    out: dict[str, Any] = {k: copy.deepcopy(trainer_security[k]) for k in _COPIED_SECURITY if k in trainer_security}
    capabilities = copy.deepcopy(dict(trainer_security.get("capabilities") or {}))
    if ptrace:
        added = list(capabilities.get("add") or [])
        capabilities["add"] = added + ([PTRACE] if PTRACE not in added else [])
    if capabilities:
        out["capabilities"] = capabilities
    if _ADMIN in (capabilities.get("add") or []):
        # The API server refuses allowPrivilegeEscalation false beside it: the trainer's own setting, as it is.
        if "allowPrivilegeEscalation" in trainer_security:
            out["allowPrivilegeEscalation"] = trainer_security["allowPrivilegeEscalation"]
    else:
        out["allowPrivilegeEscalation"] = False
    out["readOnlyRootFilesystem"] = True
    return dict(sorted(out.items()))


def tools_container(tools: Tools) -> dict:
    """The init container that copies py-spy and the server into DIAGNOSTICS_VOLUME (`cp` of the image's
    coreutils; the operator image's entrypoint is replaced)."""
    return {
        "name": names.DIAGNOSTICS_TOOLS_CONTAINER,
        "image": tools.image,
        **({"imagePullPolicy": tools.pull_policy} if tools.pull_policy else {}),
        "command": ["cp", TOOLS_PY_SPY, TOOLS_SERVER, f"{names.DIAGNOSTICS_DIR}/"],
        "resources": copy.deepcopy(TOOLS_RESOURCES),
        "securityContext": {
            "allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}, "readOnlyRootFilesystem": True,
            "runAsGroup": TOOLS_USER, "runAsNonRoot": True, "runAsUser": TOOLS_USER,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "volumeMounts": [{"name": names.DIAGNOSTICS_VOLUME, "mountPath": names.DIAGNOSTICS_DIR}],
    }


def sidecar_container(trainer: Mapping[str, Any], ptrace: bool) -> dict:
    """The server, in the trainer's image (its python3) and as the trainer's user."""
    return {
        "name": names.DIAGNOSTICS_CONTAINER,
        "image": trainer.get("image"),
        **({"imagePullPolicy": trainer["imagePullPolicy"]} if trainer.get("imagePullPolicy") else {}),
        "command": ["python3", SERVER, "--port", str(names.DIAGNOSTICS_PORT), "--py-spy", PY_SPY],
        # CUDA images set NVIDIA_VISIBLE_DEVICES=all, which the NVIDIA runtime honours even in a container that
        # requested no GPU: the sidecar needs none and gets none.
        "env": [{"name": names.ENV_PYTHONUNBUFFERED, "value": "1"},
                {"name": "PYTHONDONTWRITEBYTECODE", "value": "1"},
                {"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"}],
        "ports": [{"name": PORT_NAME, "containerPort": names.DIAGNOSTICS_PORT, "protocol": "TCP"}],
        "resources": copy.deepcopy(SIDECAR_RESOURCES),
        "securityContext": sidecar_security_context(trainer.get("securityContext"), ptrace),
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "volumeMounts": [{"name": names.DIAGNOSTICS_VOLUME, "mountPath": names.DIAGNOSTICS_DIR, "readOnly": True}],
    }


def add_sidecar(diagnostics: Diagnostics, spec: dict, annotations: dict) -> None:
    """Add the sidecar, its init container and volume to a rendered trainer pod's `spec` (a private copy) and the
    default-container annotation to its `annotations`; nothing when disabled. The template's own init containers
    (native sidecars too) run after ours; its containers are left as they are."""
    if not diagnostics.enabled:
        return
    trainer = next(c for c in spec["containers"] if c["name"] == names.TRAINER_CONTAINER)
    spec["shareProcessNamespace"] = True
    # A native sidecar (an init container that keeps running, Kubernetes >= 1.29): a regular container that never
    # exits would keep a finished pod Running, its trainer exited 0, forever.
    sidecar = {**sidecar_container(trainer, diagnostics.ptrace), "restartPolicy": "Always"}
    spec["initContainers"] = [tools_container(diagnostics.tools), sidecar, *(spec.get("initContainers") or [])]
    spec["volumes"] = [*(spec.get("volumes") or []),
                       {"name": names.DIAGNOSTICS_VOLUME, "emptyDir": {"sizeLimit": VOLUME_SIZE_LIMIT}}]
    annotations.setdefault(names.DEFAULT_CONTAINER_ANNOTATION, names.TRAINER_CONTAINER)
