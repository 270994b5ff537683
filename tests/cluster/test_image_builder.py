"""hack/image.py: Dockerfiles built without a Docker engine behave as Docker would build them."""
from __future__ import annotations

import json
import time

import pytest

from tests.conftest import embedded, image_builder

# --- parsing (pure) ---------------------------------------------------------------------------


def test_parse_continuations_comments_and_flags():
    text = (
        "# syntax=docker/dockerfile:1\n"
        "FROM python:3.11-slim-bookworm AS base\n"
        "RUN --mount=type=cache,target=/root/.cache/pip \\\n"
        "    # a comment inside a continuation is dropped\n"
        "    echo one && \\\n"
        "    echo two\n"
        "\n"
        'ENTRYPOINT ["python3", "-m", "x"]\n'
    )
    ins = image_builder.parse_dockerfile(text)
    assert [i.cmd for i in ins] == ["FROM", "RUN", "ENTRYPOINT"]
    assert ins[1].flags == {"mount": ["type=cache,target=/root/.cache/pip"]}
    assert ins[1].args.split() == ["echo", "one", "&&", "echo", "two"]
    assert ins[2].json_args() == ["python3", "-m", "x"]
    assert ins[1].json_args() is None


def test_variable_expansion_and_key_values():
    env = {"A": "1", "EMPTY": ""}
    assert image_builder.expand("$A-${A}-${B:-dflt}-${A:+set}-${EMPTY:+no}-\\$A", env) == "1-1-dflt-set--$A"
    assert image_builder.key_values('PATH=/opt/venv/bin:$A X="two words"', env) == [
        ("PATH", "/opt/venv/bin:1"), ("X", "two words")]
    assert image_builder.key_values("LEGACY value with spaces", env) == [("LEGACY", "value with spaces")]


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
COPY --from=builder /src/built.txt /src/listing.txt /opt/app/
COPY --chown=nobody:nogroup data/ /opt/app/data/
ENV APP_MODE=test
WORKDIR /opt/app
USER nobody
ENTRYPOINT ["python3", "-c"]
CMD ["import os, json; print(json.dumps([open('built.txt').read().strip(), open('listing.txt').read().split(), os.getuid(), os.getcwd(), os.environ['APP_MODE'], sorted(os.listdir('data')), os.stat('data/keep.txt').st_uid]))"]
"""
REF = "localhost/ddp-buildertest:0.1.0"


def test_multistage_build_runs_as_a_pod_and_rebuilds_only_on_change(cluster, kubectl, namespace, tmp_path):
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
        kubectl("run", "built", "-n", namespace, f"--image={REF}", "--restart=Never", "--image-pull-policy=Never")
        kubectl.wait_pod_phase(namespace, "built", "Succeeded", timeout=120)
        out = json.loads(kubectl("logs", "-n", namespace, "built").stdout)
        nobody = 65534
        assert out == ["hello from builder", ["keep.txt"], nobody, "/opt/app", "test", ["keep.txt"], nobody]

        # Unchanged: a no-op that does not even start the build.
        t0 = time.monotonic()
        assert image_builder.build(tmp_path / "Dockerfile", REF, tmp_path, {"GREETING": "hello"}) == digest
        assert time.monotonic() - t0 < 5
        # A changed input file or build arg is a new image.
        (tmp_path / "data" / "keep.txt").write_text("changed\n")
        assert image_builder.build(tmp_path / "Dockerfile", REF, tmp_path, {"GREETING": "hello"}) != digest
    finally:
        embedded.ctr("images", "rm", REF, check=False)
