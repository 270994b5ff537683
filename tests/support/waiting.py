"""Waiting on a condition: poll it until it holds or a timeout passes, never a fixed sleep."""

from __future__ import annotations

import time
from typing import Any, Callable


class WaitTimeout(AssertionError):
    """A wait ran out of time: an AssertionError, so a test that times out fails (it does not error)."""


def wait_for(check: Callable[[], Any], timeout: float, what: str = "condition", interval: float = 0.5, *,
             fatal: type[BaseException] | tuple[type[BaseException], ...] = ()) -> Any:
    """Call check() until it returns something truthy and return that; WaitTimeout after `timeout` seconds.

    Exceptions raised by check() count as "not yet" (the last one is reported on timeout), except those of a type
    in `fatal`: they end the wait at once (a job that failed will not reach the phase waited for)."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        try:
            last = check()
            if last:
                return last
        except fatal:
            raise
        except Exception as e:  # noqa: BLE001 - a failing probe just means "not yet"
            last = e
        if time.monotonic() >= deadline:
            raise WaitTimeout(f"timed out after {timeout:.0f}s waiting for {what}; last result: {last!r}")
        time.sleep(interval)
