"""One component of the host's running cluster at a time, for fault injection: `restart`, `stop` (its exact
command line, working directory and environment kept in <owner>/.cluster/pids/<name>.stopped.json) and
`start` (exactly that again), whichever checkout owns the cluster."""
from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

from hack.common import API_URL, COMPONENTS, STATE, ClusterError, log, path_env
from hack.components import HEALTH, argv_for, http_ok, kill_group, ssl_context
from hack.host import component_processes, owner

# --------------------------------------------------------------------------------------------
# one component at a time (fault injection): restart / stop / start

ALIASES = {"apiserver": "kube-apiserver", "controller-manager": "kube-controller-manager",
           "scheduler": "kube-scheduler", "proxy": "kube-proxy"}
SINGLE = [n for n in COMPONENTS if n != "containerd"]  # containerd holds every container: never alone


def component_name(name: str) -> str:
    name = ALIASES.get(name, name)
    if name not in SINGLE:
        raise ClusterError(f"unknown component {name!r}: one of {', '.join(SINGLE)} "
                           f"(aliases: {', '.join(ALIASES)})")
    return name


def _host_state() -> Path:
    """.cluster/ of the checkout whose cluster runs on this host (this one when none runs)."""
    o = owner()
    return Path(o["repo"]) / ".cluster" if o else STATE


def _running_component(name: str) -> tuple[int, Path] | None:
    """(pid, its checkout's .cluster/) of a running component of this host's cluster: the process
    leading its own session (start() makes every component one), not a child it spawned."""
    for repo, procs in component_processes().items():
        for pid, n in procs:
            try:
                stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if n == name and int(stat[3]) == pid:  # session id == pid
                return pid, repo / ".cluster"
    return None


def _launch_record(pid: int) -> dict:
    proc = Path(f"/proc/{pid}")
    argv = [a.decode() for a in (proc / "cmdline").read_bytes().split(b"\0")[:-1]]
    env = dict(e.decode(errors="replace").split("=", 1) for e in (proc / "environ").read_bytes().split(b"\0")
               if b"=" in e)
    return {"argv": argv, "cwd": os.readlink(proc / "cwd").removesuffix(" (deleted)"), "env": env}



def _component_healthy(name: str, state: Path) -> bool:
    if name == "kube-apiserver":  # the owner's PKI, which may not be this checkout's
        return http_ok(f"{API_URL}/readyz", ssl_context(pki=state / "pki"))
    return bool(HEALTH[name]())


def stop_component(name: str) -> dict:
    """Stop one component of the host's cluster, remembering how to start it again."""
    name = component_name(name)
    found = _running_component(name)
    if found is None:
        raise ClusterError(f"{name} is not running")
    pid, state = found
    rec = _launch_record(pid)
    (state / "pids" / f"{name}.stopped.json").write_text(json.dumps(rec) + "\n")
    t0 = time.monotonic()
    kill_group(name, pid)
    (state / "pids" / f"{name}.pid").unlink(missing_ok=True)
    log(f"stopped {name} (pid {pid}, {time.monotonic() - t0:.1f}s)")
    return rec


def start_component(name: str, rec: dict | None = None, timeout: float = 120) -> int:
    """Start one stopped component again exactly as it ran; wait until it is healthy. Returns its pid."""
    name = component_name(name)
    found = _running_component(name)
    if found is not None:
        log(f"{name} is already running (pid {found[0]})")
        return found[0]
    state = _host_state()
    saved = state / "pids" / f"{name}.stopped.json"
    if rec is None and saved.exists():
        rec = json.loads(saved.read_text())
    if rec is None:
        if state != STATE:
            raise ClusterError(f"{name} was not stopped by `hack/cluster.py stop`: run `make cluster-up` in "
                               f"{state.parent}")
        rec = {"argv": argv_for(name), "cwd": str(STATE), "env": {**os.environ, "PATH": path_env()}}
    state = Path(rec["cwd"])
    (state / "logs").mkdir(parents=True, exist_ok=True)
    with open(state / "logs" / f"{name}.log", "ab") as out:
        out.write(f"# {time.strftime('%F %T')} started again by hack/cluster.py start\n".encode())
        out.flush()
        p = subprocess.Popen(rec["argv"], stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                             cwd=state, start_new_session=True, env=rec["env"])
    (state / "pids").mkdir(parents=True, exist_ok=True)
    (state / "pids" / f"{name}.pid").write_text(str(p.pid))
    saved.unlink(missing_ok=True)
    t0 = time.monotonic()
    deadline = t0 + timeout
    while not _component_healthy(name, state):
        if p.poll() is not None:
            raise ClusterError(f"{name} exited ({p.returncode}) after starting again; see {state / 'logs' / name}.log")
        if time.monotonic() > deadline:
            raise ClusterError(f"{name} not healthy {timeout:.0f}s after starting again")
        time.sleep(0.1)
    log(f"started {name} (pid {p.pid}), healthy after {time.monotonic() - t0:.1f}s")
    return p.pid


def restart_component(name: str) -> int:
    return start_component(name, stop_component(name))
