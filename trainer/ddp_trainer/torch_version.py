"""Which torch ddp_trainer supports, and the refusal of any other at start.

``python -m ddp_trainer.launch`` and the ``ddpjob-c10d`` rendezvous backend patch torch's launcher, elastic agent and
c10d rendezvous where torch offers no hook (underscored names: ``launch._tune_torchrun``, ``rendezvous.create_handler``).
Another torch release may have moved or changed any of them, and a patch that misses fails late and obscurely (a
rendezvous that never closes, a recovery that waits for heartbeats) or not at all. So both refuse, before they patch
anything, a torch outside the range they are tested with: one line that names the torch found, the range supported
and what to do, and exit code ``EXIT_CODE`` (78, sysexits' EX_CONFIG: a configuration error, not a training failure).
The operator reads that line (``MARKER``, the last of the log) and fails the job at once (reason ``UnsupportedTorch``):
no restart could help. ``DDPJOB_ALLOW_UNSUPPORTED_TORCH=1`` starts anyway, with a warning, to try a new torch.

The range is written once, as the torch line of ``requirements.txt`` beside this module: pip reads the same file
(trainer/pyproject.toml's dependencies), so ``pip install ddp-trainer`` brings a supported torch, and this module
reads it here. The rest of the package (``Run``, the snapshots, the sampler) uses torch's public API and is not
guarded. Importing this module does not import torch.
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from .env import ALLOW_UNSUPPORTED_TORCH, ConfigError

REQUIREMENTS = Path(__file__).with_name("requirements.txt")
MARKER = "ddp_trainer: unsupported torch"  # the operator's names.TORCH_UNSUPPORTED_TEXT
EXIT_CODE = 78  # sysexits.h EX_CONFIG
_BOUND = re.compile(r"^(>=|<)\s*(\d+(?:\.\d+)*)$")
_RELEASE = re.compile(r"^v?(\d+(?:\.\d+)*)")


class UnsupportedTorch(ConfigError):
    """torch's version is outside the supported range; the message says which, and what to do."""


@dataclass(frozen=True)
class Range:
    lowest: tuple[int, ...]  # included
    below: tuple[int, ...]  # excluded
    text: str  # as written, e.g. ">=2.13,<2.14"

    def allows(self, version: str) -> bool:
        found = release(version)
        return found is not None and _padded(self.lowest) <= _padded(found) < _padded(self.below)


def release(version: str) -> tuple[int, ...] | None:
    """The release numbers of a version string (``2.13.0+cu130`` -> (2, 13, 0); a pre-release or a local build counts
    as its release: ``2.14.0a0+git1234`` is 2.14.0); None when it has none."""
    m = _RELEASE.match(version.strip())
    return tuple(int(n) for n in m.group(1).split(".")) if m else None


def _padded(numbers: tuple[int, ...]) -> tuple[int, ...]:
    return numbers + (0,) * (3 - len(numbers))


def parse_range(requirements: str) -> Range:
    """The torch range of a requirements text: its ``torch`` line, with exactly one ``>=`` and one ``<`` bound."""
    for line in requirements.splitlines():
        line = line.split("#", 1)[0].strip()
        m = re.match(r"^torch\s*(\S.*)$", line)
        if not m:
            continue
        bounds: dict[str, tuple[int, ...]] = {}
        for part in m.group(1).replace(" ", "").split(","):
            b = _BOUND.match(part)
            if b is None or b.group(1) in bounds:
                raise ValueError(f"{REQUIREMENTS.name}: torch bound {part!r}: write exactly one >=X.Y and one <X.Y")
            bounds[b.group(1)] = tuple(int(n) for n in b.group(2).split("."))
        if set(bounds) != {">=", "<"}:
            raise ValueError(f"{REQUIREMENTS.name}: the torch line needs a >= and a < bound, got {m.group(1)!r}")
        return Range(bounds[">="], bounds["<"], m.group(1).replace(" ", ""))
    raise ValueError(f"{REQUIREMENTS.name} has no torch line")


def supported() -> Range:
    """The torch versions ddp_trainer supports (requirements.txt beside this module)."""
    return parse_range(REQUIREMENTS.read_text())


def installed() -> str:
    """The version of the torch this process runs (or would import), read without importing it where possible."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(getattr(torch, "__version__", None), str):
        return torch.__version__
    from importlib import metadata

    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        import torch as imported  # a torch on sys.path without metadata (a source build)

        return str(imported.__version__)


def refusal(found: str, allowed: Range | None = None) -> str | None:
    """The one-line message that refuses torch ``found``; None when it is supported."""
    allowed = allowed or supported()
    if allowed.allows(found):
        return None
    return (f"{MARKER} {found}: ddp_trainer supports torch {allowed.text} (its launcher and the ddpjob-c10d "
            f"rendezvous backend patch torch internals, tested in that range only). Install a supported torch "
            f"(pip install 'torch{allowed.text}') or build on the ddp-trainer image; a plain torchrun script needs no "
            f"ddp_trainer (torchrun instead of python -m ddp_trainer.launch, spec.torchrun.rdzvBackend: c10d; "
            f"docs/your-script.md). {ALLOW_UNSUPPORTED_TORCH}=1 starts anyway, untested.")


def check(found: str | None = None) -> None:
    """Raise UnsupportedTorch when torch (``found``, else the installed one) is outside the supported range."""
    message = refusal(installed() if found is None else found)
    if message is not None:
        raise UnsupportedTorch(message)


def require(what: str, found: str | None = None) -> None:
    """At the start of ``what`` (the launcher, the rendezvous backend): return when torch is supported (or
    ``DDPJOB_ALLOW_UNSUPPORTED_TORCH=1``, with a warning); otherwise print the refusal as the last line of stderr and
    exit with EXIT_CODE."""
    try:
        check(found)
    except UnsupportedTorch as e:
        if os.environ.get(ALLOW_UNSUPPORTED_TORCH, "").strip() == "1":
            print(f"{what}: warning: {e} Starting anyway ({ALLOW_UNSUPPORTED_TORCH}=1).", file=sys.stderr, flush=True)
            return
        print(str(e), file=sys.stderr, flush=True)
        raise SystemExit(EXIT_CODE) from None
