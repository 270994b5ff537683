"""One worker's distributed session, set up from torchrun's environment.

Owns: reading and checking torchrun's variables, ``init_process_group`` (gloo on CPU, nccl on GPU)
with a bounded timeout, the device (``cuda:LOCAL_RANK`` or CPU), rank-0 logging, agreement helpers and
SIGTERM.

SIGTERM is what the torchrun agent sends to stop workers before a new rendezvous round (a peer died
or joined) and what the kubelet sends on pod deletion. A worker is then often blocked inside a
collective that will never finish, where a Python signal handler would not run until the collective
times out. So a watcher thread learns of SIGTERM through Python's signal wakeup fd, runs the registered
callbacks (e.g. a checkpoint of the last completed step) and exits with 143.

When every pod is stopped at once (an eviction, a drain, a preemption) the other ranks exit at once and rank 0's
collective fails: its main thread raises and the process would end, killing the watcher (a daemon thread) in the
middle of the checkpoint. Once SIGTERM has arrived, the process's end therefore waits for the watcher, which ends it.
The end of the process also runs the :meth:`Session.on_exit` callbacks and sets :attr:`Session.main_idle` (the main
thread does nothing more), which callbacks on the watcher may wait for.
"""

from __future__ import annotations

import atexit
import datetime
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from . import env as envmod
from .env import ConfigError
from .log import Logger

EXIT_SIGTERM = 128 + signal.SIGTERM


def _require_int(name: str, env: Mapping[str, str], minimum: int) -> int:
    value = envmod.get_int(name, None, minimum=minimum, env=env)
    assert value is not None
    return value


def read_torchrun_env(env: Mapping[str, str] | None = None) -> dict[str, int]:
    """RANK/WORLD_SIZE/LOCAL_RANK/... as ints; ConfigError naming what is missing or wrong."""
    env = os.environ if env is None else env
    missing = [n for n in envmod.TORCHRUN_REQUIRED if not envmod.get_str(n, None, env)]
    if missing:
        raise ConfigError(
            f"missing environment variable(s) {', '.join(missing)}: this program must be started by torchrun, "
            "e.g. `torchrun --standalone --nproc-per-node=2 -m ddp_trainer.examples.digits`"
        )
    world = _require_int(envmod.WORLD_SIZE, env, 1)
    rank = _require_int(envmod.RANK, env, 0)
    local_rank = _require_int(envmod.LOCAL_RANK, env, 0)
    local_world = envmod.get_int(envmod.LOCAL_WORLD_SIZE, 1, minimum=1, env=env) or 1
    if rank >= world:
        raise ConfigError(f"RANK={rank} must be < WORLD_SIZE={world}")
    if local_rank >= local_world:
        raise ConfigError(f"LOCAL_RANK={local_rank} must be < LOCAL_WORLD_SIZE={local_world}")
    envmod.get_int(envmod.MASTER_PORT, None, minimum=1, env=env)
    return {
        "rank": rank,
        "world_size": world,
        "local_rank": local_rank,
        "local_world_size": local_world,
        "group_rank": envmod.get_int(envmod.GROUP_RANK, 0, env=env) or 0,
        "restart_count": envmod.get_int(envmod.RESTART_COUNT, 0, env=env) or 0,
    }


@dataclass
class Session:
    """A worker's place in the job plus its process group. Create with :func:`init_session`."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    group_rank: int
    restart_count: int
    run_key: str
    device: torch.device
    backend: str
    log: Logger
    _term_callbacks: list[Callable[[], None]] = field(default_factory=list)
    _exit_callbacks: list[Callable[[], None]] = field(default_factory=list)
    _wakeup_sockets: tuple = ()
    # set once the main thread does nothing more: it is ending, or waits for the watcher to end the process
    main_idle: threading.Event = field(default_factory=threading.Event)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    # -- agreement helpers ---------------------------------------------------------------------------------
    def _flag_tensor(self, value: float) -> torch.Tensor:
        return torch.tensor([value], dtype=torch.float64, device=self.device if self.backend == "nccl" else "cpu")

    def any(self, flag: bool) -> bool:
        """True on every rank if ``flag`` is true on any rank (all_reduce MAX)."""
        t = self._flag_tensor(1.0 if flag else 0.0)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item() > 0)

    def decide_on_main(self, flag: bool) -> bool:
        """Rank 0's ``flag``, agreed by every rank (others' values are ignored)."""
        return self.any(flag if self.is_main else False)

    def barrier(self) -> None:
        dist.barrier()

    # -- termination -----------------------------------------------------------------------------------------
    def on_terminate(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` (from a signal-watcher thread) when SIGTERM arrives, before exiting."""
        self._term_callbacks.append(callback)

    def on_exit(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` on the main thread as the process ends (returned or raised), before its threads stop
        (with ``init_session(handle_sigterm=True)``, the default)."""
        self._exit_callbacks.append(callback)

    def _exiting(self) -> None:
        self.main_idle.set()
        for cb in reversed(self._exit_callbacks):
            try:
                cb()
            except BaseException as exc:  # exiting anyway
                self.log("exit_callback_failed", all_ranks=True, error=repr(exc))

    def _terminate(self) -> None:
        # Only the watcher thread calls this, once (_install_sigterm): it ends in os._exit.
        self.log("sigterm", all_ranks=True, local_rank=self.local_rank)
        for cb in reversed(self._term_callbacks):
            try:
                cb()
            except BaseException as exc:  # exiting anyway; say why the callback failed
                self.log("sigterm_callback_failed", all_ranks=True, error=repr(exc))
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(EXIT_SIGTERM)

    def close(self) -> None:
        """Leave the process group (call once, at the end of a successful run)."""
        if dist.is_initialized():
            # Tear down only once every rank is past its last collective: a rank that destroys its gloo
            # context while a peer still has work in flight can make that peer abort in C++ teardown.
            try:
                dist.barrier()
            except RuntimeError as exc:  # a peer already left; the training itself is complete
                self.log("close_barrier_failed", all_ranks=True, error=repr(exc))
            dist.destroy_process_group()


def _install_sigterm(session: Session) -> None:
    # Python runs signal handlers on the main thread only, between bytecodes: never while it waits in a
    # collective. Its C-level handler does write the signal number to the wakeup fd from any thread at
    # once, so a watcher thread blocked on that fd reacts immediately. (Blocking the signal and using
    # sigwait instead would leak the blocked mask into every child process, e.g. DataLoader workers.)
    reader, writer = socket.socketpair()
    writer.setblocking(False)
    # The Python-level handler only makes the C-level one write to the wakeup fd; the watcher thread does the rest.
    # Running _terminate on the main thread as well could run it inside an optimizer step that the termination
    # waits for (resident state: SavePoints._hold_resident), which would then wait for itself.
    signal.signal(signal.SIGTERM, lambda signum, frame: None)
    signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)

    received = threading.Event()

    def watch() -> None:
        while True:
            data = reader.recv(64)
            if not data or signal.SIGTERM in data:
                break
        received.set()
        session._terminate()

    watcher = threading.Thread(target=watch, name="ddp-sigterm", daemon=True)
    watcher.start()
    session._wakeup_sockets = (reader, writer)  # keep both ends open for the life of the process

    def wait_for_watcher() -> None:
        # The main thread is done (returned, or raised: a collective failed because the peers, stopped by the same
        # signal, exited first). Once SIGTERM came the watcher's callbacks end the process (143), not this exit.
        session._exiting()
        if received.is_set():
            watcher.join()

    # Called as the process ends, before its threads are stopped: at the interpreter's exit, and where
    # multiprocessing ends a worker forked by ddp_trainer.launch's forkserver with os._exit (atexit never runs there).
    getattr(threading, "_register_atexit", atexit.register)(wait_for_watcher)


def _stat(pid: int | str) -> list[str]:
    """/proc/<pid>/stat's fields after the command (which may hold spaces and parentheses): [state, ppid, ...]."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rpartition(")")[2].split()


def process_start_time(pid: int | str = "self") -> float | None:
    """Wall-clock time at which process `pid` started (Linux: /proc, ~10 ms resolution); None elsewhere.

    A worker logs it with its session line, so a recovery can be split into the agent's spawn, the
    interpreter and imports, and joining the process group (tests/benchmarks/e2e_recovery.py).
    """
    try:
        start_ticks = int(_stat(pid)[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return time.time() - uptime + start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


AGENT_COMMANDS = (b"torchrun", b"torch.distributed.run", b"ddp_trainer.launch")


def agent_start_time() -> float | None:
    """When this worker's torchrun agent started: the nearest ancestor running torchrun (or ddp_trainer.launch,
    whose workers are children of a forkserver, itself forked from the agent: same command line, named
    launch.FORKSERVER_NAME). In a pod that is the container's first process."""
    from .launch import FORKSERVER_NAME

    try:
        pid = int(_stat("self")[1])
        while pid >= 1:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                command = f.read()
            with open(f"/proc/{pid}/comm") as f:
                forkserver = f.read().strip() == FORKSERVER_NAME
            if not forkserver and any(name in command for name in AGENT_COMMANDS):
                return process_start_time(pid)
            pid = int(_stat(pid)[1]) if pid > 1 else 0
        return None
    except (OSError, ValueError, IndexError):
        return None


def init_session(
    *,
    backend: str | None = None,
    timeout_s: float | None = None,
    env: Mapping[str, str] | None = None,
    handle_sigterm: bool = True,
) -> Session:
    """Set up this worker from torchrun's environment and join the process group.

    ``backend`` defaults to nccl when CUDA is usable, else gloo; ``timeout_s`` (default
    ``DDPJOB_PG_TIMEOUT`` or 120 s) bounds every collective, instead of the 30-minute default.
    """
    entered = time.time()
    env = os.environ if env is None else env
    ids = read_torchrun_env(env)
    if timeout_s is None:
        timeout_s = envmod.get_float(envmod.PG_TIMEOUT, envmod.DEFAULT_PG_TIMEOUT_S, minimum=1.0, env=env)
    assert timeout_s is not None
    use_cuda = torch.cuda.is_available() and backend in (None, "nccl")
    if use_cuda:
        if ids["local_rank"] >= torch.cuda.device_count():
            raise ConfigError(
                f"LOCAL_RANK={ids['local_rank']} but only {torch.cuda.device_count()} CUDA device(s) are visible: "
                "lower --nproc-per-node"
            )
        device = torch.device("cuda", ids["local_rank"])
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    backend = backend or ("nccl" if use_cuda else "gloo")
    session = Session(
        **ids,
        run_key=envmod.run_key(env),
        device=device,
        backend=backend,
        log=Logger(ids["rank"]),
    )
    if handle_sigterm:
        _install_sigterm(session)
    kwargs = {"device_id": device} if backend == "nccl" else {}
    joining = time.time()
    dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s), **kwargs)
    started, agent_started = process_start_time(), agent_start_time()
    # Every rank: a recovery waits for the slowest worker, usually the replacement's.
    session.log(
        "session",
        all_ranks=True,
        world_size=session.world_size,
        backend=backend,
        device=str(device),
        restart_count=session.restart_count,
        run_key=session.run_key,
        # when this process and its torchrun agent (in a pod, the container's first process) started, when
        # the script called init_session (interpreter up, torch and the script's imports done), and the
        # seconds init_process_group took (waiting for every rank)
        process_started=None if started is None else f"{started:.3f}",
        agent_started=None if agent_started is None else f"{agent_started:.3f}",
        init_called=f"{entered:.3f}",
        pg_init_s=f"{time.time() - joining:.3f}",
    )
    return session
