"""DDPJob operator: runs PyTorch DistributedDataParallel training as a Kubernetes custom resource.

The package is split into a pure core and a thin shell around kopf.
- Pure core (no I/O, no clock): names, crd (the CRD's one source; only its command line writes files), spec,
  labels, env, service, pod, rdzv, netpol, kueue, spares, observed, status, hang and plan/.
- Shell: __main__ (the process and its flags), handlers (kopf registrations), reconciler (the pass and the I/O
  that carries out a plan), jobs (what the shell keeps per job), poller (progress polling, hang detection),
  backoff (refused creates), k8s (every Kubernetes API call besides kopf's watches), progress (HTTP probes of
  the trainer pods), metrics (Prometheus), leader (leader election) and kopf_mends (fixes for kopf defects).
"""

__version__ = "0.1.0"
