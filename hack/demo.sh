#!/usr/bin/env bash
# `make demo`: from a fresh machine to a DDPJob that survives a killed pod, on the embedded cluster.
#   hack/demo.sh [--fresh] [--kill worker|rank0]   install what is missing, bring the cluster up, build
#                                     and import the images, install the chart, run the digits sample,
#                                     kill one training pod midway, print accuracy and recovery time
#   hack/demo.sh down [--cluster]     remove what the demo added (demo namespace, the Helm release and its
#                                     namespace); --cluster also stops the embedded cluster
# Every step is idempotent: a second run skips what is done (and reports a finished demo job again;
# --fresh trains again). DDPJOB_CLUSTER=external uses the current KUBECONFIG (e.g. kind) instead of the
# embedded cluster and skips the host set-up; the images must already be on its nodes then.
# DEMO_HELM_ARGS adds helm arguments, e.g. "--set rbac.scope=namespace --set watch.namespaces={ddp-demo}"
# to keep the demo's operator to its own namespace on a shared cluster.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=hack/versions.env
source hack/versions.env

CACHE_ROOT=${DDPJOB_CACHE:-$HOME/.cache/ddpjob}
RELEASE=${DEMO_RELEASE:-ddp-operator}
OPERATOR_NS=${DEMO_OPERATOR_NAMESPACE:-ddp-system}
DEMO_NS=${DEMO_NAMESPACE:-ddp-demo}
EXTERNAL=""
if [[ ${DDPJOB_CLUSTER:-embedded} == external ]]; then EXTERNAL=1; fi
log() { printf '\n\033[1m[demo %s] %s\033[0m\n' "$(date +%H:%M:%S)" "$*" >&2; }

tools() {
  HELM=$CACHE_ROOT/helm-$HELM_VERSION/helm
  KUBECTL=$CACHE_ROOT/kube-$KUBE_VERSION/kubectl
  [[ -x $HELM ]] || HELM=$(command -v helm || true)
  [[ -x $KUBECTL ]] || KUBECTL=$(command -v kubectl || true)
  [[ -n $HELM && -n $KUBECTL ]] || { echo "helm/kubectl missing: run hack/build-binaries.sh" >&2; exit 2; }
  if [[ -z $EXTERNAL ]]; then
    export KUBECONFIG=$PWD/.cluster/kubeconfig
  fi
  PY=python3
  [[ -x .venv/bin/python ]] && PY=.venv/bin/python
}

up() {
  local start=$SECONDS
  if [[ -z $EXTERNAL ]]; then
    log "1/6 host dependencies (hack/install-deps.sh)"
    hack/install-deps.sh
    log "2/6 cluster binaries from the Go module proxy (hack/build-binaries.sh; cached after the first run)"
    hack/build-binaries.sh
    tools
    log "3/6 embedded cluster (hack/cluster.py up)"
    "$PY" hack/cluster.py up
    log "4/6 images localhost/ddp-{operator,trainer,store}:0.1.0 (hack/build-images.sh)"
    hack/build-images.sh
  else
    tools
    log "using the cluster of KUBECONFIG=${KUBECONFIG:-~/.kube/config}; skipping host set-up and images"
  fi
  log "5/6 operator: helm upgrade --install $RELEASE helm/ddp-operator -n $OPERATOR_NS"
  local extra=() image_id=""
  read -r -a extra <<<"${DEMO_HELM_ARGS:-}"
  if [[ -z $EXTERNAL ]]; then
    # The tag stays 0.1.0 across local rebuilds: the image digest as a Pod annotation rolls the operator
    # whenever its image changed, and changes nothing when it did not.
    image_id=$("$PY" hack/image.py ls | awk -F'\t' '$1 == "localhost/ddp-operator:0.1.0" {print $2}')
    extra+=(--set-string "podAnnotations.demo\.ddp\.dev/image-id=${image_id#sha256:}")
  fi
  local try out
  for try in 1 2 3 4 5 6; do
    # --take-ownership: a CRD installed before the chart carried it (from crds/, or kubectl apply) becomes this
    # release's, which upgrades it from then on.
    if out=$("$HELM" upgrade --install "$RELEASE" helm/ddp-operator --namespace "$OPERATOR_NS" \
      --create-namespace --take-ownership --wait --timeout 5m "${extra[@]}" 2>&1); then
      echo "$out"
      break
    fi
    echo "$out" >&2
    # Another client (a test suite sharing the release) may be mid-upgrade: wait for it, then retry.
    [[ $out == *"another operation"* && $try -lt 6 ]] || exit 1
    sleep 10
  done
  "$KUBECTL" -n "$OPERATOR_NS" get deploy,pods -l app.kubernetes.io/instance="$RELEASE" -o wide
  log "6/6 the digits sample: 2 nodes; one pod is killed midway"
  local rc=0
  "$PY" hack/demo.py --namespace "$DEMO_NS" "$@" || rc=$?
  if [[ $rc -ne 0 ]]; then
    log "the demo job did not succeed: operator log tail and job events follow"
    "$KUBECTL" -n "$OPERATOR_NS" logs "deployment/$RELEASE" --tail=40 || true
    "$KUBECTL" -n "$DEMO_NS" get events --sort-by=.lastTimestamp | tail -20 || true
    exit "$rc"
  fi
  log "done in $((SECONDS - start)) s. Try: kubectl get ddpj -A; kubectl explain ddpjob.spec; make demo-down"
  if [[ -z $EXTERNAL ]]; then
    echo "  (export KUBECONFIG=$KUBECONFIG)" >&2
  fi
  echo "  kubectl ddp (docs/cli.md), after: export PATH=\"$PWD/.venv/bin:\$PATH\"" >&2
  echo "    kubectl ddp describe digits -n $DEMO_NS; kubectl ddp plot digits -n $DEMO_NS" >&2
  echo "    kubectl ddp run your_script.py --nodes 2 -n $DEMO_NS" >&2
}

down() {
  local stop_cluster=""
  [[ ${1:-} == --cluster ]] && stop_cluster=1
  tools
  if [[ -z $EXTERNAL && ! -f $KUBECONFIG ]]; then
    log "no embedded cluster state: nothing to remove"
    return
  fi
  if "$KUBECTL" version --request-timeout=5s >/dev/null 2>&1; then
    log "removing the demo namespace $DEMO_NS (its DDPJob, pods and Service)"
    "$KUBECTL" delete namespace "$DEMO_NS" --ignore-not-found --wait=true --timeout=120s
    log "uninstalling the Helm release $RELEASE and its namespace $OPERATOR_NS"
    if "$HELM" status "$RELEASE" -n "$OPERATOR_NS" >/dev/null 2>&1; then
      "$HELM" uninstall "$RELEASE" --namespace "$OPERATOR_NS" --wait --timeout 2m
    fi
    "$KUBECTL" delete namespace "$OPERATOR_NS" --ignore-not-found --wait=true --timeout=120s
    echo "The DDPJob CRD stays (the chart keeps it): kubectl delete crd ddpjobs.ddp.dev removes it." >&2
  else
    log "the cluster is not reachable: nothing to remove from it"
  fi
  if [[ -n $stop_cluster && -z $EXTERNAL ]]; then
    log "stopping the embedded cluster"
    "$PY" hack/cluster.py down
  fi
}

case ${1:-up} in
  down) shift; down "$@" ;;
  up) [[ $# -gt 0 ]] && shift; up "$@" ;;
  -*) up "$@" ;;
  *) echo "usage: hack/demo.sh [up] [--fresh] [--kill worker|rank0] | down [--cluster]" >&2; exit 2 ;;
esac
