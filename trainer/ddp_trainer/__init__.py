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

from . import rng
from .env import ConfigError
from .run import Run, model_digest
from .sampler import ResumableDistributedSampler
from .session import Session, init_session
from .storage import load_file
from .syncbn import SyncBatchNorm, convert_sync_batchnorm

__all__ = [
    "ConfigError",
    "ResumableDistributedSampler",
    "Run",
    "Session",
    "SyncBatchNorm",
    "convert_sync_batchnorm",
    "init_session",
    "load_file",
    "model_digest",
    "rng",
]
