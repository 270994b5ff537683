"""Disk checkpoints: atomic files ``ckpt-<step>.pt`` in one directory, newest-valid-first loading.

Only global rank 0 writes and reads them (the other ranks receive the state by broadcast). Which pod runs global
rank 0 is the rendezvous' choice and changes when the group re-forms, so every pod must see the same directory (a
ReadWriteMany volume across machines; docs/your-script.md). Writes happen on a background thread from a detached copy
of the state, so training does not wait for the disk; a corrupt or truncated newest file is skipped with
a warning and the previous one is used.

Next to them, global rank 0 leaves the *high-water mark* of a run stopped by SIGTERM (``highwater.json``: the last
step it completed, when, and the checkpoint written for it; savepoints.py). When every pod is lost at once no
``/dev/shm`` mark survives, so the next restore reads this one to tell how many steps the stop cost
(``recovery.py``), and removes it: it describes the incarnation that ended last, and no later one.

:func:`checkpoint_pod_state` is the same last checkpoint written by a stopping pod's agent (``ddp_trainer.launch``)
from the pod's ``/dev/shm`` once its workers are gone: when the pods are stopped one after the other, rank 0's worker
may have died of its failed collective (the other pods' workers exited first) before its own SIGTERM came.
"""

from __future__ import annotations

import json
import os
import queue
import re
import threading
import time
from collections.abc import Callable
from typing import Any

from . import storage
from .env import CHECKPOINT_DIR, ConfigError
from .recovery import MARK_NAME as RANK_MARK, HighWaterMark
from .resident import FILE_NAME as RESIDENT
from .slot_load import load, newest, read_header
from .snapshot import SLOT_NAMES

_NAME = re.compile(r"^ckpt-(\d{9,})\.pt$")
FORMAT = "ddp_trainer/checkpoint/1"
MARK_NAME = "highwater.json"
MARK_FORMAT = "ddp_trainer/highwater/1"


def checkpoint_name(step: int) -> str:
    return f"ckpt-{step:09d}.pt"


def validate_dir(directory: str, variable: str = CHECKPOINT_DIR) -> str:
    """Create the directory if needed and prove it is writable; raise ConfigError otherwise."""
    path = os.path.abspath(directory)
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(f"{variable}={directory!r} exists but is not a directory")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"{variable}={directory!r} cannot be created: {exc.strerror}") from None
    if not os.access(path, os.R_OK | os.W_OK | os.X_OK):
        raise ConfigError(f"{variable}={directory!r} is not readable and writable by uid {os.getuid()}")
    probe = os.path.join(path, f".probe-{os.getpid()}")
    try:
        with open(probe, "wb") as f:
            f.write(b"ok")
        os.unlink(probe)
        os.listdir(path)
    except OSError as exc:
        raise ConfigError(f"{variable}={directory!r} is not usable: {exc.strerror}") from None
    return path


class CheckpointStore:
    """The checkpoint directory of one run."""

    def __init__(
        self,
        directory: str,
        *,
        keep: int = 3,
        warn: Callable[..., None] | None = None,
    ) -> None:
        if keep < 1:
            raise ConfigError(f"keep={keep}: at least one checkpoint must be kept")
        self.directory = validate_dir(directory)
        self.keep = keep
        self._warn = warn or (lambda event, **kw: None)
        self._queue: queue.Queue[tuple[int, Any] | None] = queue.Queue(maxsize=2)
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.last_saved_step: int | None = None

    # -- reading -----------------------------------------------------------------------------------------
    def steps(self) -> list[int]:
        """Steps of the checkpoint files present, newest first (not yet verified)."""
        try:
            names = os.listdir(self.directory)
        except OSError as exc:
            raise ConfigError(f"checkpoint directory {self.directory!r} is unreadable: {exc.strerror}") from None
        found = [int(m.group(1)) for m in map(_NAME.match, names) if m]
        return sorted(found, reverse=True)

    def path(self, step: int) -> str:
        return os.path.join(self.directory, checkpoint_name(step))

    def load_latest(self, *, newer_than: int = -1) -> tuple[int, dict[str, Any]] | None:
        """The newest intact checkpoint with step > newer_than; corrupt files are skipped with a warning."""
        for step in self.steps():
            if step <= newer_than:
                break
            path = self.path(step)
            try:
                obj = storage.load_file(path)
                if not isinstance(obj, dict) or obj.get("format") != FORMAT:
                    raise storage.CorruptFileError(f"{path}: unexpected content")
            except (OSError, storage.CorruptFileError) as exc:
                self._warn("checkpoint_corrupt", step=step, path=path, error=str(exc))
                continue
            return step, obj["state"]
        return None

    def take_mark(self, run_key: str) -> tuple[int, float, int | None] | None:
        """The high-water mark left by :meth:`save_mark` for ``run_key`` — (step, unix time, its checkpoint's step) —
        removed as it is read; None if there is none (or it is another run's, or unreadable)."""
        path = os.path.join(self.directory, MARK_NAME)
        try:
            with open(path, "rb") as f:
                data = json.loads(f.read())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            data = None
            self._warn("highwater_unreadable", path=path, error=str(exc))
        try:
            os.unlink(path)
        except OSError:
            pass
        try:
            if data["format"] != MARK_FORMAT or data["runKey"] != run_key:
                return None
            checkpoint = data.get("checkpointStep")
            return int(data["step"]), float(data["time"]), None if checkpoint is None else int(checkpoint)
        except (KeyError, TypeError, ValueError):
            return None

    # -- writing -----------------------------------------------------------------------------------------
    def save_mark(self, step: int, at: float, run_key: str, checkpoint_step: int | None) -> None:
        """Leave the high-water mark of a run that is stopping (the last step it completed, at unix time ``at``)."""
        data = {"format": MARK_FORMAT, "runKey": run_key, "step": int(step), "time": at,
                "checkpointStep": checkpoint_step}
        storage.atomic_write(os.path.join(self.directory, MARK_NAME), json.dumps(data).encode())

    def save(self, step: int, state: dict[str, Any]) -> str:
        """Write synchronously (state must not change meanwhile), then prune old files."""
        path = self.path(step)
        storage.save_file(path, {"format": FORMAT, "step": step, "state": state})
        self.last_saved_step = step
        self._prune(keep_step=step)
        return path

    def save_async(self, step: int, detached_state: dict[str, Any]) -> None:
        """Queue a write of a state nobody mutates any more (see state.detached_copy)."""
        self._raise_pending()
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="ddp-checkpoint", daemon=True)
            self._thread.start()
        self._queue.put((step, detached_state))

    def flush(self) -> None:
        """Wait for queued writes; re-raise a failure of the writer thread."""
        if self._thread is not None:
            self._queue.join()
        self._raise_pending()

    def close(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None
        self._raise_pending()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                self.save(*item)
            except BaseException as exc:  # surfaced on the training thread at the next save/flush
                self._error = exc
            finally:
                self._queue.task_done()

    def _raise_pending(self) -> None:
        if self._error is not None:
            exc, self._error = self._error, None
            raise RuntimeError(f"writing a checkpoint failed: {exc}") from exc

    def _prune(self, keep_step: int) -> None:
        for step in self.steps()[self.keep :]:
            if step == keep_step:
                continue
            try:
                os.unlink(self.path(step))
            except OSError:
                pass


def checkpoint_pod_state(snapshot_dir: str, directory: str, run_key: str, *, keep: int = 3,
                         warn: Callable[..., None] | None = None) -> dict[str, Any]:
    """A stopping pod's last checkpoint, for its agent once the workers are gone (module doc): the newest state the
    pod holds (its snapshot copies, local rank 0's resident state) unless the disk holds that step already, and the
    highest high-water mark of its ranks beside it. Returns what it did, for the agent's log line."""
    t0 = time.perf_counter()
    store = CheckpointStore(directory, keep=keep, warn=warn)
    candidates = [*SLOT_NAMES, RESIDENT.format(local_rank=0)]
    head = newest(*(read_header(os.path.join(snapshot_dir, name), run_key) for name in candidates))
    on_disk = store.steps()
    last = on_disk[0] if on_disk else None
    written = head is not None and (last is None or head.step > last)
    if written:
        assert head is not None
        store.save(head.step, load(head))
        last = head.step
    marks = []
    prefix, suffix = RANK_MARK.split("{local_rank}")
    for name in sorted(os.listdir(snapshot_dir)) if os.path.isdir(snapshot_dir) else []:
        local_rank = name[len(prefix):-len(suffix)] if name.startswith(prefix) and name.endswith(suffix) else ""
        if local_rank.isdigit():
            mark = HighWaterMark(snapshot_dir, run_key, int(local_rank))
            marks.append(mark.read())
            mark.close()
    highest = max((m for m in marks if m is not None), default=None)
    if highest is not None:
        store.save_mark(highest[0], highest[1], run_key, last)
    return {"step": head.step if head is not None else None, "written": written,
            "highest_step": highest[0] if highest is not None else None,
            "seconds": round(time.perf_counter() - t0, 3)}
