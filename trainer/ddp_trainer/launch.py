"""`python -m ddp_trainer.launch` — torchrun, tuned for fast recovery.

Takes exactly torchrun's arguments and `PET_*` variables (it *is* torchrun: torch's own parser, elastic agent and
c10d rendezvous) and changes four things that cost seconds on every recovery (docs/recovery.md, "Where the seconds
go"):

1. **Workers fork from a warm process.** torchrun starts every worker as a fresh interpreter (`python -u -m
   module` / `python -u script.py`) that imports torch again — 1.5–2 s per worker on a small CPU, on the critical
   path each time the group re-forms. Here workers are forked from a multiprocessing *forkserver* that imported
   torch and ddp_trainer once. torch is imported once per pod: the agent imports it, then the forkserver is
   *forked* from the agent (instead of multiprocessing's exec of a fresh interpreter that would import torch a
   second time, side by side with the agent's import on the same cores) and imports the rest of PRELOAD while
   the agent joins the rendezvous. ``DDPJOB_FORKSERVER=exec`` keeps multiprocessing's own start, begun before the
   agent imports torch (the two imports then run side by side). The script runs as `__main__` in the forked
   child (runpy), with the same argv, environment (RANK, LOCAL_RANK, MASTER_ADDR, … set by the agent),
   stdout/stderr and exit code as under torchrun.
2. **A waiting agent reads the rendezvous state every `poll_interval(N)`** (rendezvous rule 6:
   `min(DDPJOB_RDZV_POLL_SECONDS x max(1, N/8), 2 s)`, base 0.1 s, less up to 20 % jitter) instead of torch's fixed
   1 s (its state holder's cache), so a round of up to 8 nodes completes within a tenth of a second of its last
   member arriving, and N agents' reads of the O(N) state stay at most ~80 a second up to 160 nodes.
3. **A stopped agent leaves the rendezvous.** torchrun's agent dies on SIGTERM (the kubelet's first signal when a
   pod is deleted, evicted or preempted, even with `--force --grace-period=0`) without leaving the round it
   trains in, so the others cannot form the next round before its heartbeats expire (keep-alive interval x
   attempts, 3 s by default). Here the signal also starts a thread that takes this node out of the round's
   participants, as the agent itself does before it rejoins, while the agent stops its workers; the agent waits
   up to LEAVE_TIMEOUT_S for it before it exits. With a hot spare waiting, the next round then forms as soon as
   the survivors rejoin. ``DDPJOB_LEAVE_ON_SIGNAL=0`` turns it off.
4. **A replacement takes its predecessor's place at once.** An agent killed without a signal it can catch (SIGKILL:
   the OOM killer, a lost node, a container restarted in place) cannot leave; the round waited for its heartbeats to
   expire. Here the rendezvous handler, ``c10d`` or ``ddpjob-c10d``, records each agent's pod (``DDPJOB_POD_INDEX``)
   and the agent of a recreated pod takes the old agent of that pod out of the rendezvous when it enters it
   (``ddp_trainer.rendezvous``, rule 4). ``DDPJOB_TAKE_OVER=0`` turns it off.
5. **A failed agent leaves the rendezvous open.** torchrun's agent closes the rendezvous for good whenever it ends
   without a signal — after its workers failed more than ``--max-restarts`` times, or on an error of its own (a
   role-info wait timed out on a slow first start, seen on kind). Every later agent of that run id then fails with
   ``RendezvousClosedError``: the pods the operator recreates crash-loop until the job's backoff limit, and a job
   that one pod's failure should only have cost a restart is lost. In a DDPJob pod (``DDPJOB_POD_INDEX`` set) the
   operator decides whether a job goes on, so an agent closes the rendezvous only when its workers succeeded (the
   end of the training, which also releases the hot spares); a failed one leaves its round, so that the others
   re-form at once with its replacement. Outside a DDPJob torch's behaviour stays.

6. **A stopped pod keeps its last step.** When every pod is stopped (a drain, an eviction, a preemption), the pods'
   SIGTERMs come one after the other: a pod stopped first ends its workers at once, and global rank 0's worker,
   whose collective then fails, may die of it before its own SIGTERM would have made it checkpoint the last step
   (``savepoints.py``). So the agent that ran global rank 0, stopped by a signal once its workers are gone, writes the
   newest state its pod's ``/dev/shm`` holds as a checkpoint unless the disk has that step already, with the pod's
   high-water mark beside it (``checkpoint.checkpoint_pod_state``; ``DDPJOB_CHECKPOINT_DIR`` set, as ``spec.checkpoint``
   does).

CUDA stays correct: the agent and the forkserver import torch but never initialise CUDA (torch initialises it
lazily, in the worker, after the fork); the forkserver is forked before torchrun parses its arguments, while the
agent has no other thread (else it is exec'd as multiprocessing does); nothing here touches a device. What
torchrun cannot run as a Python script or module (`--no-python`, `--run-path`) is handed to torchrun unchanged,
and plain `torchrun` keeps working with every script: this launcher is an opt-in for images that have ddp_trainer
(the samples use it). It patches torch internals, so it refuses a torch outside the range it is tested with before it
patches anything (``torch_version``: one line, exit code 78).
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.forkserver
import multiprocessing.util
import os
import runpy
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from . import rendezvous, torch_version
from .rendezvous_rules import POLL_BASE_S
from .env import FORKSERVER, LEAVE_ON_SIGNAL, POD_INDEX, RDZV_POLL, ConfigError, get_float, get_int, get_str

# Imported once by the forkserver; every worker inherits them (copy-on-write) instead of importing them.
# torch._inductor (and torch._dynamo under it) is imported lazily by torch.use_deterministic_algorithms,
# torch.compile and more: ~1.2 s of a worker's start on a small CPU, measured with the digits example.
PRELOAD = ("torch", "torch.distributed", "torch.nn", "torch.optim", "torch.utils.data", "torch._inductor", "numpy",
           "ddp_trainer.run", "ddp_trainer.session", "ddp_trainer.sampler", "ddp_trainer.syncbn")
START_METHOD = "forkserver"
FORKSERVER_MODES = ("fork", "exec")  # DDPJOB_FORKSERVER: how the forkserver starts (item 1)
# Process names (/proc/<pid>/comm, what ps and top show): a forked forkserver and its workers show the agent's
# command line, so they are told apart by name.
FORKSERVER_NAME = "ddp-forkserver"
WORKER_NAME = "ddp-worker"
DEFAULT_RDZV_POLL_S = POLL_BASE_S
# How long a stopping agent waits for its node to leave the rendezvous (a few store round trips when it is up).
LEAVE_TIMEOUT_S = 2.0

log = logging.getLogger(__name__)


def name_process(name: str) -> None:
    """Set this process's name (/proc/<pid>/comm, at most 15 bytes); nothing where prctl is missing."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass


def run_program(kind: str, target: str, *argv: str) -> None:
    """The worker: run a module (`kind` "module") or a script path as `__main__`, as `python -u` would."""
    name_process(WORKER_NAME)
    sys.argv = [target, *argv]
    try:
        if kind == "module":
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            sys.path.insert(0, str(Path(target).resolve().parent))  # as `python script.py` puts its directory first
            runpy.run_path(target, run_name="__main__")
    except SystemExit as e:
        if e.code not in (None, 0):
            raise  # the worker's exit code, as under torchrun


def forked(cmd: object, cmd_args: Sequence[str]) -> tuple[str, str, list[str]] | None:
    """torchrun's (cmd, cmd_args) for a Python worker -> (kind, target, argv) for run_program; None when the
    worker is not `python -u [-m] target ...` (e.g. --no-python)."""
    if not isinstance(cmd, str) or cmd != os.getenv("PYTHON_EXEC", sys.executable):
        return None
    rest = list(cmd_args)
    if rest[:1] != ["-u"]:
        return None
    rest = rest[1:]
    if rest[:1] == ["-m"] and len(rest) >= 2:
        return "module", rest[1], rest[2:]
    if rest and not rest[0].startswith("-"):
        return "path", rest[0], rest[1:]
    return None


def start_forkserver() -> threading.Thread:
    """Start multiprocessing's own forkserver (a fresh interpreter) in the background: its imports overlap this
    process's (DDPJOB_FORKSERVER=exec)."""
    multiprocessing.set_forkserver_preload(list(PRELOAD))
    thread = threading.Thread(target=multiprocessing.forkserver.ensure_running, name="ddp-forkserver", daemon=True)
    thread.start()
    return thread


def fork_forkserver() -> bool:
    """Start the forkserver as a fork of this process, which has imported torch (item 1 of the module doc). False,
    and nothing started, when this process runs another thread (a fork would copy its locks mid-use)."""
    if threading.active_count() != 1:
        return False
    multiprocessing.set_forkserver_preload(list(PRELOAD))
    spawnv_passfds = multiprocessing.util.spawnv_passfds

    def fork_passfds(path: str, args: Sequence[str], passfds: Sequence[int]) -> int:
        # multiprocessing runs the forkserver as `python -c "from multiprocessing.forkserver import main; main(...)"`
        # with `passfds` kept open: run that same code in a child of this process instead.
        if list(args[-2:-1]) != ["-c"] or "multiprocessing.forkserver" not in args[-1]:
            return spawnv_passfds(path, args, passfds)  # the resource tracker, as before
        pid = os.fork()
        if pid:
            return pid
        try:
            keep = {0, 1, 2, *map(int, passfds)}
            for fd in [int(f) for f in os.listdir("/proc/self/fd")]:
                if fd not in keep:
                    try:
                        os.close(fd)
                    except OSError:
                        pass
            name_process(FORKSERVER_NAME)
            exec(args[-1], {"__name__": "__ddp_forkserver__"})  # noqa: S102 - multiprocessing's own command
        finally:
            os._exit(0)

    multiprocessing.util.spawnv_passfds = fork_passfds
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        multiprocessing.util.spawnv_passfds = spawnv_passfds
    return True


def leave_rendezvous(handler: Any, timeout: float = LEAVE_TIMEOUT_S) -> bool:
    """Take this node out of the participants of its rendezvous round (torch's exit operation, which the agent runs
    before every rejoin) and stop its heartbeats. False when the handler is not torch's dynamic one (or this torch
    lacks what it uses), the heartbeat thread holds on, or the store does not answer in time."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr

    needed = ("_op_executor", "_heartbeat_lock", "_stop_heartbeats", "_this_node")
    if not isinstance(handler, dr.DynamicRendezvousHandler) or not hasattr(dr, "_RendezvousExitOp") or \
            not all(hasattr(handler, n) for n in needed):
        return False
    handler._stop_heartbeats()
    if not handler._heartbeat_lock.acquire(timeout=timeout):
        return False
    try:
        handler._op_executor.run(dr._RendezvousExitOp(), time.monotonic() + timeout)
    except Exception as e:  # noqa: BLE001 - dying anyway: the heartbeat expiry removes the node instead
        log.warning("could not leave the rendezvous: %s: %s", type(e).__name__, e)
        return False
    finally:
        handler._heartbeat_lock.release()
    print(f"ddp_trainer.launch: node {handler._this_node} left the rendezvous (stopping on a signal)",
          file=sys.stderr, flush=True)
    return True


def checkpoint_on_stop(agent: Any) -> dict[str, Any] | None:
    """Item 6 of the module doc, for an agent stopped by a signal whose workers are gone: the pod's last checkpoint if
    this agent ran global rank 0 (None when it did not, or has nothing to write it from, or could not)."""
    group = getattr(agent, "_worker_group", None)
    if not any(getattr(w, "global_rank", None) == 0 for w in getattr(group, "workers", None) or []):
        return None
    from .checkpoint import checkpoint_pod_state
    from .config import RunConfig
    from .env import RUN_ID, run_key
    from .log import Logger

    env = dict(os.environ)
    try:
        env.setdefault(RUN_ID, group.spec.rdzv_handler.get_run_id())  # what the workers' TORCHELASTIC_RUN_ID was
    except AttributeError:
        pass
    key = run_key(env)
    try:
        config = RunConfig.from_env(env, key)
        if not config.checkpoint_dir or not config.snapshot_dir:
            return None
        done = checkpoint_pod_state(config.snapshot_dir, config.checkpoint_dir, key, keep=config.keep_checkpoints)
    except Exception as e:  # noqa: BLE001 - stopping anyway: say why there is no checkpoint
        print(f"ddp_trainer.launch: no checkpoint of the pod's state: {type(e).__name__}: {e}", file=sys.stderr,
              flush=True)
        return None
    if done["written"]:
        Logger(0)("checkpoint", step=done["step"], reason="sigterm", by="agent", highest_step=done["highest_step"],
                  seconds=done["seconds"])
    return done


def keep_open_on_failure(handler: Any, succeeded: Callable[[], bool]) -> None:
    """Item 5 of the module doc: the handler's ``shutdown`` (torchrun calls it as its agent ends) closes the rendezvous
    only when ``succeeded()``; otherwise this node leaves its round and the rendezvous stays open."""
    close = handler.shutdown

    def shutdown() -> bool:
        state = getattr(getattr(handler, "_state_holder", None), "state", None)
        if succeeded() or getattr(state, "closed", False):  # the end, or a spare released by it: nothing to keep
            return close()
        print(f"ddp_trainer.launch: node {handler._this_node} failed; the rendezvous stays open for its replacement "
              "(the operator decides whether the job goes on)", file=sys.stderr, flush=True)
        return leave_rendezvous(handler)

    handler.shutdown = shutdown


class _Leaver:
    """Item 3 of the module doc: the rendezvous handlers this agent made, and the thread that leaves them."""

    def __init__(self) -> None:
        self.handlers: list[Any] = []
        self.thread: threading.Thread | None = None

    def start(self) -> None:
        if self.thread is None:
            self.thread = threading.Thread(target=self._leave, name="ddp-leave-rendezvous", daemon=True)
            self.thread.start()

    def _leave(self) -> None:
        for handler in self.handlers:
            leave_rendezvous(handler)

    def wait(self) -> None:
        if self.thread is not None:
            self.thread.join(LEAVE_TIMEOUT_S)


def _tune_torchrun(poll_s: float, leave_on_signal: bool = True, in_ddpjob: bool = False) -> None:
    """Patch the seven places of torch's launcher this module changes (torch is imported here, not before)."""
    from torch._logging._internal import TorchLogsFormatter
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.agent.server.api import SimpleElasticAgent
    from torch.distributed.elastic.multiprocessing import api as mp_api
    from torch.distributed.elastic.multiprocessing.api import MultiprocessContext, SignalException
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous, registry, utils
    from torch.distributed.launcher import api as launcher_api

    torch_config_from_args = torchrun.config_from_args
    torch_poll = MultiprocessContext._poll
    torch_format = TorchLogsFormatter.format
    torch_get_handler = registry.get_rendezvous_handler
    torch_on_signal = mp_api._terminate_process_handler
    torch_launch_agent = launcher_api.launch_agent
    torch_agent_run = SimpleElasticAgent.run
    leaver = _Leaver()
    succeeded: list[bool] = []  # item 5: the outcome of this agent's run, once known

    def get_rendezvous_handler(params: Any) -> Any:
        handler = torch_get_handler(params)
        rendezvous.enable_take_over(handler, rendezvous.this_pod())  # item 4
        if in_ddpjob:
            keep_open_on_failure(handler, lambda: succeeded == [True])  # item 5
        if leave_on_signal:
            leaver.handlers.append(handler)
        return handler

    def agent_run(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            result = torch_agent_run(self, *args, **kwargs)
        except SignalException:
            checkpoint_on_stop(self)  # item 6: torch's run has stopped the workers
            raise
        succeeded[:] = [result is not None and not result.is_failed()]  # None: a spare released
        return result

    def on_signal(signum: int, frame: Any) -> None:
        leaver.start()  # side by side with the agent stopping its workers
        torch_on_signal(signum, frame)

    def launch_agent(*args: Any, **kwargs: Any) -> Any:
        try:
            return torch_launch_agent(*args, **kwargs)
        except SignalException:
            leaver.wait()
            raise

    def config_from_args(args: Any) -> tuple[Any, Any, list[str]]:
        config, cmd, cmd_args = torch_config_from_args(args)
        program = forked(cmd, cmd_args)
        if program is None:
            return config, cmd, cmd_args
        kind, target, argv = program
        config.start_method = START_METHOD
        return config, run_program, [kind, target, *argv]

    def poll_counting_clean_exits(self: Any) -> Any:
        # torch waits for a function worker's return value; a script that ends with os._exit(0) (common, to skip
        # the C++ teardown of gloo/NCCL) never returns one, and its agent would wait forever.
        if self._pc is not None:
            for rank, proc in enumerate(self._pc.processes):
                if proc.exitcode == 0 and rank not in self._return_values and self._ret_vals[rank].empty():
                    self._return_values[rank] = None
        return torch_poll(self)

    def delay(seconds: float | tuple[float, float]) -> None:
        # the join loop's fixed 1 s between reads of the rendezvous state; random back-offs stay as they are
        utils._delay(min(seconds, poll_s) if isinstance(seconds, (int, float)) else seconds)

    def format_without_dynamo(self: Any, record: logging.LogRecord) -> str:
        # torch's formatter imports torch._dynamo (and sympy, inductor: 1.5-2.5 s here) to format any record
        # that carries an exception — the agent's log of a failed worker, on the critical path of a recovery.
        # Format the exception as torch would (its dynamo check only concerns graph-break records) without it.
        if not record.exc_info or "torch._dynamo" in sys.modules:
            return torch_format(self, record)
        if not record.exc_text:
            record.exc_text = self.formatException(record.exc_info)
        exc_info, record.exc_info = record.exc_info, None
        try:
            return torch_format(self, record)
        finally:
            record.exc_info = exc_info

    torchrun.config_from_args = config_from_args
    TorchLogsFormatter.format = format_without_dynamo
    MultiprocessContext._poll = poll_counting_clean_exits
    dynamic_rendezvous._delay = delay
    registry.get_rendezvous_handler = get_rendezvous_handler
    SimpleElasticAgent.run = agent_run
    if leave_on_signal:
        mp_api._terminate_process_handler = on_signal
        launcher_api.launch_agent = launch_agent


def main(argv: Sequence[str] | None = None) -> None:
    torch_version.require("ddp_trainer.launch")  # before anything is patched (or torch imported): exit 78 if unfit
    poll_s = get_float(RDZV_POLL, DEFAULT_RDZV_POLL_S, minimum=0.0)
    assert poll_s is not None
    # Workers torchrun does not start as Python (--no-python, --run-path) never use the forkserver; it exits with
    # this process.
    mode = get_str(FORKSERVER, FORKSERVER_MODES[0])
    if mode not in FORKSERVER_MODES:
        raise ConfigError(f"{FORKSERVER} must be one of {', '.join(FORKSERVER_MODES)}, got {mode!r}")
    if mode == "exec":
        start_forkserver()  # first, before torch is imported here
    from torch.distributed import run as torchrun  # imports torch: once, for the agent and a forked forkserver

    if mode == "fork" and not fork_forkserver():
        start_forkserver()

    _tune_torchrun(poll_s, leave_on_signal=get_int(LEAVE_ON_SIGNAL, 1, minimum=0) != 0,
                   in_ddpjob=get_str(POD_INDEX, None) is not None)
    torchrun.main(list(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    # Run through the package module, so run_program pickles as ddp_trainer.launch.run_program.
    from ddp_trainer.launch import main as _main

    _main()
