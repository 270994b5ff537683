"""The GPU sample's trainer path on a real GPU (manifests/samples/gpu.yaml without Kubernetes): NCCL, one worker per
visible GPU (what `nprocPerNode: auto` resolves to for a pod that requests them all), mixed precision (``--amp
auto``: bf16 where the GPU has it), and a killed worker recovered in place from its pod's snapshot (copied through a
CUDA side stream into pinned memory), ending bitwise equal to an uninterrupted run. Resident state stays off: CUDA
tensors cannot live in /dev/shm.

Skipped without CUDA (CI and the development VM have no GPU); on a GPU machine: ``make test-gpu``."""

from __future__ import annotations

import pytest
import torch
from ddp_trainer.testing import LocalCluster, recovery_after_kill
from tests.trainer.digits_job import DIGITS_ARGS, JOB_TIMEOUT, SLOW, final_event

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

GPU_ARGS = [*DIGITS_ARGS, "--amp", "auto", *SLOW]
# Resident state asked for on purpose: on CUDA it must stay off (and the copies hold the state).
GPU_ENV = {"DDPJOB_SNAPSHOT_RESIDENT": "1"}


def _cluster(tmp_path, name: str) -> LocalCluster:
    return LocalCluster(tmp_path / name, nnodes="1:1", nproc_per_node=torch.cuda.device_count(), args=GPU_ARGS,
                        env=GPU_ENV, rdzv_id=f"gpu-{name}", pid_namespace=False)


def test_gpu_sample_trains_on_nccl_with_amp_and_recovers_a_killed_worker_bitwise(tmp_path):
    with _cluster(tmp_path, "reference") as ref:
        ref.start_node()
        assert set(ref.wait_exit(timeout=JOB_TIMEOUT).values()) == {0}, ref.dump()
        reference = final_event(ref)
        sessions = [e.fields for e in ref.events("session")]
        print("GPU sessions:", sessions, "config:", [e.fields for e in ref.events("config")])
        assert len(sessions) == torch.cuda.device_count(), sessions
        assert all(e.get("backend") == "nccl" and e.get("device", "").startswith("cuda") for e in sessions), sessions
        expected_amp = "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
        assert [e["amp"] for e in ref.events("config")] == [expected_amp], [e.fields for e in ref.events("config")]
        assert float(reference["test_accuracy"]) >= 0.9, ref.dump()

    with _cluster(tmp_path, "kill") as job:
        node = job.start_node()
        job.wait_for_step(25, timeout=JOB_TIMEOUT)
        killed_at = job.kill_workers(node)
        rec = recovery_after_kill(job, killed_at, timeout=JOB_TIMEOUT)
        assert set(job.wait_exit(timeout=JOB_TIMEOUT).values()) == {0}, job.dump()
        print("GPU worker kill:", rec)
        assert rec["source"] == "local" and 0 <= rec["steps_lost"] <= 1, rec  # the pod's own snapshot, K = 1
        assert not job.events("resident_state"), job.dump()  # CUDA state: copies only
        assert final_event(job)["weights_sha256"] == reference["weights_sha256"], job.dump()
