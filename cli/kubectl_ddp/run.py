"""`kubectl ddp run train.py [-- args]`: a script (or a small directory) as a DDPJob, then followed to its end.

The script travels in a ConfigMap (`<job>-script`) mounted read-only at SCRIPT_DIR in the stock trainer image (or
`--image`), and the trainer runs `torchrun <script> <args>`: the operator passes every torchrun option as PET_*
variables. The ConfigMap is created first (so no pod ever waits for its volume) and handed to the job once the job
exists, so deleting the job deletes it. A ConfigMap holds at most 1 MiB: beyond that the message says to bake the
code into an image and run it with `--image I --in-image` (nothing uploaded; docs/cli.md).

Following (`follow`): a progress line (phase, nodes, step, epoch, loss, samples/s, ETA when the script reports
`totalSteps`) kept at the bottom of the terminal, global rank 0's output streamed above it (the pod
status.progress.pod names: the rendezvous, not the pod index, decides where rank 0 runs; kubectl_ddp.logs follows
it when it is replaced or restarted, and `run` moves to another pod when rank 0 does), and each incident and
recovery announced as the operator records it. The
exit status is the job's result: 0 Succeeded, 1 Failed; Ctrl-C detaches (130) and says how to reattach or delete.
"""

from __future__ import annotations

import base64
import os
import re
import secrets
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Mapping, TextIO

import urllib3

from ddp_operator import names

from kubectl_ddp import logs, view
from kubectl_ddp.kube import CliError, Kube, unreachable

DEFAULT_IMAGE = "localhost/ddp-trainer:0.1.0"
SCRIPT_DIR = "/ddp/script"
SCRIPT_VOLUME = "script"
CREATED_BY = "kubectl-ddp"
LABEL_CREATED_BY = "app.kubernetes.io/created-by"
# The API server refuses a ConfigMap whose data is larger than 1 MiB; keys and the object's own fields need room.
MAX_SCRIPT_BYTES = 1024 * 1024 - 16 * 1024
MAX_FILES = 256
SKIPPED = {"__pycache__", ".git", ".hg", ".svn", ".venv", "venv", ".mypy_cache", ".pytest_cache", ".ipynb_checkpoints"}
_KEY_CHARS = re.compile(r"[^-._a-zA-Z0-9]")
POLL_SECONDS = 1.0


def script_files(path: Path) -> dict[str, tuple[str, bytes]]:
    """ConfigMap key -> (path under SCRIPT_DIR, content) for a script or a directory (caches and VCS folders
    left out). Raises CliError when it cannot travel in a ConfigMap."""
    if path.is_file():
        found = [(path.name, path)]
    elif path.is_dir():
        found = []
        for root, dirs, files in os.walk(path):
            dirs[:] = sorted(d for d in dirs if d not in SKIPPED)
            for f in sorted(files):
                if not f.endswith(".pyc"):
                    full = Path(root) / f
                    found.append((full.relative_to(path).as_posix(), full))
    else:
        raise CliError(f"{path}: no such file or directory")
    if len(found) > MAX_FILES:
        raise CliError(f"{path} holds {len(found)} files, more than a ConfigMap should carry ({MAX_FILES}): "
                       f"bake them into an image (FROM {DEFAULT_IMAGE}; docs/cli.md) and run it with "
                       f"--image IMAGE --in-image")
    out: dict[str, tuple[str, bytes]] = {}
    total = 0
    for rel, full in found:
        data = full.read_bytes()
        key = _KEY_CHARS.sub("_", rel.replace("/", "__"))
        while key in out:
            key = "_" + key
        out[key] = (rel, data)
        total += len(key) + len(data)  # the API server counts the keys too
    if total > MAX_SCRIPT_BYTES:
        raise CliError(f"{path} is {total / 1024:.0f} KiB; a ConfigMap carries at most {MAX_SCRIPT_BYTES // 1024} KiB: "
                       f"bake the code into an image (FROM {DEFAULT_IMAGE}; docs/cli.md) and run it with "
                       f"--image IMAGE --in-image")
    return out


def script_config_map(name: str, job: str, files: Mapping[str, tuple[str, bytes]]) -> dict:
    data, binary = {}, {}
    for key, (_, content) in files.items():
        try:
            data[key] = content.decode("utf-8")
        except UnicodeDecodeError:
            binary[key] = base64.b64encode(content).decode()
    body = {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": name, "labels": {names.LABEL_JOB_NAME: job, LABEL_CREATED_BY: CREATED_BY}},
            "data": data}
    if binary:
        body["binaryData"] = binary
    return body


def job_name(script: Path, given: str | None) -> str:
    """--name, or the script's name made a DNS-1035 label plus a random suffix (runs of one script never clash)."""
    if given:
        return given
    stem = re.sub(r"[^a-z0-9-]+", "-", script.stem.lower()).strip("-")
    stem = re.sub(r"^[^a-z]+", "", stem)[:names.MAX_NAME_LENGTH - 6] or "ddp"
    return f"{stem}-{secrets.token_hex(3)[:5]}"


def job_manifest(name: str, *, entry: str, args: list[str], files: Mapping[str, tuple[str, bytes]], nodes: int,
                 nproc_per_node: str, spares: int, image: str, cpu: str, memory: str,
                 checkpoint_claim: str | None, progress_period: int, backoff_limit: int | None = None,
                 max_restarts: int | None = None, memory_limit: str | None = None) -> dict:
    """The DDPJob: the stock trainer's hardening (non-root, read-only root, /tmp an emptyDir), the script mounted
    (no `files`: the code is in the image, run from its own working directory)."""
    nproc: Any = "auto" if nproc_per_node == "auto" else int(nproc_per_node)
    script_volume = [{"name": SCRIPT_VOLUME, "configMap": {
        "name": f"{name}-script", "items": [{"key": k, "path": rel} for k, (rel, _) in sorted(files.items())]}}]
    script_mount = [{"name": SCRIPT_VOLUME, "mountPath": SCRIPT_DIR, "readOnly": True}]
    spec: dict[str, Any] = {
        "nodes": nodes,
        "nprocPerNode": nproc,
        "progressPeriodSeconds": progress_period,
        "template": {"spec": {
            "securityContext": {"runAsNonRoot": True, "runAsUser": 1000, "seccompProfile": {"type": "RuntimeDefault"}},
            "containers": [{
                "name": names.TRAINER_CONTAINER,
                "image": image,
                "imagePullPolicy": "IfNotPresent",
                "command": ["torchrun", entry, *args],
                **({"workingDir": SCRIPT_DIR} if files else {}),
                "resources": {"requests": {"cpu": cpu, "memory": memory},
                              **({"limits": {"memory": memory_limit}} if memory_limit else {})},
                "securityContext": {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                    "capabilities": {"drop": ["ALL"]}},
                "volumeMounts": [*(script_mount if files else []), {"name": "tmp", "mountPath": "/tmp"}],
            }],
            "volumes": [*(script_volume if files else []), {"name": "tmp", "emptyDir": {}}],
        }},
    }
    if spares:
        spec["spares"] = spares
    if backoff_limit is not None:
        spec["failurePolicy"] = {"backoffLimit": backoff_limit}
    if max_restarts is not None:
        spec["torchrun"] = {"maxRestarts": max_restarts}
    if checkpoint_claim:
        spec["checkpoint"] = {"volume": {"persistentVolumeClaim": {"claimName": checkpoint_claim}}}
    return {"apiVersion": names.API_VERSION, "kind": names.KIND,
            "metadata": {"name": name, "labels": {LABEL_CREATED_BY: CREATED_BY}}, "spec": spec}


def checkpoint_claim(name: str, size: str, storage_class: str | None) -> dict:
    """The checkpoint volume: ReadWriteMany, since global rank 0 writes it and a replacement may run rank 0 on
    another machine."""
    spec: dict[str, Any] = {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": size}}}
    if storage_class is not None:
        spec["storageClassName"] = storage_class
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim",
            "metadata": {"name": name, "labels": {LABEL_CREATED_BY: CREATED_BY}}, "spec": spec}


def submit(kube: Kube, args: Any) -> str:
    """Create the script's ConfigMap, the checkpoint claim and the job; returns the job's name."""
    path = Path(args.script)
    if args.in_image:  # baked into the image: nothing travels
        files, entry = {}, args.script
    else:
        files = script_files(path)
        entry = path.name if path.is_file() else args.entry
        if not entry or not any(rel == entry for rel, _ in files.values()):
            raise CliError(f"{path} is a directory: name the script to run in it with --entry (e.g. --entry "
                           f"train.py)")
    name = job_name(path, args.name)
    claim = f"{name}-checkpoint" if args.checkpoint else None
    body = job_manifest(name, entry=entry, args=list(args.args), files=files, nodes=args.nodes,
                        nproc_per_node=args.nproc_per_node, spares=args.spares, image=args.image, cpu=args.cpu,
                        memory=args.memory, checkpoint_claim=claim, progress_period=args.progress_period,
                        backoff_limit=args.backoff_limit, max_restarts=args.max_restarts,
                        memory_limit=args.memory_limit)
    made: list[tuple[str, str]] = []
    try:
        if files:
            kube.create_config_map(script_config_map(f"{name}-script", name, files))
            made.append(("ConfigMap", f"{name}-script"))
        if claim:
            kube.create_pvc(checkpoint_claim(claim, args.checkpoint, args.storage_class))
            made.append(("PersistentVolumeClaim", claim))
        job = kube.create_job(body)
    except (CliError, urllib3.exceptions.HTTPError):
        for kind, what in made:  # nothing half-made stays behind
            kube.delete(kind, what)
        raise
    for kind, what in made:
        kube.own(kind, what, job)
    return name


def follow(kube: Kube, name: str, console: Any, out: TextIO = sys.stdout) -> int:
    """Watch the job to its end; the exit status of `run`."""
    from rich.live import Live
    from rich.text import Text

    stop = threading.Event()
    writer = _ConsoleLines(console)
    streamer: threading.Thread | None = None
    streaming: int | None = None  # the pod index whose log is streamed: global rank 0's
    seen: dict[str, Any] = {}
    since: tuple[float, float] | None = None
    live = Live(Text(""), console=console, refresh_per_second=4, transient=True) if console.is_terminal else None
    try:
        if live:
            live.start()
        while True:
            try:
                job = kube.job(name)
                index = _rank0_index(kube, name, view.progress(job).get("pod"))
            except urllib3.exceptions.HTTPError as e:  # the job goes on without us: so does following it
                if not seen.get("unreachable"):
                    console.print(Text(f"--- {unreachable(e, kube.api.configuration.host)} (retrying)", style="red"))
                seen["unreachable"] = True
                time.sleep(POLL_SECONDS)
                continue
            seen["unreachable"] = False
            status = job.get("status") or {}
            p = view.progress(job)
            if since is None and isinstance(p.get("time"), (int, float)) and isinstance(p.get("step"), int):
                since = (float(p["time"]), float(p["step"]))
            for line in announcements(seen, status):
                console.print(Text(line, style="bold yellow"))
            line = view.progress_line(job, view.eta_seconds(p, since), console.width if live else None)
            if live:  # one row: a live line that wraps leaves its second row behind on some terminals
                live.update(Text(line, style="bold", no_wrap=True, overflow="ellipsis"))
            elif seen.get("line") != line:
                console.print(line)
            seen["line"] = line
            if index is not None and index != streaming:
                if streamer is not None:  # global rank 0 moved to another pod (a recovery): follow it there
                    stop.set()
                    writer.write(f"--- rank 0 is now in pod {p.get('pod')}\n")
                    stop = threading.Event()
                streaming = index
                streamer = threading.Thread(target=_stream, args=(kube, name, index, writer, stop), daemon=True,
                                            name="rank0-log")
                streamer.start()
            if view.finished(job):
                break
            time.sleep(POLL_SECONDS)
    except KeyboardInterrupt:
        stop.set()
        writer.close()  # the streamer prints nothing more: the interpreter may shut down under it
        if live:
            live.stop()
        console.print(f"\ndetached from {name}; it keeps running.\n  reattach:  kubectl ddp logs {name} -f -n "
                      f"{kube.namespace}   (or: kubectl ddp top {name})\n  delete:    kubectl delete ddpj {name} "
                      f"-n {kube.namespace}")
        return 130
    finally:
        if live and live.is_started:
            live.stop()
    if streamer is not None:
        streamer.join(timeout=10)  # the last lines of rank 0's log
    stop.set()
    writer.close()
    if view.progress_line(job) != seen.get("line") or live:
        console.print(Text(view.progress_line(job), style="bold"))
    if view.phase(job) == names.PHASE_SUCCEEDED:
        return 0
    console.print(Text(f"{name} failed: {status.get('reason', '')} {status.get('message', '')}".rstrip(),
                       style="bold red"))
    return 1


def announcements(seen: dict[str, Any], status: Mapping[str, Any]) -> list[str]:
    """Lines for what changed since the last call: a new incident, a new recovery record, the phase."""
    out = []
    incident = status.get("lastIncident") if isinstance(status.get("lastIncident"), Mapping) else None
    if incident and incident != seen.get("incident") and "incident" in seen:
        out.append(f"! incident: {incident.get('reason', 'Unknown')} at {incident.get('time', '?')}; recovering")
    seen["incident"] = incident
    recovery = status.get("lastRecovery") if isinstance(status.get("lastRecovery"), Mapping) else None
    if recovery and recovery != seen.get("recovery") and "recovery" in seen:
        line = view.recovery_line(recovery)
        if line:
            out.append(f"! {line}")
    seen["recovery"] = recovery
    phase = status.get("phase")
    if phase != seen.get("phase") and phase:
        message = status.get("message")
        out.append(f"> {phase}" + (f": {message}" if isinstance(message, str) and message else ""))
    seen["phase"] = phase
    return out


def _rank0_index(kube: Kube, name: str, rank0_pod: Any) -> int | None:
    """The pod index (ddp.dev/node-index) of global rank 0's pod (status.progress.pod; the rendezvous, not the
    index, decides which pod holds rank 0), or of pod 0 before any report, once its trainer has started."""
    for pod in kube.pods(name):
        meta = pod.get("metadata") or {}
        index = (meta.get("labels") or {}).get(names.LABEL_NODE_INDEX)
        if not isinstance(index, str) or not index.isdigit():
            continue
        if (rank0_pod and meta.get("name") == rank0_pod) or (not rank0_pod and index == "0" and any(
                c.get("name") == names.TRAINER_CONTAINER and set(c.get("state") or {}) & {"running", "terminated"}
                for c in (pod.get("status") or {}).get("containerStatuses") or [])):
            return int(index)
    return None


def _stream(kube: Kube, name: str, index: int, out: TextIO, stop: threading.Event) -> None:
    try:
        logs.show_logs(kube.core, kube.namespace, name, follow=True, rank=index, previous=False, out=out, stop=stop)
    except Exception as e:  # the log is a courtesy of `run`: the job's result still decides
        out.write(f"--- rank 0's log stopped: {e}\n")


class _ConsoleLines:
    """A text stream whose whole lines go to the rich console (above a live progress line), until `close`.

    The log streamer is a daemon thread that may still be reading when `run` returns (Ctrl-C): a daemon thread
    printing while the interpreter shuts down aborts it ("Fatal Python error: _enter_buffered_busy", exit 134). Lines
    are printed under the lock, and `close` takes it: once it returns, no line is being printed or will be."""

    def __init__(self, console: Any):
        self.console = console
        self._partial = ""
        self._lock = threading.Lock()
        self._closed = False

    def write(self, s: str) -> int:
        from rich.text import Text
        with self._lock:
            if self._closed:
                return len(s)
            *lines, self._partial = (self._partial + s).split("\n")
            for line in lines:
                self.console.print(Text(line), soft_wrap=True, highlight=False)
        return len(s)

    def close(self) -> None:
        with self._lock:
            self._closed = True

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return False


def now() -> datetime:
    return datetime.now(timezone.utc)
