"""A release's Helm chart and manifests.yaml (hack/release.py): the chart copied with the release's version and its
images pinned by digest, packaged, checked by rendering it and pushed as an OCI chart; manifests.yaml rendered from
that package, so it holds exactly the objects the chart installs with its default values (one source).

The edits are textual (values.yaml's comments are its manual, and a YAML round trip would drop them): a values block
whose `repository:` is the locally built `localhost/ddp-<name>` gets the release's repository and, where it has a
`digest:` key, the pushed digest; rendering the packaged chart then proves that no `localhost/ddp-` image is left.
"""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

from hack import common
from hack.common import BuildError

CHART_NAME = "ddp-operator"
RELEASE_NAME = "ddp-operator"  # what manifests.yaml installs: the chart's default release name and namespace
NAMESPACE = "ddp-system"
LOCAL_PREFIX = "localhost/ddp-"


def set_version(chart_yaml: str, version: str) -> str:
    """Chart.yaml's text with `version` and `appVersion` set to `version`."""
    out, n = re.subn(r"(?m)^version:.*$", f"version: {version}", chart_yaml)
    out, m = re.subn(r"(?m)^appVersion:.*$", f'appVersion: "{version}"', out)
    if (n, m) != (1, 1):
        raise BuildError("Chart.yaml must have one top-level version and one appVersion line")
    return out


def pin_images(values: str, images: dict[str, tuple[str, str]]) -> str:
    """values.yaml's text with each block `repository: localhost/ddp-<name>` pointed at images[name] = (repository,
    digest): its repository replaced, and its `digest:` set where the block has that key. BuildError when no block
    names the operator's image (the chart would install something else than what was pushed)."""
    lines = values.splitlines(keepends=True)
    found = set()
    for i, line in enumerate(lines):
        m = re.match(rf"^(\s*)repository:\s*{re.escape(LOCAL_PREFIX)}([a-z0-9-]+)\s*$", line)
        if not m or m.group(2) not in images:
            continue
        indent, name = m.group(1), m.group(2)
        repository, digest = images[name]
        lines[i] = f"{indent}repository: {repository}\n"
        found.add(name)
        for j in _block(lines, i, len(indent)):
            if re.match(rf"^{indent}digest:", lines[j]):
                lines[j] = f'{indent}digest: "{digest}"\n'
    if "operator" not in found:
        raise BuildError(f"values.yaml has no block with `repository: {LOCAL_PREFIX}operator`")
    return "".join(lines)


def _block(lines: list[str], at: int, indent: int) -> list[int]:
    """The indexes of the lines of the values block that holds line `at` (its keys at `indent` spaces)."""
    start = at
    while start > 0 and _inside(lines[start - 1], indent):
        start -= 1
    end = at
    while end + 1 < len(lines) and _inside(lines[end + 1], indent):
        end += 1
    return list(range(start, end + 1))


def _inside(line: str, indent: int) -> bool:
    stripped = line.strip()
    return not stripped or stripped.startswith("#") or len(line) - len(line.lstrip()) >= indent


def helm(*args: str, timeout: float = 300) -> str:
    p = subprocess.run([common.binary("helm"), *args], capture_output=True, text=True, timeout=timeout)
    if p.returncode != 0:
        raise BuildError(f"helm {' '.join(args[:2])} failed ({p.returncode}):\n{p.stderr.strip() or p.stdout.strip()}")
    return p.stdout + p.stderr


def stage(source: Path, dest: Path, version: str, images: dict[str, tuple[str, str]]) -> Path:
    """A copy of the chart at `source` in `dest`, with the release's version and images."""
    shutil.rmtree(dest, ignore_errors=True)
    shutil.copytree(source, dest)
    (dest / "Chart.yaml").write_text(set_version((dest / "Chart.yaml").read_text(), version))
    (dest / "values.yaml").write_text(pin_images((dest / "values.yaml").read_text(), images))
    return dest


def package(staged: Path, out_dir: Path, version: str) -> Path:
    helm("package", str(staged), "--destination", str(out_dir))
    tgz = out_dir / f"{CHART_NAME}-{version}.tgz"
    if not tgz.is_file():
        raise BuildError(f"helm package wrote no {tgz}")
    return tgz


def render(tgz: Path) -> str:
    """`helm template` of the package with its default values, as manifests.yaml installs it."""
    kube = common.versions()["KUBE_VERSION"]
    return helm("template", RELEASE_NAME, str(tgz), "--namespace", NAMESPACE, "--kube-version", kube)


def rendered_images(rendered: str) -> set[str]:
    """Every image the rendered chart names: containers' `image:` and the operator's `*_IMAGE` variables."""
    found = set(re.findall(r'(?m)^\s*(?:- )?image:\s*"?([^"\s]+)"?\s*$', rendered))
    found |= set(re.findall(r'(?m)^\s*- name:\s*\w+_IMAGE\s*\n\s*value:\s*"?([^"\s]+)"?\s*$', rendered))
    return found


def check_rendered(rendered: str, operator_image: str) -> None:
    """The packaged chart installs the pushed operator image, and no locally built image anywhere."""
    images = rendered_images(rendered)
    if operator_image not in images:
        raise BuildError(f"the packaged chart does not install {operator_image}: {sorted(images)}")
    left = sorted(i for i in images if i.startswith(LOCAL_PREFIX))
    if left:
        raise BuildError(f"the packaged chart still names locally built images: {left} (a values block the release "
                         "does not know how to pin: see hack/release_chart.py)")


def push(tgz: Path, registry: str, plain_http: bool) -> str:
    """`helm push` to oci://<registry>/charts; the chart's digest."""
    out = helm("push", str(tgz), f"oci://{registry}/charts", *(["--plain-http"] if plain_http else []))
    m = re.search(r"Digest:\s*(sha256:[0-9a-f]{64})", out)
    if not m:
        raise BuildError(f"helm push printed no digest:\n{out}")
    return m.group(1)


def manifests(namespace_yaml: str, rendered: str, version: str, chart_ref: str) -> str:
    """manifests.yaml: a header, the Namespace, then the chart's objects as `helm template` renders them (Helm's
    install order: the CRD before the RBAC and the Deployment)."""
    header = (f"# DDPJob {version}: the operator as `helm install {RELEASE_NAME} {chart_ref} --version {version}\n"
              f"# -n {NAMESPACE} --create-namespace` installs it with default values (rendered by hack/release.py).\n"
              "#   kubectl apply --server-side -f manifests.yaml\n")
    body = rendered if rendered.startswith("---") else "---\n" + rendered
    return header + "---\n" + namespace_yaml.strip() + "\n" + body
