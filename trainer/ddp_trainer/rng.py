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


def seed_all(seed: int) -> None:
    """Seed Python, NumPy and torch (CPU and every CUDA device)."""
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


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
