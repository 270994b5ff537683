"""Elastic, deterministic, fault-tolerant DDP training under torchrun.

A plain DDP script gains exact resume, peer recovery and progress reporting with a few lines::

    import ddp_trainer

    session = ddp_trainer.init_session()                 # process group from torchrun's env, SIGTERM
    model = DDP(ddp_trainer.convert_sync_batchnorm(net, session.device))
    run = ddp_trainer.Run(session, model=model, optimizer=opt, seed=seed)
    run.restore()
    for epoch in run.epochs(epochs):
        sampler.set_epoch(epoch)
        for x, y in run.batches(loader):
            ...
            run.step_done(loss=loss, samples=len(x))
        run.epoch_done(metrics={...})
    run.finish(metrics={"testAccuracy": acc})

See trainer/README.md for the environment variables and the guarantees.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# Imported on first use, so that `import ddp_trainer` (and `python -m ddp_trainer.launch`, which starts its
# forkserver before torch is imported) does not import torch by itself.
_EXPORTS = {
    "ConfigError": "env",
    "ResumableDistributedSampler": "sampler",
    "Run": "run",
    "Session": "session",
    "SyncBatchNorm": "syncbn",
    "convert_sync_batchnorm": "syncbn",
    "init_session": "session",
    "load_file": "storage",
    "model_digest": "state",
    "rng": None,  # a submodule
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from . import rng
    from .env import ConfigError
    from .run import Run
    from .sampler import ResumableDistributedSampler
    from .session import Session, init_session
    from .state import model_digest
    from .storage import load_file
    from .syncbn import SyncBatchNorm, convert_sync_batchnorm


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module = importlib.import_module(f".{_EXPORTS[name] or name}", __name__)
    value = module if _EXPORTS[name] is None else getattr(module, name)
    globals()[name] = value
    return value
