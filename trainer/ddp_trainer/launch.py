"""`python -m ddp_trainer.launch` — torchrun, tuned for fast recovery.

Takes exactly torchrun's arguments and `PET_*` variables (it *is* torchrun: torch's own parser, elastic agent and
c10d rendezvous) and changes two things that cost seconds on every recovery (docs/recovery.md, "Where the seconds
go"):

1. **Workers fork from a warm process.** torchrun starts every worker as a fresh interpreter (`python -u -m
   module` / `python -u script.py`) that imports torch again — 1.5–2 s per worker on a small CPU, on the critical
   path each time the group re-forms. Here workers are forked from a multiprocessing *forkserver* that imported
   torch and ddp_trainer once. The forkserver is started first thing, before this process imports torch, so in a
   new pod both imports run side by side and the forkserver is warm by the time the agent has joined the
   rendezvous. The script runs as `__main__` in the forked child (runpy), with the same argv, environment (RANK,
   LOCAL_RANK, MASTER_ADDR, … set by the agent), stdout/stderr and exit code as under torchrun.
2. **The rendezvous is polled every `DDPJOB_RDZV_POLL_SECONDS` (0.1 s)** instead of torch's fixed 1 s while an
   agent waits for the others, so a round completes within a tenth of a second of its last member arriving. Each
   poll is one small read of the rendezvous state from the store pod.

CUDA stays correct: the forkserver imports torch but never initialises CUDA (torch initialises it lazily, in the
worker, after the fork); nothing here touches a device. What torchrun cannot run as a Python script or module
(`--no-python`, `--run-path`) is handed to torchrun unchanged, and plain `torchrun` keeps working with every
script: this launcher is an opt-in for images that have ddp_trainer (the samples use it).
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.forkserver
import os
import runpy
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .env import RDZV_POLL, get_float

# Imported once by the forkserver; every worker inherits them (copy-on-write) instead of importing them.
# torch._inductor (and torch._dynamo under it) is imported lazily by torch.use_deterministic_algorithms,
# torch.compile and more: ~1.2 s of a worker's start on a small CPU, measured with the digits example.
PRELOAD = ("torch", "torch.distributed", "torch.nn", "torch.optim", "torch.utils.data", "torch._inductor", "numpy",
           "ddp_trainer.run", "ddp_trainer.session", "ddp_trainer.sampler", "ddp_trainer.syncbn")
START_METHOD = "forkserver"
DEFAULT_RDZV_POLL_S = 0.1


def run_program(kind: str, target: str, *argv: str) -> None:
    """The worker: run a module (`kind` "module") or a script path as `__main__`, as `python -u` would."""
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
    """Start the forkserver in the background (its imports overlap this process's)."""
    multiprocessing.set_forkserver_preload(list(PRELOAD))
    thread = threading.Thread(target=multiprocessing.forkserver.ensure_running, name="ddp-forkserver", daemon=True)
    thread.start()
    return thread


def _tune_torchrun(poll_s: float) -> None:
    """Patch the four places of torch's launcher this module changes (torch is imported here, not before)."""
    from torch._logging._internal import TorchLogsFormatter
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import MultiprocessContext
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous, utils

    torch_config_from_args = torchrun.config_from_args
    torch_poll = MultiprocessContext._poll
    torch_format = TorchLogsFormatter.format

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


def main(argv: Sequence[str] | None = None) -> None:
    poll_s = get_float(RDZV_POLL, DEFAULT_RDZV_POLL_S, minimum=0.0)
    assert poll_s is not None
    # First, before torch is imported here. Workers torchrun does not start as Python (--no-python, --run-path)
    # never use it; it exits with this process.
    start_forkserver()
    from torch.distributed import run as torchrun

    _tune_torchrun(poll_s)
    torchrun.main(list(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    # Run through the package module, so run_program pickles as ddp_trainer.launch.run_program.
    from ddp_trainer.launch import main as _main

    _main()
