"""The Helm chart (docker/helm/triton-sampling-mask), checked without a cluster.

The chart is rendered by Helm's own engine: the `helm-python-sdk` wheel binds Helm 4's Go SDK
(`helm template`'s code path, values schema included) through ctypes, so no `helm` binary is needed.
Every manifest is parsed and its invariants asserted (replicas, GPUs, /dev/shm, probes, ports,
scraping, autoscaler, admin key, security), `helm lint --strict` must be clean, and checkov scans
the rendered manifests: every finding is fixed, or skipped in the chart with its reason.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO_ROOT = Path(__file__).resolve().parent.parent
CHART = REPO_ROOT / "docker" / "helm" / "triton-sampling-mask"
RELEASE, NAMESPACE = "rl", "sampling"
FULLNAME = f"{RELEASE}-triton-sampling-mask"
PORTS = {"http": 8000, "grpc": 8001, "metrics": 8002, "probe": 8003, "api": 9000}
PENDING_METRIC = "nv_inference_pending_request_count"
# The launcher's charset for TRITON_ADMIN_KEY (server_process.admin_args).
ADMIN_KEY_CHARSET = r"[A-Za-z0-9._~+/-]+"
# checkov findings the chart may skip, each tied to the value that makes it unnecessary.
KEPT_FINDINGS = {"CKV_K8S_35", "CKV_K8S_15", "CKV_K8S_43", "CKV_K8S_40", "CKV_K8S_38"}
HARDENED = {
    "image": {"digest": "sha256:" + "0" * 64, "pullPolicy": "Always"},
    "router": {"image": {"digest": "sha256:" + "1" * 64, "pullPolicy": "Always"}},
    "podSecurityContext": {"runAsUser": 10001, "runAsGroup": 10001, "fsGroup": 10001},
}
ROUTER = f"{FULLNAME}-router"
ROUTER_PORTS = {"router": 30000, "router-metrics": 29000}
EVERYTHING_ON = {
    "autoscaling": {"enabled": True},
    "metrics": {"serviceMonitor": {"enabled": True}, "grafanaDashboard": {"enabled": True}},
}
CHECKOV_TIMEOUT_S = 120


def helm():
    """Helm's engine: the `helm_python` module of the helm-python-sdk wheel."""
    try:
        import helm_python
    except ImportError:
        pytest.fail("helm-python-sdk is missing: run `make setup` (the lint extra installs it)")
    return helm_python


def render_files(values: dict | None = None, namespace: str = NAMESPACE) -> dict[str, str]:
    """Template path -> rendered text, as `helm template RELEASE CHART -n NAMESPACE` renders it."""
    with helm().Chart.load(str(CHART)) as chart:
        return chart.render(values, name=RELEASE, namespace=namespace, is_install=True)


def render(values: dict | None = None, namespace: str = NAMESPACE) -> list[dict]:
    """Every manifest the chart renders, parsed."""
    return [
        doc
        for path, text in sorted(render_files(values, namespace).items())
        if path.endswith(".yaml")
        for doc in yaml.safe_load_all(text)
        if doc
    ]


def one(manifests: list[dict], kind: str, name: str = FULLNAME) -> dict:
    """The one `kind` object of the chart; where the router has one too, the one named `name`
    (the replicas', by default)."""
    found = [m for m in manifests if m["kind"] == kind]
    if len(found) > 1:
        found = [m for m in found if m["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind}, got {[m['metadata']['name'] for m in found]}"
    return found[0]


def pod_spec(manifests: list[dict], name: str = FULLNAME) -> dict:
    return one(manifests, "Deployment", name)["spec"]["template"]["spec"]


def container(manifests: list[dict], name: str = FULLNAME) -> dict:
    (server,) = pod_spec(manifests, name)["containers"]
    return server


def env(manifests: list[dict]) -> dict[str, dict]:
    return {variable["name"]: variable for variable in container(manifests)["env"]}


def quantity_bytes(quantity: str) -> int:
    """A Kubernetes quantity in bytes: 4Gi (binary) or 4G (decimal)."""
    match = re.fullmatch(r"(\d+)(Ki|Mi|Gi|Ti|k|M|G|T)?", quantity)
    assert match, quantity
    unit = match.group(2) or ""
    scale = (
        1024 ** ("KMGT".index(unit[0].upper()) + 1)
        if unit.endswith("i")
        else 1000 ** ("kMGT".index(unit) + 1)
        if unit
        else 1
    )
    return int(match.group(1)) * scale


def docker_size_bytes(size: str) -> int:
    """A Docker size (compose's shm_size: 4gb, 512m), in binary units as Docker reads it."""
    match = re.fullmatch(r"(\d+)\s*([bkmg]?)b?", size.strip().lower())
    assert match, size
    return int(match.group(1)) * 1024 ** "bkmg".index(match.group(2) or "b")


def test_chart_passes_helm_lint_strict():
    report = helm().lint(str(CHART), strict=True, namespace=NAMESPACE)
    assert not report["errors"], report
    # Severity 1 is informational ("icon is recommended"); warnings (2) and errors (3) fail.
    assert all(message["severity"] < 2 for message in report["messages"]), report


def test_chart_version_and_image_tag_follow_the_package():
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    version = re.search(r'^version = "(.+)"$', (REPO_ROOT / "pyproject.toml").read_text(), flags=re.MULTILINE).group(1)
    assert chart["apiVersion"] == "v2"
    assert chart["appVersion"] == version, "tag the image with the package version and set appVersion to it"
    assert container(render())["image"] == f"triton-sampling-mask:{version}"
    digest = HARDENED["image"]["digest"]
    assert container(render({"image": {"digest": digest}}))["image"] == f"triton-sampling-mask@{digest}"
    # The 2.51 line's image, tagged as values.yaml and the chart's README suggest.
    tag = f"{version}-triton2.51"
    assert container(render({"image": {"tag": tag}}))["image"] == f"triton-sampling-mask:{tag}"
    assert f"image.tag={tag}" in (CHART / "README.md").read_text()


def test_pods_run_as_the_images_user():
    """The chart's default uid/gid is the Dockerfile's USER, so the pod runs the image as built."""
    dockerfile = (REPO_ROOT / "docker" / "Dockerfile").read_text()
    user = re.findall(r"^USER\s+(\d+):(\d+)\s*$", dockerfile, flags=re.MULTILINE)[-1]
    context = pod_spec(render())["securityContext"]
    assert (str(context["runAsUser"]), str(context["runAsGroup"])) == user


def test_default_objects_all_in_the_release_namespace():
    manifests = render()
    router = ["Deployment", "NetworkPolicy", "Role", "RoleBinding", "Service", "ServiceAccount"]
    assert sorted(m["kind"] for m in manifests) == sorted(
        ["Deployment", "NetworkPolicy", "Secret", "Service", "ServiceAccount", *router]
    )
    assert sorted(m["kind"] for m in render(EVERYTHING_ON)) == sorted(
        [
            "ConfigMap",
            "Deployment",
            "HorizontalPodAutoscaler",
            "NetworkPolicy",
            "Secret",
            "Service",
            "ServiceAccount",
            "ServiceMonitor",
            *router,
        ]
    )
    without = render({"router": {"enabled": False}})
    assert sorted(m["kind"] for m in without) == ["Deployment", "NetworkPolicy", "Secret", "Service", "ServiceAccount"]
    assert {m["metadata"]["namespace"] for m in render(EVERYTHING_ON)} == {NAMESPACE}


def test_container_runs_the_images_command():
    """The container's args are the Dockerfile's CMD (the NGC entrypoint stays), plus extraArgs."""
    dockerfile = (REPO_ROOT / "docker" / "Dockerfile").read_text()
    cmd = json.loads(re.search(r"^CMD\s+(\[.*\])\s*$", dockerfile, flags=re.MULTILINE).group(1))
    server = container(render())
    assert "command" not in server
    assert server["args"] == cmd
    assert container(render({"server": {"extraArgs": ["--log-verbose=1"]}}))["args"] == [*cmd, "--log-verbose=1"]


def test_replicas_unless_the_autoscaler_owns_them():
    assert one(render(), "Deployment")["spec"]["replicas"] == 1
    assert one(render({"replicaCount": 3}), "Deployment")["spec"]["replicas"] == 3
    assert "replicas" not in one(render({"replicaCount": 3, **EVERYTHING_ON}), "Deployment")["spec"]


def test_gpu_requested_and_limited_alike():
    for gpus, values in (
        (1, None),
        (2, {"resources": {"requests": {"nvidia.com/gpu": 2}, "limits": {"nvidia.com/gpu": 2}}}),
    ):
        resources = container(render(values))["resources"]
        assert resources["requests"]["nvidia.com/gpu"] == resources["limits"]["nvidia.com/gpu"] == gpus
        for kind in ("cpu", "memory"):
            assert resources["requests"][kind] and resources["limits"][kind]


def test_dev_shm_is_memory_backed_and_sized_as_compose():
    compose = yaml.safe_load((REPO_ROOT / "docker" / "compose.yaml").read_text())
    manifests = render()
    volumes = {volume["name"]: volume for volume in pod_spec(manifests)["volumes"]}
    mounts = {mount["mountPath"]: mount["name"] for mount in container(manifests)["volumeMounts"]}
    shm = volumes[mounts["/dev/shm"]]["emptyDir"]
    assert shm["medium"] == "Memory"
    assert quantity_bytes(shm["sizeLimit"]) == docker_size_bytes(compose["services"]["sampler"]["shm_size"])
    # The memory limit holds /dev/shm too (a memory-backed emptyDir is charged to it).
    limit = container(manifests)["resources"]["limits"]["memory"]
    assert quantity_bytes(limit) > quantity_bytes(shm["sizeLimit"])


def test_probes_use_the_supervisors_endpoints():
    manifests = render()
    server = container(manifests)
    ports = {port["name"]: port["containerPort"] for port in server["ports"]}
    assert ports == PORTS
    assert env(manifests)["TRITON_PROBE_PORT"]["value"] == str(PORTS["probe"])
    for probe, path in (("readinessProbe", "/ready"), ("livenessProbe", "/live"), ("startupProbe", "/live")):
        assert server[probe]["httpGet"] == {"path": path, "port": "probe"}, probe
    # The exec alternative documented in values.yaml replaces the HTTP handler.
    command = ["python3", "-m", "triton_sampling_mask.ops.probe", "--url", f"localhost:{PORTS['http']}"]
    probe = container(render({"probes": {"readiness": {"httpGet": None, "exec": {"command": command}}}}))[
        "readinessProbe"
    ]
    assert probe["exec"]["command"] == command and "httpGet" not in probe
    values_text = (CHART / "values.yaml").read_text()
    assert "triton_sampling_mask.ops.probe, --url, localhost:8000" in values_text


def test_service_exposes_every_port_by_name():
    manifests = render()
    service = one(manifests, "Service")
    assert {port["name"]: port["port"] for port in service["spec"]["ports"]} == PORTS
    assert all(port["targetPort"] == port["name"] for port in service["spec"]["ports"])
    pod_labels = one(manifests, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    policy = one(manifests, "NetworkPolicy")
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= pod_labels.items()
    assert sorted(port["port"] for port in policy["spec"]["ingress"][0]["ports"]) == sorted(PORTS.values())


def test_http_api_port_and_key_reach_the_launcher():
    """The API's port is the launcher's TRITON_API_PORT, served by the container, the Service and
    the NetworkPolicy; 0 runs no API and leaves it out; its key comes from a Secret only."""
    from triton_sampling_mask.ops import settings

    manifests = render()
    assert PORTS["api"] == settings.TRITON_API_PORT.default
    assert env(manifests)["TRITON_API_PORT"]["value"] == str(PORTS["api"])
    assert "TRITON_API_KEY" not in env(manifests)

    with pytest.raises(Exception, match="router.enabled needs the HTTP API"):
        render({"ports": {"api": 0}})
    manifests = render({"ports": {"api": 0}, "apiKey": {"existingSecret": "sampler-api"}, "router": {"enabled": False}})
    assert env(manifests)["TRITON_API_PORT"]["value"] == "0"
    assert "api" not in {port["name"] for port in container(manifests)["ports"]}
    assert "api" not in {port["name"] for port in one(manifests, "Service")["spec"]["ports"]}
    policy_ports = {port["port"] for port in one(manifests, "NetworkPolicy")["spec"]["ingress"][0]["ports"]}
    assert policy_ports == {port for name, port in PORTS.items() if name != "api"}
    assert env(manifests)["TRITON_API_KEY"] == {
        "name": "TRITON_API_KEY",
        "valueFrom": {"secretKeyRef": {"name": "sampler-api", "key": "api-key"}},
    }
    with pytest.raises(Exception, match="api"):
        render({"ports": {"api": 70000}})


def test_metrics_scrape_annotations_and_service_monitor():
    template = one(render(), "Deployment")["spec"]["template"]
    assert template["metadata"]["annotations"] == {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(PORTS["metrics"]),
        "prometheus.io/path": "/metrics",
    }
    unannotated = one(render({"metrics": {"scrapeAnnotations": False}}), "Deployment")["spec"]["template"]["metadata"]
    assert "prometheus.io/scrape" not in unannotated.get("annotations", {})

    manifests = render(
        {"metrics": {"serviceMonitor": {"enabled": True, "labels": {"release": "kube-prometheus-stack"}}}}
    )
    monitor = one(manifests, "ServiceMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert monitor["spec"]["selector"]["matchLabels"].items() <= one(manifests, "Service")["metadata"]["labels"].items()
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    assert [(e["port"], e["path"]) for e in monitor["spec"]["endpoints"]] == [
        ("metrics", "/metrics"),
        ("probe", "/metrics"),
    ]


def test_grafana_dashboard_configmap_holds_the_dashboard_behind_its_flag():
    """Off by default; on, a ConfigMap with the sidecar's label holding docker/grafana/dashboard.json as it is."""
    assert not [m for m in render() if m["kind"] == "ConfigMap"]
    values = {"metrics": {"grafanaDashboard": {"enabled": True, "annotations": {"grafana_folder": "Inference"}}}}
    config_map = one(render(values), "ConfigMap")
    assert config_map["metadata"]["namespace"] == NAMESPACE
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert config_map["metadata"]["annotations"] == {"grafana_folder": "Inference"}
    (text,) = config_map["data"].values()
    assert json.loads(text) == json.loads((REPO_ROOT / "docker" / "grafana" / "dashboard.json").read_text())


def test_autoscaler_scales_the_deployment_on_pending_requests_per_pod():
    manifests = render({"autoscaling": {"enabled": True, "minReplicas": 2, "maxReplicas": 6}})
    hpa = one(manifests, "HorizontalPodAutoscaler")
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": FULLNAME}
    assert one(manifests, "Deployment")["metadata"]["name"] == FULLNAME
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2, 6)
    (metric,) = hpa["spec"]["metrics"]
    assert metric == {
        "type": "Pods",
        "pods": {"metric": {"name": PENDING_METRIC}, "target": {"type": "AverageValue", "averageValue": "8"}},
    }
    assert hpa["spec"]["behavior"]["scaleDown"]["stabilizationWindowSeconds"] > 0
    with pytest.raises(Exception, match="maxReplicas must be at least"):
        render({"autoscaling": {"enabled": True, "minReplicas": 5, "maxReplicas": 2}})


def test_readme_gives_the_adapter_rule_for_the_autoscalers_metric():
    """The prometheus-adapter rule in the chart's README exposes, per pod, the metric the HPA reads."""
    readme = (CHART / "README.md").read_text()
    blocks = [yaml.safe_load(block) for block in re.findall(r"```yaml\n(.*?)```", readme, flags=re.DOTALL)]
    rules = [
        rule for block in blocks if isinstance(block, dict) and "rules" in block for rule in block["rules"]["custom"]
    ]
    (rule,) = [rule for rule in rules if rule["name"]["as"] == PENDING_METRIC]
    assert rule["seriesQuery"].startswith(PENDING_METRIC + "{")
    assert rule["resources"]["overrides"]["pod"] == {"resource": "pod"}
    assert "by (<<.GroupBy>>)" in rule["metricsQuery"]
    # values.yaml repeats the same rule in its comments.
    assert f"matches: ^{PENDING_METRIC}$" in (CHART / "values.yaml").read_text()


def test_admin_key_comes_from_a_secret():
    manifests = render()
    source = env(manifests)["TRITON_ADMIN_KEY"]
    assert "value" not in source
    reference = source["valueFrom"]["secretKeyRef"]
    secret = one(manifests, "Secret")
    assert secret["metadata"]["name"] == reference["name"]
    key = base64.b64decode(secret["data"][reference["key"]]).decode()
    assert len(key) >= 32 and re.fullmatch(ADMIN_KEY_CHARSET, key)

    manifests = render({"adminKey": {"existingSecret": "sampler-admin", "secretKey": "token"}})
    assert not [m for m in manifests if m["kind"] == "Secret"]
    assert env(manifests)["TRITON_ADMIN_KEY"]["valueFrom"]["secretKeyRef"] == {"name": "sampler-admin", "key": "token"}


def test_pods_are_unprivileged_with_a_read_only_root():
    for values in (None, EVERYTHING_ON, HARDENED):
        manifests = render(values)
        spec, server = pod_spec(manifests), container(manifests)
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        assert spec["automountServiceAccountToken"] is False
        assert not {"hostNetwork", "hostPID", "hostIPC"} & spec.keys()
        assert not [volume for volume in spec["volumes"] if "hostPath" in volume]
        context = server["securityContext"]
        assert context["privileged"] is False and context["allowPrivilegeEscalation"] is False
        assert context["readOnlyRootFilesystem"] is True
        assert context["capabilities"] == {"drop": ["ALL"]}
        # Everything the server writes has an emptyDir: /dev/shm, and /tmp for HOME and the caches.
        mounts = {mount["mountPath"] for mount in server["volumeMounts"]}
        assert {"/dev/shm", "/tmp"} <= mounts
        variables = env(manifests)
        for name in ("HOME", "TMPDIR", "XDG_CACHE_HOME", "TRITON_CACHE_DIR"):
            assert variables[name]["value"].startswith("/tmp"), name
    with pytest.raises(Exception, match="privileged"):
        render({"securityContext": {"privileged": True}})


def test_model_repository_baked_in_or_mounted():
    dockerfile = (REPO_ROOT / "docker" / "Dockerfile").read_text()
    baked = re.search(r"gpu_repository\s+\S+\s+(/\S+)", dockerfile).group(1)
    manifests = render()
    assert env(manifests)["MODEL_REPOSITORY"]["value"] == baked
    assert baked not in {mount["mountPath"] for mount in container(manifests)["volumeMounts"]}

    volume = {"persistentVolumeClaim": {"claimName": "sampler-models", "readOnly": True}}
    manifests = render({"modelRepository": {"path": "/repository", "volume": volume}})
    assert env(manifests)["MODEL_REPOSITORY"]["value"] == "/repository"
    (mount,) = [mount for mount in container(manifests)["volumeMounts"] if mount["mountPath"] == "/repository"]
    assert mount["readOnly"] is True
    (source,) = [v for v in pod_spec(manifests)["volumes"] if v["name"] == mount["name"]]
    assert source["persistentVolumeClaim"] == volume["persistentVolumeClaim"]


def test_mask_width_has_one_source_of_truth():
    """W lives in config.pbtxt only: the chart has no value for it, and its schema refuses one."""

    def keys(node):
        if isinstance(node, dict):
            for key, value in node.items():
                yield key
                yield from keys(value)

    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert not [key for key in keys(values) if re.search(r"mask|width", key, flags=re.IGNORECASE)]
    with pytest.raises(Exception, match="maskWidth"):
        render({"maskWidth": 1024})
    assert "sampling_mask" in (CHART / "values.yaml").read_text()  # ... and the comments say where W is


def checkov() -> list[str]:
    """The checkov command: CHECKOV, a checkov venv inside this one (.venv/checkov; checkov pins
    dependencies the project's venv must not take), this venv's bin/, or PATH."""
    candidates = [
        os.environ.get("CHECKOV", ""),
        str(Path(sys.prefix) / "checkov" / "bin" / "checkov"),
        str(Path(sys.executable).parent / "checkov"),
        shutil.which("checkov") or "",
    ]
    for candidate in candidates:
        if candidate and Path(candidate).is_file():
            return [candidate]
    pytest.fail("checkov is missing: run `make setup` (it installs checkov in .venv/checkov)")


def test_checkov_finds_nothing_unexplained(tmp_path):
    """Three renders (defaults, every object on, the hardened values) each in its own namespace, so
    checkov's graph checks (e.g. the NetworkPolicy's selector) never match across renders."""
    variants = {"defaults": None, "everything": EVERYTHING_ON, "hardened": HARDENED}
    for variant, values in variants.items():
        (tmp_path / variant).mkdir()
        for path, text in render_files(values, namespace=f"sampling-{variant}").items():
            if path.endswith(".yaml") and text.strip():
                (tmp_path / variant / Path(path).name).write_text(text)
    done = subprocess.run(
        [*checkov(), "--directory", str(tmp_path), "--framework", "kubernetes", "--skip-download", "--output", "json"],
        capture_output=True,
        text=True,
        timeout=CHECKOV_TIMEOUT_S,
        env={**os.environ, "LOG_LEVEL": "WARNING"},
    )
    assert done.stdout.lstrip().startswith(("{", "[")), done.stdout[-2000:] + done.stderr[-2000:]
    report = json.loads(done.stdout)
    if isinstance(report, list):  # one report per framework when several ran
        (report,) = [r for r in report if r["check_type"] == "kubernetes"]
    results = report["results"]
    failed = [
        f"{c['check_id']} {c['check_name']} ({c['resource']}, {c['file_path']})" for c in results["failed_checks"]
    ]
    assert not failed, "checkov findings (fix them, or skip them in the chart with a reason):\n" + "\n".join(failed)
    assert report["summary"]["parsing_errors"] == 0, done.stdout[-2000:]
    assert report["summary"]["passed"] > 50, "checkov checked almost nothing"
    skipped = {}
    for check in results["skipped_checks"]:
        assert check["check_result"].get("suppress_comment", "").strip(), (
            f"{check['check_id']} skipped without a reason"
        )
        skipped.setdefault(check["file_path"].split("/")[1], set()).add(check["check_id"])
    assert skipped["defaults"] <= KEPT_FINDINGS and skipped["everything"] <= KEPT_FINDINGS
    # Each conditional skip goes away with the value that fixes its finding.
    assert skipped["hardened"] == {"CKV_K8S_35", "CKV_K8S_38"}


# The router in front of the replicas (docs/deploy.md, "Scale-out: the router").


def router_args(manifests: list[dict]) -> list[str]:
    return container(manifests, ROUTER)["args"]


def matches(selector: dict, labels: dict) -> bool:
    return selector.items() <= labels.items()


def test_the_router_discovers_this_releases_replica_pods_and_nothing_else():
    manifests = render()
    replica_labels = one(manifests, "Deployment")["spec"]["template"]["metadata"]["labels"]
    router = one(manifests, "Deployment", ROUTER)
    router_labels = router["spec"]["template"]["metadata"]["labels"]
    args = router_args(manifests)
    selector_at = args.index("--selector")
    selector = dict(a.split("=", 1) for a in args[selector_at + 1 : selector_at + 3])
    assert not args[selector_at + 3].startswith("app.kubernetes.io/")
    assert matches(selector, replica_labels) and not matches(selector, router_labels)
    assert "--service-discovery" in args
    assert f"--service-discovery-port={PORTS['api']}" in args
    assert f"--service-discovery-namespace={NAMESPACE}" in args
    # The replicas' Deployment, Service and NetworkPolicy never take the router's pods for replicas.
    for selecting in (
        one(manifests, "Deployment")["spec"]["selector"]["matchLabels"],
        one(manifests, "Service")["spec"]["selector"],
        one(manifests, "NetworkPolicy")["spec"]["podSelector"]["matchLabels"],
    ):
        assert matches(selecting, replica_labels) and not matches(selecting, router_labels)
    assert matches(router["spec"]["selector"]["matchLabels"], router_labels)
    assert not matches(router["spec"]["selector"]["matchLabels"], replica_labels)


def test_the_router_reads_pods_only_with_a_token_of_its_own():
    manifests = render()
    role = one(manifests, "Role", ROUTER)
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]
    binding = one(manifests, "RoleBinding", ROUTER)
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": ROUTER}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": ROUTER, "namespace": NAMESPACE}]
    spec = pod_spec(manifests, ROUTER)
    assert spec["serviceAccountName"] == ROUTER and spec["automountServiceAccountToken"] is True
    assert pod_spec(manifests)["automountServiceAccountToken"] is False  # the replicas still get none
    assert pod_spec(manifests)["serviceAccountName"] != ROUTER


def test_the_router_is_keyed_with_the_api_key_from_a_file():
    """With the API's key, the router requires it and sends it to the replicas (their front door's
    keyed client): it reads it from the Secret as a file, never from a variable or its arguments."""
    assert not [a for a in router_args(render()) if a.startswith("--api-key")]
    manifests = render({"apiKey": {"existingSecret": "sampler-api", "secretKey": "token"}})
    server = container(manifests, ROUTER)
    assert "--api-key-file=/run/secrets/router/token" in server["args"]
    assert not [a for a in server["args"] if a.startswith("--api-key=") or a == "--api-key"]
    assert "env" not in server
    mounts = {m["name"]: m for m in server["volumeMounts"]}
    assert mounts["api-key"] == {"name": "api-key", "mountPath": "/run/secrets/router", "readOnly": True}
    (volume,) = [v for v in pod_spec(manifests, ROUTER)["volumes"] if v["name"] == "api-key"]
    assert volume["secret"] == {
        "secretName": "sampler-api",
        "items": [{"key": "token", "path": "token"}],
        "defaultMode": 0o440,
    }
    # The replicas require the same key (TRITON_API_KEY, a client key of their front door).
    assert env(manifests)["TRITON_API_KEY"]["valueFrom"]["secretKeyRef"] == {"name": "sampler-api", "key": "token"}


def test_the_router_is_served_probed_and_scraped_on_its_ports():
    manifests = render()
    server = container(manifests, ROUTER)
    assert {p["name"]: p["containerPort"] for p in server["ports"]} == ROUTER_PORTS
    args = router_args(manifests)
    assert f"--port={ROUTER_PORTS['router']}" in args and f"--prometheus-port={ROUTER_PORTS['router-metrics']}" in args
    assert server["readinessProbe"]["httpGet"] == {"path": "/readiness", "port": "router"}
    assert server["livenessProbe"]["httpGet"] == {"path": "/liveness", "port": "router"}
    assert (
        server["image"]
        == f"triton-sampling-mask-router:{yaml.safe_load((CHART / 'Chart.yaml').read_text())['appVersion']}"
    )
    service = one(manifests, "Service", ROUTER)
    assert {p["name"]: p["port"] for p in service["spec"]["ports"]} == ROUTER_PORTS
    assert matches(
        service["spec"]["selector"], one(manifests, "Deployment", ROUTER)["spec"]["template"]["metadata"]["labels"]
    )
    annotations = one(manifests, "Deployment", ROUTER)["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(ROUTER_PORTS["router-metrics"])
    policy = one(manifests, "NetworkPolicy", ROUTER)
    assert sorted(p["port"] for p in policy["spec"]["ingress"][0]["ports"]) == sorted(ROUTER_PORTS.values())
    for context in (server["securityContext"], container(manifests)["securityContext"]):
        assert context["readOnlyRootFilesystem"] is True and context["capabilities"] == {"drop": ["ALL"]}
    assert router_args(render({"router": {"extraArgs": ["--policy=round_robin"]}}))[-1] == "--policy=round_robin"


def test_a_restricted_network_policy_still_admits_the_router_to_the_replicas_api():
    peers = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "rl"}}}]
    manifests = render({"networkPolicy": {"from": peers}, "router": {"networkPolicy": {"from": peers}}})
    rules = one(manifests, "NetworkPolicy")["spec"]["ingress"]
    router_labels = one(manifests, "Deployment", ROUTER)["spec"]["template"]["metadata"]["labels"]
    (router_rule,) = [r for r in rules if any("podSelector" in peer for peer in r["from"])]
    assert [p["port"] for p in router_rule["ports"]] == [PORTS["api"]]
    assert matches(router_rule["from"][0]["podSelector"]["matchLabels"], router_labels)
    assert one(manifests, "NetworkPolicy", ROUTER)["spec"]["ingress"][0]["from"] == peers
    # With every source admitted, no extra rule is needed.
    assert len(one(render(), "NetworkPolicy")["spec"]["ingress"]) == 1
