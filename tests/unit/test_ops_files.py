"""The operations kit in ops/ (and docs/operating.md) agrees with the code:
metrics, label values, reasons, commands.

No database needed. PyYAML is not a project dependency, so the YAML files are not parsed
here: ``promtool check rules`` / ``check config`` prove they are valid, ``promtool test
rules`` runs the alert unit tests, and this module reads ``alert:``, ``expr:`` and
``runbook_url:`` entries textually (a count check makes sure none is missed). PromQL is
read the same way: selectors, matchers and grouping labels are taken apart with regular
expressions, and ``promtool`` parses every dashboard query for real (as recording rules).
promtool comes from Debian's ``prometheus`` package; without it those tests are skipped,
except under ``CI=true``, where that is a failure.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shlex
import shutil
import subprocess
from dataclasses import dataclass
from enum import StrEnum
from functools import cache
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from reconciler.cli import build_parser
from reconciler.config.settings import NON_SETTING_VARIABLES, Settings
from reconciler.core.vocabulary import (
    DatabaseErrorCode,
    Disposition,
    LivenessDoubt,
    OperatorStatusReason,
    PassOutcome,
    Reason,
    StuckReason,
    WorkerStatusReason,
)
from reconciler.sidecar.metrics import Metrics
from reconciler.worker.runtime import LIFETIME_EXCEEDED

REPO = Path(__file__).resolve().parents[2]
OPS = REPO / "ops"
ALERTS = OPS / "prometheus" / "alerts.yml"
ALERT_TESTS = OPS / "prometheus" / "alerts_test.yml"
PROMETHEUS_CONFIG = OPS / "prometheus" / "prometheus.yml"
DASHBOARD = OPS / "grafana" / "reconciler-dashboard.json"
RUNBOOK = OPS / "runbook.md"
KUBERNETES = OPS / "kubernetes" / "reconciler-sidecar.yaml"
SYSTEMD = OPS / "systemd" / "stale-claim-reconciler.service"
OPERATING = REPO / "docs" / "operating.md"
SERVICE_SOURCE = REPO / "reconciler" / "sidecar" / "service.py"

# Labels Prometheus attaches to every scraped series.
TARGET_LABELS = frozenset({"job", "instance"})
# Labels whose values the service takes from an enum: a matcher must use those values.
ENUM_LABELS: dict[str, type[StrEnum]] = {
    "reason": Reason, "outcome": PassOutcome, "disposition": Disposition,
    "code": DatabaseErrorCode,
}
# Metrics whose label of that name takes another enum's values.
METRIC_ENUM_LABELS: dict[tuple[str, str], type[StrEnum]] = {
    ("reconciler_stale_claims", "reason"): StuckReason,
    ("reconciler_oldest_stale_claim_age_seconds", "reason"): StuckReason,
    ("reconciler_liveness_unknown", "code"): LivenessDoubt,
}
# Series the alert unit tests may feed besides the service's own (Prometheus' scrape health).
PROMETHEUS_SERIES = frozenset({"up"})
SEVERITIES = frozenset({"critical", "warning", "info"})
# Grafana's built-in interval variables, replaced by a duration before promtool parses.
GRAFANA_INTERVAL = re.compile(r"\$__(?:rate_interval|interval|range)\b")
GRAFANA_VARIABLE = re.compile(r"\$\{?\w+\}?")


def promtool_or_skip() -> str:
    """promtool's path; a skip naming the package, or a failure under CI=true."""
    path = shutil.which("promtool")
    if path is None:
        message = ("promtool not found: install Debian's prometheus package "
                   "(apt-get install -y prometheus) to check ops/prometheus")
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(message)
        pytest.skip(message)
    return path


def run_promtool(*args: str, cwd: Path) -> None:
    """Run promtool and fail with its whole output when it does not succeed."""
    result = subprocess.run([promtool_or_skip(), *args], cwd=cwd, capture_output=True,
                            text=True, timeout=120, check=False)
    assert result.returncode == 0, (
        f"promtool {' '.join(args)} failed:\n{result.stdout}\n{result.stderr}")


# -- what the service exports ---------------------------------------------------------------

_SAMPLE = re.compile(r"^(?P<name>[A-Za-z_:][A-Za-z0-9_:]*)(?:\{(?P<labels>[^}]*)\})?\s")
_TYPE_LINE = re.compile(r"^# TYPE (?P<name>\S+) (?P<type>\S+)$")
# The sample names each metric type line stands for in the text format.
_TYPE_SAMPLES = {"counter": ("",), "gauge": ("",), "untyped": ("",),
                 "histogram": ("_bucket", "_sum", "_count"),
                 "summary": ("", "_sum", "_count")}


def register_service_metrics(registry: CollectorRegistry) -> list[str]:
    """Register the metrics the sidecar service declares beside Metrics(), read from source.

    The service is too heavy to construct here (it opens the database), so each
    ``Counter(...)``/``Gauge(...)``/``Histogram(...)`` call in its source is repeated on
    ``registry`` with the same name and label names.
    """
    kinds: dict[str, Any] = {"Counter": Counter, "Gauge": Gauge, "Histogram": Histogram}
    names = []
    for node in ast.walk(ast.parse(SERVICE_SOURCE.read_text())):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id in kinds and node.args
                and isinstance(node.args[0], ast.Constant)):
            continue
        labels: list[str] = []
        if len(node.args) > 2:
            labels = list(ast.literal_eval(node.args[2]))
        for keyword in node.keywords:
            if keyword.arg == "labelnames":
                labels = list(ast.literal_eval(keyword.value))
        name = str(node.args[0].value)
        kinds[node.func.id](name, "declared in reconciler/sidecar/service.py", labels,
                            registry=registry)
        names.append(name)
    return names


@cache
def exported() -> dict[str, frozenset[str]]:
    """Every sample name /metrics serves, with the label names its samples carry."""
    metrics = Metrics()
    assert register_service_metrics(metrics.registry), (
        "found no metric declared in reconciler/sidecar/service.py (its pass overrun counter)")
    found: dict[str, set[str]] = {}
    for line in generate_latest(metrics.registry).decode().splitlines():
        type_line = _TYPE_LINE.match(line)
        if type_line:
            for suffix in _TYPE_SAMPLES[type_line["type"]]:
                found.setdefault(type_line["name"] + suffix, set())
            continue
        sample = _SAMPLE.match(line)
        if sample:
            labels = re.findall(r'(\w+)="', sample["labels"] or "")
            found.setdefault(sample["name"], set()).update(labels)
    return {name: frozenset(labels) for name, labels in found.items()}


def all_label_names() -> frozenset[str]:
    """Every label some exported sample carries, plus the scrape's own."""
    return TARGET_LABELS.union(*exported().values())


# -- PromQL, taken apart textually --------------------------------------------------------

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'')
_SELECTOR = re.compile(r"(?P<name>[A-Za-z_:][A-Za-z0-9_:]*)?\s*\{(?P<matchers>[^{}]*)\}")
_MATCHER = re.compile(
    r'(?P<label>[A-Za-z_]\w*)\s*(?P<op>=~|!~|!=|=)\s*"(?P<value>(?:[^"\\]|\\.)*)"')
_GROUPING = re.compile(
    r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\((?P<labels>[^()]*)\)")
_RANGE = re.compile(r"\[[^\]]*\]")
_IDENTIFIER = re.compile(r"(?<![\w.$:])[A-Za-z_:][A-Za-z0-9_:]*")
_KEYWORDS = frozenset({"and", "or", "unless", "by", "without", "on", "ignoring",
                       "group_left", "group_right", "bool", "offset", "inf", "nan"})


@dataclass(frozen=True, slots=True)
class Matcher:
    """One label matcher of a selector."""

    label: str
    op: str
    value: str


@dataclass(frozen=True, slots=True)
class PromQL:
    """What a PromQL expression refers to: metric names, matchers, grouping labels."""

    metrics: frozenset[str]
    selectors: tuple[tuple[str | None, tuple[Matcher, ...]], ...]
    grouping_labels: frozenset[str]


def parse_promql(expr: str) -> PromQL:
    """Metric names, selectors and grouping labels of ``expr``, found textually."""
    selectors = tuple(
        (m["name"], tuple(Matcher(x["label"], x["op"], x["value"])
                          for x in _MATCHER.finditer(m["matchers"])))
        for m in _SELECTOR.finditer(expr)
    )
    rest = _SELECTOR.sub(lambda m: f" {m['name'] or ''} ", expr)
    grouping = {label.strip() for m in _GROUPING.finditer(rest)
                for label in m["labels"].split(",") if label.strip()}
    rest = _RANGE.sub(" ", _STRING.sub(" ", _GROUPING.sub(" ", rest)))
    names = set()
    for m in _IDENTIFIER.finditer(rest):
        is_function = re.match(r"\s*\(", rest[m.end():]) is not None
        if not is_function and m.group() not in _KEYWORDS:
            names.add(m.group())
    return PromQL(frozenset(names), selectors, frozenset(grouping))


class TestPromQLParsing:
    """The textual PromQL reader this module's checks rely on."""

    def test_finds_metrics_matchers_and_grouping(self) -> None:
        """Functions, keywords, durations and numbers are not taken for metric names."""
        parsed = parse_promql(
            'histogram_quantile(0.9, sum by (le) (rate(a_bucket{job=~"$job"}[$__rate_interval])))'
            ' > 1e3 and on (job) b_total offset 5m unless absent(c{reason=~"x|y"})')
        assert parsed.metrics == {"a_bucket", "b_total", "c"}
        assert parsed.grouping_labels == {"le", "job"}
        assert [m for _, ms in parsed.selectors for m in ms] == [
            Matcher("job", "=~", "$job"), Matcher("reason", "=~", "x|y")]


# -- the files ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class AlertRule:
    """One alerting rule of alerts.yml, read textually."""

    name: str
    keys: frozenset[str]
    values: dict[str, str]


def _yaml_scalar(block: str, key: str) -> str | None:
    """The value of the first ``key:`` in ``block``: inline (plain or quoted) or a block scalar."""
    found = re.search(rf"^(?P<indent>[ ]*)(?:- )?{key}:[ ]*(?P<rest>.*)$", block, re.MULTILINE)
    if found is None:
        return None
    rest = found["rest"].strip()
    if rest in ("|", "|-", ">", ">-"):
        body = []
        for line in block[found.end():].splitlines()[1:]:
            indent = len(line) - len(line.lstrip(" "))
            if line.strip() and indent <= len(found["indent"]):
                break
            body.append(line.strip())
        return (" " if rest.startswith(">") else "\n").join(body).strip()
    if rest.startswith('"'):
        return str(json.loads(rest))
    if rest.startswith("'"):
        return rest[1:-1].replace("''", "'")
    return rest


@cache
def alert_rules() -> tuple[AlertRule, ...]:
    """Every ``- alert:`` entry of alerts.yml with its keys and scalar values."""
    text = ALERTS.read_text()
    starts = list(re.finditer(r"^\s*- alert:\s*(\S+)\s*$", text, re.MULTILINE))
    rules = []
    for i, start in enumerate(starts):
        block = text[start.start():starts[i + 1].start() if i + 1 < len(starts) else None]
        keys = frozenset(re.findall(r"^\s*(?:- )?(\w+):", block, re.MULTILINE))
        values = {key: value for key in ("expr", "for", "severity", "summary", "description",
                                         "runbook_url")
                  if (value := _yaml_scalar(block, key)) is not None}
        rules.append(AlertRule(start[1], keys, values))
    assert len(rules) == len(re.findall(r"^\s*expr:", text, re.MULTILINE)), (
        "every expr: in alerts.yml should belong to an alert (no recording rules expected)")
    return tuple(rules)


@cache
def dashboard() -> dict[str, Any]:
    """The Grafana dashboard JSON."""
    return dict(json.loads(DASHBOARD.read_text()))


def dashboard_panels() -> list[dict[str, Any]]:
    """Every panel, including those inside collapsed rows."""
    out = []
    for panel in dashboard()["panels"]:
        out.append(panel)
        out.extend(panel.get("panels", []))
    return out


@dataclass(frozen=True, slots=True)
class Query:
    """One PromQL expression and where it is."""

    where: str
    expr: str


def queries() -> list[Query]:
    """Every PromQL expression of the alert rules and of the dashboard's panels."""
    found = [Query(f"alerts.yml {r.name}", r.values["expr"]) for r in alert_rules()]
    for panel in dashboard_panels():
        for target in panel.get("targets", []):
            found.append(Query(f"dashboard panel {panel.get('title')!r} target "
                               f"{target.get('refId')}", target.get("expr", "")))
    return found


_LABEL_VALUES = re.compile(r"^label_values\((?P<selector>[^,]+),\s*(?P<label>\w+)\)$")


def variable_queries() -> list[tuple[str, str]]:
    """(name, query) of the dashboard's query variables."""
    out = []
    for variable in dashboard()["templating"]["list"]:
        if variable.get("type") == "query":
            query = variable["query"]
            out.append((variable["name"], query["query"] if isinstance(query, dict) else query))
    return out


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a Markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def markdown_outside_code(text: str) -> list[str]:
    """The lines of a Markdown text that are not inside fenced code blocks."""
    lines, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(line)
    return lines


@cache
def runbook_anchors() -> frozenset[str]:
    """The anchors of every heading in ops/runbook.md."""
    return frozenset(github_anchor(m[1]) for line in markdown_outside_code(RUNBOOK.read_text())
                     if (m := re.match(r"^#{1,6}\s+(.+?)\s*#*$", line)))


def runbook_section(anchor: str) -> str:
    """The text of the runbook section whose heading has this anchor, up to the next heading
    of the same or a higher level."""
    lines = RUNBOOK.read_text().splitlines()
    for i, line in enumerate(lines):
        heading = re.match(r"^(#{1,6})\s+(.+?)\s*#*$", line)
        if heading and github_anchor(heading[2]) == anchor:
            level = len(heading[1])
            body = []
            for later in lines[i + 1:]:
                if re.match(rf"^#{{1,{level}}}\s", later):
                    break
                body.append(later)
            return "\n".join(body)
    pytest.fail(f"ops/runbook.md has no section #{anchor}")


def operator_status_reasons() -> set[str]:
    """The status reasons operator actions write."""
    return {reason.value for reason in OperatorStatusReason}


def runbook_commands() -> list[str]:
    """Every ``reconciler ...`` command line of the runbook (code blocks and inline code)."""
    text = RUNBOOK.read_text()
    commands = []
    fenced = False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif fenced and line.strip().startswith("reconciler "):
            commands.append(line.strip())
    commands += [re.sub(r"\s+", " ", c) for c in re.findall(r"`(reconciler [^`]+)`", text)
                 if "..." not in c]
    return commands


def parses_as_cli(command: str, *, job_id_optional: bool = False) -> None:
    """Fail unless ``command`` (``reconciler ...``) is accepted by the real argument parser.

    ``JOB_ID`` stands for a job number; with ``job_id_optional`` a command named in prose
    (``reconciler jobs retry``) may leave it out.
    """
    argv = shlex.split(command.split(" | ", maxsplit=1)[0].replace("JOB_ID", "1"))
    assert argv[0] == "reconciler", command
    attempts = [argv[1:], [*argv[1:], "1"]] if job_id_optional else [argv[1:]]
    for args in attempts:
        try:
            build_parser().parse_args(args)
            return
        except SystemExit:  # argparse reports on stderr and exits 2
            continue
    pytest.fail(f"not a valid reconciler command line: {command!r}")


# -- metrics and label values --------------------------------------------------------------


class TestMetricNames:
    """Every PromQL expression names only metrics and labels the service exports."""

    def test_the_exported_set_includes_the_service_counter(self) -> None:
        """The set checked against holds Metrics() and the counter service.py adds."""
        names = register_service_metrics(CollectorRegistry())
        assert all(f"{name}_total" in exported() for name in names)
        assert "reconciler_pass_duration_seconds_bucket" in exported()

    @pytest.mark.parametrize("query", queries(), ids=lambda q: q.where)
    def test_every_metric_is_exported(self, query: Query) -> None:
        """Each metric an alert or a dashboard panel queries is served on /metrics."""
        parsed = parse_promql(query.expr)
        assert parsed.metrics, f"{query.where}: no metric found in {query.expr!r}"
        unknown = sorted(parsed.metrics - exported().keys())
        assert not unknown, f"{query.where}: not exported by the service: {unknown}"

    @pytest.mark.parametrize("query", queries(), ids=lambda q: q.where)
    def test_matchers_use_real_labels_and_values(self, query: Query) -> None:
        """Matchers name labels the metric has, and enum labels only the enum's values."""
        for metric, matchers in parse_promql(query.expr).selectors:
            assert metric is not None, f"{query.where}: selector without a metric name"
            labels = exported().get(metric, frozenset()) | TARGET_LABELS
            for matcher in matchers:
                assert matcher.label in labels, (
                    f"{query.where}: {metric} has no label {matcher.label!r}")
                check_enum_matcher(query.where, matcher, metric)

    @pytest.mark.parametrize("query", queries(), ids=lambda q: q.where)
    def test_grouping_labels_exist(self, query: Query) -> None:
        """``by``/``on``/``without`` clauses name labels some exported series carries."""
        unknown = sorted(parse_promql(query.expr).grouping_labels - all_label_names())
        assert not unknown, f"{query.where}: grouping by labels no series has: {unknown}"

    @pytest.mark.parametrize(("name", "query"), variable_queries())
    def test_dashboard_variables_query_exported_metrics(self, name: str, query: str) -> None:
        """Template variables list label values of an exported metric's real label."""
        found = _LABEL_VALUES.match(query)
        assert found, f"variable {name}: expected label_values(metric, label), got {query!r}"
        metrics = parse_promql(found["selector"]).metrics
        assert len(metrics) == 1, f"variable {name}: {query!r}"
        assert metrics <= exported().keys(), f"variable {name}: {query!r}"
        assert found["label"] in exported()[next(iter(metrics))] | TARGET_LABELS

    def test_alert_unit_test_series_look_like_the_service(self) -> None:
        """alerts_test.yml feeds series with exported names and valid label values."""
        series = re.findall(r"^\s*- series:\s*'([^']+)'", ALERT_TESTS.read_text(), re.MULTILINE)
        assert series
        for text in series:
            parsed = parse_promql(text)
            unknown = parsed.metrics - exported().keys() - PROMETHEUS_SERIES
            assert not unknown, f"alerts_test.yml series {text!r}: not exported: {unknown}"
            for metric, matchers in parsed.selectors:
                for matcher in matchers:
                    check_enum_matcher(f"alerts_test.yml series {text!r}", matcher, metric)


class TestMetricEnumLabels:
    """The enums METRIC_ENUM_LABELS checks matchers against are those the service uses."""

    @pytest.mark.parametrize(("metric", "label"), sorted(METRIC_ENUM_LABELS))
    def test_the_service_exports_every_value_of_the_enum(self, metric: str, label: str
                                                         ) -> None:
        """Each value of the enum is a series from the first scrape, and nothing else."""
        text = generate_latest(Metrics().registry).decode()
        values = set(re.findall(rf'^{metric}{{{label}="([^"]+)"}}', text, re.MULTILINE))
        assert values == {member.value for member in METRIC_ENUM_LABELS[metric, label]}


def check_enum_matcher(where: str, matcher: Matcher, metric: str | None = None) -> None:
    """A matcher on an enum label uses values of that enum (a regex only as a|b|c): the
    metric's own enum for that label where it has one, else the label's."""
    enum = METRIC_ENUM_LABELS.get((metric or "", matcher.label), ENUM_LABELS.get(matcher.label))
    if enum is None:
        return
    values = matcher.value.split("|") if matcher.op in ("=~", "!~") else [matcher.value]
    valid = {member.value for member in enum}
    bad = [v for v in values if v not in valid]
    assert not bad, (f"{where}: {matcher.label}{matcher.op}{matcher.value!r}: not "
                     f"{enum.__name__} values: {bad} (valid: {sorted(valid)})")


# -- alert rules ------------------------------------------------------------------------------


class TestAlertRules:
    """alerts.yml: valid, complete, tested, and linked to the runbook."""

    def test_the_group_is_named_after_the_service(self) -> None:
        """The rules live in one group called stale-claim-reconciler."""
        assert re.search(r"^\s*- name:\s*stale-claim-reconciler\s*$", ALERTS.read_text(),
                         re.MULTILINE)

    def test_the_issue_alerts_exist(self) -> None:
        """Not passing, erroring, backlog growing, worker_died_mid_step spike, no leader."""
        names = {rule.name for rule in alert_rules()}
        assert {"ReconcilerNotPassing", "ReconcilerPassesErroring",
                "ReconcilerStaleBacklogGrowing", "ReconcilerWorkerDiedMidStepSpike",
                "ReconcilerNoLeader"} <= names
        assert len(names) == len(alert_rules()), "alert names are unique"

    def test_the_brake_has_an_alert_on_its_gauge(self) -> None:
        """ReconcilerBrakeEngaged watches reconciler_brake_engaged."""
        rules = {rule.name: rule for rule in alert_rules()}
        assert "ReconcilerBrakeEngaged" in rules
        expr = rules["ReconcilerBrakeEngaged"].values["expr"]
        assert parse_promql(expr).metrics == {"reconciler_brake_engaged"}

    def test_decision_alerts_never_count_shadow_decisions(self) -> None:
        """Alerts on decisions read reconciler_decisions_total, which a shadow pass leaves
        alone, so a week in shadow mode pages nobody."""
        for rule in alert_rules():
            assert "reconciler_shadow_decisions_total" not in rule.values["expr"], rule.name

    @pytest.mark.parametrize("rule", alert_rules(), ids=lambda r: r.name)
    def test_every_alert_has_severity_summary_description_and_runbook(
            self, rule: AlertRule) -> None:
        """Each alert carries a known severity and the three annotations."""
        missing = {"expr", "severity", "summary", "description", "runbook_url"} - rule.keys
        assert not missing, f"{rule.name} lacks {sorted(missing)}"
        assert rule.values["severity"] in SEVERITIES

    @pytest.mark.parametrize("rule", alert_rules(), ids=lambda r: r.name)
    def test_every_runbook_url_points_at_its_runbook_heading(self, rule: AlertRule) -> None:
        """runbook_url ends in ops/runbook.md#<alert name>, and that heading exists."""
        url = rule.values["runbook_url"]
        found = re.search(r"/ops/runbook\.md#(?P<anchor>[\w-]+)$", url)
        assert found, f"{rule.name}: runbook_url {url!r} does not point into ops/runbook.md"
        assert found["anchor"] == github_anchor(rule.name)
        assert found["anchor"] in runbook_anchors(), (
            f"{rule.name}: ops/runbook.md has no heading for #{found['anchor']}")

    def test_every_alert_has_a_firing_and_a_quiet_unit_test(self) -> None:
        """alerts_test.yml checks each alert both firing and staying quiet."""
        cases = re.findall(r"alertname:\s*(\S+)\s*\n\s*exp_alerts:[ ]*(\[\])?",
                           ALERT_TESTS.read_text())
        firing = {name for name, empty in cases if not empty}
        quiet = {name for name, empty in cases if empty}
        for rule in alert_rules():
            assert rule.name in firing, f"no test where {rule.name} fires"
            assert rule.name in quiet, f"no test where {rule.name} stays quiet"

    def test_promtool_check_rules(self) -> None:
        """``promtool check rules`` accepts alerts.yml."""
        run_promtool("check", "rules", str(ALERTS), cwd=REPO)

    def test_promtool_test_rules(self) -> None:
        """The alert unit tests pass: ``cd ops/prometheus && promtool test rules ...``."""
        run_promtool("test", "rules", ALERT_TESTS.name, cwd=ALERT_TESTS.parent)

    def test_promtool_check_config(self) -> None:
        """The example prometheus.yml is valid and loads alerts.yml."""
        run_promtool("check", "config", str(PROMETHEUS_CONFIG), cwd=REPO)


# -- dashboard ----------------------------------------------------------------------------


class TestDashboard:
    """The Grafana dashboard: its structure, and every query parsed by Prometheus."""

    def test_it_has_a_datasource_and_an_instance_variable(self) -> None:
        """Panels use ${DS_PROMETHEUS}; instance can be chosen."""
        variables = {v["name"]: v for v in dashboard()["templating"]["list"]}
        assert variables["DS_PROMETHEUS"]["type"] == "datasource"
        assert variables["DS_PROMETHEUS"]["query"] == "prometheus"
        assert variables["instance"]["type"] == "query"
        assert dashboard()["schemaVersion"] >= 36

    def test_every_panel_has_a_title_and_a_query(self) -> None:
        """Rows have a title; every other panel a title and targets with expressions."""
        ids = [panel["id"] for panel in dashboard_panels()]
        assert len(ids) == len(set(ids)), "panel ids are unique"
        for panel in dashboard_panels():
            assert panel.get("title"), f"panel {panel.get('id')} has no title"
            if panel["type"] == "row":
                continue
            targets = panel.get("targets", [])
            assert targets, f"panel {panel['title']!r} has no target"
            for target in targets:
                assert target.get("expr", "").strip(), f"{panel['title']!r}: empty expr"
                assert target["datasource"]["uid"] == "${DS_PROMETHEUS}"
            assert panel["datasource"]["uid"] == "${DS_PROMETHEUS}"

    def test_the_issue_panels_exist(self) -> None:
        """Pass outcomes, decisions by reason and disposition, backlog, durations, leader."""
        exprs = " ".join(q.expr for q in queries() if q.where.startswith("dashboard"))
        for needle in ("rate(reconciler_passes_total", "sum by (reason)",
                       "sum by (disposition)", "reconciler_stale_claims",
                       "reconciler_oldest_stale_claim_age_seconds",
                       "histogram_quantile(0.99", "reconciler_pass_duration_seconds_bucket",
                       "time() - max(reconciler_last_successful_pass_timestamp_seconds",
                       "reconciler_is_leader", "reconciler_pass_overruns_total",
                       "reconciler_artifact_sweep_failures_total"):
            assert needle in exprs, f"no dashboard query with {needle!r}"

    def test_the_operating_safely_panels_exist(self) -> None:
        """Shadow decisions, the brake, passes per tick and job retention have panels."""
        panels = {panel.get("title"): " ".join(t.get("expr", "") for t in panel.get("targets", []))
                  for panel in dashboard_panels()}
        wanted = {
            "Shadow decisions by reason": "reconciler_shadow_decisions_total",
            "Mass-staleness brake": "reconciler_brake_engaged",
            "Passes per tick": "reconciler_tick_batches_bucket",
            "Job retention": "reconciler_job_rows_deleted_total",
        }
        for title, metric in wanted.items():
            assert metric in panels.get(title, ""), f"no panel {title!r} querying {metric}"
        assert "sum by (disposition, reason)" in panels["Shadow decisions by reason"]

    def test_every_exported_metric_has_a_panel(self) -> None:
        """Each metric the service exports is queried by at least one dashboard panel."""
        families = set(re.findall(r"^# TYPE (\S+) \S+$",
                                  generate_latest(Metrics().registry).decode(), re.MULTILINE))
        families = {f for f in families if not f.endswith("_created")}
        queried = {name for q in queries() if q.where.startswith("dashboard")
                   for name in parse_promql(q.expr).metrics}
        missing = sorted(f for f in families
                         if not any(m == f or m.startswith(f + "_") for m in queried))
        assert not missing, f"no dashboard panel queries {missing}"

    def test_promtool_parses_every_dashboard_query(self, tmp_path: Path) -> None:
        """Each panel query, with Grafana variables filled in, is valid PromQL."""
        rules = ["groups:", "  - name: dashboard-queries", "    rules:"]
        for i, query in enumerate(queries()):
            if not query.where.startswith("dashboard"):
                continue
            expr = GRAFANA_VARIABLE.sub(".*", GRAFANA_INTERVAL.sub("5m", query.expr))
            rules += [f"      - record: dashboard:query_{i}", f"        expr: {json.dumps(expr)}"]
        path = tmp_path / "dashboard_queries.yml"
        path.write_text("\n".join(rules) + "\n")
        run_promtool("check", "rules", str(path), cwd=tmp_path)


# -- runbook ------------------------------------------------------------------------------


class TestRunbook:
    """ops/runbook.md covers every reason code and shows only real commands."""

    def reasons(self) -> set[str]:
        """Every code that can appear as a decision's or a job's reason."""
        return ({r.value for r in Reason} | {r.value for r in WorkerStatusReason}
                | {LIFETIME_EXCEEDED} | operator_status_reasons())

    def test_every_reason_code_has_its_own_section(self) -> None:
        """Each reason (decisions, worker, runtime, operator) is a heading of its own."""
        missing = sorted(self.reasons() - runbook_anchors())
        assert not missing, f"ops/runbook.md has no section for {missing}"

    def test_every_explain_reason_appears(self) -> None:
        """Every reason `reconciler explain` prints is named in the runbook text."""
        text = RUNBOOK.read_text()
        assert all(reason.value in text for reason in Reason)

    def test_internal_links_resolve(self) -> None:
        """Every ``(#anchor)`` link in the runbook has its heading."""
        links = set(re.findall(r"\]\(#([\w-]+)\)", RUNBOOK.read_text()))
        assert links
        assert not sorted(links - runbook_anchors())

    @pytest.mark.parametrize("command", runbook_commands())
    def test_every_command_shown_is_a_valid_command_line(self, command: str) -> None:
        """Each ``reconciler ...`` the runbook shows parses with the real CLI."""
        parses_as_cli(command, job_id_optional=True)

    def test_the_operating_safely_features_are_explained(self) -> None:
        """Shadow review, releasing the brake and handling a crash loop are spelled out."""
        shadow = runbook_section("shadow-mode")
        assert "reconciler decisions --shadow" in shadow
        assert "RECONCILER_SHADOW" in shadow
        brake = runbook_section("reconcilerbrakeengaged")
        assert "brake_hold_seconds" in brake
        assert "reconciler pass --brake-hold-seconds 0" in brake
        crash = runbook_section("crash_loop")
        assert "reconciler decisions --since 1d --reason crash_loop" in crash
        assert "reconciler jobs retry JOB_ID" in crash
        # Why other sources keep completion_unrecorded.
        assert "could not record it" in runbook_section("completion_unrecorded")

    def test_the_operator_actions_are_explained(self) -> None:
        """Hold, unhold, retry and cancel each appear as a command."""
        commands = " ".join(runbook_commands())
        for action in ("hold", "unhold", "retry", "cancel"):
            assert f"reconciler jobs {action} JOB_ID" in commands


# -- deployment examples ------------------------------------------------------------------


class TestDeploymentExamples:
    """The Kubernetes and systemd examples use real settings, commands and endpoints."""

    # Python's own caches left out: the suite writes them beside ops/container's script.
    @pytest.mark.parametrize("path", sorted(p for p in OPS.rglob("*")
                                            if "__pycache__" not in p.parts),
                             ids=lambda p: str(p.relative_to(OPS)))
    def test_every_environment_setting_exists(self, path: Path) -> None:
        """Each RECONCILER_<NAME> in ops/ is a setting of reconciler.config.settings.Settings
        (or one of the variables that are not settings: the config file, the operator)."""
        if not path.is_file():
            return
        names = set(re.findall(r"\bRECONCILER_([A-Z][A-Z0-9_]*)", path.read_text()))
        unknown = sorted(n for n in names if n.lower() not in Settings.model_fields
                         and f"RECONCILER_{n}" not in NON_SETTING_VARIABLES)
        assert not unknown, f"{path.name}: no such setting: {unknown}"

    def test_kubernetes_commands_and_probes(self) -> None:
        """The sidecar runs `reconciler run`, a Job migrates, probes hit real endpoints."""
        text = KUBERNETES.read_text()
        commands = [" ".join(json.loads(c)) for c in
                    re.findall(r"^\s*command:\s*(\[.*\])\s*$", text, re.MULTILINE)]
        assert "reconciler run" in commands
        assert "reconciler db upgrade" in commands
        for command in commands:
            parses_as_cli(command)
        service = SERVICE_SOURCE.read_text()
        for path in re.findall(r"^\s*path:\s*(\S+)\s*$", text, re.MULTILINE):
            assert f'"{path}"' in service, f"the service serves no {path}"
        assert re.search(r"RECONCILER_METRICS_HOST\s*\n\s*value:\s*\"0\.0\.0\.0\"", text)
        port = Settings.model_fields["metrics_port"].default
        assert f"containerPort: {port}" in text

    def test_systemd_unit_runs_the_service(self) -> None:
        """ExecStartPre migrates, ExecStart runs, SIGTERM stops it, and it restarts."""
        text = SYSTEMD.read_text()
        directives = dict(re.findall(r"^(\w+)=(.*)$", text, re.MULTILINE))
        assert directives["Type"] == "simple"
        assert directives["KillSignal"] == "SIGTERM"
        assert directives["Restart"] == "on-failure"
        assert directives["DynamicUser"] == "yes"
        assert directives["ProtectSystem"] == "strict"
        for key, expected in (("ExecStartPre", "reconciler db upgrade"),
                              ("ExecStart", "reconciler run")):
            command = "reconciler " + directives[key].split("/bin/reconciler ", 1)[1]
            assert command == expected
            parses_as_cli(command)


# -- operating safely ---------------------------------------------------------------------


class TestOperatingSafelyPage:
    """docs/operating.md explains each operating-safely feature with its names."""

    @pytest.mark.parametrize(("feature", "needles"), [
        ("shadow mode", ("`RECONCILER_SHADOW=true`", "reconciler decisions --shadow",
                         "reconciler_shadow_decisions_total")),
        ("mass-staleness brake", ("`brake_min_jobs`", "`mass_staleness_brake`",
                                  "`reconciler_brake_engaged`", "`ReconcilerBrakeEngaged`")),
        ("crash loops", ("`crash_loop_after`", "`crash_loop`", "reconciler jobs retry")),
        ("skips recorded once", ("recorded once", "claim generation")),
        ("job retention", ("`job_retention_days`", "`audit_retention_days`",
                           "`reconciler_job_rows_deleted_total`")),
        ("completion recovered", ("`completion_recovered`", "`completion_unrecorded`")),
    ])
    def test_the_page_names_each_feature(self, feature: str,
                                         needles: tuple[str, ...]) -> None:
        """Each feature's setting, reason, metric and alert are named on the page."""
        text = OPERATING.read_text()
        missing = [needle for needle in needles if needle not in text]
        assert not missing, f"docs/operating.md, {feature}: missing {missing}"


class TestNoPasswordSuggested:
    """Issue 14: no example puts the database password where others can read it."""

    DOCUMENTS = (RUNBOOK, KUBERNETES, OPS / "kubernetes" / "beside-a-job-system.yaml",
                 SYSTEMD, REPO / "README.md",
                 OPS / "systemd" / "stale-claim-reconciler.env.example",
                 REPO / "docs" / "container.md", OPS / "container" / "Containerfile")

    @pytest.mark.parametrize("path", DOCUMENTS, ids=lambda p: p.name)
    def test_no_document_suggests_the_url_as_a_flag_or_holds_a_password(self, path: Path
                                                                         ) -> None:
        """No `--database-url` (a command line is visible to every user in `ps`), and no
        URL with a password in it (a copied example would carry it into a file or a log)."""
        text = path.read_text()
        assert "--database-url" not in text
        # USER:PASSWORD is a placeholder in an install note, not a password.
        assert not re.search(r"://[^\s/@:]+:(?!PASSWORD@)[^\s/@]+@", text), path

    def test_every_kubernetes_container_reads_the_url_from_a_mounted_secret(self) -> None:
        """Each container gets RECONCILER_DATABASE_URL_FILE and the secret's volume, and
        none gets the URL itself in its environment."""
        text = KUBERNETES.read_text()
        assert "RECONCILER_DATABASE_URL\n" not in text
        assert "name: RECONCILER_DATABASE_URL\n" not in text
        containers = len(re.findall(r"^\s*- name: (?:db-upgrade|worker|reconciler)$", text,
                                    re.MULTILINE))
        assert containers == 3
        assert text.count("name: RECONCILER_DATABASE_URL_FILE") == containers
        assert text.count("mountPath: /var/run/secrets/stale-claim-reconciler") == containers

    def test_the_systemd_unit_loads_the_url_as_a_credential(self) -> None:
        """LoadCredential= hands the file to the dynamic user; the setting names it."""
        text = SYSTEMD.read_text()
        assert re.search(r"^LoadCredential=database-url:/etc/stale-claim-reconciler/"
                         r"database-url$", text, re.MULTILINE)
        assert re.search(r"^Environment=RECONCILER_DATABASE_URL_FILE=%d/database-url$", text,
                         re.MULTILINE)
        env = (OPS / "systemd" / "stale-claim-reconciler.env.example").read_text()
        assert not re.search(r"^RECONCILER_DATABASE_URL=", env, re.MULTILINE)
