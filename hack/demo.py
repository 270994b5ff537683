#!/usr/bin/env python3
"""The live part of `make demo`: run the digits DDPJob, kill a training pod midway, measure recovery.

    hack/demo.py [--namespace ddp-demo] [--kill worker|rank0] [--fresh]

Applies manifests/samples/digits.yaml (slowed down a little so there is something to watch), prints a
line whenever progress changes (step, loss, accuracy, pods), deletes one training pod once training is
well under way, waits for Succeeded and prints the final test accuracy and the recovery time.

Recovery time = from the kill until training is past the furthest step it had reached before the kill,
driven by the re-formed group (the replacement pod running). It is measured here, from rank 0's progress
endpoint read through the API server's pod proxy every half second, so it does not depend on how often
the operator copies progress into the status (and works on any cluster, kind included).

Idempotent: a finished demo job is reported again, not rerun (--fresh reruns it); a job left running by
an interrupted demo is picked up where it is. Results are kept as annotations on the DDPJob.
"""

from __future__ import annotations

import argparse
import copy
import json
import pathlib
import sys
import time

import yaml
from kubernetes import client, config
from kubernetes.client.rest import ApiException

REPO = pathlib.Path(__file__).resolve().parents[1]
SAMPLE = REPO / "manifests" / "samples" / "digits.yaml"
GROUP, VERSION, PLURAL = "ddp.dev", "v1alpha1", "ddpjobs"
LABEL_JOB, LABEL_ROLE = "ddp.dev/job-name", "ddp.dev/role"
PROGRESS_PORT = 29401
ANN = "demo.ddp.dev/"
FINISHED = ("Succeeded", "Failed")


def say(msg: str) -> None:
    print(msg, flush=True)


class Demo:
    def __init__(self, args: argparse.Namespace) -> None:
        self.a = args
        config.load_kube_config()
        self.core = client.CoreV1Api()
        self.crd = client.CustomObjectsApi()
        self.ns, self.name = args.namespace, args.job
        self.t0 = time.monotonic()

    # --- API helpers ----------------------------------------------------------------------------
    def job(self) -> dict | None:
        try:
            return self.crd.get_namespaced_custom_object(GROUP, VERSION, self.ns, PLURAL, self.name)
        except ApiException as e:
            if e.status == 404:
                return None
            raise

    def annotate(self, **values: str) -> None:
        body = {"metadata": {"annotations": {ANN + k: str(v) for k, v in values.items()}}}
        self.crd.patch_namespaced_custom_object(GROUP, VERSION, self.ns, PLURAL, self.name, body)

    def trainer_pods(self) -> list:
        sel = f"{LABEL_JOB}={self.name},{LABEL_ROLE}=trainer"
        pods = self.core.list_namespaced_pod(self.ns, label_selector=sel).items
        return sorted(pods, key=lambda p: p.metadata.name)

    def progress_of(self, pod) -> dict | None:
        """Rank 0's progress, read through the API server's pod proxy; None from any other pod."""
        if pod.status.phase != "Running" or pod.metadata.deletion_timestamp:
            return None
        try:
            # Raw bytes: the client would otherwise hand back a str() of the parsed JSON.
            resp = self.core.connect_get_namespaced_pod_proxy_with_path(
                f"{pod.metadata.name}:{PROGRESS_PORT}", self.ns, "progress", _request_timeout=2,
                _preload_content=False)
            record = json.loads(resp.data)
        except Exception:  # not rank 0, not serving yet, or restarting: all mean "no progress here"
            return None
        return record if isinstance(record, dict) and "step" in record else None

    # --- steps ----------------------------------------------------------------------------------
    def ensure_namespace(self) -> None:
        try:
            self.core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(
                name=self.ns, labels={"app.kubernetes.io/part-of": "ddpjob-demo"})))
        except ApiException as e:
            if e.status != 409:
                raise

    def manifest(self) -> dict:
        job = copy.deepcopy(next(d for d in yaml.safe_load_all(SAMPLE.read_text()) if d and d["kind"] == "DDPJob"))
        job["metadata"]["namespace"] = self.ns
        job["metadata"]["name"] = self.name
        # Demo-only: copy progress into the status often, slow each step a little and train all 10
        # epochs (no early stop), so that the run lasts long enough to watch and to kill a pod midway.
        job["spec"]["progressPeriodSeconds"] = 2
        trainer = next(c for c in job["spec"]["template"]["spec"]["containers"] if c["name"] == "trainer")
        demo_env = {"DIGITS_STEP_DELAY": str(self.a.step_delay), "DIGITS_PATIENCE": "0"}
        trainer["env"] = [e for e in trainer.get("env", []) if e["name"] not in demo_env] + [
            {"name": k, "value": v} for k, v in demo_env.items()]
        return job

    def delete_job(self) -> None:
        say(f"deleting the previous {self.ns}/{self.name}")
        try:
            self.crd.delete_namespaced_custom_object(GROUP, VERSION, self.ns, PLURAL, self.name,
                                                     body=client.V1DeleteOptions(propagation_policy="Foreground"))
        except ApiException as e:
            if e.status != 404:
                raise
        deadline = time.monotonic() + 120
        while (self.job() is not None or self.trainer_pods()) and time.monotonic() < deadline:
            time.sleep(1)

    def report(self, job: dict) -> int:
        st = job.get("status", {})
        ann = job["metadata"].get("annotations", {})
        metrics = (st.get("progress") or {}).get("metrics") or {}
        acc = metrics.get("testAccuracy")
        recovery = ann.get(ANN + "recovery-seconds")
        say("")
        say(f"=== {self.ns}/{self.name}: {st.get('phase')} ===")
        say(f"final test accuracy : {acc if acc is not None else 'n/a'}")
        say(f"killed pod          : {ann.get(ANN + 'killed-pod', 'none')} at step {ann.get(ANN + 'killed-at-step', '-')}")
        say(f"recovery time       : {recovery + ' s' if recovery else 'n/a'}"
            "  (kill -> training past the step reached before the kill)")
        say(f"restarts counted    : {st.get('restarts', 0)}   disruptions: {st.get('disruptions', 0)}")
        if st.get("startTime") and st.get("completionTime"):
            say(f"job ran from        : {st['startTime']} to {st['completionTime']}")
        ok = st.get("phase") == "Succeeded" and acc is not None and float(acc) >= self.a.min_accuracy
        if not ok:
            say(f"DEMO FAILED: expected Succeeded with accuracy >= {self.a.min_accuracy} "
                f"(reason: {st.get('reason')}, message: {st.get('message')})")
        elif not recovery:
            say("DEMO INCOMPLETE: the job succeeded but no recovery was measured (the kill came too late, or "
                "training finished first); run `hack/demo.sh --fresh` to try again")
            ok = False
        return 0 if ok else 1

    def run(self) -> int:
        job = self.job()
        if job is not None and self.a.fresh:
            self.delete_job()
            job = None
        if job is not None and job.get("status", {}).get("phase") in FINISHED:
            say(f"{self.ns}/{self.name} already finished (run `hack/demo.sh --fresh` to train again)")
            return self.report(job)
        if job is None:
            self.ensure_namespace()
            body = self.manifest()
            self.crd.create_namespaced_custom_object(GROUP, VERSION, self.ns, PLURAL, body)
            say(f"applied {SAMPLE.relative_to(REPO)} as {self.ns}/{self.name} "
                f"(2 nodes; demo: DIGITS_STEP_DELAY={self.a.step_delay}, DIGITS_PATIENCE=0, progressPeriodSeconds=2)")
        else:
            say(f"{self.ns}/{self.name} is already running: watching it")
        return self.watch()

    def watch(self) -> int:
        say("    time  phase       nodes  step  epoch    loss  valAcc  restarts  pods")
        last_line, last_key, last_print = "", None, 0.0
        max_step = -1        # furthest step seen before the kill
        kill_time = None     # monotonic time of the kill
        killed = None        # (name, uid)
        job = self.job()
        ann = job["metadata"].get("annotations", {}) if job else {}
        already_killed = ANN + "killed-pod" in ann
        deadline = time.monotonic() + self.a.timeout
        while time.monotonic() < deadline:
            job = self.job()
            if job is None:
                say("the DDPJob disappeared")
                return 1
            st = job.get("status", {})
            pods = self.trainer_pods()
            prog = None
            rank0 = None
            for p in pods:
                prog = self.progress_of(p)
                if prog is not None:
                    rank0 = p
                    break
            shown = prog or st.get("progress") or {}
            step = shown.get("step")
            metrics = shown.get("metrics") or {}
            acc = metrics.get("valAccuracy", metrics.get("testAccuracy"))
            loss = shown.get("loss")
            pod_txt = " ".join(
                f"{p.metadata.name.removeprefix(self.name + '-')}:"
                f"{'Terminating' if p.metadata.deletion_timestamp else p.status.phase}" for p in pods)
            line = (f"{st.get('phase', '-'):<10} {st.get('nodesReady', '-'):>6} {step if step is not None else '-':>5} "
                    f"{shown.get('epoch', '-'):>6} {f'{loss:.4f}' if isinstance(loss, (int, float)) else '-':>7} "
                    f"{f'{acc:.3f}' if isinstance(acc, (int, float)) else '-':>7} {st.get('restarts', 0):>9}  {pod_txt}")
            # A line when the job or its pods change, and at most every 2 s while only progress moves.
            key = (st.get("phase"), st.get("nodesReady"), st.get("restarts"), pod_txt)
            now = time.monotonic()
            if line != last_line and (key != last_key or now - last_print >= 2):
                say(f"{now - self.t0:7.1f}s  {line}")
                last_line, last_key, last_print = line, key, now

            if st.get("phase") in FINISHED:
                return self.report(job)

            if prog is not None and kill_time is None:
                max_step = max(max_step, prog.get("step") or 0)
            # Kill once training is well under way (and only once, even across reruns of the demo).
            if (kill_time is None and not already_killed and prog is not None and rank0 is not None
                    and (prog.get("epoch") or 0) >= self.a.kill_epoch):
                victims = [p for p in pods if p.status.phase == "Running" and not p.metadata.deletion_timestamp]
                if self.a.kill != "rank0":
                    victims = [p for p in victims if p.metadata.name != rank0.metadata.name] or victims
                else:
                    victims = [rank0]
                victim = victims[-1]
                say(f"\n>>> killing {victim.metadata.name} at step {max_step} "
                    f"({'rank 0' if victim is rank0 else 'not rank 0'}): "
                    f"kubectl delete pod --grace-period={self.a.kill_grace}\n")
                self.core.delete_namespaced_pod(victim.metadata.name, self.ns,
                                                grace_period_seconds=self.a.kill_grace)
                kill_time = time.monotonic()
                killed = (victim.metadata.name, victim.metadata.uid)
                self.annotate(**{"killed-pod": victim.metadata.name, "killed-at-step": max_step})

            if kill_time is not None:
                replaced = any(p.metadata.name == killed[0] and p.metadata.uid != killed[1]
                               and p.status.phase == "Running" for p in pods)
                step_now = (prog or {}).get("step")
                if not replaced:
                    # Survivors may finish the step in flight before they notice: that is not recovery.
                    max_step = max(max_step, step_now or 0)
                elif step_now is not None and step_now > max_step:
                    recovery = time.monotonic() - kill_time
                    say(f"\n>>> recovered: step {step_now} > {max_step} with {killed[0]} replaced, "
                        f"{recovery:.1f} s after the kill\n")
                    self.annotate(**{"recovery-seconds": f"{recovery:.1f}"})
                    kill_time, already_killed = None, True
                    max_step = 10**12  # measured; stop tracking
            time.sleep(0.5)
        say(f"timed out after {self.a.timeout} s")
        return 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--namespace", default="ddp-demo")
    ap.add_argument("--job", default="digits")
    ap.add_argument("--kill", choices=["worker", "rank0"], default="worker",
                    help="which training pod to kill: one that is not rank 0 (default) or rank 0's")
    ap.add_argument("--kill-grace", type=int, default=0,
                    help="grace period of the kill: 0 (default: immediate, as a crash) or more (SIGTERM first)")
    ap.add_argument("--kill-epoch", type=int, default=3, help="kill once training reaches this epoch")
    ap.add_argument("--step-delay", type=float, default=0.25, help="DIGITS_STEP_DELAY for the demo job")
    ap.add_argument("--min-accuracy", type=float, default=0.90)
    ap.add_argument("--timeout", type=float, default=1200)
    ap.add_argument("--fresh", action="store_true", help="delete a finished demo job and train again")
    return Demo(ap.parse_args(argv)).run()


if __name__ == "__main__":
    sys.exit(main())
