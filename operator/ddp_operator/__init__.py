"""DDPJob operator: runs PyTorch DistributedDataParallel training as a Kubernetes custom resource.

The package is split into a pure core (names, spec, env, service, pod, rdzv, status, plan: no I/O,
no clock) and a thin kopf shell (handlers, reconciler, jobs, poller, backoff, k8s, progress, metrics).
"""

__version__ = "0.1.0"
