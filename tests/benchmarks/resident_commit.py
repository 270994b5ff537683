"""What sealing the resident state costs per step, by model: the digits example and the bench-overhead MLPs.

A commit (``ddp_trainer.resident.ResidentState.commit``) walks the state dict, pickles its non-tensor rest and seals
the file; it copies no resident tensor, so its cost follows the number of tensors, not their bytes. That is what
``Run``'s trial weighs against the step (``DDPJOB_SNAPSHOT_RESIDENT=auto``). One process, one thread, Adam; each
commit follows ``begin_update`` as in training. Outcome checked: the file read back equals the live state.

    .venv/bin/python tests/benchmarks/resident_commit.py [--quick] [--commits 300]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "trainer"))
sys.path.insert(0, str(ROOT))
from tests.benchmarks import results  # noqa: E402
from tests.benchmarks.trainer_overhead import HIDDEN_LAYERS, INPUTS, OUTPUTS, mlp_width  # noqa: E402


def models(quick: bool):
    import torch
    from torch import nn

    from ddp_trainer.examples.digits import DigitsNet

    yield "digits", DigitsNet(), torch.randn(32, 1, 8, 8)
    for n in ([1e5] if quick else [1e6, 1e7, 1e8]):
        w = mlp_width(n)
        layers: list[nn.Module] = [nn.Linear(INPUTS, w), nn.ReLU()]
        for _ in range(HIDDEN_LAYERS - 1):
            layers += [nn.Linear(w, w), nn.ReLU()]
        yield f"mlp-{int(n)}", nn.Sequential(*layers, nn.Linear(w, OUTPUTS)), torch.randn(32, INPUTS)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="digits and a ~100k MLP, 30 commits each")
    p.add_argument("--commits", type=int, default=300)
    results.add_record_arg(p)
    opts = p.parse_args()
    import torch

    from ddp_trainer.resident import ResidentState
    from ddp_trainer.state import Components, Position, flatten

    torch.set_num_threads(1)
    commits = 30 if opts.quick else opts.commits
    out = {}
    for name, net, x in models(opts.quick):
        opt = torch.optim.Adam(net.parameters(), lr=1e-3)
        net(x).sum().backward()
        opt.step()  # Adam's state exists: the layout is the one training uses
        comp, pos = Components(net, opt), Position(step=1)
        with tempfile.TemporaryDirectory(dir="/dev/shm" if Path("/dev/shm").is_dir() else None) as d:
            res = ResidentState(d, "bench", 0)
            res.commit(pos.step, comp.state_dict(pos), opt)  # the layout: one copy, not a commit's cost
            times = []
            for _ in range(commits):
                res.begin_update()
                pos.step += 1
                t0 = time.perf_counter()
                res.commit(pos.step, comp.state_dict(pos), opt)
                times.append(time.perf_counter() - t0)
            got = res.read()
            live = flatten(comp.state_dict(pos))[1]
            exact = got is not None and got.step == pos.step and all(
                torch.equal(a, b) for a, b in zip(live, flatten(got.state)[1], strict=True))
            res.close(remove=True)
        out[name] = {
            "params": sum(p.numel() for p in net.parameters()),
            "tensors": len(live),
            "resident_bytes": res.resident_bytes,
            "commit_ms": round(statistics.median(times) * 1e3, 4),
            "commit_ms_p90": round(statistics.quantiles(times, n=10)[-1] * 1e3, 4),
            "exact": exact,
        }
        del net, opt, comp
    result = {"models": out, "commit_ms_by_model": {k: v["commit_ms"] for k, v in out.items()},
              "exact": all(v["exact"] for v in out.values()), "commits": commits, "quick": opts.quick}
    results.emit("resident_commit", result, mode="quick" if opts.quick else "full", record=opts.record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
