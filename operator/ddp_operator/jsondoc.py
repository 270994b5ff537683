"""The API server's JSON, read and copied at the rate a large cluster sends it.

Every pod event the operator watches is a JSON document of about 10 KB, decoded and slimmed on kopf's event loop
(kopf_mends.watch_slimmed, jobs.kept_pod); a restart lists every labelled pod (106 MB at 10,113 pods).
At that size the standard library's decoder and `copy.deepcopy` were the event loop's largest costs (docs/scale.md):

- `loads` decodes with orjson where it is installed (requirements.txt; a pod in 17 µs where the standard decoder
  takes 64 µs, docs/scale.md), else with `json.loads`: the same dicts, lists, strings and numbers either way;
- `copied` copies a decoded document (dicts, lists, scalars) without deepcopy's memo and dispatch; anything else
  (a kopf view, a datetime) is deep-copied as before.
"""

from __future__ import annotations

import copy
import json
from typing import Any

try:
    import orjson
except ImportError:  # pragma: no cover - the operator image and the venv install it (requirements.txt)
    orjson = None

_SCALARS = (str, int, float, bool, type(None))


def loads(data: bytes | bytearray | memoryview | str) -> Any:
    """A JSON document decoded; ValueError (json.JSONDecodeError) when it is not one, whichever decoder reads it."""
    if orjson is not None:
        return orjson.loads(data)  # orjson.JSONDecodeError is a json.JSONDecodeError
    return json.loads(data)


def copied(value: Any) -> Any:
    """A private copy of a decoded JSON value: new dicts and lists all the way down, the scalars shared (immutable)."""
    kind = type(value)
    if kind is dict:
        return {k: copied(v) for k, v in value.items()}
    if kind is list:
        return [copied(v) for v in value]
    if kind in _SCALARS:
        return value
    return copy.deepcopy(value)
