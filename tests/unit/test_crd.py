"""The CRD: generated copies match the source, every field is described, rules are well-formed."""

import yaml

from ddp_operator import crd, names


def _walk(schema, path="$"):
    yield path, schema
    for key, sub in schema.get("properties", {}).items():
        yield from _walk(sub, f"{path}.{key}")
    if "items" in schema:
        yield from _walk(schema["items"], f"{path}[]")
    if isinstance(schema.get("additionalProperties"), dict):
        yield from _walk(schema["additionalProperties"], f"{path}{{}}")


def _schema():
    return crd.build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def test_generated_copies_are_current():
    assert crd.main(["--check"]) == 0, "run `python -m ddp_operator.crd --write`"


def test_copies_load_as_the_same_object():
    for path in crd.COPIES:
        assert yaml.safe_load(path.read_text()) == crd.build_crd()
    # The chart's copy: the same object behind crds.enabled, kept when its release is uninstalled.
    lines = crd.CHART_TEMPLATE.read_text().splitlines()
    assert lines[1] == "{{- if .Values.crds.enabled }}" and lines[-1] == "{{- end }}"
    chart = yaml.safe_load("\n".join(lines[2:-1]))
    assert chart["metadata"].pop("annotations") == {"helm.sh/resource-policy": "keep"}
    assert chart == crd.build_crd()


def test_every_field_has_a_description():
    missing = [p for p, s in _walk(_schema())
               if "description" not in s and not p.endswith("{}") and p != "$.metadata"]
    assert missing == []


def test_every_rule_has_a_message_naming_a_field():
    rules = [r for _, s in _walk(_schema()) for r in s.get("x-kubernetes-validations", [])]
    assert len(rules) >= 15
    for r in rules:
        assert "spec." in r["message"] or "metadata.name" in r["message"], r


def test_fixed_names():
    c = crd.build_crd()
    assert c["metadata"]["name"] == "ddpjobs.ddp.dev"
    assert c["spec"]["names"]["shortNames"] == ["ddpj"]
    v = c["spec"]["versions"][0]
    assert v["name"] == "v1alpha1"
    assert v["subresources"]["scale"]["specReplicasPath"] == ".spec.nodes"
    cols = [col["name"] for col in v["additionalPrinterColumns"]]
    assert cols[:5] == ["Phase", "Nodes", "Restarts", "Progress", "Age"]


def test_name_limit_keeps_pod_names_within_63():
    longest = "a" * names.MAX_NAME_LENGTH
    assert len(f"{longest}-{names.RDZV_POD_SUFFIX}") <= 63
    assert len(f"{longest}-{names.MAX_NODES - 1}") <= 63


def test_defaults_in_schema_match_spec_defaults():
    spec = _schema()["properties"]["spec"]["properties"]
    for section in ("torchrun", "failurePolicy", "runPolicy"):
        for key, value in crd.DEFAULTS[section].items():
            assert spec[section]["properties"][key]["default"] == value, (section, key)
