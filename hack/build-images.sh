#!/usr/bin/env bash
# Builds the operator and trainer images from their Dockerfiles.
#   hack/build-images.sh [operator|trainer ...]      (default: both)
# Offline (default): hack/image.py builds each Dockerfile without a Docker engine and imports the image
# into the embedded cluster's containerd; an image whose inputs (Dockerfile, requirements, package
# sources) have not changed since its last build, and which containerd still has, is skipped without
# even starting the builder (whose own step cache makes a source-only change a seconds-long rebuild).
# DDPJOB_IMAGE_BUILDER=docker: `docker build` into the local Docker engine instead (kind users, then
# `kind load docker-image`); Docker's own layer cache does the skipping.
# DDPJOB_IMAGE_FORCE=1 rebuilds even when nothing changed.
set -euo pipefail
cd "$(dirname "$0")/.."

TAG=${DDPJOB_IMAGE_TAG:-0.1.0}
BUILDER=${DDPJOB_IMAGE_BUILDER:-offline}
CACHE_ROOT=${DDPJOB_CACHE:-$HOME/.cache/ddpjob}
STAMPS=$CACHE_ROOT/images
PY=python3
[[ -x .venv/bin/python ]] && PY=.venv/bin/python
log() { printf '[images %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

# name -> "Dockerfile requirements package-dir"
inputs() {
  case $1 in
    operator) echo "operator/Dockerfile requirements.txt operator/ddp_operator" ;;
    trainer) echo "trainer/Dockerfile requirements-trainer.txt trainer/ddp_trainer" ;;
    *) echo "unknown image '$1' (operator|trainer)" >&2; return 2 ;;
  esac
}

# A digest of every file that goes into the image, paths included, so a rename also counts.
inputs_digest() {
  local paths
  read -r -a paths <<<"$(inputs "$1")"
  find "${paths[@]}" .dockerignore -type f ! -path '*/__pycache__/*' ! -name '*.pyc' -print0 \
    | LC_ALL=C sort -z | xargs -0 sha256sum | sha256sum | cut -d' ' -f1
}

image_present() {  # a stamp is only trusted while the cluster's containerd still has the image
  "$PY" hack/image.py has "$1" >/dev/null 2>&1
}

build_one() {
  local name=$1 ref="localhost/ddp-$1:$TAG" dockerfile digest stamp
  dockerfile=$(inputs "$name" | cut -d' ' -f1)
  if [[ $BUILDER == docker ]]; then
    log "docker build $ref"
    docker build -f "$dockerfile" -t "$ref" .
    return
  fi
  digest=$(inputs_digest "$name")
  stamp=$STAMPS/ddp-$name-$TAG.inputs
  if [[ -z ${DDPJOB_IMAGE_FORCE:-} && -f $stamp && $(cat "$stamp") == "$digest" ]] && image_present "$ref"; then
    log "$ref unchanged, skipped"
    return
  fi
  log "building $ref offline (the trainer image downloads torch on its first build: minutes)"
  local start=$SECONDS
  "$PY" hack/image.py build -f "$dockerfile" -t "$ref" .
  mkdir -p "$STAMPS"
  echo "$digest" >"$stamp"
  log "$ref built in $((SECONDS - start)) s"
}

case $BUILDER in
  offline | docker) ;;
  *) echo "DDPJOB_IMAGE_BUILDER must be offline or docker, not '$BUILDER'" >&2; exit 2 ;;
esac
names=("$@")
[[ ${#names[@]} -gt 0 ]] || names=(operator trainer)
for n in "${names[@]}"; do
  build_one "$n"
done
