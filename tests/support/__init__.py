"""What the tests and the benchmark programs share, as plain modules (no fixtures, no hooks: those live in the
conftest.py files, which call these).

- `suite`: the suite's own rules: the repository root, CI or not, each tier's time limit, which skips CI allows.
- `waiting`: `wait_for`, the one way to wait on a condition (a timeout, never a fixed sleep).
- `kube`: the cluster under test and kubectl bound to it: connecting, images, test namespaces, post-mortems, other
  operators paused.
- `processes`: processes the tests start on this machine: stopping one, `python -m ddp_operator` as a subprocess.
- `prometheus`: the pinned Prometheus started on loopback, PromQL through its HTTP API, the Grafana dashboard's
  queries with its variables filled in.
"""
