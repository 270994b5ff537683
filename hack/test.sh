#!/usr/bin/env bash
# `make test`: the whole suite as CI runs it, in stages whose times are printed at the end (also after a failure).
#   1. side by side: the tests that need no cluster (unit, bootstrap, trainer, gpu) in front, and behind them, at a
#      lower CPU priority so that they only take what the tests leave, the embedded cluster's Go binaries and both
#      images (downloads, mostly, on a cold machine: the Debian base and torch)
#   2. the embedded cluster up (seconds once its binaries exist); behind stage 3, at low priority, what only later
#      tests need: the Kueue manager, kind's binaries, Docker's package and the whole kind cluster of stage 4
#      (KIND_PREPARE=1 hack/kind-e2e.sh: engine, node image, nodes, images, chart, warm-up)
#   3. the tiers that use the cluster: (a) cluster and chart (the chart's: also `make release` into a local registry
#      and both installs of that release, tests/chart/test_release.py), with no other operator on the cluster, beside half of
#      the loopback trainer benchmarks' smoke tests (no cluster; their jobs run while the chart's pods start), then
#      the shared operator and Kueue installed; (b) side by side, against them: the e2e tier | the integration tier,
#      then the benchmark smoke tests; (c) the faults of the control plane, alone on the embedded cluster, and
#      beside them the other half of the trainer benchmarks and the metrics tier (a real Prometheus, no cluster) and
#   4. a node lost on that kind cluster (make kind-node-loss, KIND_CLUSTER_NAME=ddpjob-test), deleted afterwards
# Each pytest run writes JUnit XML under .test-results/; hack/test_times.py turns it into the per-directory table
# of docs/testing.md.
# Knobs: PYTEST_ARGS (extra pytest arguments for every pytest run); not under CI=true: DDPJOB_SKIP_KIND=1 (stop
# stage 4), DDPJOB_TEST_CLUSTER_ONLY=1 (stage 1 only builds: the cluster tiers again after a fix elsewhere).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
# shellcheck source=hack/versions.env
source hack/versions.env
KIND_NAME=ddpjob-test
log() { printf '[test %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
read -r -a extra <<<"${PYTEST_ARGS:-}"

STAGES=()
STARTED=$SECONDS
free_gib() { echo $(($(df --output=avail -k . | tail -1) / 1048576)); }
# a stage's time, the disk left after it (a full run needs tens of GiB: images, kind's nodes, the Go caches) and the
# least seen during it (disk_watch: a stage's peak, e.g. images streamed into kind's nodes, may be gone by its end)
record() {
  STAGES+=("$(printf '%-52s %5d s   %4d GiB free, %4s least' "$1" "$2" "$(free_gib)" "$(cat "$TMP/disk-least" 2>/dev/null)")")
  rm -f "$TMP/disk-least"
}
disk_watch() { # every 5 s: the least free GiB since the last record, in $TMP/disk-least
  local f
  while sleep 5; do
    f=$(free_gib)
    if [[ ! -s $TMP/disk-least ]] || ((f < $(cat "$TMP/disk-least"))); then echo "$f" >"$TMP/disk-least"; fi
  done
}
kill_tree() { # pid: it and everything it started (a background job still running when the run stops)
  local child
  for child in $(pgrep -P "$1"); do kill_tree "$child"; done
  kill "$1" 2>/dev/null || true
}
summary() { # exit status
  local rc=$1
  local pid
  for pid in "${BG_PIDS[@]}"; do kill_tree "$pid"; done
  if [[ -f $TMP/engine-started ]]; then  # the run started the Docker engine: stop it (and a kind cluster left)
    local kind="${DDPJOB_CACHE:-$HOME/.cache/ddpjob}/kind-$KIND_VERSION/kind"
    [[ -x $kind ]] && { "$kind" delete cluster --name "$KIND_NAME" >/dev/null 2>&1 || true; }
    python3 hack/docker.py down >/dev/null 2>&1 || true
  fi
  if [[ -f $TMP/shared-up ]]; then  # stage 3 stopped before it removed the shared operator and Kueue
    "$PY" -m tests.e2e.shared_release down >/dev/null 2>&1 || true
  fi
  rm -rf "$TMP"
  if [[ $rc -ne 0 ]] && compgen -G ".test-results/*.xml" >/dev/null; then  # last, where a log's tail shows it
    log "the tests that failed:"
    "$PY" hack/test_times.py --failures .test-results/*.xml >&2 || true
  fi
  log "stage times:"
  printf '  %s\n' "${STAGES[@]}" >&2
  printf '  %-52s %5d s\n' total $((SECONDS - STARTED)) >&2
  if [[ $rc -eq 0 ]]; then log "passed"; else log "FAILED (exit $rc)"; fi
}
TMP=$(mktemp -d /tmp/ddpjob-test-XXXXXX)
BG_PIDS=()
trap 'summary $?' EXIT
trap 'exit 143' TERM  # a stopped run cleans up too (the EXIT trap)
trap 'exit 130' INT

# background NAME CMD...: CMD at low CPU priority, its output prefixed with [NAME]; its pid in BG_PID
background() {
  local name=$1; shift
  ( t0=$SECONDS; rc=0
    renice -n 15 -p "$BASHPID" >/dev/null  # inherited by everything it starts (a function too)
    "$@" > >(sed -u "s/^/[$name] /") 2>&1 || rc=$?
    echo "$((SECONDS - t0)) $rc" >"$TMP/$name.done"
    exit "$rc" ) &
  BG_PID=$!
  BG_PIDS+=("$BG_PID")
}
# finished NAME PID: wait for a background job, record its time, fail the run with its exit status
finished() {
  local name=$1 pid=$2 rc=0 secs=0
  wait "$pid" || rc=$?
  read -r secs _ <"$TMP/$name.done" 2>/dev/null || true
  record "  $name (in the background)" "$secs"
  ((rc == 0)) || { log "$name failed (exit $rc); its output is above, prefixed [$name]"; exit "$rc"; }
}
pytest_run() { # name paths...: one pytest run with its JUnit XML
  local name=$1; shift
  "$PY" -m pytest -ra --durations=15 --junitxml=".test-results/$name.xml" "$@" "${extra[@]}"
}

rm -rf .test-results
log "$(free_gib) GiB free on this disk at the start"
disk_watch &
BG_PIDS+=("$!")
t0=$SECONDS
log "stage 1: the tests that need no cluster | the Go binaries and both images behind them"
background binaries hack/build-binaries.sh etcd coredns helm kube-router kube; pid_bin=$BG_PID
background images hack/build-images.sh; pid_img=$BG_PID
rc=0
if [[ -n ${DDPJOB_TEST_CLUSTER_ONLY:-} && ${CI:-} != true ]]; then
  log "the tests that need no cluster are skipped (DDPJOB_TEST_CLUSTER_ONLY)"
else
  pytest_run no-cluster tests/unit tests/bootstrap tests/trainer tests/gpu || rc=$?
  record "  unit, bootstrap, trainer, gpu tests" $((SECONDS - t0))
fi
((rc == 0)) || { log "the tests that need no cluster failed (exit $rc)"; exit "$rc"; }
finished binaries "$pid_bin"
finished images "$pid_img"
record "stage 1" $((SECONDS - t0))

t0=$SECONDS
log "stage 2: the embedded cluster"
"$PY" hack/cluster.py up
record "stage 2: cluster up" $((SECONDS - t0))
# Stage 4's kind cluster is made ready behind stage 3: its Docker engine (started here at low priority, so its
# containers are too), node image, nodes and images; stage 4 then only runs the test.
prepare_kind() { # (set -e does not hold in a function called with ||: every step says how it failed)
  # registry (first: a few minutes cold, seconds warm): the release test of the chart tier (tests/chart/test_release.py,
  # step 3a; it builds them itself if it gets there first); kwok: the control-plane simulation's smoke test (step 3b);
  # prometheus: the e2e metrics test (3b), tests/metrics (3c)
  hack/build-binaries.sh registry || return
  hack/build-binaries.sh kueue prometheus kwok kind || return
  if [[ -n ${DDPJOB_SKIP_KIND:-} && ${CI:-} != true ]]; then return 0; fi
  hack/install-deps.sh --docker || return
  python3 hack/docker.py status >/dev/null 2>&1 || touch "$TMP/engine-started"
  # Its images go into the nodes once step 3a is over (the release tests' registry holds GiBs until then).
  KIND_CLUSTER_NAME=$KIND_NAME KIND_FRESH=1 KIND_PREPARE=1 KIND_IMAGES_AFTER=$TMP/3a-done hack/kind-e2e.sh --node-loss
}
background later prepare_kind
pid_later=$BG_PID

# Stage 3 in three steps: (a) the tiers that restart the cluster or install charts of their own, alone; (b) two
# pytest runs side by side, whose jobs mostly sleep: the e2e tier | the integration tier (its own operators, in
# ddp-it-* namespaces the shared operator excludes), then the benchmark smoke tests; both against one operator and
# one Kueue installed before them (tests/e2e/shared_release.py; DDPJOB_OPERATOR=installed); (c) the control-plane
# faults (an API server restart, a NotReady node: nothing else may run on the cluster) beside stage 4's kind test.
CONTROL_PLANE=tests/benchmarks/test_cluster_benchmarks_run.py::test_faults_of_the_control_plane_and_the_node
# The loopback trainer benchmarks' smoke tests (no cluster), in two halves of about 2.5 minutes: beside step 3a, and
# beside step 3c.
TRAINER_BENCH=tests/benchmarks/test_trainer_benchmarks_run.py
BENCH_3A=("$TRAINER_BENCH::test_baselines_quick" "$TRAINER_BENCH::test_overhead_benchmark_quick"
  "$TRAINER_BENCH::test_resident_commit_benchmark_quick")
BENCH_3C=("$TRAINER_BENCH::test_recovery_benchmark_quick" "$TRAINER_BENCH::test_rdzv_scale_quick")
# With them in 3c: tests/metrics (no cluster; the pinned Prometheus, built behind stage 3 with Kueue's binaries).
NO_CLUSTER_3C=("${BENCH_3C[@]}" tests/metrics)
NO_CLUSTER_TESTS=$([[ -n ${DDPJOB_TEST_CLUSTER_ONLY:-} && ${CI:-} != true ]] || echo yes)
rc_bench=0
bench_lane() { # name tests...: half of the trainer benchmarks in a lane (none under DDPJOB_TEST_CLUSTER_ONLY)
  pid_bench=
  [[ -n $NO_CLUSTER_TESTS ]] || return 0
  lane bench pytest_run "$@"
  pid_bench=$LANE_PID
}
bench_waited() { # wait for bench_lane's lane; its failure in rc_bench, said once
  [[ -z $pid_bench ]] || wait "$pid_bench" || rc_bench=$?
  ((rc_bench == 0)) || log "a trainer benchmark's smoke test failed (exit $rc_bench); its output is above, [bench]"
}
lane() { # name cmd...: a command in the background at normal priority, its output prefixed [name]; pid in LANE_PID
  local name=$1; shift
  ( "$@" > >(sed -u "s/^/[$name] /") 2>&1 ) &
  LANE_PID=$!
  BG_PIDS+=("$LANE_PID")
}
# The e2e tests that run in step 3b's other lane, after the integration tier: they balance the two lanes (the e2e lane
# is the longer one; in the fresh-clone runs of 2026-12-07 it took 1,400-1,530 s against the other's 1,270-1,370 s).
E2E_IN_MORE=(tests/e2e/test_e2e_network_policy.py tests/e2e/test_e2e_user_image.py tests/e2e/test_e2e_sidecars.py
  tests/e2e/test_e2e_store_loss.py)
e2e_lane() {
  pytest_run e2e tests/e2e --ignore=tests/e2e/test_e2e_node_loss.py "${E2E_IN_MORE[@]/#/--ignore=}"
}

t0=$SECONDS
log "stage 3a: the embedded cluster's own tests and the chart's | the trainer benchmarks' smoke tests (loopback)"
rc=0
bench_lane trainer-benchmarks-a "${BENCH_3A[@]}"
pytest_run cluster tests/cluster tests/chart || rc=$?
# Step 3b's operator and Kueue, installed before either of its lanes starts (the integration tier pauses any operator
# that would handle its namespaces: `make demo`'s release, until `up` gives it the tests' values), while the
# benchmarks finish.
if ((rc == 0)); then
  touch "$TMP/shared-up"
  "$PY" -m tests.e2e.shared_release up || rc=$?
fi
bench_waited
record "stage 3a: cluster, chart, shared up | benchmarks" $((SECONDS - t0))
touch "$TMP/3a-done"
((rc == 0 && rc_bench == 0)) || exit 1

t0=$SECONDS
log "stage 3b: side by side: the e2e tier | integration, benchmark smoke tests"
export DDPJOB_OPERATOR=installed
lane e2e e2e_lane
pid_e2e=$LANE_PID
lane more pytest_run more tests/integration "${E2E_IN_MORE[@]}" tests/benchmarks/test_cluster_benchmarks_run.py \
  tests/benchmarks/test_scale_sim_run.py --deselect="$CONTROL_PLANE"
pid_more=$LANE_PID
rc_e2e=0 rc_more=0
wait "$pid_e2e" || rc_e2e=$?
wait "$pid_more" || rc_more=$?
record "stage 3b: e2e | integration, benchmarks" $((SECONDS - t0))
((rc_e2e == 0)) || log "the e2e tier failed (exit $rc_e2e); its output is above, prefixed [e2e]"
((rc_more == 0)) || log "the integration tier or a benchmark smoke test failed (exit $rc_more); prefixed [more]"
((rc_e2e == 0 && rc_more == 0)) || exit 1

t0=$SECONDS
finished later "$pid_later"
if [[ -n ${DDPJOB_SKIP_KIND:-} && ${CI:-} != true ]]; then
  log "stage 4 skipped (DDPJOB_SKIP_KIND)"
else
  log "stage 4: a lost node on kind (make kind-node-loss), beside stage 3c"
  lane kind env KIND_CLUSTER_NAME=$KIND_NAME KIND_DELETE=1 make --no-print-directory kind-node-loss
  pid_kind=$LANE_PID
fi
log "stage 3c: the control plane's faults (alone on the embedded cluster) | the trainer benchmarks' other half"
bench_lane trainer-benchmarks-c "${NO_CLUSTER_3C[@]}"
pytest_run control-plane "$CONTROL_PLANE" || rc=$?
bench_waited
record "stage 3c: control-plane faults | trainer benchmarks" $((SECONDS - t0))
((rc_bench == 0)) || rc=1
"$PY" -m tests.e2e.shared_release down && rm -f "$TMP/shared-up"
"$PY" hack/test_times.py --top 10 .test-results/*.xml >&2 || true
((rc == 0)) || exit "$rc"
if [[ -n ${pid_kind:-} ]]; then
  wait "$pid_kind" || rc=$?
  record "stage 4: kind node loss (beside 3c)" $((SECONDS - t0))
  ((rc == 0)) || { log "the kind node-loss test failed (exit $rc); its output is above, prefixed [kind]"; exit "$rc"; }
fi
