"""hack/image.py: Dockerfiles built with buildah, imported into containerd layer by layer."""
from __future__ import annotations

import hashlib
import json

import pytest

from hack import cluster as embedded
from hack import image as image_builder

# --- pure ----------------------------------------------------------------------------------------


def test_from_refs_skips_stages_and_scratch_and_expands_leading_args():
    text = (
        "# syntax=docker/dockerfile:1\n"
        "ARG BASE=python:3.11-slim-bookworm\n"
        "FROM ${BASE} AS builder\n"
        "FROM --platform=linux/amd64 debian:bookworm-slim\n"
        "FROM builder\n"
        "FROM scratch\n"
    )
    assert image_builder.from_refs(text) == ["python:3.11-slim-bookworm", "debian:bookworm-slim"]
    assert image_builder.from_refs(text, {"BASE": "debian:12"}) == ["debian:12", "debian:bookworm-slim"]


def test_base_names_are_the_ones_buildah_resolves():
    assert image_builder.base_name("python:3.11-slim-bookworm") == "docker.io/library/python:3.11-slim-bookworm"
    assert image_builder.base_name("docker.io/library/debian:12") == "docker.io/library/debian:12"
    assert image_builder.base_name("python:3.12-slim") is None  # not what the Debian base stands in for
    assert image_builder.base_name("quay.io/someone/python:3.11") is None


def test_refs_must_be_fully_qualified_and_versioned():
    for bad in ("ddp-trainer:0.1.0", "localhost/ddp-trainer", "localhost/ddp-trainer:latest"):
        with pytest.raises(image_builder.BuildError):
            image_builder.check_ref(bad)
    image_builder.check_ref("localhost/ddp-trainer:0.1.0")


# --- a real build, run as a pod ---------------------------------------------------------------

DOCKERFILE = """\
ARG BASE=python:3.11-slim-bookworm
FROM ${BASE} AS builder
ARG GREETING=hi
WORKDIR /src
COPY data/ ./data/
RUN echo "$GREETING from builder" > /src/built.txt && ls data > /src/listing.txt

FROM python:3.11-slim-bookworm
RUN --mount=type=cache,target=/root/.cache/pip python3 -m venv /opt/venv
COPY --from=builder /src/built.txt /src/listing.txt /opt/app/
COPY --chown=nobody:nogroup data/ /opt/app/data/
ENV APP_MODE=test
WORKDIR /opt/app
USER nobody
ENTRYPOINT ["python3", "-c"]
CMD ["import os, json; print(json.dumps([open('built.txt').read().strip(), open('listing.txt').read().split(), os.getuid(), os.getcwd(), os.environ['APP_MODE'], sorted(os.listdir('data')), os.stat('data/keep.txt').st_uid, open('data/keep.txt').read().strip()]))"]
"""
REF = "localhost/ddp-buildertest:0.1.0"


def _layers(ref: str) -> list[str]:
    info = json.loads(image_builder.buildah("inspect", "--type", "image", ref))
    return [layer["digest"] for layer in json.loads(info["Manifest"])["layers"]]


def _run(kubectl, namespace, name):
    kubectl("run", name, "-n", namespace, f"--image={REF}", "--restart=Never", "--image-pull-policy=Never")
    kubectl.wait_pod_phase(namespace, name, "Succeeded", timeout=120)
    return json.loads(kubectl("logs", "-n", namespace, name).stdout)


def test_multistage_build_runs_as_a_pod_and_a_change_imports_only_new_layers(cluster, kubectl, namespace, tmp_path):
    if not cluster.embedded:
        pytest.skip("the offline builder imports into the embedded cluster's containerd")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "keep.txt").write_text("kept\n")
    (tmp_path / "data" / "secret.txt").write_text("never in the image\n")
    (tmp_path / ".dockerignore").write_text("# comment\ndata/secret.txt\n")
    (tmp_path / "Dockerfile").write_text(DOCKERFILE)

    digest = image_builder.build(tmp_path / "Dockerfile", REF, tmp_path, {"GREETING": "hello"})
    try:
        # The image's own entrypoint/cmd/user/env/workdir, as a pod on the cluster.
        nobody = 65534
        assert _run(kubectl, namespace, "built") == [
            "hello from builder", ["keep.txt"], nobody, "/opt/app", "test", ["keep.txt"], nobody, "kept"]
        # Unchanged inputs: the same image (buildah's layer cache), nothing imported again.
        assert image_builder.build(tmp_path / "Dockerfile", REF, tmp_path, {"GREETING": "hello"}) == digest
        before = _layers(REF)

        # A changed input file is a new image whose unchanged layers are the same blobs; containerd gets the
        # new ones, each rebuilt from buildah's store byte for byte (the fast path, not the push fallback).
        (tmp_path / "data" / "keep.txt").write_text("changed\n")
        assert image_builder.build(tmp_path / "Dockerfile", REF, tmp_path, {"GREETING": "hello"}) != digest
        after = _layers(REF)
        new = [layer for layer in after if layer not in before]
        assert new and after[:2] == before[:2], (before, after)  # the base and the venv are reused
        store = image_builder._Store.open()
        for layer in new:
            h = hashlib.sha256()
            for chunk in store.layer_tar(layer):
                h.update(chunk)
            assert f"sha256:{h.hexdigest()}" == layer
        assert _run(kubectl, namespace, "rebuilt")[-1] == "changed"
    finally:
        embedded.ctr("images", "rm", REF, check=False)
