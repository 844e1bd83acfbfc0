"""The Kubernetes manifests in deploy/k8s/ are valid Kubernetes and agree with the code.

Rendering, twice. ``render`` below builds a kustomization itself, implementing only what
ours use (``resources``, ``namespace``, ``images``, ``secretGenerator`` from files with a
fixed name, ``patches`` of JSON 6902 operations); anything else in a kustomization.yaml
fails the test, naming the field, rather than being rendered wrongly. It is kept because it
needs nothing installed, so the schema validation and the checks against the code run on
every machine. The real kustomize (``kubectl kustomize``, built into kubectl) renders base
and overlay too, in a temporary copy of deploy/k8s; its objects are validated like the
hand-rendered ones, and ``test_kubectl_kustomize_renders_what_the_test_renders`` asserts
both renderers give the same objects, so neither drifts. Without kubectl that comparison is
skipped with a reason naming the package to install (run pytest with ``-rs`` to see it);
nothing else is. The overlay's Secret files are git-ignored, so the test supplies them
(``SECRET_FILES``: in memory for ``render``, written into the temporary copy for kubectl,
never into the checkout).

Then every object of the base and of the rendered overlays is validated: built-in kinds
against the Kubernetes JSON schemas of ``KUBERNETES_VERSION`` (kubernetes-validate,
strict: unknown fields are errors), custom resources against the openAPIV3Schema of their
CRD vendored in tests/data (``CRDS``; ``validate_custom_resource`` says what it checks).

Each ``check_*`` raises AssertionError when the manifests and the code disagree;
``test_each_check_catches_its_breakage`` breaks the rendered manifests one way per check
and proves the check notices; the schema and comparison tests are broken on purpose too.
"""

from __future__ import annotations

import base64
import contextlib
import copy
import io
import re
import shutil
import subprocess
import tempfile
import tomllib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from backend.cli import build_parser, main
from backend.cli.options import node_settings
from backend.config import NodeConfig, PoolConfig
from backend.lmcache.config import remote_url_pool_config, url_config_key
from backend.node.store.tiers import ARENA_MIN_SLACK_BYTES, ARENA_SLACK
from backend.shm import HEADER_BYTES
from tests.conftest import REPO

K8S = REPO / "deploy" / "k8s"
BASE = K8S / "base"
OVERLAY = K8S / "overlays" / "example"
KUBERNETES_VERSION = "1.33.0"  # schemas shipped by kubernetes-validate; the manifests use only GA APIs
# Custom resources: the CRD whose schema each is validated against (tests/data/*: source, version, license inside).
CRDS = {("monitoring.coreos.com/v1", "ServiceMonitor"): REPO / "tests" / "data" / "servicemonitor-crd-v0.93.0.yaml"}
KUBECTL = shutil.which("kubectl")
KUBECTL_MISSING = (
    "kubectl is not installed, so NO real kustomize rendered deploy/k8s (only the test's own renderer did): "
    "install the `kubectl` package (Kubernetes apt repository pkgs.k8s.io, or Google Cloud SDK's kubectl); "
    "kustomize is built into it"
)
# What a node process needs beside its DRAM arena. Measured: 56 MiB idle, 120 MiB after 640 MiB of
# puts through a 256 MiB DRAM tier with NVMe (docs/deploy.md#sizing); 512 MiB leaves room.
NODE_OVERHEAD_BYTES = 512 * 1024**2
# What the kubelet would put in the node's downward-API variables, for the flags that name them.
DOWNWARD = {"status.podIP": "10.1.2.3", "metadata.name": "kvpool-node-0", "metadata.namespace": "kvpool"}
SECRET_FILES = {"secrets/token": b"t0ken-from-the-test\n", "secrets/redis-password": b"redis-pw-from-the-test\n"}
KUSTOMIZATION_FIELDS = {"apiVersion", "kind", "resources", "namespace", "images", "secretGenerator", "patches"}

Obj = dict[str, Any]


# --- rendering -------------------------------------------------------------------------


def render(directory: Path, secret_files: dict[str, bytes] | None = None) -> list[Obj]:
    """The objects ``kustomize build directory`` gives, for the subset of kustomize we use."""
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unknown = set(kustomization) - KUSTOMIZATION_FIELDS
    assert not unknown, f"{directory}/kustomization.yaml: {sorted(unknown)} not implemented by the test's renderer"
    objects: list[Obj] = []
    for resource in kustomization.get("resources", []):
        path = (directory / resource).resolve()
        if path.is_dir():
            objects += render(path, secret_files)
        else:
            objects += [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
    for generator in kustomization.get("secretGenerator", []):
        objects.append(_generate_secret(directory, generator, secret_files or {}))
    for patch in kustomization.get("patches", []):
        _apply_patch(directory, patch, objects)
    for image in kustomization.get("images", []):
        _set_image(objects, image)
    if "namespace" in kustomization:
        for obj in objects:
            obj["metadata"]["namespace"] = kustomization["namespace"]
    return objects


def _generate_secret(directory: Path, generator: Obj, secret_files: dict[str, bytes]) -> Obj:
    assert set(generator) <= {"name", "files", "options"}, f"secretGenerator: {sorted(generator)} not implemented"
    assert generator.get("options", {}).get("disableNameSuffixHash") is True, (
        "secretGenerator: a hashed name is not implemented by the test's renderer"
    )
    data = {}
    for entry in generator["files"]:
        key, _, path = entry.partition("=")
        content = secret_files.get(path)
        if content is None:
            content = (directory / path).read_bytes()  # kustomize fails the same way when it is missing
        data[key] = base64.b64encode(content).decode()
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": generator["name"]},
        "type": "Opaque",
        "data": data,
    }


def _apply_patch(directory: Path, patch: Obj, objects: list[Obj]) -> None:
    assert set(patch) == {"path", "target"}, f"patches: only path + target is implemented, got {sorted(patch)}"
    operations = yaml.safe_load((directory / patch["path"]).read_text())
    assert isinstance(operations, list), f"{patch['path']}: only JSON 6902 patches (a list of operations) are rendered"
    targets = [o for o in objects if all(_field(o, k) == v for k, v in patch["target"].items())]
    assert targets, f"{patch['path']}: no object matches {patch['target']}"
    for obj in targets:
        for operation in operations:
            _json_patch(obj, operation)


def _field(obj: Obj, key: str) -> Any:
    return obj["metadata"].get(key) if key in ("name", "namespace") else obj.get(key)


def _json_patch(obj: Obj, operation: Obj) -> None:
    """RFC 6902 add / remove / replace, which is all the overlay uses."""
    op, pointer = operation["op"], operation["path"]
    *parents, last = [p.replace("~1", "/").replace("~0", "~") for p in pointer.split("/")[1:]]
    node: Any = obj
    for part in parents:
        node = node[int(part)] if isinstance(node, list) else node[part]
    if isinstance(node, list):
        index = len(node) if last == "-" else int(last)
        if op == "add":
            node.insert(index, operation["value"])
        elif op == "remove":
            del node[index]
        elif op == "replace":
            node[index] = operation["value"]
        else:
            raise AssertionError(f"JSON patch op {op!r} not implemented")
    elif op in ("add", "replace"):
        assert op == "add" or last in node, f"replace of missing {pointer}"
        node[last] = operation["value"]
    elif op == "remove":
        del node[last]
    else:
        raise AssertionError(f"JSON patch op {op!r} not implemented")


def _set_image(objects: list[Obj], image: Obj) -> None:
    for pod in (_pod_spec(o) for o in objects):
        for container in (pod or {}).get("containers", []) + (pod or {}).get("initContainers", []):
            name, _, tag = container["image"].partition(":")
            if name == image["name"]:
                container["image"] = f"{image.get('newName', name)}:{image.get('newTag', tag)}"


def kubectl_render(directory: Path, secret_files: dict[str, bytes] | None = None) -> list[Obj]:
    """``kubectl kustomize directory``: the real kustomize, on a temporary copy of deploy/k8s.

    The copy leaves out whatever secret files this checkout has and holds ``secret_files``
    instead (paths relative to ``directory``), so neither is read from nor written to the
    checkout. Raises AssertionError with kustomize's message when it refuses to build.
    """
    assert KUBECTL is not None, KUBECTL_MISSING
    with tempfile.TemporaryDirectory() as tmp:
        copy_root = Path(tmp) / "k8s"
        shutil.copytree(
            K8S,
            copy_root,
            ignore=lambda folder, names: [n for n in names if Path(folder).name == "secrets" and n != ".gitignore"],
        )
        target = copy_root / directory.relative_to(K8S)
        for path, content in (secret_files or {}).items():
            (target / path).write_bytes(content)
        built = subprocess.run(
            [KUBECTL, "kustomize", str(target)], capture_output=True, text=True, timeout=60, check=False
        )
    assert built.returncode == 0, f"kubectl kustomize {directory.relative_to(REPO)}: {built.stderr.strip()}"
    return [doc for doc in yaml.safe_load_all(built.stdout) if doc]


def _identity(obj: Obj) -> tuple[str, str, str, str]:
    return obj["apiVersion"], obj["kind"], obj["metadata"].get("namespace", ""), obj["metadata"]["name"]


def check_same_objects(ours: list[Obj], kustomize: list[Obj]) -> None:
    """The same objects, field for field, in any order (kustomize sorts them by kind)."""
    by_ours, by_kustomize = {_identity(o): o for o in ours}, {_identity(o): o for o in kustomize}
    assert len(by_ours) == len(ours) and len(by_kustomize) == len(kustomize), "two objects of the same identity"
    assert by_ours.keys() == by_kustomize.keys(), (
        f"only the test renders {sorted(by_ours.keys() - by_kustomize.keys())}, "
        f"only kustomize renders {sorted(by_kustomize.keys() - by_ours.keys())}"
    )
    differ = [key for key in by_ours if by_ours[key] != by_kustomize[key]]
    assert not differ, f"the test's renderer and kustomize disagree on {differ}"


# --- custom resources against their CRD ------------------------------------------------


def _crd(api_version: str, kind: str) -> tuple[Obj, Obj]:
    """(the CRD, its version entry) for ``apiVersion``/``kind``, from the file ``CRDS`` names."""
    crd = next(d for d in yaml.safe_load_all(CRDS[(api_version, kind)].read_text()) if d)
    group, _, version = api_version.rpartition("/")
    assert (crd["spec"]["group"], crd["spec"]["names"]["kind"]) == (group, kind), f"{CRDS[(api_version, kind)]}"
    versions = [v for v in crd["spec"]["versions"] if v["name"] == version and v["served"]]
    assert versions, f"the {kind} CRD serves no version {version}"
    return crd, versions[0]


def _as_api_server(schema: Obj) -> Obj:
    """A CRD structural schema as a Draft 4 JSON schema that refuses what the API server would.

    An object schema without ``additionalProperties`` nor ``x-kubernetes-preserve-unknown-fields``
    gets ``additionalProperties: false``: the API server prunes such unknown fields, and
    kubectl's default field validation (Strict) refuses the object. ``nullable`` admits null,
    ``x-kubernetes-int-or-string`` an integer or a string, ``x-kubernetes-list-type: set``
    unique items. Not checked: ``format``, ``x-kubernetes-list-map-keys`` uniqueness,
    ``x-kubernetes-validations`` (CEL; this CRD has none), defaulting.
    """
    out = dict(schema)
    if "properties" in out:
        out["properties"] = {name: _as_api_server(sub) for name, sub in out["properties"].items()}
    for key in ("additionalProperties", "items", "not"):
        if isinstance(out.get(key), dict):
            out[key] = _as_api_server(out[key])
    for key in ("allOf", "anyOf", "oneOf"):
        if key in out:
            out[key] = [_as_api_server(sub) for sub in out[key]]
    if (
        out.get("type") == "object"
        and "additionalProperties" not in out
        and not out.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    if out.get("x-kubernetes-int-or-string"):
        out.setdefault("type", ["integer", "string"])
    if out.get("nullable") and isinstance(out.get("type"), str):
        out["type"] = [out["type"], "null"]
    if out.get("x-kubernetes-list-type") == "set":
        out["uniqueItems"] = True
    return out


def validate_custom_resource(obj: Obj) -> None:
    """``obj`` against its CRD's openAPIV3Schema (``_as_api_server``) and its metadata as an ObjectMeta.

    Raises jsonschema.ValidationError. The root ``metadata`` is only ``type: object`` in a CRD:
    the API server checks it as an ObjectMeta, so here kubernetes-validate does (strict).
    """
    _, version = _crd(obj["apiVersion"], obj["kind"])
    schema = _as_api_server(version["schema"]["openAPIV3Schema"])
    schema["properties"]["metadata"] = {"type": "object"}
    jsonschema.Draft4Validator(schema).validate(obj)
    holder = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": obj["metadata"]}
    kubernetes_validate.validate(holder, KUBERNETES_VERSION, strict=True)


def validate(obj: Obj) -> None:
    """Any object of ours: a custom resource against its CRD, the rest against Kubernetes' schemas."""
    if (obj["apiVersion"], obj["kind"]) in CRDS:
        validate_custom_resource(obj)
    else:
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)


# --- reading the objects ---------------------------------------------------------------


def _pod_spec(obj: Obj) -> Obj | None:
    return obj.get("spec", {}).get("template", {}).get("spec") if obj["kind"] in ("StatefulSet", "Deployment") else None


def _one(objects: list[Obj], kind: str, name: str) -> Obj:
    found = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name}, found {len(found)}"
    return found[0]


def _container(objects: list[Obj], kind: str, name: str) -> tuple[Obj, Obj, Obj]:
    """(workload, pod spec, first container)."""
    workload = _one(objects, kind, name)
    pod = _pod_spec(workload)
    assert pod is not None
    return workload, pod, pod["containers"][0]


def _env(container: Obj) -> dict[str, str]:
    """The container's variables as the kubelet sets them (downward API from ``DOWNWARD``)."""
    env = {}
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = var["value"]
        else:
            path = var["valueFrom"]["fieldRef"]["fieldPath"]
            assert path in DOWNWARD, f"env {var['name']}: the test has no value for fieldRef {path}"
            env[var["name"]] = DOWNWARD[path]
    return env


def _expand(word: str, env: dict[str, str]) -> str:
    """The kubelet's ``$(VAR)`` expansion of command and args; an unknown VAR would stay as written."""

    def value(match: re.Match[str]) -> str:
        assert match.group(1) in env, f"{word!r}: $({match.group(1)}) is not a variable of the container"
        return env[match.group(1)]

    return re.sub(r"\$\((\w+)\)", value, word)


def _mounted_files(objects: list[Obj], pod: Obj, container: Obj) -> dict[str, bytes]:
    """Every file the container sees from a Secret volume: its path -> its bytes."""
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    files = {}
    for mount in container.get("volumeMounts", []):
        volume = volumes.get(mount["name"])  # None: a StatefulSet's claim template (check_node_nvme)
        if volume is None or "secret" not in volume:
            continue
        secret = _one(objects, "Secret", volume["secret"]["secretName"])
        items = volume["secret"].get("items") or [{"key": k, "path": k} for k in secret["data"]]
        for item in items:
            assert item["key"] in secret["data"], f"Secret {secret['metadata']['name']} has no key {item['key']!r}"
            files[f"{mount['mountPath']}/{item['path']}"] = base64.b64decode(secret["data"][item["key"]])
    return files


def _volume_at(pod: Obj, container: Obj, path: str) -> Obj:
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    for mount in container.get("volumeMounts", []):
        if mount["mountPath"] == path:
            return volumes.get(mount["name"]) or {"name": mount["name"], "claimTemplate": True}
    raise AssertionError(f"nothing is mounted at {path}")


def _materialize(files: dict[str, bytes], path: str, tmp: Path) -> Path:
    """A local copy of the mounted file ``path``, or an error naming it if the pod does not mount it."""
    assert path in files, f"{path} is not a file the pod mounts from a Secret (mounted: {sorted(files)})"
    local = tmp / path.strip("/").replace("/", "_")
    local.write_bytes(files[path])
    return local


UNITS = {"Ki": 1024, "Mi": 1024**2, "Gi": 1024**3, "Ti": 1024**4, "k": 1000, "M": 1000**2, "G": 1000**3, "T": 1000**4}


def quantity_bytes(text: str | int) -> int:
    match = re.fullmatch(r"(\d+)(Ki|Mi|Gi|Ti|k|M|G|T)?", str(text))
    assert match, f"{text!r}: a memory quantity this test does not read"
    return int(match.group(1)) * UNITS.get(match.group(2) or "", 1)


# --- the node, as its own parser reads it ----------------------------------------------


def node_config(objects: list[Obj], tmp: Path) -> tuple[NodeConfig, Obj, Obj]:
    """The NodeConfig the node StatefulSet's container builds, through the real ``kvpool node`` parser."""
    _, pod, container = _container(objects, "StatefulSet", "kvpool-node")
    env = _env(container)
    argv = [_expand(w, env) for w in container["command"] + container.get("args", [])]
    assert argv[:2] == ["kvpool", "node"], f"the node container runs {argv[:2]}, not kvpool node"
    args = build_parser().parse_args(argv[1:])
    args.environ = env
    settings = node_settings(args)
    files = _mounted_files(objects, pod, container)
    for name in ("token_file", "redis_password_file"):
        assert settings[name] is not None, f"the node is given no --{name.replace('_', '-')}"
        settings[name] = _materialize(files, str(settings[name]), tmp)
    return NodeConfig.from_options(settings), pod, container


def check_node_flags(objects: list[Obj], tmp: Path) -> None:
    config, _, _ = node_config(objects, tmp)
    secret = _one(objects, "Secret", "kvpool-secrets")
    assert config.token == base64.b64decode(secret["data"]["token"]).decode().strip()
    assert config.redis_password == base64.b64decode(secret["data"]["redis-password"]).decode().strip()
    assert config.host == "0.0.0.0", "a node must listen beyond the pod's loopback"
    assert config.advertise_host == DOWNWARD["status.podIP"], "a node must advertise an address clients reach"
    assert config.metrics_port and config.metrics_host == "0.0.0.0", "the probes and Prometheus need the metrics port"


def check_node_memory(objects: list[Obj], tmp: Path) -> None:
    config, pod, container = node_config(objects, tmp)
    arena = config.dram_bytes + max(int(config.dram_bytes * ARENA_SLACK), ARENA_MIN_SLACK_BYTES) + HEADER_BYTES
    assert config.shm_dir is not None, "the node keeps DRAM in /dev/shm here"
    shm = _volume_at(pod, container, str(config.shm_dir))
    assert shm.get("emptyDir", {}).get("medium") == "Memory", f"{config.shm_dir} must be a memory-backed emptyDir"
    size_limit = quantity_bytes(shm["emptyDir"]["sizeLimit"])
    assert size_limit >= arena, (
        f"/dev/shm sizeLimit {size_limit} < the DRAM arena {arena} of --dram {config.dram_bytes}"
    )
    resources = container["resources"]
    request = quantity_bytes(resources["requests"]["memory"])
    limit = quantity_bytes(resources["limits"]["memory"])
    need = arena + NODE_OVERHEAD_BYTES  # the arena's pages are charged to the container's memory
    assert request >= need, f"memory request {request} < arena {arena} + process {NODE_OVERHEAD_BYTES}"
    assert limit >= request, f"memory limit {limit} < request {request}"


def check_node_nvme(objects: list[Obj], tmp: Path) -> None:
    config, pod, container = node_config(objects, tmp)
    assert config.nvme_dir is not None and config.nvme_bytes > 0, "the node has no NVMe tier"
    volume = _volume_at(pod, container, str(config.nvme_dir))
    if "hostPath" in volume:
        assert volume["hostPath"].get("type") == "Directory", "a missing NVMe directory must fail the pod"
        return
    assert volume.get("claimTemplate"), f"{config.nvme_dir} is neither a hostPath nor a claim template"
    statefulset = _one(objects, "StatefulSet", "kvpool-node")
    claims = {c["metadata"]["name"]: c for c in statefulset["spec"].get("volumeClaimTemplates", [])}
    mount = next(m for m in container["volumeMounts"] if m["mountPath"] == str(config.nvme_dir))
    assert mount["name"] in claims, f"volumeMount {mount['name']} names no volume nor claim template"
    storage = quantity_bytes(claims[mount["name"]]["spec"]["resources"]["requests"]["storage"])
    assert storage >= config.nvme_bytes, f"the NVMe claim {storage} is smaller than --nvme {config.nvme_bytes}"


def check_node_probes(objects: list[Obj], tmp: Path) -> None:
    config, _, container = node_config(objects, tmp)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}

    def probe(name: str) -> tuple[int, str]:
        get = container[name]["httpGet"]
        return (ports[get["port"]] if isinstance(get["port"], str) else get["port"]), get["path"]

    assert probe("readinessProbe") == (config.metrics_port, "/health")
    # Liveness must not be /health: it is 503 while Redis is away, and a restart loses DRAM.
    assert probe("livenessProbe") == (config.metrics_port, "/metrics")
    assert probe("startupProbe") == (config.metrics_port, "/metrics")
    assert ports["kvpool"] == config.port
    statefulset = _one(objects, "StatefulSet", "kvpool-node")
    annotations = statefulset["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/port"] == str(config.metrics_port)
    assert annotations["prometheus.io/path"] == "/metrics"


def check_services(objects: list[Obj], tmp: Path) -> None:
    """The node Service and ServiceMonitor reach the metrics port; the PDB covers the node pods."""
    statefulset, _, container = _container(objects, "StatefulSet", "kvpool-node")
    pod_labels = statefulset["spec"]["template"]["metadata"]["labels"]
    service = _one(objects, "Service", statefulset["spec"]["serviceName"])
    assert service["spec"]["selector"].items() <= pod_labels.items(), "the node Service selects no node pod"
    container_ports = {p["name"] for p in container["ports"]}
    for port in service["spec"]["ports"]:
        assert port["targetPort"] in container_ports, f"Service port {port['name']} targets no container port"
    pdb = _one(objects, "PodDisruptionBudget", "kvpool-node")
    assert pdb["spec"]["selector"]["matchLabels"].items() <= pod_labels.items(), "the PDB selects no node pod"
    for monitor in (o for o in objects if o["kind"] == "ServiceMonitor"):
        assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
        names = {p["name"] for p in service["spec"]["ports"]}
        for endpoint in monitor["spec"]["endpoints"]:
            assert endpoint["port"] in names, f"ServiceMonitor endpoint port {endpoint['port']!r} is not a Service port"
            assert endpoint.get("path", "/metrics") == "/metrics"


def check_redis(objects: list[Obj], tmp: Path) -> None:
    """The nodes' --redis is the Redis Service, whose pods read the password from the same Secret key."""
    config, _, _ = node_config(objects, tmp)
    match = re.fullmatch(r"redis://([\w.-]+):(\d+)", config.redis_url)
    assert match, f"--redis {config.redis_url}: expected redis://SERVICE:PORT for the bundled Redis"
    service = _one(objects, "Service", match.group(1))
    assert int(match.group(2)) in {p["port"] for p in service["spec"]["ports"]}
    _, pod, redis = _container(objects, "StatefulSet", "kvpool-redis")
    files = _mounted_files(objects, pod, redis)
    script = " ".join(redis["args"])
    read = re.search(r"requirepass %s\\n' \"\$\(cat ([^)]+)\)\"", script)
    assert read, "redis-server is given no requirepass from a file"
    assert files.get(read.group(1)) is not None, f"Redis reads its password from {read.group(1)}, which is not mounted"
    assert files[read.group(1)].decode().strip() == config.redis_password, "Redis and the nodes use other passwords"


def _lmcache_config_output(url: str, *form: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["lmcache-config", "--url", url, *form, "--offline"]) == 0  # no cluster here to check
    return out.getvalue()


def check_engine_config(objects: list[Obj], tmp: Path) -> None:
    """The ConfigMap is ``kvpool lmcache-config``'s output, loads in LMCache, and reaches the nodes' pool."""
    from lmcache.v1.config import load_engine_config_with_overrides

    node, _, _ = node_config(objects, tmp)
    data = _one(objects, "ConfigMap", "kvpool-lmcache")["data"]
    plugin_yaml, remote_url_yaml = data["lmcache.yaml"], data["lmcache-remote-url.yaml"]
    url = yaml.safe_load(plugin_yaml)["extra_config"][url_config_key()]
    assert plugin_yaml == _lmcache_config_output(url), "lmcache.yaml is not what kvpool lmcache-config prints"
    assert remote_url_yaml == _lmcache_config_output(url, "--form", "remote_url"), (
        "lmcache-remote-url.yaml is not what kvpool lmcache-config --form remote_url prints"
    )
    # The engine: its variables name files of the Secret it mounts.
    _, pod, engine = _container(objects, "Deployment", "vllm-example")
    env = _env(engine)
    files = _mounted_files(objects, pod, engine)
    for name in ("KVPOOL_TOKEN_FILE", "KVPOOL_REDIS_PASSWORD_FILE"):
        assert name in env, f"the engine is given no {name}"
        env[name] = str(_materialize(files, env[name], tmp))
    config_file = Path(env["LMCACHE_CONFIG_FILE"])
    mount = next(m for m in engine["volumeMounts"] if m["mountPath"] == str(config_file.parent))
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    assert volume["configMap"]["name"] == "kvpool-lmcache"
    assert config_file.name in data, f"LMCACHE_CONFIG_FILE names {config_file.name}, not a key of kvpool-lmcache"
    redis_service = re.fullmatch(r"redis://([\w.-]+):(\d+)", node.redis_url)
    assert redis_service
    namespace = _one(objects, "Service", redis_service.group(1))["metadata"].get("namespace", "default")
    for key, text in data.items():
        local = tmp / key
        local.write_text(text)
        loaded = load_engine_config_with_overrides(str(local))
        if loaded.remote_url:
            pool = remote_url_pool_config(loaded.remote_url, env)
        else:
            pool = PoolConfig.from_url(loaded.extra_config[url_config_key()], env)
        assert pool.namespace == node.namespace, f"{key}: pool namespace {pool.namespace} != node --namespace"
        assert (pool.redis_host, str(pool.redis_port)) == (
            f"{redis_service.group(1)}.{namespace}.svc.cluster.local",
            redis_service.group(2),
        ), f"{key}: the engines' Redis is not the nodes' Redis Service"
        assert pool.token == node.token, f"{key}: the engine's token is not the nodes'"
        assert pool.redis_password == node.redis_password, f"{key}: the engine's Redis password is not the nodes'"


def check_image_version(objects: list[Obj], tmp: Path) -> None:
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    _, _, container = _container(objects, "StatefulSet", "kvpool-node")
    assert container["image"].endswith(f"kvpool-node:{version}"), f"{container['image']} is not kvpool-node:{version}"


CHECKS: list[Callable[[list[Obj], Path], None]] = [
    check_node_flags,
    check_node_memory,
    check_node_nvme,
    check_node_probes,
    check_services,
    check_redis,
    check_engine_config,
    check_image_version,
]


def _rendered() -> dict[str, list[Obj]]:
    """The objects of base and overlay by the test's renderer and, with kubectl, by kustomize."""
    renders = {"base": render(BASE), "overlay": render(OVERLAY, SECRET_FILES)}
    if KUBECTL is not None:
        renders |= {"kubectl-base": kubectl_render(BASE), "kubectl-overlay": kubectl_render(OVERLAY, SECRET_FILES)}
    # The base names the Secret the overlay makes: give it the same one to check it on its own.
    secret = _one(renders["overlay"], "Secret", "kvpool-secrets")
    for where in ("base", "kubectl-base"):
        if where in renders:
            renders[where].append(copy.deepcopy(secret))
    return renders


@pytest.fixture(scope="module")
def rendered(processes: None) -> dict[str, list[Obj]]:
    return _rendered()


def _schema_cases() -> Iterator[Any]:
    for where, objects in _rendered().items():
        for obj in objects:
            yield pytest.param(obj, id=f"{where}-{obj['kind']}-{obj['metadata']['name']}")


# --- the tests -------------------------------------------------------------------------


@pytest.mark.parametrize("obj", _schema_cases())
def test_every_manifest_validates_against_its_schema(obj: Obj) -> None:
    validate(obj)


def test_every_custom_resource_has_its_crd(rendered: dict[str, list[Obj]]) -> None:
    kinds = {(o["apiVersion"], o["kind"]) for objects in rendered.values() for o in objects}
    for api_version, kind in kinds - CRDS.keys():
        group = api_version.rpartition("/")[0]
        builtin = "." not in group or group.endswith(".k8s.io")
        assert builtin, f"{kind} ({api_version}) is a custom resource: vendor its CRD in tests/data, name it in CRDS"
    assert CRDS.keys() <= kinds, "CRDS names a kind no manifest has"


@pytest.mark.parametrize("kind", sorted(CRDS), ids=lambda k: k[1])
def test_vendored_crd_is_a_valid_crd(kind: tuple[str, str]) -> None:
    crd, version = _crd(*kind)
    kubernetes_validate.validate(crd, KUBERNETES_VERSION, strict=True)
    assert version["storage"] and "openAPIV3Schema" in version["schema"]


@pytest.mark.usefixtures("processes")
@pytest.mark.parametrize("where", ["base", "overlay"])
def test_kubectl_kustomize_renders_what_the_test_renders(where: str) -> None:
    if KUBECTL is None:
        pytest.skip(KUBECTL_MISSING)
    directory, secret_files = {"base": (BASE, None), "overlay": (OVERLAY, SECRET_FILES)}[where]
    ours, kustomize = render(directory, secret_files), kubectl_render(directory, secret_files)
    check_same_objects(ours, kustomize)
    # The comparison bites: one changed field anywhere fails it.
    changed = copy.deepcopy(ours)
    _one(changed, "StatefulSet", "kvpool-node")["spec"]["replicas"] += 1
    with pytest.raises(AssertionError, match="kvpool-node"):
        check_same_objects(changed, kustomize)


@pytest.mark.usefixtures("processes")
def test_kubectl_kustomize_refuses_the_overlay_without_its_secret_files() -> None:
    if KUBECTL is None:
        pytest.skip(KUBECTL_MISSING)
    with pytest.raises(AssertionError, match="secrets/token"):
        kubectl_render(OVERLAY)


@pytest.mark.parametrize(
    ("where", "check"),
    # The example engine is in the overlay only: its config is checked there.
    [(w, c) for w in ("base", "overlay") for c in CHECKS if not (c is check_engine_config and w == "base")],
    ids=lambda v: v if isinstance(v, str) else v.__name__,
)
def test_manifests_agree_with_the_code(rendered: dict[str, list[Obj]], where: str, check: Any, tmp_path: Path) -> None:
    check(rendered[where], tmp_path)


def test_overlay_changes_what_it_says(rendered: dict[str, list[Obj]], tmp_path: Path) -> None:
    """The renderer applied the overlay: hostPath NVMe, 16 GiB DRAM, the registry image, its namespace."""
    base, _, _ = node_config(rendered["base"], tmp_path)
    overlay, pod, container = node_config(rendered["overlay"], tmp_path)
    assert (base.dram_bytes, overlay.dram_bytes) == (4 * 1024**3, 16 * 1024**3)
    assert "hostPath" in _volume_at(pod, container, str(overlay.nvme_dir))
    assert "volumeClaimTemplates" not in _one(rendered["overlay"], "StatefulSet", "kvpool-node")["spec"]
    assert container["image"].startswith("registry.example.com/")
    assert {o["metadata"]["namespace"] for o in rendered["overlay"]} == {"kvpool"}


def test_overlay_refuses_to_build_without_its_secret_files() -> None:
    """The token files are git-ignored: a checkout without them fails to render, never deploys a known token."""
    if all((OVERLAY / path).exists() for path in SECRET_FILES):
        pytest.skip("this checkout has the overlay's secret files")
    with pytest.raises(FileNotFoundError):
        render(OVERLAY)


def _set(path: str, value: Any) -> Callable[[list[Obj]], None]:
    """A breakage: set a field of the node StatefulSet (a JSON pointer) to ``value``."""

    def breakage(objects: list[Obj]) -> None:
        _json_patch(_one(objects, "StatefulSet", "kvpool-node"), {"op": "replace", "path": path, "value": value})

    return breakage


def _replace_arg(flag: str, value: str) -> Callable[[list[Obj]], None]:
    def breakage(objects: list[Obj]) -> None:
        args = _one(objects, "StatefulSet", "kvpool-node")["spec"]["template"]["spec"]["containers"][0]["args"]
        args[:] = [f"{flag}={value}" if a.startswith(f"{flag}=") else a for a in args]

    return breakage


def _edit_configmap(objects: list[Obj]) -> None:
    data = _one(objects, "ConfigMap", "kvpool-lmcache")["data"]
    data["lmcache-remote-url.yaml"] = data["lmcache-remote-url.yaml"].replace("namespace=prod", "namespace=staging")


def _engine_env(name: str, value: str) -> Callable[[list[Obj]], None]:
    def breakage(objects: list[Obj]) -> None:
        for var in _one(objects, "Deployment", "vllm-example")["spec"]["template"]["spec"]["containers"][0]["env"]:
            if var["name"] == name:
                var["value"] = value

    return breakage


def _rename_secret_key(objects: list[Obj]) -> None:
    data = _one(objects, "Secret", "kvpool-secrets")["data"]
    data["pool-token"] = data.pop("token")


def _monitor_port(objects: list[Obj]) -> None:
    _one(objects, "ServiceMonitor", "kvpool-node")["spec"]["endpoints"][0]["port"] = "http-metrics"


def _unknown_field(objects: list[Obj]) -> None:
    _one(objects, "StatefulSet", "kvpool-node")["spec"]["template"]["spec"]["containers"][0]["livenesProbe"] = {}


CONTAINER = "/spec/template/spec/containers/0"
BREAKAGES = {
    "flag the parser refuses": (check_node_flags, _replace_arg("--dram", "lots")),
    "advertise a name the kubelet cannot expand": (check_node_flags, _replace_arg("--advertise", "$(NODE_IP)")),
    "token file not mounted": (check_node_flags, _replace_arg("--token-file", "/etc/kvpool/token")),
    "Secret key renamed": (check_node_flags, _rename_secret_key),
    "more DRAM, same memory": (check_node_memory, _replace_arg("--dram", "32GiB")),
    "shm not in memory": (check_node_memory, _set("/spec/template/spec/volumes/0/emptyDir", {"sizeLimit": "64Gi"})),
    "NVMe larger than its volume (base: a claim)": (check_node_nvme, _replace_arg("--nvme", "4TiB")),
    "NVMe hostPath created when missing": (
        check_node_nvme,
        _set("/spec/template/spec/volumes/2/hostPath/type", "DirectoryOrCreate"),
    ),
    "readiness on /metrics": (check_node_probes, _set(f"{CONTAINER}/readinessProbe/httpGet/path", "/metrics")),
    "liveness on /health": (check_node_probes, _set(f"{CONTAINER}/livenessProbe/httpGet/path", "/health")),
    "scrape annotation on another port": (
        check_node_probes,
        _set("/spec/template/metadata/annotations/prometheus.io~1port", "9401"),
    ),
    "ServiceMonitor on a port the Service lacks": (check_services, _monitor_port),
    "nodes point at another Redis": (check_redis, _replace_arg("--redis", "redis://redis-elsewhere:6379")),
    "hand-edited LMCache config": (check_engine_config, _edit_configmap),
    "engine token file elsewhere": (check_engine_config, _engine_env("KVPOOL_TOKEN_FILE", "/etc/kvpool/token")),
    "image of another version": (check_image_version, _set(f"{CONTAINER}/image", "kvpool-node:0.0.9")),
}


@pytest.mark.parametrize("name", list(BREAKAGES))
def test_each_check_catches_its_breakage(rendered: dict[str, list[Obj]], name: str, tmp_path: Path) -> None:
    check, breakage = BREAKAGES[name]
    objects = copy.deepcopy(rendered["base" if "(base" in name else "overlay"])
    check(objects, tmp_path)  # passes before
    breakage(objects)
    with pytest.raises(BaseException) as raised:  # AssertionError, or the parser's ConfigError / SystemExit
        check(objects, tmp_path)
    assert not isinstance(raised.value, (KeyError, TypeError, IndexError)), f"the check crashed: {raised.value!r}"


def test_schema_validation_catches_an_unknown_field(rendered: dict[str, list[Obj]]) -> None:
    objects = copy.deepcopy(rendered["overlay"])
    _unknown_field(objects)
    with pytest.raises(kubernetes_validate.ValidationError, match="livenesProbe"):
        validate(_one(objects, "StatefulSet", "kvpool-node"))


def _monitor_set(pointer: str, value: Any) -> Callable[[Obj], None]:
    def breakage(monitor: Obj) -> None:
        _json_patch(monitor, {"op": "add", "path": pointer, "value": value})

    return breakage


SERVICE_MONITOR_BREAKAGES = {
    "unknown endpoint field": (_monitor_set("/spec/endpoints/0/intervall", "30s"), "'intervall' was unexpected"),
    "unknown spec field": (_monitor_set("/spec/endpoint", [{"port": "metrics"}]), "'endpoint' was unexpected"),
    "interval not a duration": (_monitor_set("/spec/endpoints/0/interval", "30 seconds"), "does not match"),
    "scheme not http(s)": (_monitor_set("/spec/endpoints/0/scheme", "ftp"), "ftp"),
    "port not a string": (_monitor_set("/spec/endpoints/0/port", 9400), "is not of type 'string'"),
    "no spec": (lambda monitor: monitor.pop("spec"), "'spec' is a required property"),
    "unknown metadata field": (_monitor_set("/metadata/label", {"a": "b"}), "'label' was unexpected"),
}


@pytest.mark.parametrize("name", list(SERVICE_MONITOR_BREAKAGES))
def test_service_monitor_validation_catches(rendered: dict[str, list[Obj]], name: str) -> None:
    breakage, message = SERVICE_MONITOR_BREAKAGES[name]
    monitor = copy.deepcopy(_one(rendered["overlay"], "ServiceMonitor", "kvpool-node"))
    validate(monitor)  # passes before
    breakage(monitor)
    with pytest.raises(jsonschema.ValidationError, match=message):
        validate(monitor)
