"""deploy/grafana and deploy/prometheus: the dashboard is its generator's output, is structurally a
Grafana dashboard, and every PromQL expression in it (panel targets, nested row panels, template
variables) names only metrics and labels that a real frontend (or, in the "Standalone indexer" row, a
real indexer) exports after some traffic; the Prometheus scrape configs point at what the services
serve.

PromQL is parsed with ``promql-parser`` (test extra): a syntax error fails too, not only a wrong name.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from support import REPO_ROOT, free_ports, service, wait_until

GRAFANA = os.path.join(REPO_ROOT, "deploy", "grafana")
PROMETHEUS = os.path.join(REPO_ROOT, "deploy", "prometheus")
MODEL = "kvroute-demo"
# labels Prometheus attaches to every scraped series (target labels), absent from the exposition
TARGET_LABELS = frozenset({"instance", "job"})
# Grafana's interval variables stand where PromQL wants a duration
GRAFANA_DURATIONS = re.compile(r"\$(__rate_interval|__interval|__range)\b|\$\{(__rate_interval|__interval|__range)\}")
LABEL_VALUES = re.compile(
    r"^\s*label_values\(\s*(?:(?P<query>.+),\s*)?(?P<label>[A-Za-z_][A-Za-z0-9_]*)\s*\)\s*$", re.S
)
SUFFIXES = {
    "counter": ("_total",),
    "histogram": ("_bucket", "_sum", "_count"),  # the frontend disables _created
    "gaugehistogram": ("_bucket", "_gsum", "_gcount"),
    "summary": ("", "_sum", "_count"),
    "gauge": ("",),
    "info": ("_info",),
    "stateset": ("",),
    "unknown": ("",),
}


def _promql() -> Any:
    try:
        import promql_parser
    except ImportError:
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail("promql-parser is missing: CI must install the test extra")
        pytest.skip("promql-parser is not installed (pip install -e '.[test]')")
    return promql_parser


@functools.cache
def _dashboard_module() -> Any:
    spec = importlib.util.spec_from_file_location("kvroute_grafana_dashboard", os.path.join(GRAFANA, "dashboard.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_dashboard() -> dict[str, Any]:
    with open(os.path.join(GRAFANA, "kvroute.json"), encoding="utf-8") as f:
        return json.load(f)


def all_panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """Every panel, rows and the panels nested in (collapsed) rows included."""
    for p in panels:
        yield p
        yield from all_panels(p.get("panels", []))


# ---- PromQL: which metrics and labels an expression uses ------------------------------------------


@dataclass
class Uses:
    """What one PromQL expression reads: selectors (metric name, matcher labels) and grouping labels
    (``by``/``without``/``on``/``ignoring``/``group_left``/``group_right``) with the metrics they group."""

    selectors: list[tuple[str, frozenset[str]]] = field(default_factory=list)
    groupings: list[tuple[str, frozenset[str], frozenset[str]]] = field(
        default_factory=list
    )  # (clause, labels, metrics)

    @property
    def metrics(self) -> set[str]:
        return {name for name, _ in self.selectors}


def promql_uses(expr: str) -> Uses:
    """Parse ``expr`` (Grafana's ``$__rate_interval`` and friends taken as 5m) and list what it reads.

    Raises ``ValueError`` on a syntax error or on a selector without a literal metric name."""
    pp = _promql()
    try:
        ast = pp.parse(GRAFANA_DURATIONS.sub("5m", expr))
    except Exception as exc:  # the parser raises its own error types
        raise ValueError(f"PromQL does not parse: {expr!r}: {exc}") from None
    uses = Uses()

    def subtree_metrics(node: Any) -> frozenset[str]:
        found: set[str] = set()

        def visit(n: Any) -> None:
            if type(n).__name__ == "VectorSelector":
                found.add(_selector_name(n, expr))

        pp.walk(node, visit)
        return frozenset(found)

    def visit(n: Any) -> None:
        kind = type(n).__name__
        if kind == "VectorSelector":
            name = _selector_name(n, expr)
            uses.selectors.append((name, frozenset(m.name for m in n.matchers.matchers if m.name != "__name__")))
            if n.matchers.or_matchers:
                raise ValueError(f"'or' matchers are not checked: {expr!r}")
        elif kind == "AggregateExpr" and n.modifier is not None and n.modifier.labels:
            uses.groupings.append(
                (str(n.modifier.type).rsplit(".", 1)[-1].lower(), frozenset(n.modifier.labels), subtree_metrics(n.expr))
            )
        elif kind == "BinaryExpr" and n.modifier is not None:
            m = n.modifier
            if m.matching is not None and m.matching.labels:
                clause = "on" if "Include" in str(m.matching.type) else "ignoring"
                for side in (n.lhs, n.rhs):  # both sides carry the matching labels
                    uses.groupings.append((clause, frozenset(m.matching.labels), subtree_metrics(side)))
            if m.group_labels:  # group_left(x): x comes from the "one" side
                one = n.rhs if "ManyToOne" in str(m.card) else n.lhs
                uses.groupings.append(("group", frozenset(m.group_labels), subtree_metrics(one)))

    pp.walk(ast, visit)
    return uses


def _selector_name(selector: Any, expr: str) -> str:
    if selector.name:
        return selector.name
    names = [
        m.value
        for m in selector.matchers.matchers
        if m.name == "__name__" and str(m.op).endswith("Equal") and "Not" not in str(m.op)
    ]
    if len(names) != 1:
        raise ValueError(f"a selector without one literal metric name cannot be checked: {expr!r}")
    return names[0]


def query_uses(query: str) -> tuple[Uses, str | None]:
    """A panel expression, or a variable's ``label_values([query,] label)``: what it reads, and the label it lists."""
    m = LABEL_VALUES.match(query)
    if m is None:
        return promql_uses(query), None
    if m.group("query") is None:
        return Uses(), m.group("label")
    return promql_uses(m.group("query")), m.group("label")


def dashboard_queries(dashboard: dict[str, Any]) -> Iterator[tuple[str, str, str]]:
    """(row title, where, query) for every panel target and every query variable."""
    row = ""
    for p in dashboard["panels"]:
        if p["type"] == "row":
            row = p["title"]
        for q in all_panels([p]):
            for t in q.get("targets", []):
                yield row, f"panel {q['id']} {q['title']!r} target {t['refId']}", t["expr"]
    for v in dashboard["templating"]["list"]:
        if v["type"] == "query":
            query = v["query"]["query"] if isinstance(v["query"], dict) else v["query"]
            yield "", f"variable {v['name']}", query


# ---- the exposition: which sample names exist, with which labels ----------------------------------


class Exposition:
    """Sample names and their label names from one ``/metrics`` text; families that have no sample yet
    (labelled counters nobody incremented) contribute their type's sample names and ``declared`` labels."""

    def __init__(self, text: str, declared: dict[str, tuple[str, ...]] | None = None) -> None:
        self.labels: dict[str, set[str]] = {}
        self.empty: dict[str, str] = {}  # sample name -> family of a family without samples
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                self.labels.setdefault(s.name, set()).update(s.labels)
            if not fam.samples:
                for suffix in SUFFIXES.get(fam.type, ("",)):
                    self.empty[fam.name + suffix] = fam.name
        for sample, fam in self.empty.items():
            if sample not in self.labels and declared is not None and fam in declared:
                self.labels[sample] = set(declared[fam]) | ({"le"} if sample.endswith("_bucket") else set())

    def problems(self, uses: Uses) -> list[str]:
        """What ``uses`` reads that this exposition does not have."""
        out = []
        for name, matched in uses.selectors:
            if name not in self.labels:
                out.append(
                    f"metric {name} is not exported"
                    + (
                        f" (family {self.empty[name]} has no samples and no declared labels)"
                        if name in self.empty
                        else ""
                    )
                )
                continue
            missing = matched - self.labels[name] - TARGET_LABELS
            if missing:
                out.append(f"{name} has no label(s) {sorted(missing)} (it has {sorted(self.labels[name])})")
        for clause, labels, metrics in uses.groupings:
            have = set(TARGET_LABELS).union(*(self.labels.get(m, set()) for m in metrics))
            missing = labels - have
            if missing:
                out.append(
                    f"{clause} ({', '.join(sorted(labels))}): no metric among {sorted(metrics)} has {sorted(missing)}"
                )
        return out


def declared_frontend_labels() -> dict[str, tuple[str, ...]]:
    """Label names of the frontend's own counters/histograms as declared (for families still without samples)."""
    from prometheus_client.metrics import MetricWrapperBase

    from frontend.observability.metrics import FrontendMetrics

    return {
        m._name: tuple(m._labelnames)
        for m in vars(FrontendMetrics(router_id="x")).values()
        if isinstance(m, MetricWrapperBase)
    }


# ---- tests without services --------------------------------------------------------------------


def test_dashboard_json_is_the_generators_output() -> None:
    with open(os.path.join(GRAFANA, "kvroute.json"), encoding="utf-8") as f:
        assert f.read() == _dashboard_module().render(), (
            "deploy/grafana/kvroute.json is stale: run python deploy/grafana/dashboard.py"
        )


def test_dashboard_structure() -> None:
    d = load_dashboard()
    assert 36 <= d["schemaVersion"] <= 41 and d["uid"] and d["title"]
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    panels = list(all_panels(d["panels"]))
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    assert any(p["type"] == "row" and p["collapsed"] and p["panels"] for p in d["panels"]), (
        "a collapsed row nests its panels"
    )
    for p in panels:
        g = p["gridPos"]
        assert all(isinstance(g[k], int) for k in "hwxy") and 0 <= g["x"] and g["x"] + g["w"] <= 24 and g["h"] > 0, p[
            "title"
        ]
        if p["type"] == "row":
            assert not p.get("targets")
            continue
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        assert p["targets"] and p["title"] and p.get("description"), p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert all(refs) and len(refs) == len(set(refs)), f"{p['title']}: refIds {refs}"
        for t in p["targets"]:
            assert t["datasource"] == p["datasource"] and t["expr"].strip()
            for var in re.findall(r"\$\{?(\w+)", t["expr"]):
                assert var in variables or var.startswith("__"), f"{p['title']}: ${var} is not a dashboard variable"
    # panels of one level do not overlap
    for level in [[p for p in d["panels"]]] + [p["panels"] for p in d["panels"] if p["type"] == "row" and p["panels"]]:
        cells = set()
        for p in level:
            g = p["gridPos"]
            mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
            assert not cells & mine, f"{p['title']} overlaps another panel"
            cells |= mine


def test_extractor_finds_names_and_labels() -> None:
    expr = (
        "histogram_quantile(0.9, sum by (le, model) "
        '(rate(a_seconds_bucket{model=~"$model", instance=~"$instance"}[$__rate_interval])))'
        ' / on (instance) group_left (region) max by (instance, region) (b_info{job="x"}) + time() - c_total offset 5m'
        ' + count without (q) ({__name__="d", e!="f"}) + vector(1)'
    )
    uses = promql_uses(expr)
    assert uses.metrics == {"a_seconds_bucket", "b_info", "c_total", "d"}
    assert ("a_seconds_bucket", frozenset({"model", "instance"})) in uses.selectors
    assert ("d", frozenset({"e"})) in uses.selectors
    clauses = {(c, labels) for c, labels, _ in uses.groupings}
    assert clauses >= {
        ("by", frozenset({"le", "model"})),
        ("on", frozenset({"instance"})),
        ("group", frozenset({"region"})),
        ("without", frozenset({"q"})),
    }
    assert query_uses('label_values(x_total{a="1"}, b)') == (Uses([("x_total", frozenset({"a"}))]), "b")
    assert query_uses("label_values(job)") == (Uses(), "job")
    with pytest.raises(ValueError, match="does not parse"):
        promql_uses("sum(rate(x[5m])")


def test_checker_rejects_made_up_metrics_and_labels() -> None:
    text = (
        '# TYPE req counter\nreq_total{model="m"} 1\n# TYPE lat histogram\nlat_bucket{le="1"} 1\n'
        'lat_bucket{le="+Inf"} 1\n'
        "lat_sum 1\nlat_count 1\n# TYPE quiet counter\n"
    )
    exp = Exposition(text, declared={"quiet": ("reason",)})
    assert exp.problems(promql_uses('sum by (model) (rate(req_total{model=~"$model"}[5m]))')) == []
    assert exp.problems(promql_uses("histogram_quantile(0.5, sum by (le) (rate(lat_bucket[5m])))")) == []
    assert exp.problems(promql_uses("sum by (reason) (rate(quiet_total[5m]))")) == []  # declared, no sample yet
    assert exp.problems(promql_uses("rate(made_up_metric_total[5m])")) == [
        "metric made_up_metric_total is not exported"
    ]
    assert exp.problems(promql_uses("rate(req[5m])")), "a counter's family name is not a sample name"
    assert exp.problems(promql_uses("rate(lat[5m])")), "neither is a histogram's"
    assert exp.problems(promql_uses('rate(req_total{colour="red"}[5m])'))
    assert exp.problems(promql_uses("sum by (colour) (rate(req_total[5m]))"))
    assert exp.problems(promql_uses("sum by (le) (rate(lat_sum[5m]))")), "le is on _bucket only"
    assert exp.problems(promql_uses('rate(quiet_total{model="m"}[5m])'))
    assert Exposition("# TYPE quiet counter\n").problems(promql_uses("rate(quiet_total[5m])")), (
        "no samples and no declaration"
    )


def test_prometheus_configs_point_at_the_services() -> None:
    from frontend.api.openapi import build_document as frontend_document
    from frontend.cli import build_parser
    from indexer.app import build_parser as indexer_parser
    from indexer.openapi import build_document as indexer_document

    with open(os.path.join(PROMETHEUS, "prometheus.yml"), encoding="utf-8") as f:
        static = yaml.safe_load(f)
    jobs = {j["job_name"]: j for j in static["scrape_configs"]}
    frontend_port = build_parser().get_default("http_port")
    assert (
        _ports(jobs["kvroute-frontend"]) == {frontend_port}
        and jobs["kvroute-frontend"].get("metrics_path", "/metrics") == "/metrics"
    )
    assert _ports(jobs["kvroute-indexer"]) == {indexer_parser().get_default("port")}
    assert jobs["kvroute-indexer"].get("metrics_path", "/metrics") == "/metrics"
    assert "/metrics" in frontend_document()["paths"] and "/metrics" in indexer_document()["paths"]
    assert not any("slot" in name for name in jobs), "the slot tracker serves no /metrics"

    with open(os.path.join(PROMETHEUS, "prometheus-kubernetes.yml"), encoding="utf-8") as f:
        k8s = yaml.safe_load(f)
    (job,) = k8s["scrape_configs"]
    assert job["kubernetes_sd_configs"][0]["role"] == "pod"
    read = {label for rule in job["relabel_configs"] for label in rule.get("source_labels", [])}
    for manifest in ("base/frontend-deployment.yaml", "components/standalone-indexer/indexer.yaml"):
        with open(os.path.join(REPO_ROOT, "deploy", "k8s", manifest), encoding="utf-8") as f:
            (dep,) = [d for d in yaml.safe_load_all(f) if d and d["kind"] == "Deployment"]
        annotations = dep["spec"]["template"]["metadata"]["annotations"]
        for key in ("prometheus.io/scrape", "prometheus.io/port", "prometheus.io/path"):
            assert key in annotations
            assert "__meta_kubernetes_pod_annotation_" + re.sub(r"[^A-Za-z0-9_]", "_", key) in read


def _ports(job: dict[str, Any]) -> set[int]:
    return {int(t.rsplit(":", 1)[1]) for sc in job["static_configs"] for t in sc["targets"]}


# ---- against running services ---------------------------------------------------------------------


def _scrape(url: str) -> str:
    r = httpx.get(url + "/metrics", timeout=5)
    r.raise_for_status()
    return r.text


def _value(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


def test_every_dashboard_query_reads_exported_metrics() -> None:
    _promql()
    with contextlib.ExitStack() as stack:
        port, ev, rp, port2, fport, iport = free_ports(6)
        murl, murl2 = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{port2}"
        stack.enter_context(
            service(
                [
                    "-m",
                    "mocker",
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(port),
                    "--max-model-len",
                    "512",
                    "--kv-events-endpoint",
                    f"tcp://127.0.0.1:{ev}",
                    "--replay-endpoint",
                    f"tcp://127.0.0.1:{rp}",
                ],
                ready_url=murl + "/health",
                timeout=90,
            )
        )
        stack.enter_context(
            service(
                [
                    "-m",
                    "mocker",
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(port2),
                    "--no-kv-events",
                    "--max-model-len",
                    "512",
                ],
                ready_url=murl2 + "/health",
                timeout=90,
            )
        )
        url, iurl = f"http://127.0.0.1:{fport}", f"http://127.0.0.1:{iport}"
        stack.enter_context(
            service(
                [
                    "-m",
                    "frontend",
                    "--http-host",
                    "127.0.0.1",
                    "--http-port",
                    str(fport),
                    "--router-mode",
                    "kv",
                    "--router-queue-threshold",
                    "4",
                    "--health-check-interval",
                    "0.5",
                    "--worker",
                    f"id=1,url={murl},kv_events_endpoint=tcp://127.0.0.1:{ev},replay_endpoint=tcp://127.0.0.1:{rp}",
                    "--worker",
                    f"id=2,url={murl2}",
                ],
                ready=lambda: len(httpx.get(url + "/v1/models", timeout=2).json()["data"]) == 1,
                timeout=90,
            )
        )
        stack.enter_context(
            service(
                [
                    "-m",
                    "indexer",
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(iport),
                    "--block-size",
                    "16",
                    "--model-name",
                    MODEL,
                    "--workers",
                    f"1=tcp://127.0.0.1:{ev}",
                ],
                ready_url=iurl + "/health",
                timeout=90,
            )
        )
        wait_until(
            lambda: all(w["healthy"] for w in httpx.get(url + "/admin/workers", timeout=2).json()["workers"]),
            30,
            what="healthy workers",
        )
        _until_both_subscribed(url, iurl)
        _traffic(url, iurl)
        # the scrape-time and asynchronous series (parity, decomposition) have caught up
        for series, labels in (
            ("kvroute_router_decomposed_requests_total", {}),
            ("kvroute_hash_parity_checks_total", {}),
            ("dynamo_frontend_requests_total", {"status": "error"}),
        ):
            wait_until(
                lambda s=series, lb=labels: _value(_scrape(url), s, **lb) > 0, 60, what=f"frontend series {series}"
            )
        front = wait_until(
            lambda: _scrape(url),
            30,
            what="frontend series",
        )
        idx = wait_until(
            lambda: (
                (t := _scrape(iurl))
                and _value(t, "kvroute_kv_events_received_total") > 0
                and _value(t, "dynamo_kvindexer_errors_total") > 0
                and t
            ),
            30,
            what="indexer series",
        )

    declared = declared_frontend_labels()
    frontend_exp, indexer_exp = Exposition(front, declared), Exposition(idx)
    row_title = _dashboard_module().INDEXER_ROW
    problems, checked = [], set()
    for row, where, query in dashboard_queries(load_dashboard()):
        exp = indexer_exp if row == row_title else frontend_exp
        if where.startswith("variable indexer"):
            exp = indexer_exp
        uses, label = query_uses(query)
        assert uses.selectors or label in TARGET_LABELS, f"{where}: reads no metric: {query}"
        checked |= uses.metrics
        problems += [f"{where}: {p}" for p in exp.problems(uses)]
        if label is not None and label not in TARGET_LABELS:
            problems += [
                f"{where}: label_values lists {label}, which {name} does not have"
                for name, _ in uses.selectors
                if label not in exp.labels.get(name, set())
            ]
    assert not problems, "\n".join(problems)
    # what the dashboard shows of the list (a renamed metric would drop a panel silently otherwise)
    for must in (
        "dynamo_frontend_router_queue_pending_requests",
        "dynamo_frontend_worker_active_prefill_tokens_",
        "kvroute_hash_parity_mismatch",
        "kvroute_router_delivered_cached_tokens_total",
        "dynamo_frontend_model_migration_total",
        "dynamo_frontend_time_to_first_token_seconds_bucket",
        "dynamo_frontend_inter_token_latency_seconds_bucket",
        "dynamo_frontend_request_duration_seconds_bucket",
        "kvroute_kv_event_gaps_total",
        "dynamo_kvindexer_requests_total",
    ):
        assert any(m.startswith(must.rstrip("_")) for m in checked), must


def _until_both_subscribed(url: str, iurl: str) -> None:
    """Requests until the frontend and the indexer have both applied a KV event: a ZMQ subscription reaches
    the mocker's publisher asynchronously, and batches published before it are not seen (one request per
    round, each with a new prompt, so that every round publishes)."""
    rounds = iter(range(1000))

    def applied() -> bool:
        prompt = f"warm-up {next(rounds)} " * 20
        body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": 1}
        assert httpx.post(url + "/v1/chat/completions", json=body, timeout=60).status_code == 200
        return (
            _value(_scrape(url), "dynamo_kvrouter_kv_cache_events_applied") > 0
            and _value(_scrape(iurl), "kvroute_kv_events_received_total") > 0
        )

    wait_until(applied, 60, 0.2, what="KV events applied by the frontend and the indexer")


def _traffic(url: str, iurl: str) -> None:
    """A few requests so that labelled series and histograms exist: unary, streamed, completions, a
    counted error (prompt over the context length), a stream the client abandons, and indexer queries."""
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hello " * 40}], "max_tokens": 4}
    for _ in range(2):
        assert httpx.post(url + "/v1/chat/completions", json=chat, timeout=60).status_code == 200
    with httpx.stream("POST", url + "/v1/chat/completions", json={**chat, "stream": True}, timeout=60) as r:
        assert r.status_code == 200 and b"[DONE]" in r.read()
    assert (
        httpx.post(
            url + "/v1/completions", json={"model": MODEL, "prompt": "hi there " * 30, "max_tokens": 3}, timeout=60
        ).status_code
        == 200
    )
    too_long = {**chat, "messages": [{"role": "user", "content": "word " * 2000}]}
    assert httpx.post(url + "/v1/chat/completions", json=too_long, timeout=60).status_code == 400
    assert httpx.post(iurl + "/query", json={}, timeout=10).status_code >= 400
    assert (
        httpx.post(iurl + "/query", json={"model_name": MODEL, "token_ids": list(range(64))}, timeout=10).status_code
        < 500
    )


def test_monitoring_component_ships_the_dashboard() -> None:
    """Overlays with components/monitoring carry the dashboard as a sidecar-labelled ConfigMap, byte for byte."""
    from test_deploy_k8s import render

    with open(os.path.join(GRAFANA, "kvroute.json"), encoding="utf-8") as f:
        text = f.read()
    for overlay in ("production", "standalone-services"):
        maps = [
            o
            for o in render(overlay)
            if o["kind"] == "ConfigMap" and o["metadata"]["name"] == "kvroute-grafana-dashboard"
        ]
        assert len(maps) == 1, overlay
        assert maps[0]["metadata"]["labels"]["grafana_dashboard"] == "1"
        assert maps[0]["data"] == {"kvroute.json": text}
    assert not any(o["metadata"]["name"] == "kvroute-grafana-dashboard" for o in render("dev")), (
        "dev has no monitoring component"
    )
