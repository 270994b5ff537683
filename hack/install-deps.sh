#!/usr/bin/env bash
# Installs what the project needs on a fresh Debian 12 machine, idempotently (a second run is quick):
#   - system packages for the embedded cluster and the offline image builder
#   - .venv at the repository root with requirements-dev.txt, the project itself and the trainer (both editable)
# Go is not needed: hack/build-binaries.sh uses a new enough `go` on PATH or fetches the pinned
# toolchain itself (hack/install-go.py).
#   hack/install-deps.sh            the embedded cluster's needs
#   hack/install-deps.sh --docker   also Debian's docker.io, for kind (hack/docker.py runs a private engine)
set -euo pipefail
cd "$(dirname "$0")/.."
log() { printf '[deps %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

# containerd/runc/CNI plugins run the pods; conntrack+iptables serve kube-proxy and the bridge
# plugin; ipset serves kube-router's NetworkPolicy firewall; openssl makes the PKI;
# buildah builds images (no daemon) and debootstrap their Debian base; tini reaps orphaned shims (PID 1
# is not an init here); gcc+libc6-dev compile the static pause binary.
PACKAGES=(containerd runc containernetworking-plugins conntrack iptables ipset iproute2 openssl
          buildah debootstrap tini gcc libc6-dev tar util-linux ca-certificates python3 python3-venv)
# ShellCheck lints the shipping scripts in tests/chart/test_scripts.py (which fails without it in CI).
PACKAGES+=(shellcheck)
# The kubectl plugin's live views are tested in a real terminal (tests/e2e/test_e2e_cli.py).
PACKAGES+=(tmux)
# kind only (opt-in): dockerd and its CLI. hack/docker.py runs its own engine; the package's system engine
# (its iptables rules set the FORWARD policy to DROP, cutting off the embedded cluster's pods) is
# stopped and disabled again where this run installed it on a systemd host.
if [[ ${1:-} == --docker ]]; then
  PACKAGES+=(docker.io)
elif [[ $# -gt 0 ]]; then
  echo "usage: hack/install-deps.sh [--docker]" >&2; exit 2
fi

missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done
if ((${#missing[@]})); then
  SUDO=; [[ $(id -u) == 0 ]] || SUDO=sudo
  log "installing ${missing[*]}"
  $SUDO apt-get update -qq
  # Debian's containerd does not start itself without systemd; the cluster runs its own instance.
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  if [[ " ${missing[*]} " == *" docker.io "* && -d /run/systemd/system ]]; then
    $SUDO systemctl disable --now docker.service docker.socket >/dev/null 2>&1 || true
  fi
else
  log "system packages present"
fi

# The virtualenv: recreated only when missing, reinstalled only when the requirements change.
PY=${PYTHON:-python3}
if [[ ! -x .venv/bin/python ]]; then
  log "creating .venv with $($PY --version)"
  "$PY" -m venv .venv
fi
stamp=.venv/.ddpjob-deps
want=$(cat requirements*.txt pyproject.toml trainer/pyproject.toml trainer/ddp_trainer/requirements.txt | sha256sum |
  cut -d' ' -f1)
if [[ ! -f $stamp || $(cat "$stamp") != "$want" ]]; then
  # torch's CUDA build and its NVIDIA libraries take ~5 GiB installed, and pip unpacks each wheel under TMPDIR
  # first: a full disk otherwise surfaces as pip's bare "[Errno 28] No space left on device".
  need_gib=8
  for dir in .venv "${TMPDIR:-/tmp}"; do
    free_gib=$(($(df --output=avail -k "$dir" | tail -1) / 1048576))
    if ((free_gib < need_gib)); then
      log "only $free_gib GiB free on the disk of $dir; installing torch needs about $need_gib GiB." \
        "Free some first (an old clone's .venv, 'buildah rmi --prune', 'make cluster-down' and its images)."
      exit 1
    fi
  done
  log "installing Python requirements (torch is large: minutes on first run)"
  # No wheel cache: it would keep a second copy of torch (GBs) that only a second fresh clone would use.
  .venv/bin/pip install -q --no-cache-dir -r requirements-dev.txt
  # The operator and the kubectl plugin (pyproject.toml), and the trainer, a distribution of its own
  # (trainer/pyproject.toml): editable, so that torchrun finds its rendezvous backend ddpjob-c10d (an entry point).
  .venv/bin/pip install -q --no-deps -e . -e ./trainer
  echo "$want" >"$stamp"
else
  log ".venv up to date"
fi
# `kubectl ddp` (docs/cli.md): kubectl finds the plugin on PATH.
command -v kubectl-ddp >/dev/null 2>&1 ||
  log "kubectl ddp: .venv/bin/kubectl-ddp is installed; put it on PATH with: export PATH=\"$PWD/.venv/bin:\$PATH\""
