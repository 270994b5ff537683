"""What a training run's state is, and moving it between objects, trees of tensors and bytes.

The state of a run is a plain dict::

    {"model": ..., "optimizer": ..., "scaler": ..., "scheduler": ..., "extra": {...},
     "position": {"step": s, "epoch": e, "batch": b, "world_size": w, "stopped": False}}

``position`` says where the run is: ``step`` optimizer steps done, ``batch`` batches of epoch ``epoch``
consumed. Together with per-step reseeding (``rng.py``) and a sampler that can start mid-epoch
(``sampler.py``) that is everything an exact resume needs. Snapshots store the tree flattened into a
skeleton (tensors replaced by indices) plus a flat list of tensors; see :func:`flatten`.
"""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn


@dataclass
class Position:
    step: int = 0
    epoch: int = 0
    batch: int = 0
    world_size: int = 0
    stopped: bool = False

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Position:
        return cls(
            int(d["step"]),
            int(d["epoch"]),
            int(d["batch"]),
            int(d.get("world_size", 0)),
            bool(d.get("stopped", False)),
        )

    def to_dict(self) -> dict[str, int]:
        return asdict(self)

    def rescale(self, world_size: int) -> bool:
        """Move to ``world_size``; whether the run stays exact (the same world size, or none recorded)."""
        if not self.world_size or self.world_size == world_size:
            return True
        # Another world size partitions the data differently: keep the share of the epoch that
        # was done (rounded up), which cannot be bitwise-identical to any uninterrupted run.
        consumed = self.batch * self.world_size
        self.batch = -(-consumed // world_size)
        self.world_size = world_size
        return False


class TensorRef:
    """Placeholder for the i-th tensor in a flattened state tree."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index

    def __reduce__(self):
        return (TensorRef, (self.index,))


def _map_leaves(node: Any, leaf: Any) -> Any:
    """Rebuild a tree of dicts/lists/tuples with `leaf` applied to everything else."""
    if isinstance(node, dict):
        return {k: _map_leaves(v, leaf) for k, v in node.items()}
    if isinstance(node, list):
        return [_map_leaves(v, leaf) for v in node]
    if isinstance(node, tuple):
        return tuple(_map_leaves(v, leaf) for v in node)
    return leaf(node)


def flatten(tree: Any) -> tuple[Any, list[torch.Tensor]]:
    """Split a tree of dicts/lists/tuples into (skeleton without tensors, tensors in order)."""
    tensors: list[torch.Tensor] = []

    def take(node: Any) -> Any:
        if isinstance(node, torch.Tensor):
            tensors.append(node)
            return TensorRef(len(tensors) - 1)
        return node

    return _map_leaves(tree, take), tensors


def unflatten(skeleton: Any, tensors: list[torch.Tensor]) -> Any:
    return _map_leaves(skeleton, lambda node: tensors[node.index] if isinstance(node, TensorRef) else node)


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside DDP/FSDP-style wrappers (their state dicts carry a ``module.`` prefix)."""
    while hasattr(model, "module") and isinstance(model.module, nn.Module):
        model = model.module
    return model


class Components:
    """The stateful objects of a run: reads and writes their state as one dict."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        scaler: Any | None = None,
        scheduler: Any | None = None,
        extra: dict[str, Any] | None = None,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.scaler = scaler
        self.scheduler = scheduler
        self.extra = extra if extra is not None else {}

    def state_dict(self, position: Position) -> dict[str, Any]:
        state: dict[str, Any] = {"model": unwrap(self.model).state_dict()}
        if self.optimizer is not None:
            state["optimizer"] = self.optimizer.state_dict()
        if self.scaler is not None:
            state["scaler"] = self.scaler.state_dict()
        if self.scheduler is not None:
            state["scheduler"] = self.scheduler.state_dict()
        state["extra"] = self.extra
        state["position"] = position.to_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> Position:
        unwrap(self.model).load_state_dict(state["model"])
        if self.optimizer is not None and "optimizer" in state:
            self.optimizer.load_state_dict(state["optimizer"])
        if self.scaler is not None and "scaler" in state:
            self.scaler.load_state_dict(state["scaler"])
        if self.scheduler is not None and "scheduler" in state:
            self.scheduler.load_state_dict(state["scheduler"])
        # Keep the caller's dict object: the training loop holds a reference to it.
        self.extra.clear()
        self.extra.update(copy.deepcopy(state.get("extra", {})))
        return Position.from_dict(state["position"])


def detached_copy(tree: Any, device: str | torch.device = "cpu") -> Any:
    """A deep copy with every tensor cloned to ``device`` (training goes on mutating the originals)."""
    skeleton, tensors = flatten(tree)
    copies = [t.detach().to(device, copy=True) for t in tensors]
    return unflatten(copy.deepcopy(skeleton), copies)


def model_digest(model: nn.Module) -> str:
    """sha256 over the model's state dict (names, dtypes, shapes and bytes): equal iff bitwise equal."""
    import hashlib

    h = hashlib.sha256()
    for name, tensor in sorted(unwrap(model).state_dict().items()):
        t = tensor.detach().cpu().contiguous()
        h.update(name.encode())
        h.update(str(t.dtype).encode())
        h.update(str(tuple(t.shape)).encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()
