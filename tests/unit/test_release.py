"""The release tooling's pure parts (hack/release.py, release_chart.py, release_images.py, registry.py): which
versions are released, how the chart is pinned to what was pushed, what manifests.yaml holds, and the registry's and
containerd's configuration. tests/chart/test_release.py runs a release against a real registry."""

from __future__ import annotations

import tomllib

import pytest
import yaml

from hack import common, registry, release, release_chart, release_images
from hack.common import BuildError
from tests import tools

CHANGELOG = """# Changelog

## [Unreleased]
- something new

## [0.2.0] - 2027-01-02
### Fixed
- a bug

## [0.1.0] - 2026-12-06
- the first release
"""
DIGEST = "sha256:" + "0123456789abcdef" * 4


@pytest.mark.parametrize("version", ["0.1.0", "1.22.333", "0.2.0-rc.1", "0.1.0-test.1733450000", "2.0.0-alpha-2"])
def test_semver_versions_are_accepted(version):
    release.check_version(version)


@pytest.mark.parametrize("version", ["1.2", "v1.2.3", "01.2.3", "1.2.3+build.5", "1.2.3-", "latest", "1.2.3-a..b"])
def test_other_versions_are_refused_with_an_example(version):
    with pytest.raises(BuildError, match="not SemVer"):
        release.check_version(version)


def test_a_final_version_needs_its_own_changelog_entry():
    assert release.changelog_entry(CHANGELOG, "0.2.0").startswith("## [0.2.0] - 2027-01-02\n### Fixed\n- a bug")
    assert "the first release" in release.changelog_entry(CHANGELOG, "0.1.0")
    assert release.changelog_entry(CHANGELOG, "0.3.0") is None
    assert release.changelog_entry(CHANGELOG, "0.1") is None  # no prefix match: [0.1.0] is not [0.1]


def test_a_pre_release_goes_under_its_version_else_under_unreleased():
    assert "a bug" in release.changelog_entry(CHANGELOG, "0.2.0-rc.1")
    assert "something new" in release.changelog_entry(CHANGELOG, "0.3.0-rc.1")
    assert release.changelog_entry(CHANGELOG.replace("## [Unreleased]", "## Notes"), "0.3.0-rc.1") is None


def test_the_repository_changelog_has_the_charts_version():
    """make release of the chart's own version is possible: CHANGELOG.md has its entry."""
    chart = yaml.safe_load((tools.REPO_ROOT / "helm" / "ddp-operator" / "Chart.yaml").read_text())
    assert release.changelog_entry((tools.REPO_ROOT / "CHANGELOG.md").read_text(), chart["version"]) is not None


def test_chart_version_and_app_version_are_set():
    text = release_chart.set_version('apiVersion: v2\nname: x\nversion: 0.1.0\nappVersion: "0.1.0"\n', "1.2.3-rc.1")
    assert yaml.safe_load(text) == {"apiVersion": "v2", "name": "x", "version": "1.2.3-rc.1", "appVersion": "1.2.3-rc.1"}


VALUES = """\
image:
  # -- Image repository.
  repository: localhost/ddp-operator
  # -- Tag.
  tag: ""
  # -- Digest.
  digest: ""
  pullPolicy: IfNotPresent

# -- Something else at the same indentation, with a digest of its own.
other:
  digest: ""

store:
  image:
    repository: localhost/ddp-store
    tag: ""

diagnostics:
  image:
    # -- Empty: the operator's.
    repository: ""
    digest: ""
"""


def test_the_chart_is_pinned_to_the_pushed_images_and_nothing_else():
    pinned = yaml.safe_load(release_chart.pin_images(VALUES, {
        "operator": ("ghcr.io/acme/ddp-operator", DIGEST), "store": ("ghcr.io/acme/ddp-store", DIGEST),
        "trainer": ("ghcr.io/acme/ddp-trainer", DIGEST)}))
    assert pinned["image"] == {"repository": "ghcr.io/acme/ddp-operator", "tag": "", "digest": DIGEST,
                               "pullPolicy": "IfNotPresent"}
    assert pinned["store"] == {"image": {"repository": "ghcr.io/acme/ddp-store", "tag": ""}}  # no digest key: none
    assert pinned["other"] == {"digest": ""} and pinned["diagnostics"] == {"image": {"repository": "", "digest": ""}}
    assert "# -- Image repository." in release_chart.pin_images(VALUES, {"operator": ("r/ddp-operator", DIGEST)})


def test_a_chart_without_the_operators_block_is_refused():
    with pytest.raises(BuildError, match="localhost/ddp-operator"):
        release_chart.pin_images(VALUES.replace("localhost/ddp-operator", "example/op"), {"operator": ("r", DIGEST)})


RENDERED = f"""---
apiVersion: apps/v1
kind: Deployment
spec:
  template:
    spec:
      containers:
        - name: operator
          image: "reg/ddp-operator:1.0.0@{DIGEST}"
          env:
            - name: DDPJOB_DIAGNOSTICS_IMAGE
              value: "localhost/ddp-operator:1.0.0"
"""


def test_a_rendered_chart_naming_a_local_image_is_refused():
    assert release_chart.rendered_images(RENDERED) == {f"reg/ddp-operator:1.0.0@{DIGEST}",
                                                       "localhost/ddp-operator:1.0.0"}
    with pytest.raises(BuildError, match="locally built images"):
        release_chart.check_rendered(RENDERED, f"reg/ddp-operator:1.0.0@{DIGEST}")
    with pytest.raises(BuildError, match="does not install"):
        release_chart.check_rendered(RENDERED, "reg/ddp-operator:2.0.0")
    release_chart.check_rendered(RENDERED.replace("localhost/", "reg/"), f"reg/ddp-operator:1.0.0@{DIGEST}")
    # a description that mentions a local image (the CRD's) is no image
    release_chart.check_rendered(RENDERED.replace("localhost/", "reg/") + "  description: e.g. localhost/ddp-x:1.\n",
                                 f"reg/ddp-operator:1.0.0@{DIGEST}")


def test_manifests_start_with_the_namespace_then_the_charts_objects():
    text = release_chart.manifests("apiVersion: v1\nkind: Namespace\nmetadata: {name: ddp-system}\n", RENDERED,
                                   "1.0.0", "oci://reg/charts/ddp-operator")
    docs = [d for d in yaml.safe_load_all(text) if d]
    assert [d["kind"] for d in docs] == ["Namespace", "Deployment"]
    assert text.startswith("# DDPJob 1.0.0") and "kubectl apply --server-side -f manifests.yaml" in text


def test_crane_progress_counts_uploads_and_reuses():
    said = ("2026/12/06 existing blob: sha256:aa\n2026/12/06 pushed blob: sha256:bb\n"
            "2026/12/06 mounted blob: sha256:cc\n2026/12/06 pushed blob: sha256:dd\n")
    assert release_images.pushed_blobs(said) == (2, 2)


def test_only_this_machines_registries_are_plain_http():
    assert release_images.loopback("127.0.0.1:5000/ddpjob") and release_images.loopback("localhost:5000")
    assert not release_images.loopback("ghcr.io/acme") and not release_images.loopback("registry.example:443/x")


def test_registry_config_is_loopback_only_with_deletes_for_the_tests():
    cfg = yaml.safe_load(registry.config_text(5000, common.CACHE / "x", "s3cret"))
    assert cfg["http"]["addr"] == "127.0.0.1:5000"
    assert cfg["storage"]["filesystem"]["rootdirectory"] == str(common.CACHE / "x")
    assert cfg["storage"]["delete"]["enabled"] is True


def test_containerd_reads_registry_hosts_from_the_clusters_config_directory():
    hosts = tomllib.loads(registry.hosts_toml("127.0.0.1:5000"))
    assert hosts["server"] == "http://127.0.0.1:5000"
    assert hosts["host"]["http://127.0.0.1:5000"]["capabilities"] == ["pull", "resolve"]
    embedded = tomllib.loads(common.containerd_config("p", "/cni", systemd_cgroup=False, restrict_oom_score_adj=False,
                                                      private=True, registry_hosts=common.REGISTRY_HOSTS_DIR))
    cri = embedded["plugins"]["io.containerd.grpc.v1.cri"]
    assert cri["registry"]["config_path"] == str(common.REGISTRY_HOSTS_DIR)
    kind = tomllib.loads(common.containerd_config("p", "/cni", systemd_cgroup=True, restrict_oom_score_adj=False,
                                                  private=False))
    assert "registry" not in kind["plugins"]["io.containerd.grpc.v1.cri"]  # a kind node keeps kind's own
