"""The typed DDPJob model: `parse_job(body)` turns an API object into frozen dataclasses once, at the edge.

Defaults come from crd.DEFAULTS (the same values the API server applies), so an object that skipped
server-side defaulting parses identically. Everything the CRD's CEL rules check is checked again here
(the operator may meet objects created before a rule existed); any violation raises SpecError, whose
message names the field and says what to do.
"""

from __future__ import annotations

import copy
import math
import re
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Mapping

from ddp_operator import crd, names
from ddp_operator.diagnostics import Diagnostics, parse_diagnostics
from ddp_operator.observed import parse_time
from ddp_operator.rdzv_spec import Rendezvous, parse_rendezvous
# SpecError is the parsers' one error: importers take it from here.
from ddp_operator.spec_fields import SpecError, integer as _int, section as _section  # noqa: F401
from ddp_operator.template import template_problem


@dataclass(frozen=True)
class Torchrun:
    rdzv_port: int
    join_timeout_seconds: int
    last_call_timeout_seconds: int
    keep_alive_interval_seconds: int
    keep_alive_max_attempts: int
    max_restarts: int
    extra_args: tuple[str, ...]
    rdzv_backend: str = names.RDZV_BACKEND_AUTO  # as written; env.rdzv_backend resolves "auto"


@dataclass(frozen=True)
class FailurePolicy:
    backoff_limit: int
    permanent_exit_codes: frozenset[int]
    retryable_exit_codes: frozenset[int] | None
    count_disruptions: bool
    incident_window_seconds: int
    stuck_terminating_timeout_seconds: int
    # Each 0: never.
    hang_timeout_seconds: int
    startup_timeout_seconds: int
    node_lost_timeout_seconds: int
    # From the moment every trainer pod runs until the process group formed (docs/diagnostics.md).
    process_group_timeout_seconds: int = crd.DEFAULTS["failurePolicy"]["processGroupTimeoutSeconds"]
    # Infrastructure failures' own budget (failure_class.py); backoff_limit counts the user's code and hangs.
    infra_backoff_limit: int = crd.DEFAULTS["failurePolicy"]["infraBackoffLimit"]

    def is_permanent(self, exit_codes: tuple[int, ...]) -> bool:
        """Whether any of the exit codes (trainer container and workers) rules out a retry."""
        failing = [c for c in exit_codes if c != 0]
        if any(c in self.permanent_exit_codes for c in failing):
            return True
        if self.retryable_exit_codes is not None:
            return any(c not in self.retryable_exit_codes for c in failing)
        return False


@dataclass(frozen=True)
class RunPolicy:
    suspend: bool
    active_deadline_seconds: int | None
    ttl_seconds_after_finished: int | None
    clean_pod_policy: str


@dataclass(frozen=True)
class Shm:
    medium: str
    size_limit: str | int | None


@dataclass(frozen=True)
class Checkpoint:
    volume: Mapping[str, Any]
    mount_path: str


@dataclass(frozen=True)
class JobSpec:
    nodes: int
    min_nodes: int
    max_nodes: int
    nproc_per_node: int
    omp_num_threads: int
    progress_period_seconds: int
    template: Mapping[str, Any]  # a private deep copy; renderers copy it again before changing it
    torchrun: Torchrun
    failure_policy: FailurePolicy
    run_policy: RunPolicy
    shm: Shm
    checkpoint: Checkpoint | None
    # spec.networkPolicy.enabled; None: the operator's default decides (netpol.wanted).
    network_policy_enabled: bool | None = None
    # Hot spares (spares.py): trainer pods beyond `nodes`, waiting in the rendezvous.
    spares: int = 0
    # The diagnostics sidecar of every trainer pod (diagnostics.py).
    diagnostics: Diagnostics = Diagnostics()
    # The rendezvous-store pod's image and resources (rdzv_spec.py).
    rendezvous: Rendezvous = Rendezvous()

    @property
    def pods(self) -> int:
        """Trainer pods the job keeps: the training nodes and the spares (indices 0 .. pods-1)."""
        return self.nodes + self.spares

    @property
    def trainer_container(self) -> Mapping[str, Any]:
        return next(c for c in self.template["spec"]["containers"] if c.get("name") == names.TRAINER_CONTAINER)


@dataclass(frozen=True)
class Job:
    name: str
    namespace: str
    uid: str
    generation: int
    spec: JobSpec
    # metadata.labels[kueue.x-k8s.io/queue-name] and [.../priority-class]: the job runs behind Kueue (kueue.py).
    queue_name: str | None = None
    priority_class: str | None = None
    # The label was removed, and queue_name is the queue of the Workload the job still has (kueue.kept_queue).
    queue_label_removed: bool = False
    created: datetime | None = None  # metadata.creationTimestamp: where goodput's wall time starts


# --- helpers ---------------------------------------------------------------------------------------
_CPU = re.compile(r"^([0-9]+(?:\.[0-9]+)?)(m?)$")


def _cpus(quantity: Any) -> float | None:
    """CPU quantity ('2', '500m', 1.5) in cores; None if absent or not a plain CPU quantity."""
    if quantity is None:
        return None
    m = _CPU.match(str(quantity))
    if not m:
        return None
    return float(m.group(1)) / (1000 if m.group(2) else 1)


def _gpus(container: Mapping) -> int:
    resources = container.get("resources") or {}
    for kind in ("limits", "requests"):
        for gpu in names.GPU_RESOURCES:
            value = (resources.get(kind) or {}).get(gpu)
            if value is not None:
                try:
                    return int(str(value))
                except ValueError:
                    raise SpecError(f"spec.template.spec.containers[trainer].resources.{kind}[{gpu}]",
                                    f"must be a whole number of GPUs, got {value!r}") from None
    return 0


def _template(spec: Mapping) -> dict:
    template = spec.get("template")
    if not isinstance(template, Mapping) or not isinstance(template.get("spec"), Mapping):
        raise SpecError("spec.template.spec", "is required: a pod spec with a container named 'trainer'")
    pod = template["spec"]
    containers = pod.get("containers")
    if not isinstance(containers, list) or not containers:
        raise SpecError("spec.template.spec.containers", "must list at least the 'trainer' container")
    problem = template_problem(template)  # every field read below, and by the renderers, has its type
    if problem is not None:
        raise SpecError(*problem)
    seen = [c["name"] for c in containers]
    if names.TRAINER_CONTAINER not in seen:
        raise SpecError("spec.template.spec.containers",
                        "must contain a container named 'trainer' (the one that runs torchrun)")
    if len(set(seen)) != len(seen):
        raise SpecError("spec.template.spec.containers", "container names must be unique")
    if pod.get("restartPolicy") not in (None, "OnFailure", "Never"):
        raise SpecError("spec.template.spec.restartPolicy",
                        "must be OnFailure, Never or unset: a pod that ends is replaced by the operator")
    for key in ("hostname", "subdomain"):
        if pod.get(key):
            raise SpecError(f"spec.template.spec.{key}", "is set by the operator (<job>-<index>.<job>); remove it")
    _operator_owned(pod)
    return copy.deepcopy(dict(template))


def option_name(arg: str) -> str:
    """`--nproc_per_node=4` -> "nproc-per-node": torchrun reads `-` and `_` spellings as the same option."""
    return arg.split("=", 1)[0][2:].replace("_", "-")


def reserved_option(arg: str) -> bool:
    option = option_name(arg)
    return option in names.RESERVED_TORCHRUN_OPTIONS or option.startswith(names.RESERVED_OPTION_PREFIX)


def reserved_env(name: Any) -> bool:
    """A PET_* variable torchrun reads for an option the operator owns."""
    return isinstance(name, str) and (name in names.RESERVED_ENV or name.startswith(names.RESERVED_ENV_PREFIX))


def _operator_owned(pod: Mapping) -> None:
    """The template may not set what the operator owns: torchrun's PET_* variables (they would silently replace
    the rendezvous settings) and the names of the volumes it adds (they would replace spec.checkpoint/spec.shm)."""
    trainer = next(c for c in pod["containers"] if c["name"] == names.TRAINER_CONTAINER)
    owned = [e["name"] for e in trainer.get("env") or [] if reserved_env(e["name"])]
    if owned:
        raise SpecError("spec.template.spec.containers[trainer].env",
                        f"sets {', '.join(owned)}: torchrun options the operator owns; use the matching spec "
                        f"field (nodes, minNodes/maxNodes, nprocPerNode, torchrun.*) instead")
    volumes = [v["name"] for v in pod.get("volumes") or []]
    taken = [v for v in volumes if v in names.OPERATOR_VOLUMES]
    if taken:
        raise SpecError("spec.template.spec.volumes",
                        f"volume name {', '.join(taken)} is reserved for the operator's volumes "
                        f"({', '.join(names.OPERATOR_VOLUMES)}: spec.shm, spec.checkpoint); rename it")


def _extra_args(section: Mapping) -> tuple[str, ...]:
    args = section.get("extraArgs") or []
    if not isinstance(args, list):
        raise SpecError("spec.torchrun.extraArgs", "must be a list of '--option=value' strings")
    for arg in args:
        if not isinstance(arg, str) or not re.match(crd.EXTRA_ARG_PATTERN, arg):
            raise SpecError("spec.torchrun.extraArgs", f"{arg!r} is not of the form --option=value or --flag")
        if reserved_option(arg):
            raise SpecError("spec.torchrun.extraArgs",
                            f"{arg!r} sets an option the operator owns; use the matching spec field instead")
    options = [option_name(a) for a in args]
    repeated = sorted({o for o in options if options.count(o) > 1})
    if repeated:
        raise SpecError("spec.torchrun.extraArgs", f"sets --{', --'.join(repeated)} more than once "
                                                   f"(- and _ spell the same option)")
    return tuple(args)


def _exit_codes(section: Mapping, key: str) -> frozenset[int] | None:
    codes = section.get(key)
    if codes is None:
        return None
    if not isinstance(codes, list) or not all(isinstance(c, int) and 1 <= c <= 255 for c in codes):
        raise SpecError(f"spec.failurePolicy.{key}", "must be a list of exit codes between 1 and 255")
    return frozenset(codes)


# --- the parser -----------------------------------------------------------------------------------
def parse_spec(spec: Mapping[str, Any]) -> JobSpec:
    """Validate and default `spec`; raise SpecError naming the first offending field."""
    if not isinstance(spec, Mapping):
        raise SpecError("spec", "must be an object")
    d = crd.DEFAULTS
    nodes = _int(spec, "nodes", "spec.nodes", minimum=1, maximum=names.MAX_NODES)
    if nodes is None:
        raise SpecError("spec.nodes", "is required: the number of training pods")
    min_nodes = _int(spec, "minNodes", "spec.minNodes", default=nodes, minimum=1, maximum=names.MAX_NODES)
    max_nodes = _int(spec, "maxNodes", "spec.maxNodes", default=nodes, minimum=1, maximum=names.MAX_NODES)
    if min_nodes > max_nodes:
        raise SpecError("spec.minNodes", f"must be <= spec.maxNodes ({min_nodes} > {max_nodes})")
    if not min_nodes <= nodes <= max_nodes:
        raise SpecError("spec.nodes", f"must be within [minNodes, maxNodes] = [{min_nodes}, {max_nodes}], got {nodes}")
    spares = _int(spec, "spares", "spec.spares", default=d["spares"], maximum=names.MAX_SPARES) or 0
    if nodes + spares > names.MAX_NODES:
        raise SpecError("spec.spares", f"spec.nodes + spec.spares must be <= {names.MAX_NODES}, got {nodes + spares}")
    if spares and not min_nodes == nodes == max_nodes:
        raise SpecError("spec.spares", f"needs a fixed-size job (minNodes == maxNodes == nodes), got [{min_nodes}, "
                                       f"{max_nodes}]: torchrun would admit a spare as a training node whenever "
                                       f"fewer than maxNodes train; remove spec.spares or spec.minNodes/maxNodes")

    template = _template(spec)
    trainer = next(c for c in template["spec"]["containers"] if c.get("name") == names.TRAINER_CONTAINER)

    nproc = spec.get("nprocPerNode", d["nprocPerNode"])
    if nproc == "auto":
        nproc = _gpus(trainer) or 1
    elif isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
        raise SpecError("spec.nprocPerNode", f'must be an integer >= 1 or "auto", got {nproc!r}')

    omp = _int(spec, "ompNumThreads", "spec.ompNumThreads", minimum=1, maximum=1024)
    if omp is None:
        resources = trainer.get("resources") or {}
        cpus = _cpus((resources.get("limits") or {}).get("cpu")) or _cpus((resources.get("requests") or {}).get("cpu"))
        omp = max(1, math.floor(cpus / nproc)) if cpus else 1

    t = _section(spec, "torchrun")
    td = d["torchrun"]
    torchrun = Torchrun(
        rdzv_port=_int(t, "rdzvPort", "spec.torchrun.rdzvPort", default=td["rdzvPort"], minimum=1, maximum=65535),
        join_timeout_seconds=_int(t, "joinTimeoutSeconds", "spec.torchrun.joinTimeoutSeconds",
                                  default=td["joinTimeoutSeconds"], minimum=1,
                                  maximum=crd.MAXIMA["joinTimeoutSeconds"]),
        last_call_timeout_seconds=_int(t, "lastCallTimeoutSeconds", "spec.torchrun.lastCallTimeoutSeconds",
                                       default=td["lastCallTimeoutSeconds"],
                                       maximum=crd.MAXIMA["lastCallTimeoutSeconds"]),
        keep_alive_interval_seconds=_int(t, "keepAliveIntervalSeconds", "spec.torchrun.keepAliveIntervalSeconds",
                                         default=td["keepAliveIntervalSeconds"], minimum=1,
                                         maximum=crd.MAXIMA["keepAliveIntervalSeconds"]),
        keep_alive_max_attempts=_int(t, "keepAliveMaxAttempts", "spec.torchrun.keepAliveMaxAttempts",
                                     default=td["keepAliveMaxAttempts"], minimum=1),
        max_restarts=_int(t, "maxRestarts", "spec.torchrun.maxRestarts", default=td["maxRestarts"]),
        extra_args=_extra_args(t),
        rdzv_backend=t.get("rdzvBackend", td["rdzvBackend"]),
    )
    if torchrun.rdzv_port == names.PROGRESS_PORT:
        raise SpecError("spec.torchrun.rdzvPort", f"must differ from the progress port {names.PROGRESS_PORT}")
    if torchrun.rdzv_backend not in names.RDZV_BACKENDS:
        raise SpecError("spec.torchrun.rdzvBackend", f"must be one of {', '.join(names.RDZV_BACKENDS)}, got "
                                                     f"{torchrun.rdzv_backend!r}")
    if spares and torchrun.rdzv_backend == names.RDZV_BACKEND:
        raise SpecError("spec.torchrun.rdzvBackend", f"spares need the {names.RDZV_BACKEND_SPARES} backend (torch's "
                                                     f"c10d livelocks with a spare): set auto or remove spec.spares")

    f = _section(spec, "failurePolicy")
    fd = d["failurePolicy"]
    permanent = _exit_codes(f, "permanentExitCodes")
    retryable = _exit_codes(f, "retryableExitCodes")
    if permanent is not None and retryable is not None:
        raise SpecError("spec.failurePolicy", "set permanentExitCodes or retryableExitCodes, not both")
    count_disruptions = f.get("countDisruptions", fd["countDisruptions"])
    if not isinstance(count_disruptions, bool):
        raise SpecError("spec.failurePolicy.countDisruptions", "must be true or false")
    failure_policy = FailurePolicy(
        backoff_limit=_int(f, "backoffLimit", "spec.failurePolicy.backoffLimit", default=fd["backoffLimit"]),
        infra_backoff_limit=_int(f, "infraBackoffLimit", "spec.failurePolicy.infraBackoffLimit",
                                 default=fd["infraBackoffLimit"], maximum=100000),
        permanent_exit_codes=permanent or frozenset(),
        retryable_exit_codes=retryable,
        count_disruptions=count_disruptions,
        incident_window_seconds=_int(f, "incidentWindowSeconds", "spec.failurePolicy.incidentWindowSeconds",
                                     default=fd["incidentWindowSeconds"],
                                     maximum=crd.MAXIMA["incidentWindowSeconds"]),
        stuck_terminating_timeout_seconds=_int(
            f, "stuckTerminatingTimeoutSeconds", "spec.failurePolicy.stuckTerminatingTimeoutSeconds",
            default=fd["stuckTerminatingTimeoutSeconds"], minimum=1,
            maximum=crd.MAXIMA["stuckTerminatingTimeoutSeconds"]),
        hang_timeout_seconds=_int(f, "hangTimeoutSeconds", "spec.failurePolicy.hangTimeoutSeconds",
                                  default=fd["hangTimeoutSeconds"], maximum=crd.MAXIMA["hangTimeoutSeconds"]),
        startup_timeout_seconds=_int(f, "startupTimeoutSeconds", "spec.failurePolicy.startupTimeoutSeconds",
                                     default=fd["startupTimeoutSeconds"], maximum=crd.MAXIMA["startupTimeoutSeconds"]),
        node_lost_timeout_seconds=_int(f, "nodeLostTimeoutSeconds", "spec.failurePolicy.nodeLostTimeoutSeconds",
                                       default=fd["nodeLostTimeoutSeconds"],
                                       maximum=crd.MAXIMA["nodeLostTimeoutSeconds"]),
        process_group_timeout_seconds=_int(
            f, "processGroupTimeoutSeconds", "spec.failurePolicy.processGroupTimeoutSeconds",
            default=fd["processGroupTimeoutSeconds"], maximum=crd.MAXIMA["processGroupTimeoutSeconds"]),
    )

    r = _section(spec, "runPolicy")
    suspend = r.get("suspend", d["runPolicy"]["suspend"])
    if not isinstance(suspend, bool):
        raise SpecError("spec.runPolicy.suspend", "must be true or false")
    clean = r.get("cleanPodPolicy", d["runPolicy"]["cleanPodPolicy"])
    if clean not in crd.CLEAN_POD_POLICIES:
        raise SpecError("spec.runPolicy.cleanPodPolicy", f"must be one of {', '.join(crd.CLEAN_POD_POLICIES)}, got {clean!r}")
    run_policy = RunPolicy(
        suspend=suspend,
        active_deadline_seconds=_int(r, "activeDeadlineSeconds", "spec.runPolicy.activeDeadlineSeconds", minimum=1,
                                     maximum=crd.MAXIMA["activeDeadlineSeconds"]),
        ttl_seconds_after_finished=_int(r, "ttlSecondsAfterFinished", "spec.runPolicy.ttlSecondsAfterFinished",
                                        maximum=crd.MAXIMA["ttlSecondsAfterFinished"]),
        clean_pod_policy=clean,
    )

    s = _section(spec, "shm")
    medium = s.get("medium", d["shm"]["medium"])
    if medium not in ("Memory", ""):
        raise SpecError("spec.shm.medium", f'must be "Memory" or "", got {medium!r}')
    size_limit = s.get("sizeLimit")
    if size_limit is not None and (isinstance(size_limit, bool) or not isinstance(size_limit, (str, int))):
        raise SpecError("spec.shm.sizeLimit", f'must be a quantity such as "8Gi", got {size_limit!r}')
    shm = Shm(medium=medium, size_limit=size_limit)

    checkpoint = None
    if spec.get("checkpoint") is not None:
        c = _section(spec, "checkpoint")
        volume = c.get("volume")
        if not isinstance(volume, Mapping) or not volume:
            raise SpecError("spec.checkpoint.volume",
                            "is required: a volume source such as {persistentVolumeClaim: {claimName: ckpt}}")
        mount_path = c.get("mountPath", d["checkpoint"]["mountPath"])
        if not isinstance(mount_path, str) or not mount_path.startswith("/"):
            raise SpecError("spec.checkpoint.mountPath", f"must be an absolute path, got {mount_path!r}")
        checkpoint = Checkpoint(volume=copy.deepcopy(dict(volume)), mount_path=mount_path)

    diagnostics = parse_diagnostics(_section(spec, "diagnostics"), template["spec"], d["diagnostics"])
    network_policy_enabled = _section(spec, "networkPolicy").get("enabled")
    if network_policy_enabled is not None and not isinstance(network_policy_enabled, bool):
        raise SpecError("spec.networkPolicy.enabled", "must be true or false")

    return JobSpec(
        nodes=nodes, min_nodes=min_nodes, max_nodes=max_nodes, nproc_per_node=nproc, omp_num_threads=omp,
        progress_period_seconds=_int(spec, "progressPeriodSeconds", "spec.progressPeriodSeconds",
                                     default=d["progressPeriodSeconds"],
                                     maximum=crd.MAXIMA["progressPeriodSeconds"]),
        template=template, torchrun=torchrun, failure_policy=failure_policy, run_policy=run_policy, shm=shm,
        checkpoint=checkpoint, network_policy_enabled=network_policy_enabled, spares=spares, diagnostics=diagnostics,
        rendezvous=parse_rendezvous(_section(spec, "rendezvous")),
    )


def parse_job(body: Mapping[str, Any]) -> Job:
    """A DDPJob API object (dict or kopf Body) as a Job; raises SpecError."""
    meta = body.get("metadata") or {}
    name = meta.get("name") or ""
    if len(name) > names.MAX_NAME_LENGTH:
        raise SpecError("metadata.name", f"must be at most {names.MAX_NAME_LENGTH} characters so pod names "
                                         f"<job>-rdzv and <job>-<index> stay within 63")
    if not re.match(crd.NAME_PATTERN, name):
        raise SpecError("metadata.name", "must be a DNS-1035 label (lowercase letters, digits and '-', "
                                         "starting with a letter)")
    labels = meta.get("labels") or {}
    return Job(
        name=name,
        namespace=meta.get("namespace") or "default",
        uid=meta.get("uid") or "",
        generation=int(meta.get("generation") or 0),
        spec=parse_spec(body.get("spec") or {}),
        queue_name=_kueue_label(labels, names.LABEL_QUEUE_NAME, "LocalQueue"),
        priority_class=_kueue_label(labels, names.LABEL_PRIORITY_CLASS, "WorkloadPriorityClass"),
        created=parse_time(meta.get("creationTimestamp")),
    )


def _kueue_label(labels: Mapping[str, Any], key: str, kind: str) -> str | None:
    """A Kueue label's value: the name of a Kueue object (a DNS-1123 subdomain), or None when absent or empty."""
    value = labels.get(key)
    if not value:
        return None
    if len(value) > 253 or not re.fullmatch(_DNS_SUBDOMAIN, value):
        raise SpecError(f"metadata.labels[{key}]", f"must name a {kind} (lowercase letters, digits, '-' and '.'), "
                                                   f"not {value!r}")
    return value


_DNS_SUBDOMAIN = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*"
