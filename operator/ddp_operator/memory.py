"""The operator's memory given back to the system: glibc's allocator, told how the operator uses it.

The operator decodes many large JSON documents (every pod event, every listing page) on many threads: kopf's event
loop and executor, the pod writers, the progress probes, the due passes. glibc gives each new thread that
allocates an arena of its own, up to 8 per core (512 on a 64-core node), and a freed chunk goes
back to the arena it came from: memory freed on one thread is not reused by another, and an arena's free space
inside its heap is not returned to the system. The resident memory then grows with the threads and the bursts seen,
not with what the operator keeps.

- `limit_arenas` caps the arenas (`mallopt(M_ARENA_MAX)`, what MALLOC_ARENA_MAX sets) before the threads start;
- `start_trimming` gives the free pages of every arena back every TRIM_SECONDS (`malloc_trim(0)`).

Both do nothing where the C library is not glibc (musl, macOS): `available()` says whether they act.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import threading

log = logging.getLogger("ddp_operator")

ARENAS = 2  # what one busy event loop and its worker threads need; glibc's own default is 8 per core
TRIM_SECONDS = 30.0
M_ARENA_MAX = -8  # glibc's malloc.h


def _libc():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None


_LIBC = _libc()


def available() -> bool:
    """Whether the C library is glibc's (mallopt and malloc_trim exist)."""
    return _LIBC is not None


def limit_arenas(arenas: int = ARENAS) -> bool:
    """Cap glibc's malloc arenas at `arenas` for every thread started afterwards; whether it took effect. Call it
    before the threads start: an arena a thread already has stays."""
    if _LIBC is None or arenas < 1:
        return False
    return bool(_LIBC.mallopt(M_ARENA_MAX, int(arenas)))


def trim() -> bool:
    """Give the free pages of every arena back to the system now; whether any was."""
    return bool(_LIBC.malloc_trim(0)) if _LIBC is not None else False


def start_trimming(stop: threading.Event, every: float = TRIM_SECONDS) -> threading.Thread | None:
    """A daemon thread that trims every `every` seconds until `stop` is set; None where there is nothing to trim."""
    if _LIBC is None:
        return None

    def loop() -> None:
        while not stop.wait(every):
            try:
                trim()
            except Exception:  # noqa: BLE001 - never let the trimmer take the operator down
                log.exception("malloc_trim failed")
                return

    thread = threading.Thread(target=loop, name="ddp-malloc-trim", daemon=True)
    thread.start()
    return thread
