"""bench-node-loss: a kind worker lost under a training job, node stopped -> first resumed step.

The measurements are made by tests/e2e/test_e2e_node_loss.py on the 3-node kind cluster of hack/kind-e2e.sh
(`docker stop`, then `docker pause`, of the worker running one trainer; see that file), which appends one JSON
line per case to $DDPJOB_NODE_LOSS_RESULTS. This program turns those lines into the benchmark's result:

    hack/kind-e2e.sh --node-loss                       (make kind-node-loss)
    KIND_RECORD=1 hack/kind-e2e.sh --node-loss         (make bench-node-loss: also docs/bench/node_loss.json)
    .venv/bin/python tests/benchmarks/node_loss.py RESULTS.jsonl [--record]

Per case: how long the node took to turn NotReady (the controller manager's grace period, 20 s in
hack/kind-config.yaml), node lost -> first resumed step (`recovery_s`, ddp_trainer's steps-lost definition for
`steps_lost`), and the part after NotReady, which is the operator's: nodeLostTimeoutSeconds, then the force-delete,
the replacement on the other worker and the re-formed group. Target: that part within the timeout + 15 s.
Prints one JSON object as its last line.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from tests.benchmarks import results  # noqa: E402

MARGIN_S = 15.0  # the target: NotReady -> first resumed step within nodeLostTimeoutSeconds + this


def summarize(cases: list[dict]) -> dict:
    if not cases:
        raise SystemExit("no node-loss results: did tests/e2e/test_e2e_node_loss.py run?")
    out: dict = {"cases": {}}
    for c in cases:
        after = round(c["recovery_s"] - c["notready_s"], 2)
        out["cases"][c["how"]] = {**c, "after_notready_s": after,
                                  "within_target": after <= c["node_lost_timeout_s"] + MARGIN_S}
    timeout = max(c["node_lost_timeout_s"] for c in cases)
    out.update({
        "node_lost_timeout_s": timeout,
        "target_after_notready_s": timeout + MARGIN_S,
        "recovery_s_max": max(c["recovery_s"] for c in cases),
        "after_notready_s_max": max(v["after_notready_s"] for v in out["cases"].values()),
        "notready_s_max": max(c["notready_s"] for c in cases),
        "steps_lost_max": max(c["steps_lost"] for c in cases),
        "all_from_peer": all(c["source"] == "peer" for c in cases),
    })
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("results_file", help="the JSON lines tests/e2e/test_e2e_node_loss.py appended")
    results.add_record_arg(p)
    opts = p.parse_args()
    cases = [json.loads(line) for line in Path(opts.results_file).read_text().splitlines() if line.strip()]
    results.emit("node_loss", summarize(cases), mode="full", record=opts.record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
