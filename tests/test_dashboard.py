"""Every query of the Grafana dashboard names only series the server exports."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

from triton_sampling_mask.ops import proxy_metrics
from triton_sampling_mask.serving.metrics import GenerateMetrics, SamplerMetrics

from .metrics_stub import MetricStub

REPO_ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = REPO_ROOT / "docker" / "grafana" / "dashboard.json"
# PromQL words that look like names: aggregation modifiers, set and vector-matching operators.
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless", "offset"}


def exported_names() -> set[str]:
    """The families both models register (through a stand-in pb_utils), the front door's series
    (ops.proxy_metrics) and Triton's own series that docs/metrics.md lists (the client tests check
    those against a real server)."""
    stub = MetricStub.reset()
    SamplerMetrics(stub, "sampler", "1", 512)
    GenerateMetrics(stub, "generate")
    triton = set(re.findall(r"`(nv_\w+)`", (REPO_ROOT / "docs" / "metrics.md").read_text()))
    return set(stub.families) | set(proxy_metrics.HELP) | triton


def metric_names(expr: str) -> set[str]:
    """The series names a PromQL expression selects: identifiers that are neither functions,
    keywords, label names (in `{...}`, `by (...)`), strings nor range durations."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # label values and strings
    expr = re.sub(r"\{[^}]*\}", "", expr)  # label matchers
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # ranges
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", expr)
    names = set()
    for match in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", expr):
        following = expr[match.end() :].lstrip()
        if following.startswith("(") or match.group() in KEYWORDS:
            continue
        if match.start() and (expr[match.start() - 1].isdigit() or expr[match.start() - 1] == "."):
            continue  # the exponent or unit of a number (1e6)
        names.add(match.group())
    return names


def queries(dashboard: dict) -> list[str]:
    """Every PromQL text in the dashboard: panel targets and query variables."""
    found = [t["expr"] for panel in dashboard["panels"] for t in panel.get("targets", [])]
    for variable in dashboard.get("templating", {}).get("list", []):
        query = variable.get("query")
        text = query.get("query", "") if isinstance(query, dict) else query or ""
        found.extend(re.findall(r"label_values\((\w+)", text))
    return found


def test_the_name_parser_finds_selected_series_only():
    expr = (
        'histogram_quantile(0.99, sum by (le) (rate(a_bucket{model=~"$model", le!="x_y"}[$__rate_interval])))'
        " / on (model) group_left sum without (reason) (b_total) * 1e6 + c"
    )
    assert metric_names(expr) == {"a_bucket", "b_total", "c"}


def test_every_dashboard_query_names_an_exported_series():
    dashboard = json.loads(DASHBOARD.read_text())
    exported = exported_names()
    exprs = queries(dashboard)
    assert len(exprs) > 20
    used = set()
    for expr in exprs:
        names = metric_names(expr)
        assert names, expr
        assert names <= exported, (names - exported, expr)
        used |= names
    # The four things the dashboard is for: throughput, latency, shedding, truncation.
    for name in (
        "generate_tokens_total",
        "generate_e2e_request_latency_seconds_bucket",
        "generate_time_to_first_token_seconds_bucket",
        "generate_inter_token_latency_seconds_bucket",
        "generate_requests_total",
        "generate_neg_log_kept_mass_bucket",
        "proxy_requests_refused_total",
    ):
        assert name in used, name


def test_compose_provisions_the_dashboard_and_a_prometheus_scraping_the_server():
    compose = yaml.safe_load((REPO_ROOT / "docker" / "compose.yaml").read_text())
    services = compose["services"]
    grafana_mounts = {m.split(":")[0]: m.split(":")[1] for m in services["grafana"]["volumes"]}
    assert (REPO_ROOT / "docker" / "grafana" / "dashboard.json").resolve() in {
        (REPO_ROOT / "docker" / source).resolve() for source in grafana_mounts
    }
    providers = yaml.safe_load((REPO_ROOT / "docker/grafana/provisioning/dashboards/dashboards.yaml").read_text())
    dashboard_dir = providers["providers"][0]["options"]["path"]
    assert grafana_mounts["./grafana/dashboard.json"].startswith(dashboard_dir + "/")
    sources = yaml.safe_load((REPO_ROOT / "docker/grafana/provisioning/datasources/prometheus.yaml").read_text())
    uids = {source["uid"] for source in sources["datasources"]}
    dashboard = json.loads(DASHBOARD.read_text())
    assert {p["datasource"]["uid"] for p in dashboard["panels"] if "datasource" in p} <= uids
    prometheus = yaml.safe_load((REPO_ROOT / "docker/prometheus/prometheus.yml").read_text())
    targets = [t for job in prometheus["scrape_configs"] for c in job["static_configs"] for t in c["targets"]]
    metrics_port = next(p.split(":")[1] for p in services["sampler"]["ports"] if p.endswith("8002"))
    assert f"sampler:{metrics_port}" in targets
