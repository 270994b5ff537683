#!/usr/bin/env bash
# For users with Docker: the end-to-end suite (tests/e2e) on a kind cluster.
#   hack/kind-e2e.sh            create (or reuse) kind cluster "ddpjob", build + load images, install
#                               the chart, run tests/e2e, delete the cluster
#   KIND_KEEP=1 hack/kind-e2e.sh     keep the cluster afterwards (KUBECONFIG path is printed)
# Knobs: KIND_CLUSTER_NAME (ddpjob), KIND_NODE_IMAGE (kind's default; e.g. kindest/node:v1.34.0),
#        KIND, HELM, KUBECTL (binaries on PATH by default), PYTEST_ARGS (extra pytest arguments).
# The suite itself is provider-agnostic: it only sees KUBECONFIG and images already on the nodes, the
# same way it sees the embedded cluster after hack/build-images.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

CLUSTER=${KIND_CLUSTER_NAME:-ddpjob}
KIND=${KIND:-kind}
HELM=${HELM:-helm}
KUBECTL=${KUBECTL:-kubectl}
TAG=0.1.0
RELEASE=ddp-operator
OPERATOR_NS=ddp-system
KCFG=${XDG_CACHE_HOME:-$HOME/.cache}/ddpjob/kind-$CLUSTER.kubeconfig
log() { printf '[kind-e2e %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

for bin in docker "$KIND" "$HELM" "$KUBECTL" python3; do
  command -v "$bin" >/dev/null || { echo "kind-e2e needs '$bin' on PATH" >&2; exit 2; }
done
docker info >/dev/null 2>&1 || { echo "kind-e2e needs a running Docker engine" >&2; exit 2; }

cleanup() {
  local rc=$?
  if [[ $rc -ne 0 ]]; then
    log "failed: operator logs follow"
    "$KUBECTL" -n "$OPERATOR_NS" logs "deployment/$RELEASE" --tail=100 2>/dev/null || true
  fi
  if [[ -n ${KIND_KEEP:-} ]]; then
    log "cluster kept: export KUBECONFIG=$KCFG   (delete: $KIND delete cluster --name $CLUSTER)"
  else
    log "deleting kind cluster $CLUSTER"
    "$KIND" delete cluster --name "$CLUSTER" >/dev/null 2>&1 || true
  fi
  exit "$rc"
}
trap cleanup EXIT

mkdir -p "$(dirname "$KCFG")"
if "$KIND" get clusters 2>/dev/null | grep -qx "$CLUSTER"; then
  log "reusing kind cluster $CLUSTER"
  "$KIND" export kubeconfig --name "$CLUSTER" --kubeconfig "$KCFG"
else
  log "creating kind cluster $CLUSTER"
  create=(create cluster --name "$CLUSTER" --kubeconfig "$KCFG" --wait 180s)
  [[ -n ${KIND_NODE_IMAGE:-} ]] && create+=(--image "$KIND_NODE_IMAGE")
  "$KIND" "${create[@]}"
fi
export KUBECONFIG=$KCFG

log "building images with Docker"
DDPJOB_IMAGE_BUILDER=docker DDPJOB_IMAGE_TAG=$TAG hack/build-images.sh
for name in operator trainer; do
  log "loading localhost/ddp-$name:$TAG into $CLUSTER"
  "$KIND" load docker-image "localhost/ddp-$name:$TAG" --name "$CLUSTER"
done

log "installing the chart"
"$HELM" upgrade --install "$RELEASE" helm/ddp-operator --namespace "$OPERATOR_NS" --create-namespace \
  --wait --timeout 5m

if [[ ! -x .venv/bin/python ]]; then
  log "creating .venv (requirements-dev.txt)"
  python3 -m venv .venv
  .venv/bin/pip install -q -r requirements-dev.txt
fi

log "running tests/e2e against kind"
# DDPJOB_TEST_KUBECONFIG is what makes tests/conftest.py use kind (it never follows a plain
# KUBECONFIG); its context name (kind-<cluster>) is how the suite knows to `kind load` any image it
# builds itself.
# DDPJOB_OPERATOR=installed: the chart installed above is the operator under test.
read -r -a extra <<<"${PYTEST_ARGS:-}"
DDPJOB_TEST_KUBECONFIG=$KCFG DDPJOB_OPERATOR=installed PYTHONPATH="$ROOT/operator:$ROOT/trainer:$ROOT" \
  .venv/bin/python -m pytest -ra tests/e2e "${extra[@]}"
