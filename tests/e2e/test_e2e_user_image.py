"""A user's own script in a user's own image, built as docs/your-script.md says: a five-line Dockerfile on the trainer
image (tests/e2e/user_image/) around a plain DDP script written the way the PyTorch tutorials teach it (its own model,
DistributedSampler, its own torch.save snapshot at --snapshot-path, prints; no ddp_trainer import).

The image is one small layer on localhost/ddp-trainer:0.1.0, built here with the project's builder (hack/image.py on
the embedded cluster; tests.support.kube.ensure_image elsewhere) and cached by it. A DDPJob of 2 nodes runs it with the
snapshot on the job's checkpoint volume (spec.checkpoint: a directory every node sees). Once rank 0 saved a snapshot a
few epochs in, its pod is killed. What the user sees is asserted: the pod is replaced under its name, the job ends
Succeeded with the kill spent from infraBackoffLimit (restarts 0, infraRestarts 1, lastFailure PodDeleted; so
`kubectl get ddpj -o wide` says), and the script's own snapshot carried the run: every rank of the re-formed group
printed its "Resuming training from snapshot at epoch N" line with N past the kill's epoch, and the snapshot file
holds every epoch at the end. About a minute on two cores; runs in the e2e lane of hack/test.sh's stage 3b.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from tests.e2e import harness as h
from tests.support.kube import ensure_image

CONTEXT = Path(__file__).resolve().parent / "user_image"
USER_IMAGE = f"localhost/ddp-user-example:{h.TAG}"
JOB = "user"
EPOCHS = 12
KILL_AFTER_EPOCH = 3  # rank 0 saved this epoch's snapshot: the kill lands with 4+ epochs done, 8- to go
SNAPSHOT = f"{h.CHECKPOINT_MOUNT}/snapshot.pt"
_SAVED = re.compile(r"^Epoch (\d+) \| snapshot saved at ", re.MULTILINE)
_RESUMED = re.compile(r"^\[rank (\d+)\] Resuming training from snapshot at epoch (\d+)$", re.MULTILINE)


def user_job(host_dir: str) -> dict:
    """The DDPJob a user writes for the image: its own args, a snapshot path on the checkpoint volume, and the
    hardening of the samples (read-only root filesystem, so /tmp is an emptyDir)."""
    trainer = {
        "name": "trainer", "image": USER_IMAGE, "imagePullPolicy": "IfNotPresent",
        "args": ["--epochs", str(EPOCHS), "--snapshot-path", SNAPSHOT, "--sleep-per-batch", "0.02"],
        "resources": {"requests": {"cpu": "100m", "memory": "256Mi"}, "limits": {"memory": "2Gi"}},
        "securityContext": {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                            "capabilities": {"drop": ["ALL"]}},
        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}],
    }
    job = {"apiVersion": "ddp.dev/v1alpha1", "kind": "DDPJob", "metadata": {"name": JOB}, "spec": {
        "nodes": 2,
        "template": {"spec": {
            "securityContext": {"runAsNonRoot": True, "runAsUser": 1000, "seccompProfile": {"type": "RuntimeDefault"}},
            "containers": [trainer],
            "volumes": [{"name": "tmp", "emptyDir": {}}]}}}}
    # spec.checkpoint on a node directory every node sees, made writable for uid 1000 by an init container; the
    # harness's helper also sets DDPJOB_CHECKPOINT_EVERY, which this script never reads
    return h.with_disk_checkpoint(job, host_dir)


def _saved(kubectl, ns: str) -> tuple[str, int] | None:
    """(the pod of rank 0, the newest epoch it saved) once that is KILL_AFTER_EPOCH or later."""
    for pod in (f"{JOB}-0", f"{JOB}-1"):
        epochs = [int(e) for e in _SAVED.findall(h.pod_logs(kubectl, ns, pod) or "")]
        if epochs and max(epochs) >= KILL_AFTER_EPOCH:
            return pod, max(epochs)
    return None


def _replaced(kubectl, ns: str, pod: str, uid: str) -> bool:
    return {p["metadata"]["name"]: p["metadata"]["uid"] for p in h.trainer_pods(kubectl, ns, JOB)}.get(pod) \
        not in (None, uid)


def _columns(table: str) -> dict[str, str]:
    """The first row of `kubectl get` output by its header's columns (a value may be empty or hold spaces)."""
    header, row = table.splitlines()[:2]
    starts = [m.start() for m in re.finditer(r"\S+", header)] + [None]
    return {header[a:b].strip(): row[a:b].strip() for a, b in zip(starts, starts[1:])}


def test_a_users_own_image_survives_a_killed_pod_through_its_own_snapshot(cluster, kubectl, ns, request):
    host_dir = f"{h.SHARED_HOST_DIR}/{ns}-snapshots"
    request.addfinalizer(lambda: shutil.rmtree(host_dir, ignore_errors=True))
    ensure_image(cluster, USER_IMAGE, CONTEXT / "Dockerfile", CONTEXT)
    h.apply(kubectl, ns, user_job(host_dir))

    rank0, saved = h.wait_for(lambda: _saved(kubectl, ns), 240, f"rank 0 to save epoch {KILL_AFTER_EPOCH}")
    uid = kubectl.pod(ns, rank0)["metadata"]["uid"]
    h.kill_pod(kubectl, ns, rank0)  # the pod that writes the snapshots: the survivor must read them from the volume
    h.log(f"killed {rank0} (rank 0) after it saved epoch {saved}")
    h.wait_for(lambda: _replaced(kubectl, ns, rank0, uid), 120, f"a replacement for {rank0}")

    st = h.wait_phase(kubectl, ns, JOB, "Succeeded", 240)
    conditions = {c["type"]: c["status"] for c in st.get("conditions") or []}
    assert conditions.get("Succeeded") == "True", st
    # A killed pod is the infrastructure's failure: it spends infraBackoffLimit, not the user's backoffLimit.
    assert (st.get("restarts", 0), st.get("infraRestarts")) == (0, 1), st
    failure = st.get("lastFailure") or {}
    assert (failure.get("class"), failure.get("reason"), failure.get("pod")) == \
        ("Infrastructure", "PodDeleted", rank0), failure
    columns = _columns(kubectl("get", "ddpj", JOB, "-n", ns, "-o", "wide").stdout)
    assert (columns.get("PHASE"), columns.get("RESTARTS"), columns.get("FAILURE")) == \
        ("Succeeded", "0", "PodDeleted"), columns

    # The script's own snapshot carried the run: both ranks of the re-formed group loaded it, past the kill's epoch.
    logs = {pod: h.pod_logs(kubectl, ns, pod) or "" for pod in (f"{JOB}-0", f"{JOB}-1")}
    resumed = sorted((int(r), int(e)) for text in logs.values() for r, e in _RESUMED.findall(text))
    assert {r for r, _ in resumed} == {0, 1}, f"the ranks did not both resume from the snapshot: {resumed}\n{logs}"
    assert all(saved + 1 <= e < EPOCHS for _, e in resumed), (saved, resumed)
    finished = [t for t in logs.values() if f"Training finished: {EPOCHS} epochs" in t]
    start = max(e for r, e in resumed if r == 0)
    assert len(finished) == 1 and f"from epoch {start} of {EPOCHS}" in finished[0], logs
    import torch  # the snapshot as the script left it on the volume (written by rank 0, read by every rank)

    assert torch.load(Path(host_dir) / "snapshot.pt", weights_only=True)["epochs_run"] == EPOCHS
    print(f"user image: rank 0's pod {rank0} killed after epoch {saved}; resumed at epoch {start} from the "
          f"script's own snapshot; {columns}")
