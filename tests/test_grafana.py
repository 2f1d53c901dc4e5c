"""deploy/grafana/kvroute.json and deploy/prometheus/prometheus.yml against what the frontend exports.

Every PromQL expression of the dashboard (panel targets, rows' panels, template-variable queries) is
read for the metric names and label names it uses, and each is checked against ``/metrics`` of a
running frontend with simulated workers that has served requests: a dashboard that names a metric
the frontend does not export shows an empty panel forever, and nobody notices.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from kvroute_common.local_cluster import MockerOptions, start_cluster
from support import REPO_ROOT, wait_until

DASHBOARD = os.path.join(REPO_ROOT, "deploy", "grafana", "kvroute.json")
PROMETHEUS = os.path.join(REPO_ROOT, "deploy", "prometheus", "prometheus.yml")

# Labels Prometheus itself attaches to every scraped series (not in /metrics).
TARGET_LABELS = {"instance", "job", "le"}  # le: the bucket label of histograms, named with _bucket
FUNCTIONS_AND_KEYWORDS = {
    "sum", "min", "max", "avg", "count", "stddev", "stdvar", "topk", "bottomk", "quantile", "count_values", "group",
    "by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless", "offset",
}
LABEL_LIST_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right"}
_TOKEN = re.compile(
    r'\s+|"(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\])*\'|\[[^\]]*\]|\{(?:"(?:\\.|[^"\\])*"|[^}"])*\}|\$\w+|'
    r'(?:\d+(?:ms|[smhdwy]))+(?![A-Za-z0-9_])|\d+(?:\.\d+)?(?:[eE][+-]?\d+)?|[A-Za-z_:][A-Za-z0-9_:]*|==|!=|>=|<=|=~|!~|[-+*/%^(),<>=]'
)
_MATCHER = re.compile(r'\s*([A-Za-z_][A-Za-z0-9_]*)\s*(=~|!~|!=|=)\s*"(?:\\.|[^"\\])*"\s*,?')


@dataclass
class Selector:
    metric: str
    labels: set[str] = field(default_factory=set)


@dataclass
class Query:
    selectors: list[Selector]
    grouping: set[str]  # labels named in by/without/on/ignoring/group_* lists


def parse_promql(expr: str) -> Query:
    """The metric selectors and grouping labels of a PromQL expression (enough to check names)."""
    tokens = [t for t in _TOKEN.findall(expr) if not t.isspace()]
    if "".join(tokens).replace(" ", "") != re.sub(r"\s+", "", expr):
        raise ValueError(f"cannot tokenize PromQL: {expr!r}")
    selectors: list[Selector] = []
    grouping: set[str] = set()
    i = 0
    while i < len(tokens):
        tok = tokens[i]
        nxt = tokens[i + 1] if i + 1 < len(tokens) else ""
        if tok in LABEL_LIST_KEYWORDS and nxt == "(":
            j = tokens.index(")", i)
            grouping.update(t for t in tokens[i + 2:j] if t != ",")
            i = j + 1
            continue
        if re.fullmatch(r"[A-Za-z_:][A-Za-z0-9_:]*", tok):
            if nxt == "(" or tok in FUNCTIONS_AND_KEYWORDS:
                i += 1
                continue
            sel = Selector(tok)
            if nxt.startswith("{"):
                sel.labels = _matcher_labels(nxt)
                i += 1
            selectors.append(sel)
        elif tok.startswith("{"):  # a selector without a metric name: {__name__=~...} is not used here
            raise ValueError(f"selector without a metric name in {expr!r}")
        i += 1
    return Query(selectors, grouping)


def _matcher_labels(block: str) -> set[str]:
    inner = block[1:-1]
    labels: set[str] = set()
    pos = 0
    while pos < len(inner):
        m = _MATCHER.match(inner, pos)
        if not m:
            raise ValueError(f"cannot read label matchers {block!r}")
        labels.add(m.group(1))
        pos = m.end()
    return labels


def _label_values_metric(query: str) -> Selector:
    m = re.fullmatch(r"\s*label_values\(\s*([A-Za-z_:][A-Za-z0-9_:]*)\s*,\s*([A-Za-z_][A-Za-z0-9_]*)\s*\)\s*", query)
    assert m, f"template query is not label_values(metric, label): {query!r}"
    return Selector(m.group(1), {m.group(2)})


def _panels(panels: list[dict]) -> Iterator[dict]:
    for p in panels:
        yield p
        yield from _panels(p.get("panels", []))


def _dashboard() -> dict:
    with open(DASHBOARD) as f:
        return json.load(f)


def dashboard_queries(dash: dict) -> list[tuple[str, Query]]:
    """(where, parsed query) for every expression the dashboard evaluates."""
    out = []
    for p in _panels(dash["panels"]):
        for t in p.get("targets", []):
            out.append((f"panel {p['id']} {p['title']!r} {t['refId']}", parse_promql(t["expr"])))
    for var in dash.get("templating", {}).get("list", []):
        if var.get("type") == "query":
            q = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
            out.append((f"variable {var['name']}", Query([_label_values_metric(q)], set())))
    return out


@dataclass
class Exported:
    """What ``/metrics`` says: every sample name that can appear, and the label names seen per sample name."""

    samples: set[str] = field(default_factory=set)
    labels: dict[str, set[str]] = field(default_factory=dict)
    declared_only: set[str] = field(default_factory=set)  # families declared (HELP/TYPE) with no series yet


SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "summary": ("", "_sum", "_count"),
            "gauge": ("",), "untyped": ("",), "info": ("_info",)}


def read_exported(text: str) -> Exported:
    ex = Exported()
    for fam in text_string_to_metric_families(text):
        names = {fam.name + s for s in SUFFIXES.get(fam.type, ("",))}
        ex.samples |= names
        if not fam.samples:
            ex.declared_only |= names
        for s in fam.samples:
            ex.samples.add(s.name)
            ex.labels.setdefault(s.name, set()).update(s.labels)
    return ex


def check(dash: dict, ex: Exported) -> list[str]:
    """Problems: metrics not exported, labels not carried by the metrics of their expression."""
    problems = []
    for where, q in dashboard_queries(dash):
        carried: set[str] = set(TARGET_LABELS)
        verifiable = True
        for sel in q.selectors:
            if sel.metric not in ex.samples:
                problems.append(f"{where}: metric {sel.metric!r} is not exported")
                verifiable = False
                continue
            if sel.metric in ex.declared_only:
                verifiable = False  # no series yet: its label names cannot be read from /metrics
                continue
            have = ex.labels.get(sel.metric, set()) | TARGET_LABELS
            carried |= have
            for label in sel.labels - have:
                problems.append(f"{where}: {sel.metric!r} has no label {label!r}")
        if verifiable:
            for label in q.grouping - carried:
                problems.append(f"{where}: groups by {label!r}, which none of its metrics carries")
    return problems


# --- units: the reader finds what it must, and the check fails on a made-up metric -----------------------


def test_promql_reader() -> None:
    q = parse_promql('histogram_quantile(0.99, sum by (le, operation) (rate(x_ms_bucket{model=~"$model", a!="b,c}"}[$__rate_interval])))')
    assert [(s.metric, s.labels) for s in q.selectors] == [("x_ms_bucket", {"model", "a"})]
    assert q.grouping == {"le", "operation"}
    q = parse_promql("time() - max by (worker_id) (last_ts) / 1e3 + sum(rate(a_total[5m] offset 1h)) by (w) or on(x) b")
    assert [s.metric for s in q.selectors] == ["last_ts", "a_total", "b"]
    assert q.grouping == {"worker_id", "w", "x"}
    with pytest.raises(ValueError):
        parse_promql('rate({__name__="x"}[1m])')


def test_check_refuses_unknown_metrics_and_labels() -> None:
    text = ('# TYPE good_total counter\ngood_total{model="m"} 1\n'
            '# TYPE h histogram\nh_bucket{le="1"} 1\nh_bucket{le="+Inf"} 1\nh_sum 1\nh_count 1\n')
    ex = read_exported(text)
    ok = {"panels": [{"id": 1, "title": "t", "targets": [
        {"refId": "A", "expr": 'sum by (model) (rate(good_total{model="m"}[1m]))'},
        {"refId": "B", "expr": "histogram_quantile(0.5, sum by (le) (rate(h_bucket[1m])))"}]}]}
    assert check(ok, ex) == []
    bad = {"panels": [{"id": 1, "title": "t", "targets": [
        {"refId": "A", "expr": "rate(made_up_metric_total[1m])"},
        {"refId": "B", "expr": 'good_total{worker="1"}'},
        {"refId": "C", "expr": "sum by (worker) (good_total)"}]}]}
    assert len(check(bad, ex)) == 3


# --- the dashboard file ---------------------------------------------------------------------------------


def test_dashboard_structure() -> None:
    dash = _dashboard()
    assert dash["uid"] and dash["title"] and dash["schemaVersion"] >= 36
    ids = [p["id"] for p in _panels(dash["panels"])]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for p in _panels(dash["panels"]):
        assert {"h", "w", "x", "y"} <= set(p["gridPos"]) and p["gridPos"]["x"] + p["gridPos"]["w"] <= 24, p["title"]
        if p["type"] == "row":
            continue
        assert p["datasource"]["uid"] == "${datasource}", p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert refs and len(refs) == len(set(refs)), p["title"]
    names = [v["name"] for v in dash["templating"]["list"]]
    assert "datasource" in names and "model" in names
    # every row of the issue is covered
    titles = " ".join(p["title"].lower() for p in _panels(dash["panels"]))
    for words in ("time to first token", "inter-token", "hit-rate decomposition", "router queue", "active prefill tokens",
                  "active decode blocks", "kv events", "hash-parity", "routing decisions"):
        assert words in titles, words


def test_prometheus_config_scrapes_the_services() -> None:
    with open(PROMETHEUS) as f:
        cfg = yaml.safe_load(f)
    jobs = {j["job_name"]: j for j in cfg["scrape_configs"]}
    frontend = jobs["kvroute-frontend"]
    assert frontend.get("metrics_path", "/metrics") == "/metrics"
    assert any(t.endswith(":8000") for sc in frontend["static_configs"] for t in sc["targets"])  # the frontend's default port
    assert any(t.endswith(":8090") for sc in jobs["kvroute-indexer"]["static_configs"] for t in sc["targets"])
    k8s = jobs["kvroute-kubernetes-pods"]
    assert k8s["kubernetes_sd_configs"][0]["role"] == "pod"
    annotations = {r.get("source_labels", [""])[0] for r in k8s["relabel_configs"]}
    assert "__meta_kubernetes_pod_annotation_prometheus_io_scrape" in annotations


# --- against a running frontend ---------------------------------------------------------------------------


def test_every_dashboard_query_names_exported_metrics() -> None:
    with start_cluster(2, MockerOptions(speedup_ratio=20.0)) as cluster:
        url = cluster.frontend_url
        assert url
        chat = {"model": "kvroute-demo", "messages": [{"role": "user", "content": "tell me about prefix caches " * 20}], "max_tokens": 4}
        with httpx.Client(timeout=60) as c:
            for stream in (False, True, True):
                r = c.post(f"{url}/v1/chat/completions", json={**chat, "stream": stream})
                assert r.status_code == 200
            assert c.post(f"{url}/v1/chat/completions", json={**chat, "model": "missing"}).status_code == 404

            def metrics_ready() -> str | None:
                text = c.get(f"{url}/metrics").text
                return text if "kvroute_router_delivered_cached_tokens_total{" in text else None

            text = wait_until(metrics_ready, 30, what="request metrics with series")
        exported = read_exported(text)
        dash = _dashboard()
        assert check(dash, exported) == []
        used = {s.metric for _, q in dashboard_queries(dash) for s in q.selectors}
        # most of what the dashboard reads has live series after a handful of requests (the rest are
        # failure counters: rejections, migrations, queue refusals, disaggregated prefill)
        with_series = used - exported.declared_only
        assert len(with_series) >= 0.8 * len(used), sorted(used & exported.declared_only)
