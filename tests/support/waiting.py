"""Waiting on a condition: poll it until it holds or a timeout passes, never a fixed sleep."""

from __future__ import annotations

import time
from typing import Any, Callable


def wait_for(check: Callable[[], Any], timeout: float, what: str = "condition", interval: float = 0.5) -> Any:
    """Call check() until it returns something truthy and return that; AssertionError after timeout.

    Exceptions raised by check() count as "not yet"; the last one is reported on timeout."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        try:
            last = check()
            if last:
                return last
        except Exception as e:  # noqa: BLE001 - a failing probe just means "not yet"
            last = e
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}; last result: {last!r}")
        time.sleep(interval)
