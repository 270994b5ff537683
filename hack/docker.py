#!/usr/bin/env python3
"""A private Docker engine for kind, beside (never instead of) anything else on the host.

    hack/docker.py up       start dockerd and its containerd, wait until `docker info` answers (no-op when up)
    hack/docker.py down     stop dockerd (it stops its containers) and then its containerd; data is kept
    hack/docker.py status   running or not, with pids, socket and runtime
    hack/docker.py env      `export DOCKER_HOST=...` for the engine:  eval "$(hack/docker.py env)"

Debian's docker.io package provides dockerd (hack/install-deps.sh --docker installs it); no systemd
unit is used, the daemons run detached and are tracked by their pid files. What this engine owns:
    socket     unix:///run/ddpjob-docker.sock          pid files /run/ddpjob-docker{,-containerd}.pid
    data       /var/lib/ddpjob/docker (images, volumes; containerd's content under containerd/)
    state      /run/ddpjob-docker (dockerd's exec-root; containerd's state and socket under containerd/)
    logs       /var/lib/ddpjob/docker-logs/{dockerd,containerd}.log

Why it looks the way it does:
- Its own containerd, started here and handed to dockerd with --containerd. A dockerd left to find one
  would use /run/containerd/containerd.sock whenever a system containerd runs, and the embedded cluster
  (hack/cluster.py) has its own containerd at /run/ddpjob; neither is touched.
- --iptables=false --ip-masq=false: Docker would otherwise add its chains and set the FORWARD policy to
  DROP, which cuts off the embedded cluster's pods. kind does not need them: its nodes talk over the
  `kind` bridge, the API server is published on 127.0.0.1 by docker-proxy (the userland proxy), and
  containers need no NAT to the outside (everything is offline). With br_netfilter loaded, traffic between
  kind nodes still crosses the host's FORWARD chain, so `up` warns when that chain's policy is DROP.
- --bridge=none: no default `docker0` (it would collide with another Docker on the host); kind creates
  its own network, and other containers name one with --network.
- Where the host's capability bounding set is incomplete (some sandboxed VMs lack CAP_SYS_RESOURCE),
  `docker run --privileged` fails with "unable to apply caps"; hack/docker-capshim, registered as the
  default runtime only then, drops exactly the missing capabilities before runc runs.
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

HACK = Path(__file__).resolve().parent
CAPSHIM = HACK / "docker-capshim"
CAPSHIM_RUNTIME = "ddpjob-capshim"

DATA_ROOT = Path("/var/lib/ddpjob/docker")
EXEC_ROOT = Path("/run/ddpjob-docker")
SOCK = Path("/run/ddpjob-docker.sock")
DOCKER_HOST = f"unix://{SOCK}"
PIDFILE = Path("/run/ddpjob-docker.pid")
LOGS = Path("/var/lib/ddpjob/docker-logs")

CONTAINERD_ROOT = DATA_ROOT / "containerd"
CONTAINERD_STATE = EXEC_ROOT / "containerd"
CONTAINERD_SOCK = CONTAINERD_STATE / "containerd.sock"
CONTAINERD_CONFIG = CONTAINERD_STATE / "config.toml"
CONTAINERD_PIDFILE = Path("/run/ddpjob-docker-containerd.pid")

START_TIMEOUT_S = 60
STOP_TIMEOUT_S = 90  # dockerd gives each container its stop timeout (kind nodes: 10 s) before SIGKILL
SYS_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


class EngineError(RuntimeError):
    pass


def log(msg: str) -> None:
    print(f"[docker {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def read_pid(pidfile: Path, binary: str) -> int | None:
    """The pid in `pidfile` when that process is alive and runs `binary`."""
    try:
        pid = int(pidfile.read_text().strip())
        exe = os.readlink(f"/proc/{pid}/exe")
    except (OSError, ValueError):
        return None
    return pid if os.path.basename(exe.removesuffix(" (deleted)")) == binary else None


def docker(*args: str, check: bool = True, timeout: float | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["docker", "-H", DOCKER_HOST, *args], capture_output=True, text=True,
                          check=check, timeout=timeout)


def answers() -> bool:
    try:
        return docker("info", "--format", "{{.ServerVersion}}", check=False, timeout=10).returncode == 0
    except subprocess.TimeoutExpired:
        return False


def missing_capabilities() -> bool:
    """True when this host's capability bounding set lacks a capability the kernel knows."""
    with open("/proc/self/status") as f:
        bnd = int(next(line for line in f if line.startswith("CapBnd:")).split()[1], 16)
    last = int(Path("/proc/sys/kernel/cap_last_cap").read_text())
    return bnd & ((1 << (last + 1)) - 1) != (1 << (last + 1)) - 1


def forward_policy() -> str | None:
    try:
        out = subprocess.run(["iptables", "-S", "FORWARD"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    return next((line.split()[2] for line in out.splitlines() if line.startswith("-P FORWARD")), None)


def spawn(argv: list[str], logfile: Path) -> int:
    """Start a daemon detached from this process (own session, stdin closed, output to its log)."""
    LOGS.mkdir(parents=True, exist_ok=True)
    with open(logfile, "ab") as out:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True, env={**os.environ, "PATH": SYS_PATH})
    return proc.pid


def wait_for(what: str, ready, pid: int, logfile: Path, timeout: float = START_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ready():
            return
        if not Path(f"/proc/{pid}").exists():
            break
        time.sleep(0.5)
    tail = logfile.read_text(errors="replace").splitlines()[-15:] if logfile.exists() else []
    raise EngineError(f"{what} did not come up (log {logfile}):\n" + "\n".join(tail))


def start_containerd() -> None:
    if read_pid(CONTAINERD_PIDFILE, "containerd") and CONTAINERD_SOCK.is_socket():
        return
    CONTAINERD_STATE.mkdir(parents=True, exist_ok=True)
    CONTAINERD_ROOT.mkdir(parents=True, exist_ok=True)
    # What dockerd would give a containerd it manages itself: no CRI plugin (not a kubelet's runtime).
    CONTAINERD_CONFIG.write_text(
        "version = 2\n"
        f'root = "{CONTAINERD_ROOT}"\n'
        f'state = "{CONTAINERD_STATE}"\n'
        'disabled_plugins = ["io.containerd.grpc.v1.cri"]\n'
        "oom_score = -500\n"
        "[grpc]\n"
        f'  address = "{CONTAINERD_SOCK}"\n'
    )
    logfile = LOGS / "containerd.log"
    pid = spawn(["containerd", "--config", str(CONTAINERD_CONFIG)], logfile)
    CONTAINERD_PIDFILE.write_text(f"{pid}\n")
    wait_for("containerd", CONTAINERD_SOCK.is_socket, pid, logfile)


def dockerd_argv() -> list[str]:
    argv = ["dockerd", "--data-root", str(DATA_ROOT), "--exec-root", str(EXEC_ROOT), "-H", DOCKER_HOST,
            "--pidfile", str(PIDFILE), "--containerd", str(CONTAINERD_SOCK),
            "--iptables=false", "--ip-masq=false", "--bridge=none"]
    if missing_capabilities():
        argv += ["--add-runtime", f"{CAPSHIM_RUNTIME}={CAPSHIM}", "--default-runtime", CAPSHIM_RUNTIME]
    return argv


def up() -> None:
    if not shutil.which("dockerd"):
        raise EngineError("dockerd is not installed: run hack/install-deps.sh --docker (Debian package docker.io)")
    if read_pid(PIDFILE, "dockerd") and answers():
        log(f"engine up at {DOCKER_HOST}")
        return
    start_containerd()
    if not read_pid(PIDFILE, "dockerd"):
        DATA_ROOT.mkdir(parents=True, exist_ok=True)
        argv = dockerd_argv()
        log("starting dockerd" + (f" with runtime {CAPSHIM_RUNTIME} (host lacks capabilities)"
                                  if CAPSHIM_RUNTIME in argv else ""))
        pid = spawn(argv, LOGS / "dockerd.log")
    else:
        pid = read_pid(PIDFILE, "dockerd")
    wait_for("dockerd", answers, pid, LOGS / "dockerd.log")
    if forward_policy() == "DROP":
        log("warning: the host's iptables FORWARD policy is DROP; with br_netfilter, kind nodes cannot "
            "reach each other until it is ACCEPT (or a rule accepts the kind bridge)")
    log(f"engine up at {DOCKER_HOST}")


def stop(pidfile: Path, binary: str, timeout: float) -> None:
    pid = read_pid(pidfile, binary)
    if not pid:
        pidfile.unlink(missing_ok=True)
        return
    log(f"stopping {binary} (pid {pid})")
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.5)
    if Path(f"/proc/{pid}").exists():
        log(f"{binary} still running after {timeout:.0f}s: SIGKILL")
        os.kill(pid, signal.SIGKILL)
    pidfile.unlink(missing_ok=True)


def down() -> None:
    stop(PIDFILE, "dockerd", STOP_TIMEOUT_S)
    stop(CONTAINERD_PIDFILE, "containerd", 30)
    SOCK.unlink(missing_ok=True)


def status() -> int:
    dpid, cpid = read_pid(PIDFILE, "dockerd"), read_pid(CONTAINERD_PIDFILE, "containerd")
    ok = bool(dpid) and answers()
    print(f"dockerd     {'running' if ok else 'stopped'}" + (f" (pid {dpid})" if dpid else ""))
    print(f"containerd  {'running' if cpid else 'stopped'}" + (f" (pid {cpid})" if cpid else ""))
    print(f"socket      {DOCKER_HOST}")
    print(f"runtime     {CAPSHIM_RUNTIME if missing_capabilities() else 'runc'}")
    print(f"FORWARD     {forward_policy() or 'unknown'}")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", choices=["up", "down", "status", "env"])
    args = ap.parse_args(argv)
    if args.command == "env":
        print(f"export DOCKER_HOST={DOCKER_HOST}")
        return 0
    if os.geteuid() != 0:
        print("hack/docker.py needs root (dockerd)", file=sys.stderr)
        return 2
    try:
        if args.command == "up":
            up()
        elif args.command == "down":
            down()
        else:
            return status()
    except EngineError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
