#!/usr/bin/env bash
# Builds every Go component of the embedded cluster from the Go module proxy into a cache directory
# keyed by the versions in hack/versions.env, so a second run is a no-op. Never writes into the repo.
#   hack/build-binaries.sh [component...]   components: kube etcd coredns helm kube-router kueue kind kwok prometheus
#                                           registry
#   (default: all but kind, which only the kind cluster of hack/kind_node.py needs, kwok, which only the
#   control-plane simulation of hack/kwok.py needs, prometheus, which only the metrics tests need, and registry,
#   which only `make release` and its test need)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=hack/versions.env
source "$here/versions.env"

CACHE_ROOT=${DDPJOB_CACHE:-$HOME/.cache/ddpjob}
mkdir -p "$CACHE_ROOT"
# One build at a time per cache (the Go toolchain fetch included): `make test` builds Kueue and kind in the
# background while a test may ask for one; a second run waits here, then finds it cached.
exec 9>"$CACHE_ROOT/.build.lock"
flock 9
export GOTOOLCHAIN=local GOFLAGS=-mod=mod GOPROXY=${GOPROXY:-https://proxy.golang.org,direct}
log() { printf '[build %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
# Go: the one on PATH when it is new enough, else the pinned toolchain from the module proxy
# (hack/install-go.py; a fresh Debian has no usable Go).
goroot=$(python3 "$here/install-go.py")
export GOROOT=$goroot PATH="$goroot/bin:$PATH"

# Each component gets its own scratch module so dependency graphs never mix.
scratch() { local d="$CACHE_ROOT/src/$1"; mkdir -p "$d"; echo "$d"; }

# The scratch module every kube binary is built in (kubeadm of the kind target too, so it reuses the
# kube target's build cache).
kube_src() {
  local src; src=$(scratch "kube-$KUBE_VERSION")
  cd "$src"
  if [[ ! -f go.mod ]]; then
    go mod init local.build/kube >/dev/null 2>&1
    # k8s.io/kubernetes requires its staging modules at v0.0.0 and replaces them with ./staging;
    # replaces of a dependency are ignored, so point each one at its published tag instead.
    local gomod
    gomod=$(go mod download -json "k8s.io/kubernetes@$KUBE_VERSION" | python3 -c 'import json,sys;print(json.load(sys.stdin)["GoMod"])')
    local goline; goline=$(awk '$1=="go"{print $2; exit}' "$gomod")
    go mod edit -go="$goline"
    for m in $(awk '$1 ~ /^k8s\.io\// && $2=="v0.0.0" {print $1}' "$gomod" | sort -u); do
      go mod edit -replace="$m=$m@$KUBE_STAGING_VERSION"
    done
    cat > tools.go <<'GO'
//go:build tools

package tools

import (
	_ "k8s.io/kubernetes/cmd/kube-apiserver"
	_ "k8s.io/kubernetes/cmd/kube-controller-manager"
	_ "k8s.io/kubernetes/cmd/kube-proxy"
	_ "k8s.io/kubernetes/cmd/kube-scheduler"
	_ "k8s.io/kubernetes/cmd/kubelet"
	_ "k8s.io/kubernetes/cmd/kubectl"
)
GO
    go get "k8s.io/kubernetes@$KUBE_VERSION"
    # godebug defaults of the Go version kubernetes itself declares
    grep -q '^godebug' go.mod || printf '\ngodebug default=go%s\n' "$(echo "$goline" | cut -d. -f1,2)" >> go.mod
  fi
}

# -ldflags that stamp $KUBE_VERSION into a kube binary (what `kubectl version` and kubeadm read)
kube_ldflags() {
  local minor; minor=$(echo "$KUBE_VERSION" | cut -d. -f2)
  local ldf="-s -w" kv
  for kv in "gitVersion=$KUBE_VERSION" gitMajor=1 "gitMinor=$minor" gitTreeState=clean gitCommit=0000000000000000000000000000000000000000 buildDate=2026-01-01T00:00:00Z; do
    ldf="$ldf -X k8s.io/component-base/version.$kv -X k8s.io/client-go/pkg/version.$kv"
  done
  echo "$ldf"
}

build_kube() {
  local out="$CACHE_ROOT/kube-$KUBE_VERSION"
  [[ -x $out/kubelet && -x $out/kubectl && -x $out/kube-proxy ]] && { log "kube $KUBE_VERSION cached"; return; }
  kube_src
  mkdir -p "$out.tmp"
  log "building kube $KUBE_VERSION (cold: tens of minutes on 2 cores)"
  CGO_ENABLED=0 go build -trimpath -ldflags "$(kube_ldflags)" -o "$out.tmp/" \
    k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kube-controller-manager \
    k8s.io/kubernetes/cmd/kube-scheduler k8s.io/kubernetes/cmd/kubectl k8s.io/kubernetes/cmd/kube-proxy \
    k8s.io/kubernetes/cmd/kubelet
  rm -rf "$out"; mv "$out.tmp" "$out"
  log "kube done"
}

build_etcd() {
  local out="$CACHE_ROOT/etcd-$ETCD_VERSION"
  [[ -x $out/etcd ]] && { log "etcd cached"; return; }
  local src; src=$(scratch "etcd-$ETCD_VERSION"); cd "$src"
  if [[ ! -f go.mod ]]; then
    go mod init local.build/etcd >/dev/null 2>&1
    # exactly what etcd's own main.go does; server/v3 has replace directives, so `go install` refuses it
    printf 'package main\n\nimport (\n\t"os"\n\n\t"go.etcd.io/etcd/server/v3/etcdmain"\n)\n\nfunc main() { etcdmain.Main(os.Args) }\n' > main.go
    go get "go.etcd.io/etcd/server/v3@$ETCD_VERSION"
  fi
  mkdir -p "$out.tmp"; CGO_ENABLED=0 go build -trimpath -ldflags "-s -w" -o "$out.tmp/etcd" .
  rm -rf "$out"; mv "$out.tmp" "$out"; log "etcd done"
}

build_coredns() {
  local out="$CACHE_ROOT/coredns-$COREDNS_VERSION"
  # rebuild a cached binary that predates the plugin list below (bind was added later)
  [[ -x $out/coredns ]] && "$out/coredns" -plugins | grep -qx 'bind' && { log "coredns cached"; return; }
  local src; src=$(scratch "coredns-$COREDNS_VERSION"); cd "$src"
  # Only the plugins the cluster uses, a fraction of the full build (core/plugin imports all of them).
  # bind: listen on the bridge address only, never on the host's real interfaces.
  cat > main.go <<'GO'
package main

import (
	"github.com/coredns/coredns/core/dnsserver"
	"github.com/coredns/coredns/coremain"
	_ "github.com/coredns/coredns/plugin/bind"
	_ "github.com/coredns/coredns/plugin/cache"
	_ "github.com/coredns/coredns/plugin/errors"
	_ "github.com/coredns/coredns/plugin/health"
	_ "github.com/coredns/coredns/plugin/kubernetes"
	_ "github.com/coredns/coredns/plugin/log"
	_ "github.com/coredns/coredns/plugin/ready"
	_ "github.com/coredns/coredns/plugin/reload"
)

func init() {
	dnsserver.Directives = []string{"bind", "reload", "errors", "log", "health", "ready", "cache", "kubernetes"}
}

func main() { coremain.Run() }
GO
  if [[ ! -f go.mod ]]; then
    go mod init local.build/coredns >/dev/null 2>&1
    go get "github.com/coredns/coredns@$COREDNS_VERSION"
  fi
  mkdir -p "$out.tmp"; CGO_ENABLED=0 go build -trimpath -ldflags "-s -w" -o "$out.tmp/coredns" .
  rm -rf "$out"; mv "$out.tmp" "$out"; log "coredns done"
}

build_helm() {
  local out="$CACHE_ROOT/helm-$HELM_VERSION"
  # A helm built without its release ldflags reports "v3.19" and assumes Kubernetes 1.20 in
  # `helm template`/`lint`; the version check makes a cache filled by such a build rebuild itself.
  [[ -x $out/helm && $("$out/helm" version --template '{{.Version}}' 2>/dev/null) == "$HELM_VERSION" ]] \
    && { log "helm cached"; return; }
  local kminor; kminor=$(echo "$KUBE_VERSION" | cut -d. -f2)
  local ldf="-s -w -X helm.sh/helm/v3/internal/version.version=$HELM_VERSION" pkg
  for pkg in chartutil lint/rules; do
    ldf="$ldf -X helm.sh/helm/v3/pkg/$pkg.k8sVersionMajor=1 -X helm.sh/helm/v3/pkg/$pkg.k8sVersionMinor=$kminor"
  done
  mkdir -p "$out.tmp"
  GOBIN="$out.tmp" CGO_ENABLED=0 go install -trimpath -ldflags "$ldf" "helm.sh/helm/v3/cmd/helm@$HELM_VERSION"
  rm -rf "$out"; mv "$out.tmp" "$out"; log "helm done"
}

build_kube_router() {
  local out="$CACHE_ROOT/kube-router-$KUBE_ROUTER_VERSION"
  [[ -x $out/kube-router ]] && { log "kube-router cached"; return; }
  # The NetworkPolicy enforcer (firewall controller only; hack/cluster.py turns routing and the
  # service proxy off). Its go.mod has no replace directives, so `go install` builds it as released.
  local ldf="-s -w -X github.com/cloudnativelabs/kube-router/v2/pkg/version.Version=$KUBE_ROUTER_VERSION"
  ldf="$ldf -X github.com/cloudnativelabs/kube-router/v2/pkg/version.BuildDate=2026-01-01T00:00:00Z"
  mkdir -p "$out.tmp"
  GOBIN="$out.tmp" CGO_ENABLED=0 go install -trimpath -ldflags "$ldf" \
    "github.com/cloudnativelabs/kube-router/v2/cmd/kube-router@$KUBE_ROUTER_VERSION"
  rm -rf "$out"; mv "$out.tmp" "$out"; log "kube-router done"
}

build_kueue() {
  local out="$CACHE_ROOT/kueue-$KUEUE_VERSION"
  [[ -x $out/manager && -f $out/chart/Chart.yaml ]] && { log "kueue cached"; return; }
  # The manager of hack/kueue/Dockerfile plus Kueue's own Helm chart, both from the released module.
  # Its go.mod has no replace directives, so `go install` builds it as released.
  local vpkg=sigs.k8s.io/kueue/pkg/version
  local ldf="-s -w -X $vpkg.GitVersion=$KUEUE_VERSION -X $vpkg.GitCommit=0000000000000000000000000000000000000000"
  ldf="$ldf -X $vpkg.BuildDate=2026-01-01T00:00:00Z"
  rm -rf "$out.tmp"; mkdir -p "$out.tmp"
  log "building kueue $KUEUE_VERSION (cold: several minutes on 2 cores)"
  GOBIN="$out.tmp" CGO_ENABLED=0 go install -trimpath -ldflags "$ldf" "sigs.k8s.io/kueue/cmd/kueue@$KUEUE_VERSION"
  mv "$out.tmp/kueue" "$out.tmp/manager"
  # The chart ships inside the module; the module cache is read-only, so copy without its modes.
  local moddir
  moddir=$(cd "$CACHE_ROOT" && go mod download -json "sigs.k8s.io/kueue@$KUEUE_VERSION" \
    | python3 -c 'import json,sys;print(json.load(sys.stdin)["Dir"])')
  cp -r --no-preserve=mode "$moddir/charts/kueue" "$out.tmp/chart"
  rm -rf "$out"; mv "$out.tmp" "$out"; log "kueue done"
}

build_kind() {
  # kind itself plus what a kind node image needs that the embedded cluster does not: kubeadm, and a
  # CoreDNS with every plugin of kubeadm's default Corefile (the coredns target builds a minimal one).
  local out="$CACHE_ROOT/kind-$KIND_VERSION"
  [[ -x $out/kind && -x $out/kubeadm && -x $out/coredns && \
     $("$out/kubeadm" version -o short 2>/dev/null) == "$KUBE_VERSION" ]] && { log "kind cached"; return; }
  rm -rf "$out.tmp"; mkdir -p "$out.tmp"
  log "building kind $KIND_VERSION"
  # kind's go.mod has no replace directives, so `go install` builds it as released
  GOBIN="$out.tmp" CGO_ENABLED=0 go install -trimpath -ldflags "-s -w" "sigs.k8s.io/kind@$KIND_VERSION"
  log "building kubeadm $KUBE_VERSION (after the kube target: minutes, most packages are cached)"
  kube_src
  CGO_ENABLED=0 go build -trimpath -ldflags "$(kube_ldflags)" -o "$out.tmp/kubeadm" k8s.io/kubernetes/cmd/kubeadm
  log "building coredns $COREDNS_VERSION with the plugins of kubeadm's Corefile"
  local src; src=$(scratch "coredns-kubeadm-$COREDNS_VERSION"); cd "$src"
  cat > main.go <<'GO'
package main

import (
	"github.com/coredns/coredns/core/dnsserver"
	"github.com/coredns/coredns/coremain"
	_ "github.com/coredns/coredns/plugin/cache"
	_ "github.com/coredns/coredns/plugin/errors"
	_ "github.com/coredns/coredns/plugin/forward"
	_ "github.com/coredns/coredns/plugin/health"
	_ "github.com/coredns/coredns/plugin/kubernetes"
	_ "github.com/coredns/coredns/plugin/loadbalance"
	_ "github.com/coredns/coredns/plugin/log"
	_ "github.com/coredns/coredns/plugin/loop"
	_ "github.com/coredns/coredns/plugin/metrics"
	_ "github.com/coredns/coredns/plugin/ready"
	_ "github.com/coredns/coredns/plugin/reload"
)

// The order of CoreDNS's plugin.cfg, restricted to the plugins above (it decides which runs first).
func init() {
	dnsserver.Directives = []string{"reload", "ready", "health", "prometheus", "errors", "log", "loadbalance",
		"cache", "kubernetes", "loop", "forward"}
}

func main() { coremain.Run() }
GO
  if [[ ! -f go.mod ]]; then
    go mod init local.build/coredns >/dev/null 2>&1
    go get "github.com/coredns/coredns@$COREDNS_VERSION"
  fi
  CGO_ENABLED=0 go build -trimpath -ldflags "-s -w" -o "$out.tmp/coredns" .
  rm -rf "$out"; mv "$out.tmp" "$out"; log "kind done"
}

build_kwok() {
  local out="$CACHE_ROOT/kwok-$KWOK_VERSION"
  [[ -x $out/kwok ]] && { log "kwok cached"; return; }
  # The controller only (never kwokctl, which downloads binaries): hack/kwok.py runs it against the embedded
  # cluster with stages of its own. kwok's go.mod has no replace directives, so `go install` builds it as released.
  rm -rf "$out.tmp"; mkdir -p "$out.tmp"
  log "building kwok $KWOK_VERSION (cold: a few minutes on 2 cores)"
  GOBIN="$out.tmp" CGO_ENABLED=0 go install -trimpath -ldflags "-s -w" "sigs.k8s.io/kwok/cmd/kwok@$KWOK_VERSION"
  rm -rf "$out"; mv "$out.tmp" "$out"; log "kwok done"
}

build_prometheus() {
  local out="$CACHE_ROOT/prometheus-$PROMETHEUS_VERSION"
  [[ -x $out/prometheus ]] && { log "prometheus cached"; return; }
  # The server only (no promtool). Its go.mod has no replace directives, so `go install` builds it as released, with
  # two differences from the release build: no `builtinassets` tag (the web UI's assets are not compiled in: the HTTP
  # API answers, the UI pages 404) and `remove_all_sd` (no cloud or Kubernetes service discovery, so none of their
  # SDKs: static and file targets are all the tests use).
  local vpkg=github.com/prometheus/common/version
  local ldf="-s -w -X $vpkg.Version=$PROMETHEUS_RELEASE -X $vpkg.Revision=0000000000000000000000000000000000000000"
  ldf="$ldf -X $vpkg.Branch=HEAD -X $vpkg.BuildUser=ddpjob -X $vpkg.BuildDate=20260101-00:00:00"
  rm -rf "$out.tmp"; mkdir -p "$out.tmp"
  log "building prometheus $PROMETHEUS_VERSION (cold: a few minutes on 2 cores)"
  GOBIN="$out.tmp" CGO_ENABLED=0 go install -trimpath -tags netgo,remove_all_sd -ldflags "$ldf" \
    "github.com/prometheus/prometheus/cmd/prometheus@$PROMETHEUS_VERSION"
  rm -rf "$out"; mv "$out.tmp" "$out"; log "prometheus done"
}

build_registry() {
  # Two binaries for `make release` (hack/release.py) and its local registry (hack/registry.py): crane, the client
  # (go-containerregistry's go.mod has no replace directives, so `go install` builds it as released), and CNCF
  # Distribution's registry with the filesystem storage driver only: a main of our own, as the etcd target does,
  # so none of the cloud storage drivers' SDKs are compiled (its own cmd/registry imports all of them).
  local crane_out="$CACHE_ROOT/crane-$GGCR_VERSION" out="$CACHE_ROOT/registry-$DISTRIBUTION_VERSION"
  if [[ -x $crane_out/crane ]]; then
    log "crane cached"
  else
    rm -rf "$crane_out.tmp"; mkdir -p "$crane_out.tmp"
    log "building crane $GGCR_VERSION"
    GOBIN="$crane_out.tmp" CGO_ENABLED=0 go install -trimpath -ldflags "-s -w" \
      "github.com/google/go-containerregistry/cmd/crane@$GGCR_VERSION"
    rm -rf "$crane_out"; mv "$crane_out.tmp" "$crane_out"; log "crane done"
  fi
  [[ -x $out/registry ]] && { log "registry cached"; return; }
  local src; src=$(scratch "registry-$DISTRIBUTION_VERSION"); cd "$src"
  printf 'package main\n\nimport (\n\t"github.com/distribution/distribution/v3/registry"\n\t_ "github.com/distribution/distribution/v3/registry/storage/driver/filesystem"\n)\n\nfunc main() { _ = registry.RootCmd.Execute() }\n' > main.go
  if [[ ! -f go.mod ]]; then
    go mod init local.build/registry >/dev/null 2>&1
    go get "github.com/distribution/distribution/v3@$DISTRIBUTION_VERSION"
  fi
  rm -rf "$out.tmp"; mkdir -p "$out.tmp"
  log "building registry $DISTRIBUTION_VERSION (cold: a few minutes on 2 cores)"
  CGO_ENABLED=0 go build -trimpath -ldflags "-s -w" -o "$out.tmp/registry" .
  rm -rf "$out"; mv "$out.tmp" "$out"; log "registry done"
}

components=("$@"); [[ ${#components[@]} -gt 0 ]] || components=(etcd coredns helm kube-router kube kueue)
for c in "${components[@]}"; do
  case $c in
    kube) build_kube ;;
    etcd) build_etcd ;;
    coredns) build_coredns ;;
    helm) build_helm ;;
    kube-router) build_kube_router ;;
    kueue) build_kueue ;;
    kind) build_kind ;;
    kwok) build_kwok ;;
    prometheus) build_prometheus ;;
    registry) build_registry ;;
    *) echo "unknown component $c" >&2; exit 2 ;;
  esac
done
