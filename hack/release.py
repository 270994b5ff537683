#!/usr/bin/env python3
"""`make release VERSION=x.y.z [REGISTRY=host[:port]/path]`: one version's images, chart and manifests.yaml, pushed
to a registry and written to dist/VERSION/.

    hack/release.py VERSION [--registry REG] [--ref COMMIT] [--images operator,...] [--compression none|gzip]
                    [--dist DIR]

1. Refuses a VERSION that is not SemVer x.y.z[-pre] (no +build: an OCI tag cannot hold it), that CHANGELOG.md has no
   entry for (a pre-release x.y.z-pre goes under the entry of x.y.z, else under Unreleased), or that the registry
   already holds (an image tag or the chart): a release is immutable, a change is a new version. All checked before
   anything is built.
2. Builds every image of `hack/build-images.sh --list` as localhost/ddp-<name>:VERSION with buildah (its layer cache
   makes an unchanged image a matter of seconds), from the working tree or, with --ref, from `git archive` of that
   commit (an earlier version rebuilt, e.g. for an upgrade test), which then supplies the chart and CHANGELOG too.
3. Pushes each as REG/ddp-<name>:VERSION (hack/release_images.py: only the blobs the registry lacks) and records its
   digest; drops the local tag.
4. The chart: version and appVersion VERSION, image defaults REG/ddp-<name> at their digests, packaged, rendered to
   check it, pushed to oci://REG/charts/ddp-operator (hack/release_chart.py).
5. dist/VERSION/: the chart package, manifests.yaml (`kubectl apply --server-side -f`), notes.md (the CHANGELOG
   entry, for the release page) and release.json, whose content is also the last line printed.

Without --registry: the local registry of hack/registry.py (started when needed), at 127.0.0.1:PORT/ddpjob.
"""
from __future__ import annotations

import argparse
import fcntl
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if not __package__:  # run as a script (python hack/release.py): hack.* from the repository root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hack import common, release_chart, release_images  # noqa: E402
from hack import registry as local_registry  # noqa: E402
from hack.common import BuildError, ClusterError  # noqa: E402

REPO = common.REPO
SEMVER = re.compile(r"(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)(?:-([0-9A-Za-z-]+(?:\.[0-9A-Za-z-]+)*))?")
LOCAL_REPOSITORY = "ddpjob"  # the path of the local registry's repositories: 127.0.0.1:PORT/ddpjob/ddp-<name>
WORK = common.CACHE / "release"

log = common.logger("release")


def check_version(version: str) -> None:
    if not SEMVER.fullmatch(version):
        raise BuildError(f"VERSION {version!r} is not SemVer x.y.z or x.y.z-pre (e.g. 0.2.0, 0.2.0-rc.1; no +build)")


def changelog_entry(changelog: str, version: str) -> str | None:
    """The text of CHANGELOG.md's entry for `version` (Keep a Changelog: `## [x.y.z] - date`); for a pre-release
    x.y.z-pre also the entry of x.y.z, else `## [Unreleased]` (what the pre-release previews). None when none."""
    base, pre = version.split("-", 1)[0], "-" in version
    sections = re.split(r"(?m)^## ", changelog)[1:]
    for wanted in (version, base, "Unreleased") if pre else (version,):
        for section in sections:
            if re.match(rf"\[{re.escape(wanted)}\](\s|$)", section):
                return "## " + section.rstrip() + "\n"
    return None


def image_ref(registry: str, name: str, version: str) -> str:
    return f"{registry}/ddp-{name}:{version}"


def chart_ref(registry: str) -> str:
    return f"oci://{registry}/charts/{release_chart.CHART_NAME}"


def source_tree(ref: str | None) -> Path:
    """The tree a release is built from: the working tree, or `git archive` of commit `ref` (kept in the cache)."""
    if ref is None:
        return REPO
    sha = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--verify", f"{ref}^{{commit}}"], capture_output=True,
                         text=True)
    if sha.returncode != 0:
        raise BuildError(f"--ref {ref!r} is not a commit of {REPO}:\n{sha.stderr.strip()}")
    tree = WORK / "src" / sha.stdout.strip()
    if not (tree / "hack" / "build-images.sh").exists():
        tmp = Path(tempfile.mkdtemp(dir=WORK, prefix="src-"))
        archive = subprocess.run(["git", "-C", str(REPO), "archive", "--format=tar", sha.stdout.strip()],
                                 capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(tmp)], input=archive, check=True)
        shutil.rmtree(tree, ignore_errors=True)
        tree.parent.mkdir(parents=True, exist_ok=True)
        tmp.rename(tree)
    log(f"building {ref} ({sha.stdout.strip()[:12]}) from {tree}")
    return tree


def image_names(tree: Path) -> list[str]:
    out = subprocess.run([str(tree / "hack" / "build-images.sh"), "--list"], capture_output=True, text=True,
                         cwd=tree)
    names = out.stdout.split()
    if out.returncode != 0 or "operator" not in names:
        raise BuildError(f"{tree}/hack/build-images.sh --list named no images:\n{out.stderr.strip()}")
    return names


def refuse_existing(registry: str, names: list[str], version: str) -> None:
    refs = [image_ref(registry, n, version) for n in names]
    refs.append(f"{registry}/charts/{release_chart.CHART_NAME}:{version}")
    taken = [r for r in refs if release_images.tag_digest(r) is not None]
    if taken:
        raise BuildError(f"{', '.join(taken)} already in the registry: a release is immutable; release a new version")


def build(tree: Path, names: list[str], version: str) -> float:
    t0 = time.monotonic()
    env = {**os.environ, "DDPJOB_IMAGE_TAG": version, "DDPJOB_IMAGE_BUILDER": "buildah"}
    # The builder's output goes to stderr: stdout carries the release's JSON line only.
    p = subprocess.run([str(tree / "hack" / "build-images.sh"), *names], cwd=tree, env=env, stdout=sys.stderr)
    if p.returncode != 0:
        raise BuildError(f"hack/build-images.sh {' '.join(names)} failed (exit {p.returncode})")
    return round(time.monotonic() - t0, 1)


def release(version: str, registry: str, *, ref: str | None = None, compression: str = "none",
            dist: Path | None = None, only: list[str] | None = None) -> dict:
    t0 = time.monotonic()
    check_version(version)
    tree = source_tree(ref)
    entry = changelog_entry((tree / "CHANGELOG.md").read_text() if (tree / "CHANGELOG.md").exists() else "", version)
    if entry is None:
        raise BuildError(f"CHANGELOG.md has no entry for {version} (`## [{version.split('-', 1)[0]}] - <date>`): "
                         "write what the release changes first")
    names = image_names(tree)
    if only:  # a partial release: the chart's check below still refuses one whose chart names an image left out
        unknown = sorted(set(only) - set(names))
        if unknown or "operator" not in only:
            raise BuildError(f"--images {','.join(only)}: the images are {', '.join(names)}, operator among them")
        names = [n for n in names if n in only]
    refuse_existing(registry, names, version)
    out = (dist or REPO / "dist") / version
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)

    seconds: dict[str, float] = {"build": build(tree, names, version)}
    images: dict[str, dict] = {}
    for name in names:
        local, dest = f"localhost/ddp-{name}:{version}", image_ref(registry, name, version)
        pushed = release_images.push(local, dest, compression, WORK)
        images[name] = {"ref": f"{dest}@{pushed['digest']}", **pushed}
        log(f"{dest}@{pushed['digest']} in {pushed['seconds']} s "
            f"({pushed.get('blobs_uploaded', '?')} blobs uploaded, {pushed.get('blobs_found', '?')} already there)")
        subprocess.run(["buildah", "rmi", local], capture_output=True)  # the tag only; the layer cache stays
    seconds["push"] = round(sum(i["seconds"] for i in images.values()), 1)

    t_chart = time.monotonic()
    pins = {n: (f"{registry}/ddp-{n}", i["digest"]) for n, i in images.items()}
    with tempfile.TemporaryDirectory(dir=WORK) as tmp:
        staged = release_chart.stage(tree / "helm" / release_chart.CHART_NAME, Path(tmp) / release_chart.CHART_NAME,
                                     version, pins)
        tgz = release_chart.package(staged, out, version)
    rendered = release_chart.render(tgz)
    release_chart.check_rendered(rendered, f"{registry}/ddp-operator:{version}@{images['operator']['digest']}")
    chart_digest = release_chart.push(tgz, registry, release_images.loopback(registry))
    namespace = (tree / "manifests" / "base" / "namespace.yaml").read_text()
    (out / "manifests.yaml").write_text(release_chart.manifests(namespace, rendered, version, chart_ref(registry)))
    (out / "notes.md").write_text(entry)
    seconds["chart"] = round(time.monotonic() - t_chart, 1)
    seconds["total"] = round(time.monotonic() - t0, 1)

    record = {"version": version, "registry": registry, "source": ref or "working tree", "compression": compression,
              "images": images,
              "chart": {"ref": chart_ref(registry), "version": version, "digest": chart_digest, "package": str(tgz)},
              "manifests": str(out / "manifests.yaml"), "notes": str(out / "notes.md"), "seconds": seconds}
    (out / "release.json").write_text(json.dumps(record, indent=2) + "\n")
    return record


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="hack/release.py", description=__doc__.splitlines()[0])
    parser.add_argument("version", help="SemVer x.y.z or x.y.z-pre, with an entry in CHANGELOG.md")
    parser.add_argument("--registry", help="where to push: host[:port]/path (default: the local registry, "
                        f"hack/registry.py, at 127.0.0.1:PORT/{LOCAL_REPOSITORY})")
    parser.add_argument("--ref", help="build this commit (git archive) instead of the working tree")
    parser.add_argument("--compression", choices=release_images.COMPRESSIONS, default="none",
                        help="the layers as built, uncompressed (default; a node that has the image pulls the "
                        "manifest only), or gzip (buildah push) for a registry whose users pull over the internet")
    parser.add_argument("--images", help="comma-separated: release only these images (operator always), e.g. an "
                        "earlier version's operator for an upgrade test, whose trainer image nobody needs again")
    parser.add_argument("--dist", type=Path, help="where dist/VERSION/ goes (default: the repository's dist/)")
    args = parser.parse_args(argv)
    try:
        registry = (args.registry or f"{local_registry.up()}/{LOCAL_REPOSITORY}").rstrip("/")
        WORK.mkdir(parents=True, exist_ok=True)
        with open(WORK / ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # one release at a time: they share the build and the work directory
            record = release(args.version, registry, ref=args.ref, compression=args.compression, dist=args.dist,
                             only=args.images.split(",") if args.images else None)
    except (BuildError, ClusterError) as e:
        print(f"release refused or failed: {e}", file=sys.stderr)
        return 1
    print(json.dumps(record, separators=(",", ":")))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
