"""kubectl-ddp: run, watch, read the logs of and plot DDPJobs from a terminal (docs/cli.md).

One module per command (run, top, logs, describe, plot), the cluster access in `kube`, the argument parser in
`main`. Contract strings (labels, the history ConfigMap, phases) come from `ddp_operator.names`, the one place
the operator keeps them.
"""
