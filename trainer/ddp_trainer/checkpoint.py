"""Disk checkpoints: atomic files ``ckpt-<step>.pt`` in one directory, newest-valid-first loading.

Only global rank 0 writes and reads them (the other ranks receive the state by broadcast), so the
directory need not be shared between nodes. Writes happen on a background thread from a detached copy
of the state, so training does not wait for the disk; a corrupt or truncated newest file is skipped with
a warning and the previous one is used.
"""

from __future__ import annotations

import os
import queue
import re
import threading
from collections.abc import Callable
from typing import Any

from . import storage
from .env import CHECKPOINT_DIR, ConfigError

_NAME = re.compile(r"^ckpt-(\d{9,})\.pt$")
FORMAT = "ddp_trainer/checkpoint/1"


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

    # -- writing -----------------------------------------------------------------------------------------
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
