#!/usr/bin/env bash
# The end-to-end suite (tests/e2e) on a kind cluster: one control plane and two workers
# (hack/kind-config.yaml).
#   hack/kind-e2e.sh            create (or reuse) kind cluster "ddpjob", build + load images, install
#                               Kueue (hack/kueue.py) and the chart (kueue.enabled=true), run tests/e2e,
#                               delete the cluster
#   hack/kind-e2e.sh --node-loss     the same, running only the multi-node node-loss test
#                               (tests/e2e/test_e2e_node_loss.py: make kind-node-loss; `make test` ends with it,
#                               KIND_CLUSTER_NAME=ddpjob-test)
#   KIND_KEEP=1 hack/kind-e2e.sh     keep the cluster afterwards (KUBECONFIG path is printed); a cluster the
#                               run found already there is always kept (only what a run creates is deleted)
#   KIND_PREPARE=1 hack/kind-e2e.sh [--node-loss]   everything up to the tests (cluster, images, chart, warm-up),
#                               then stop, keeping the cluster and the engine: `make test` prepares stage 4 while
#                               stage 3 runs
#   KIND_DELETE=1 hack/kind-e2e.sh   delete the cluster afterwards even when the run found it (a prepared one)
#   KIND_FRESH=1 hack/kind-e2e.sh    a cluster of that name found at the start is deleted first, never reused
#                               (`make test`'s: one left by a killed run is not trusted)
#   KIND_RECORD=1 hack/kind-e2e.sh --node-loss   also record docs/bench/node_loss.json (make bench-node-loss)
# Every stage's duration is printed at the end (also after a failure); the exit code is non-zero on any failure.
# Works offline: without a Docker engine that answers, it starts the private one of hack/docker.py (root;
# `hack/install-deps.sh --docker` installs dockerd); kind, kubectl and helm come from PATH or else from
# hack/build-binaries.sh's cache; and without KIND_NODE_IMAGE, where Docker Hub cannot be reached, the node
# image is built here from the project's own binaries (hack/kind_node.py), else kind's default is used.
# Knobs: KIND_CLUSTER_NAME (ddpjob), KIND_NODE_IMAGE (e.g. kindest/node:v1.34.0 or ddpjob/kind-node:v1.34.4),
#        KIND, HELM, KUBECTL (binaries), PYTEST_ARGS (extra pytest arguments), KIND_MIN_FREE_GIB (16: the
#        free disk a new cluster needs; the run stops before creating one with less), KIND_IMAGES_AFTER (a file:
#        the images go into the nodes once it exists; hack/test.sh's end of step 3a).
# The suite itself is provider-agnostic: it only sees KUBECONFIG and images already on the nodes, the
# same way it sees the embedded cluster after hack/build-images.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
# shellcheck source=hack/versions.env
source hack/versions.env

CLUSTER=${KIND_CLUSTER_NAME:-ddpjob}
CACHE_ROOT=${DDPJOB_CACHE:-$HOME/.cache/ddpjob}
TAG=0.1.0
RELEASE=ddp-operator
OPERATOR_NS=ddp-system
KCFG=${XDG_CACHE_HOME:-$HOME/.cache}/ddpjob/kind-$CLUSTER.kubeconfig
log() { printf '[kind-e2e %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

TESTS=(tests/e2e)
NODE_LOSS_ONLY=
case ${1:-} in
  --node-loss) TESTS=(tests/e2e/test_e2e_node_loss.py); NODE_LOSS_ONLY=1 ;;
  "") ;;
  *) echo "usage: hack/kind-e2e.sh [--node-loss]" >&2; exit 2 ;;
esac

# stage NAME: ends the previous stage (its duration goes into the summary) and starts NAME
STAGES=()
STAGE=""
STAGE_T0=$SECONDS
STARTED=$SECONDS
stage() {
  [[ -n $STAGE ]] && STAGES+=("$(printf '%-28s %5d s' "$STAGE" $((SECONDS - STAGE_T0)))")
  STAGE=$1
  STAGE_T0=$SECONDS
  [[ -n $STAGE ]] && log "$STAGE"
  return 0
}
summary() {
  stage ""
  log "stage times:"
  printf '  %s\n' "${STAGES[@]}" >&2
  printf '  %-28s %5d s\n' total $((SECONDS - STARTED)) >&2
}

# A tool from PATH, else from hack/build-binaries.sh's cache (built there on first use).
tool() { # name cached-path build-target
  if command -v "$1" >/dev/null; then echo "$1"; return; fi
  [[ -x $2 ]] || { log "building $3 (hack/build-binaries.sh $3)"; hack/build-binaries.sh "$3" >&2; }
  echo "$2"
}
stage "tools (kind, kubectl, helm)"
KIND=${KIND:-$(tool kind "$CACHE_ROOT/kind-$KIND_VERSION/kind" kind)}
KUBECTL=${KUBECTL:-$(tool kubectl "$CACHE_ROOT/kube-$KUBE_VERSION/kubectl" kube)}
HELM=${HELM:-$(tool helm "$CACHE_ROOT/helm-$HELM_VERSION/helm" helm)}
# tests/conftest.py runs `kind load` by name
[[ $KIND == */* ]] && PATH="$(cd "$(dirname "$KIND")" && pwd):$PATH" && export PATH

if [[ ! -x .venv/bin/python ]]; then
  log "creating .venv (requirements-dev.txt)"
  python3 -m venv .venv
  .venv/bin/pip install -q -r requirements-dev.txt
fi

command -v docker >/dev/null || { echo "kind-e2e needs docker (hack/install-deps.sh --docker)" >&2; exit 2; }
if ! docker info >/dev/null 2>&1; then
  stage "Docker engine (hack/docker.py up)"
  # stopped again at the end only when this run started it
  python3 hack/docker.py status >/dev/null 2>&1 || STARTED_ENGINE=1
  python3 hack/docker.py up
  eval "$(python3 hack/docker.py env)"
  export DOCKER_HOST
fi

# Online (Docker Hub answers): kind's default node image, images built by Docker. Offline: the node image
# is built here, and the operator/trainer/store images (and those the suite builds, tests/conftest.py) by
# buildah, then streamed into the nodes (hack/image.py kind-load).
if python3 - <<'PY' 2>/dev/null
import urllib.error, urllib.request
try:
    urllib.request.urlopen("https://registry-1.docker.io/v2/", timeout=5)
except urllib.error.HTTPError:
    pass  # 401: the registry is there
PY
then
  IMAGE_BUILDER=docker
else
  IMAGE_BUILDER=buildah
  if [[ -z ${KIND_NODE_IMAGE:-} ]]; then
    stage "node image (hack/kind_node.py build; Docker Hub is unreachable)"
    KIND_NODE_IMAGE=$(python3 hack/kind_node.py build)
  fi
fi
export DDPJOB_IMAGE_BUILDER=$IMAGE_BUILDER

cleanup() {
  local rc=$?
  stage "cleanup"
  if [[ $rc -ne 0 ]]; then
    log "failed: operator logs follow"
    "$KUBECTL" -n "$OPERATOR_NS" logs "deployment/$RELEASE" --tail=100 2>/dev/null || true
  fi
  if [[ -n ${KIND_KEEP:-} || (-n ${KIND_PREPARE:-} && $rc -eq 0) || (-z ${CREATED_CLUSTER:-} && -z ${KIND_DELETE:-}) ]]; then
    # a cluster this run found (reused) is left as it was found: only what the run created goes
    log "cluster kept${CREATED_CLUSTER:+ (KIND_KEEP)}: export KUBECONFIG=$KCFG   (delete: $KIND delete cluster --name $CLUSTER)"
  else
    log "deleting kind cluster $CLUSTER"
    "$KIND" delete cluster --name "$CLUSTER" >/dev/null 2>&1 || true
    if [[ -n ${STARTED_ENGINE:-} ]]; then
      log "stopping the Docker engine this run started"
      python3 hack/docker.py down >/dev/null 2>&1 || true
    fi
  fi
  summary
  if [[ -s $NODE_LOSS_RESULTS ]]; then
    log "node loss (tests/e2e/test_e2e_node_loss.py; KIND_RECORD=1 also writes docs/bench/node_loss.json):"
    .venv/bin/python tests/benchmarks/node_loss.py "$NODE_LOSS_RESULTS" ${KIND_RECORD:+--record} >&2 || true
  fi
  rm -f "$NODE_LOSS_RESULTS"
  if [[ $rc -eq 0 ]]; then log "passed"; else log "FAILED (exit $rc)"; fi
  exit "$rc"
}
NODE_LOSS_RESULTS=$(mktemp /tmp/ddpjob-node-loss-XXXXXX.jsonl)
trap cleanup EXIT

mkdir -p "$(dirname "$KCFG")" /var/tmp/ddpjob-shared  # the workers' shared directory (hack/kind-config.yaml)
if "$KIND" get clusters 2>/dev/null | grep -qx "$CLUSTER"; then
  if [[ -n ${KIND_FRESH:-} ]]; then
    # make test's own cluster, left by a run that was killed before its cleanup (its nodes hold GiBs of images)
    log "deleting kind cluster $CLUSTER, left by an earlier run (KIND_FRESH)"
    "$KIND" delete cluster --name "$CLUSTER"
  else
    REUSED=1
  fi
fi
# Disk: a new cluster holds the trainer image (5+ GB, unpacked) on each worker, besides the node image and the
# nodes' own files. Say so now, with what to free, rather than minutes later from inside an image import.
DOCKER_ROOT=$(docker info -f '{{.DockerRootDir}}')
if [[ -z ${REUSED:-} && -d $DOCKER_ROOT ]]; then
  free_gib=$(($(df --output=avail -k "$DOCKER_ROOT" | tail -1) / 1048576))
  if ((free_gib < ${KIND_MIN_FREE_GIB:-16})); then
    log "only $free_gib GiB free on the filesystem of $DOCKER_ROOT; a kind cluster for these tests needs" \
      "${KIND_MIN_FREE_GIB:-16} GiB (KIND_MIN_FREE_GIB). Free some: other kind clusters ($KIND get clusters)," \
      "buildah's unused images (buildah rmi --prune), Docker's (docker system prune)"
    exit 1
  fi
fi
if [[ -n ${REUSED:-} ]]; then
  stage "cluster (reused)"
  "$KIND" export kubeconfig --name "$CLUSTER" --kubeconfig "$KCFG"
else
  stage "cluster (kind create cluster)"
  create=(create cluster --name "$CLUSTER" --config hack/kind-config.yaml --kubeconfig "$KCFG" --wait 180s)
  [[ -n ${KIND_NODE_IMAGE:-} ]] && create+=(--image "$KIND_NODE_IMAGE")
  CREATED_CLUSTER=1  # set first: a create that fails half-way leaves nodes to delete
  "$KIND" "${create[@]}"
fi
export KUBECONFIG=$KCFG

# The workers run the tests' pods (kind's control plane is tainted); the trainer and store images go there only. The
# operator runs on the control plane, as on a cluster with system nodes: a test that stops a worker must not stop
# the operator with it (its pod would wait out the 300 s unreachable toleration before moving).
workers=$("$KIND" get nodes --name "$CLUSTER" | grep -v -- '-control-plane$' | paste -sd, -)
if [[ -n ${KIND_IMAGES_AFTER:-} && ! -e $KIND_IMAGES_AFTER ]]; then
  # hack/test.sh: not beside its stage 3a, whose release tests hold the trainer image's GiBs in the local registry
  log "waiting for $KIND_IMAGES_AFTER before the images go into the nodes (KIND_IMAGES_AFTER)"
  while [[ ! -e $KIND_IMAGES_AFTER ]]; do sleep 2; done
fi
if [[ $IMAGE_BUILDER == docker ]]; then
  stage "images (docker build, kind load)"
  DDPJOB_IMAGE_BUILDER=docker DDPJOB_IMAGE_TAG=$TAG hack/build-images.sh
  "$KIND" load docker-image "localhost/ddp-operator:$TAG" --name "$CLUSTER"
  "$KIND" load docker-image "localhost/ddp-trainer:$TAG" --name "$CLUSTER" --nodes "$workers"
  "$KIND" load docker-image "localhost/ddp-store:$TAG" --name "$CLUSTER" --nodes "$workers"
else
  stage "images (buildah, streamed into the nodes)"
  DDPJOB_IMAGE_BUILDER=buildah DDPJOB_IMAGE_TAG=$TAG hack/build-images.sh
  for name in operator trainer store; do
    nodes=$(if [[ $name != operator ]]; then echo "$workers"; else "$KIND" get nodes --name "$CLUSTER" | paste -sd, -; fi)
    log "loading localhost/ddp-$name:$TAG into $nodes"
    python3 hack/image.py kind-load "localhost/ddp-$name:$TAG" --name "$CLUSTER" --nodes "$nodes" --kind "$KIND"
  done
fi

if [[ -z $NODE_LOSS_ONLY ]]; then
  # tests/e2e/test_e2e_kueue.py needs Kueue and the operator's Kueue integration; jobs without a queue label are
  # not gated, so every other test runs against the same operator.
  stage "Kueue (hack/kueue.py up)"
  .venv/bin/python hack/kueue.py --kubeconfig "$KCFG" --kind-cluster "$CLUSTER" --kind "$KIND" up
  CHART_KUEUE=true
fi

stage "chart (helm upgrade --install)"
# --take-ownership: a reused cluster may hold the CRD from before the chart carried it (crds/, or a kubectl apply).
"$HELM" upgrade --install "$RELEASE" helm/ddp-operator --namespace "$OPERATOR_NS" --create-namespace --take-ownership \
  --set-json 'nodeSelector={"node-role.kubernetes.io/control-plane":""}' \
  --set-json 'tolerations=[{"key":"node-role.kubernetes.io/control-plane","operator":"Exists","effect":"NoSchedule"}]' \
  --set "kueue.enabled=${CHART_KUEUE:-false}" --wait --timeout 5m

stage "warm-up (the trainer image on every worker)"
# The first pod of a 5 GB image on a fresh node reads torch from disk: its agent once took over a minute to
# reach the rendezvous after its peer had joined, past torch's 60 s wait for the peers' role information.
# Read the image once per worker, as a long-running cluster would have, before the tests time anything.
for node in ${workers//,/ }; do
  "$KUBECTL" run "warm-$node" --restart=Never --image "localhost/ddp-trainer:$TAG" --image-pull-policy=Never \
    --overrides "{\"spec\": {\"nodeName\": \"$node\"}}" --command -- python -c "import torch.distributed.run" >/dev/null
done
for node in ${workers//,/ }; do
  "$KUBECTL" wait --for=jsonpath='{.status.phase}'=Succeeded "pod/warm-$node" --timeout=600s >/dev/null
  "$KUBECTL" delete pod "warm-$node" --wait=false >/dev/null
done

if [[ -n ${KIND_PREPARE:-} ]]; then
  log "prepared (KIND_PREPARE): the tests run when hack/kind-e2e.sh runs again"
  exit 0
fi

stage "tests (${TESTS[*]})"
# DDPJOB_TEST_KUBECONFIG is what makes tests/conftest.py use kind (it never follows a plain
# KUBECONFIG); its context name (kind-<cluster>) is how the suite knows to `kind load` any image it
# builds itself.
# DDPJOB_OPERATOR=installed: the chart installed above is the operator under test.
read -r -a extra <<<"${PYTEST_ARGS:-}"
DDPJOB_NODE_LOSS_RESULTS=$NODE_LOSS_RESULTS \
DDPJOB_TEST_KUBECONFIG=$KCFG DDPJOB_OPERATOR=installed PYTHONPATH="$ROOT/operator:$ROOT/trainer:$ROOT/cli:$ROOT" \
  .venv/bin/python -m pytest -ra "${TESTS[@]}" "${extra[@]}"
