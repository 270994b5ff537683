"""Structured, rank-aware log lines.

One line per event, ``key=value`` pairs after a fixed prefix, so people can read them and tests and
benchmarks can parse them (``event=step step=<n> ...`` is emitted after every logged step)::

    2025-01-01T12:00:00.123Z ddp_trainer rank=0 event=step step=12 epoch=0 loss=0.4123 ...

Only global rank 0 logs unless a call asks for every rank (``all_ranks=True``).
"""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    text = str(value)
    if text == "" or any(c.isspace() for c in text) or '"' in text:
        return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'
    return text


def format_line(rank: int, event: str, fields: dict[str, Any]) -> str:
    now = time.time()
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(now)) + f".{int(now * 1000) % 1000:03d}Z"
    parts = [stamp, "ddp_trainer", f"rank={rank}", f"event={event}"]
    parts.extend(f"{k}={_fmt(v)}" for k, v in fields.items() if v is not None)
    return " ".join(parts)


class Logger:
    """Writes structured lines for one process; quiet on ranks other than 0 unless asked."""

    def __init__(self, rank: int, stream: TextIO | None = None) -> None:
        self.rank = rank
        self._stream = stream

    def __call__(self, event: str, *, all_ranks: bool = False, **fields: Any) -> None:
        if self.rank != 0 and not all_ranks:
            return
        stream = self._stream or sys.stdout
        stream.write(format_line(self.rank, event, fields) + "\n")
        stream.flush()


def parse_line(line: str) -> dict[str, str] | None:
    """Inverse of :func:`format_line` for the simple values we emit (tests and benchmarks use it)."""
    if " ddp_trainer " not in line:
        return None
    _, _, rest = line.partition(" ddp_trainer ")
    out: dict[str, str] = {}
    i = 0
    n = len(rest)
    while i < n:
        while i < n and rest[i] == " ":
            i += 1
        eq = rest.find("=", i)
        if eq < 0:
            break
        key = rest[i:eq]
        j = eq + 1
        if j < n and rest[j] == '"':
            j += 1
            buf = []
            while j < n and rest[j] != '"':
                if rest[j] == "\\" and j + 1 < n:
                    j += 1
                    buf.append({"n": "\n"}.get(rest[j], rest[j]))
                else:
                    buf.append(rest[j])
                j += 1
            value = "".join(buf)
            j += 1
        else:
            end = rest.find(" ", j)
            end = n if end < 0 else end
            value = rest[j:end]
            j = end
        out[key] = value
        i = j
    return out
