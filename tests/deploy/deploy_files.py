"""Readers for the files under deploy/ that the tests in this folder share: dashboards, their
queries and variables, rule files, and the metric names a PromQL expression uses."""

import json
import re
from dataclasses import dataclass
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
DASHBOARDS = sorted((DEPLOY / "grafana" / "dashboards").glob("*.json"))
RULE_FILES = sorted((DEPLOY / "prometheus" / "rules").glob("*.yml"))
RULE_TESTS = sorted((DEPLOY / "prometheus" / "tests").glob("*.yml"))
PROMETHEUS_CONFIG = DEPLOY / "prometheus" / "prometheus.yml"
KUSTOMIZATION_DIR = DEPLOY / "kubernetes"
SYSTEMD_UNIT = DEPLOY / "systemd" / "vcap-sidecar.service"

# Grafana's built-in variables, which Prometheus never sees.
GRAFANA_BUILTINS = ("__rate_interval", "__interval", "__range", "__interval_ms", "__range_s",
                    "__range_ms", "__from", "__to", "__dashboard")


@dataclass(frozen=True)
class Query:
    """One PromQL query of a dashboard: a panel target, an annotation or a variable."""

    dashboard: str
    panel_id: int | None
    panel_title: str
    ref_id: str
    expr: str
    instant: bool = False
    in_collapsed_row: str = ""


def load_dashboard(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def iter_panels(dashboard: dict):
    """Every panel, rows included, with the title of the collapsed row that holds it ('' if none)."""
    for panel in dashboard.get("panels", []):
        yield panel, ""
        for child in panel.get("panels", []):
            yield child, panel.get("title", "")


def panel_queries(path: Path) -> list[Query]:
    """Every panel target's expr."""
    dashboard = load_dashboard(path)
    queries = []
    for panel, row in iter_panels(dashboard):
        for target in panel.get("targets", []):
            queries.append(Query(path.name, panel.get("id"), panel.get("title", ""),
                                 target.get("refId", ""), target.get("expr", ""),
                                 bool(target.get("instant")), row))
    return queries


def annotation_queries(path: Path) -> list[Query]:
    queries = []
    for annotation in load_dashboard(path).get("annotations", {}).get("list", []):
        expr = (annotation.get("target") or {}).get("expr") or annotation.get("expr")
        if expr:
            queries.append(Query(path.name, None, f"annotation {annotation['name']}", "Anno", expr))
    return queries


def variable_queries(path: Path) -> list[tuple[dict, str]]:
    """(variable, PromQL selector/expression inside label_values()/query_result()) per query variable."""
    found = []
    for variable in load_dashboard(path).get("templating", {}).get("list", []):
        if variable.get("type") != "query":
            continue
        query = variable["query"]["query"] if isinstance(variable["query"], dict) else variable["query"]
        match = re.fullmatch(r"\s*label_values\((.*),\s*(\w+)\)\s*", query)
        if match:
            found.append((variable, match.group(1)))
            continue
        match = re.fullmatch(r"\s*query_result\((.*)\)\s*", query)
        if match:
            found.append((variable, match.group(1)))
            continue
        raise ValueError(f"variable {variable['name']}: unsupported query {query!r}")
    return found


def load_rules() -> list[dict]:
    rules = []
    for path in RULE_FILES:
        for group in yaml.safe_load(path.read_text(encoding="utf-8"))["groups"]:
            rules.extend(group["rules"])
    return rules


def recording_rule_names() -> set[str]:
    return {rule["record"] for rule in load_rules() if "record" in rule}


_KEYWORDS = {"and", "or", "unless", "by", "without", "on", "ignoring", "group_left", "group_right",
             "bool", "offset", "inf", "nan", "start", "end"}


def metric_names(expr: str) -> set[str]:
    """Metric names (and recording rule names) a PromQL expression selects.

    A light lexer, enough for the expressions in deploy/: strings, label matchers, ranges,
    grouping clauses and function calls are removed before identifiers are read.
    """
    text = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`', '""', expr)
    text = re.sub(r"\$\{?\w+(?::\w+)?\}?", "", text)
    text = re.sub(r"\{[^}]*\}", " ", text)
    text = re.sub(r"\[[^\]]*\]", " ", text)
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    names = set()
    for match in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", text):
        name = match.group(0)
        before = text[match.start() - 1] if match.start() else " "
        if before.isdigit() or before == ".":
            continue  # 1e3, 5m, 0.5s
        if text[match.end():].lstrip().startswith("("):
            continue  # function or aggregation
        if name.lower() in _KEYWORDS:
            continue
        names.add(name)
    return names


def template_variables(expr: str) -> set[str]:
    return set(re.findall(r"\$\{?(\w+)", expr))
