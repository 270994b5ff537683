#!/usr/bin/env bash
# Builds the operator, trainer and store images from their Dockerfiles (build context: the repository root).
#   hack/build-images.sh [operator|trainer|store ...]      (default: every image in IMAGES)
#   hack/build-images.sh --list                      the names in IMAGES, one a line (hack/release.py reads them)
# Offline (default): hack/image.py builds each Dockerfile with buildah (no Docker engine) and imports it
# into the embedded cluster's containerd as localhost/ddp-<name>:0.1.0. buildah's layer cache makes an
# unchanged image a few-second no-op, and only the layers containerd lacks are imported: a source-only
# change re-imports the small top layer, never the torch layer.
# DDPJOB_IMAGE_BUILDER=docker: `docker build` into the local Docker engine instead (kind users, then
# `kind load docker-image`); Docker's layer cache does the skipping.
# DDPJOB_IMAGE_BUILDER=buildah: the offline build without the containerd import (kind offline, where
# Docker cannot pull the python base: then `hack/image.py kind-load` streams buildah's images into the nodes).
set -euo pipefail
cd "$(dirname "$0")/.."

TAG=${DDPJOB_IMAGE_TAG:-0.1.0}
BUILDER=${DDPJOB_IMAGE_BUILDER:-offline}
PY=python3
[[ -x .venv/bin/python ]] && PY=.venv/bin/python
log() { printf '[images %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

case $BUILDER in
  offline | docker | buildah) ;;
  *) echo "DDPJOB_IMAGE_BUILDER must be offline, docker or buildah, not '$BUILDER'" >&2; exit 2 ;;
esac

# Every image the project builds, <name>/Dockerfile each: the one list (make release pushes exactly these).
IMAGES=(operator trainer store)
if [[ ${1:-} == --list ]]; then
  printf '%s\n' "${IMAGES[@]}"
  exit 0
fi
names=("$@")
[[ ${#names[@]} -gt 0 ]] || names=("${IMAGES[@]}")
for name in "${names[@]}"; do
  [[ " ${IMAGES[*]} " == *" $name "* ]] || { echo "unknown image '$name' (${IMAGES[*]})" >&2; exit 2; }
  ref="localhost/ddp-$name:$TAG"
  start=$SECONDS
  if [[ $BUILDER == docker ]]; then
    log "docker build $ref"
    docker build -f "$name/Dockerfile" -t "$ref" .
  elif [[ $BUILDER == buildah ]]; then
    log "$ref (buildah only, for kind)"
    "$PY" hack/image.py build --no-import -f "$name/Dockerfile" -t "$ref" .
  else
    log "$ref (offline; the first trainer build downloads torch: several minutes)"
    "$PY" hack/image.py build -f "$name/Dockerfile" -t "$ref" .
  fi
  log "$ref ready after $((SECONDS - start)) s"
done
