"""Random number generators made a pure function of (seed, step, rank).

Saving and restoring RNG states is not enough for peer recovery: a replaced node's RNG state died with
it, and survivors only hold their own. So the trainer reseeds every generator before each step from
``(seed, step, rank)``; the state needed for determinism is then just the step counter, which every
snapshot and checkpoint already carries. :func:`capture`/:func:`restore` remain for users who prefer
classic RNG-state checkpoints.
"""

from __future__ import annotations

import hashlib
import random
import struct
from typing import Any

import numpy as np
import torch


def step_seed(seed: int, step: int, rank: int) -> int:
    """A well-mixed 63-bit seed for one (seed, step, rank); nearby inputs give unrelated streams."""
    digest = hashlib.blake2b(struct.pack("<qqq", seed, step, rank), digest_size=8).digest()
    return int.from_bytes(digest, "little") & 0x7FFF_FFFF_FFFF_FFFF


def _accelerator_initialized() -> bool:
    return torch.cuda.is_initialized() or (hasattr(torch, "xpu") and torch.xpu.is_initialized())


def seed_all(seed: int) -> None:
    """Seed Python, NumPy and torch (CPU and every initialised CUDA/XPU device)."""
    random.seed(seed)
    np.random.seed(seed % (2**32))
    if _accelerator_initialized():
        torch.manual_seed(seed)
    else:
        # torch.manual_seed on a process that has not initialised CUDA/XPU queues a lazy seeding call
        # per device type and captures a Python stack trace for each: ~0.25 ms per call, 2 % of a small
        # model's step when done every step. Seed the CPU generator alone (what torch.manual_seed does
        # for it); an accelerator initialised later is seeded from the next step on. Models live on
        # their device before the first step, so a training loop never hits that case.
        torch.default_generator.manual_seed(seed)


def seed_step(seed: int, step: int, rank: int) -> None:
    seed_all(step_seed(seed, step, rank))


def capture() -> dict[str, Any]:
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
