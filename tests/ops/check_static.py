#!/usr/bin/env python3
"""Static checks of tollgate's operator assets (no services needed).

    python tests/ops/check_static.py [CHECK ...]     # all checks, or the named ones
    python tests/ops/check_static.py --write-prometheusrule

Checks (each prints one `ok: ...` line, or `FAIL: <check>: <why>` and exits 1):

  alerts          deploy/prometheus/alerts.yaml: every alert has for, severity,
                  summary, description and a runbook_url to docs/runbooks/<Alert>.md
                  (which exists); promtool tests cover each alert firing and not firing
  dashboards      dashboards/*.json: fixed uid, schemaVersion, datasource and tenant
                  variables, a description and unit on every panel, $__rate_interval
                  in every rate(), known metric names, the required panels
  prometheusrule  the PrometheusRule in deploy/kubernetes carries exactly the groups
                  of deploy/prometheus/alerts.yaml (--write-prometheusrule rewrites it)
  kustomize       `kubectl kustomize` of every overlay; core kinds validated strictly
                  with kubernetes-validate; CRD kinds (KEDA, Prometheus Operator)
                  validated against their schemas (npm @kubernetes-models) plus
                  unknown-field checks; consistency (secrets mounted as files and
                  read through TOLLGATE_*_FILE, probes, selectors, NetworkPolicy
                  ports vs the URLs the workers use, shards vs KEDA triggers,
                  dashboards and rules equal to the sources); the example Secret
                  (base/secret.example.yaml) is valid, and no overlay renders a
                  placeholder credential (prod renders no Secret at all)
  compose         deploy/compose/compose.yaml parses, validates against the compose
                  spec schema, every referenced local file exists, the config it
                  mounts and the Prometheus config it runs are valid
  dockerfile      deploy/docker/Dockerfile: build stage runs exactly
                  `cargo build --release --locked -p tollgate`, non-root runtime;
                  Makefile `release` runs the same command; Cargo.lock is in sync
"""

from __future__ import annotations

import copy
import base64
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path
from urllib.parse import urlsplit

import yaml

sys.dont_write_bytecode = True
sys.path.insert(0, str(Path(__file__).resolve().parent))
from opslib import (  # noqa: E402
    COUNTERS,
    HISTOGRAMS,
    ROOT,
    RUNBOOK_BASE,
    SERIES,
    CheckFailed,
    data_parts,
    fail,
    metric_names,
    ok,
    rel,
    run_checks,
)

ALERTS = ROOT / "deploy/prometheus/alerts.yaml"
ALERT_TESTS = ROOT / "deploy/prometheus/tests"
RUNBOOKS = ROOT / "docs/runbooks"
DASHBOARDS = ROOT / "dashboards"
K8S = ROOT / "deploy/kubernetes"
PROMETHEUSRULE = K8S / "components/monitoring/prometheusrule.yaml"
COMPOSE = ROOT / "deploy/compose/compose.yaml"
DOCKERFILE = ROOT / "deploy/docker/Dockerfile"
BUILD_COMMAND = "cargo build --release --locked -p tollgate"
TOLLGATE_TOML = K8S / "base/tollgate.toml"

# Kubernetes version the core kinds are validated against (kubernetes-validate
# ships schemas for 1.25 .. 1.37; 1.30 is the oldest still widely run).
K8S_VERSIONS = ["1.30.0", "1.37.0"]
NODE_MODULES = Path(os.environ.get("OPS_NODE_MODULES", ROOT / "target/ops-node/node_modules"))
CRDS = {
    # kind: (apiVersion, module file under node_modules, class)
    "ScaledObject": ("keda.sh/v1alpha1", "@kubernetes-models/keda/keda.sh/v1alpha1/ScaledObject"),
    "TriggerAuthentication": ("keda.sh/v1alpha1", "@kubernetes-models/keda/keda.sh/v1alpha1/TriggerAuthentication"),
    "PodMonitor": ("monitoring.coreos.com/v1", "@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1/PodMonitor"),
    "ServiceMonitor": ("monitoring.coreos.com/v1", "@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1/ServiceMonitor"),
    "PrometheusRule": ("monitoring.coreos.com/v1", "@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1/PrometheusRule"),
}
# The credentials, and the Secret key each is read from: the Deployment mounts
# the Secret as files and names them with TOLLGATE_<KEY>_FILE.
SECRET_KEYS = {"amqp_url": "amqp-url", "redis_url": "redis-url", "admin_token": "admin-token"}
# Settings tollgate reads from a file when TOLLGATE_<KEY>_FILE is set
# (crates/tollgate/src/config.rs, Config::with_secret_files); optional ones too.
FILE_KEYS = set(SECRET_KEYS) | {"provider_url"}
SECRET_EXAMPLE = K8S / "base/secret.example.yaml"
PLACEHOLDER = "CHANGE-ME"
DEFAULT_PORTS = {"amqp": 5672, "amqps": 5671, "redis": 6379, "rediss": 6379, "http": 80, "https": 443}


def load_yaml(path: Path):
    try:
        return yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as e:
        fail(f"{rel(path)}: {e}")


def config_keys() -> set[str]:
    """The keys of tollgate's Config struct (crates/tollgate/src/config.rs)."""
    src = (ROOT / "crates/tollgate/src/config.rs").read_text()
    m = re.search(r"pub struct Config \{(.*?)\n\}", src, re.S)
    if not m:
        fail("cannot find `pub struct Config` in crates/tollgate/src/config.rs")
    return set(re.findall(r"^\s*pub (\w+):", m.group(1), re.M))


def check_env_keys(env_names, where: str) -> None:
    """Every TOLLGATE_* variable must name a config key: tollgate exits 64 on
    unknown ones. TOLLGATE_<KEY>_FILE is read for the secret settings only
    (any other *_FILE variable would be silently ignored)."""
    keys = config_keys() | {"config"}
    for name in env_names:
        if not name.startswith("TOLLGATE_"):
            continue
        key = name[len("TOLLGATE_") :].lower()
        if key.endswith("_file") and key not in keys:  # quotas_file, tls_ca_file are paths, not secret files
            if key.removesuffix("_file") not in FILE_KEYS:
                fail(f"{where}: {name}: tollgate reads a file only for {sorted(k.upper() for k in FILE_KEYS)}")
            continue
        if key.split("__")[0] not in keys:
            fail(f"{where}: {name} is not a tollgate setting (tollgate exits 64 on unknown TOLLGATE_* variables)")


def check_toml(path: Path, label: str | None = None) -> dict:
    label = label or rel(path)
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as e:
        fail(f"{label}: {e}")
    unknown = set(data) - config_keys()
    if unknown:
        fail(f"{label}: unknown keys {sorted(unknown)} (tollgate exits 64 on them)")
    for secret in ("amqp_url", "redis_url", "admin_token"):
        if secret in data:
            fail(f"{label}: {secret} carries a credential: it belongs in the Secret, not the ConfigMap")
    return data


# ------------------------------------------------------------------ alerts


def alert_rules() -> list[dict]:
    doc = load_yaml(ALERTS)
    rules = [r for g in doc.get("groups", []) for r in g.get("rules", []) if "alert" in r]
    if not rules:
        fail(f"{rel(ALERTS)}: no alerting rules")
    return rules


def check_alerts() -> None:
    rules = alert_rules()
    names = [r["alert"] for r in rules]
    if len(set(names)) != len(names):
        fail(f"{rel(ALERTS)}: duplicate alert names")
    for r in rules:
        a = r["alert"]
        where = f"{rel(ALERTS)}: {a}"
        if not re.fullmatch(r"\d+[smh]", str(r.get("for", ""))):
            fail(f"{where}: needs `for:` (a duration such as 10m)")
        if (r.get("labels") or {}).get("severity") not in ("warning", "critical"):
            fail(f"{where}: labels.severity must be warning or critical")
        ann = r.get("annotations") or {}
        for key in ("summary", "description", "runbook_url"):
            if not str(ann.get(key, "")).strip():
                fail(f"{where}: annotations.{key} is missing")
        if ann["runbook_url"] != f"{RUNBOOK_BASE}{a}.md":
            fail(f"{where}: runbook_url must be {RUNBOOK_BASE}{a}.md")
        page = RUNBOOKS / f"{a}.md"
        if not page.is_file():
            fail(f"{where}: runbook {rel(page)} does not exist")
        if not page.read_text().startswith(f"# {a}\n"):
            fail(f"{rel(page)}: must start with the heading `# {a}`")
        headings = [h.lower() for h in re.findall(r"^## (.*)$", page.read_text(), re.M)]
        for sec in ("what it means", "confirm", "likely causes", "fixes"):
            if not any(sec in h for h in headings):
                fail(f"{rel(page)}: needs a section on {sec!r} (## heading)")
        unknown = metric_names(r["expr"]) - SERIES
        if unknown:
            fail(f"{where}: unknown metric(s) {sorted(unknown)}")
    pages = {p.stem for p in RUNBOOKS.glob("*.md")} - {"README"}
    if pages - set(names):
        fail(f"docs/runbooks: pages without an alert: {sorted(pages - set(names))}")
    index = (RUNBOOKS / "README.md").read_text()
    ops = (ROOT / "docs/operations.md").read_text()
    for a in names:
        if f"({a}.md)" not in index:
            fail(f"docs/runbooks/README.md does not link {a}.md")
        if f"runbooks/{a}.md" not in ops:
            fail(f"docs/operations.md does not link runbooks/{a}.md")

    firing, quiet = set(), set()
    files = sorted(ALERT_TESTS.glob("*.yaml"))
    if not files:
        fail(f"no promtool tests in {rel(ALERT_TESTS)}")
    for f in files:
        doc = load_yaml(f)
        if [str((f.parent / p).resolve()) for p in doc.get("rule_files", [])] != [str(ALERTS)]:
            fail(f"{rel(f)}: rule_files must be [../alerts.yaml]")
        for t in doc.get("tests", []):
            for case in t.get("alert_rule_test", []):
                (firing if case.get("exp_alerts") else quiet).add(case["alertname"])
    for a in names:
        if a not in firing:
            fail(f"{rel(ALERT_TESTS)}: no promtool test where {a} fires")
        if a not in quiet:
            fail(f"{rel(ALERT_TESTS)}: no promtool test where {a} does not fire")
    ok(f"alerts: {len(names)} alerts with for/severity/summary/description/runbook_url, "
       f"a runbook each, promtool tests firing and not firing for each")


# -------------------------------------------------------------- dashboards

REQUIRED_PANELS = {
    # what: (metric, extra regex that an expression must match)
    "queue age": ("tollgate_queue_age_seconds_bucket", r""),
    "due lag p50": ("tollgate_due_lag_seconds_bucket", r"histogram_quantile\(0\.5,"),
    "due lag p95": ("tollgate_due_lag_seconds_bucket", r"histogram_quantile\(0\.95,"),
    "due lag p99": ("tollgate_due_lag_seconds_bucket", r"histogram_quantile\(0\.99,"),
    "quota wait": ("tollgate_quota_wait_seconds", r""),
    "permit decisions": ("tollgate_permit_decisions_total", r"by \(decision\)"),
    "provider outcomes": ("tollgate_provider_requests_total", r"outcome\)"),
    "429 ratio by tenant": ("tollgate_provider_requests_total", r'by \(tenant\).*outcome="throttled".*/'),
    "retries": ("tollgate_provider_requests_total", r'outcome="failed"'),
    "dead letters by reason": ("tollgate_dead_letters_total", r"by \(reason\)"),
    "in-flight": ("tollgate_jobs_in_flight", r""),
    "parked by reason": ("tollgate_parked_total", r"by \(reason\)"),
    "pods consuming": ("tollgate_consuming", r"^sum\(tollgate_consuming\)$"),
}


def panels_of(dash: dict):
    for p in dash.get("panels", []):
        yield p
        yield from p.get("panels", [])  # collapsed rows


def dashboard_exprs(dash: dict) -> list[tuple[str, str]]:
    """(panel title, expr) of every query, and the tenant variable's query."""
    out = []
    for p in panels_of(dash):
        for t in p.get("targets", []):
            out.append((p.get("title", "?"), t["expr"]))
    return out


def check_dashboards() -> None:
    files = sorted(DASHBOARDS.glob("*.json"))
    if len(files) < 2:
        fail("dashboards/: expected the overview and the per-tenant dashboard")
    uids = set()
    all_exprs = []
    for f in files:
        where = rel(f)
        try:
            d = json.loads(f.read_text())
        except json.JSONDecodeError as e:
            fail(f"{where}: {e}")
        uid = d.get("uid")
        if not uid or not re.fullmatch(r"[a-z0-9-]{1,40}", uid) or uid in uids:
            fail(f"{where}: needs a fixed, unique uid ([a-z0-9-], at most 40 characters)")
        uids.add(uid)
        if not isinstance(d.get("schemaVersion"), int):
            fail(f"{where}: schemaVersion missing")
        if d.get("id") is not None:
            fail(f"{where}: `id` must be null or absent (Grafana assigns it)")
        variables = {v["name"]: v for v in d.get("templating", {}).get("list", [])}
        ds = variables.get("datasource")
        if not ds or ds.get("type") != "datasource" or ds.get("query") != "prometheus":
            fail(f"{where}: needs a `datasource` variable of type datasource (prometheus)")
        tenant = variables.get("tenant")
        tq = (tenant or {}).get("query")
        tq = tq.get("query") if isinstance(tq, dict) else tq
        if not tenant or tq != "label_values(tollgate_permit_decisions_total, tenant)":
            fail(f"{where}: needs a `tenant` variable: label_values(tollgate_permit_decisions_total, tenant)")
        if tenant.get("datasource", {}).get("uid") != "${datasource}":
            fail(f"{where}: the tenant variable must use ${{datasource}}")
        ids = set()
        cells: dict[tuple[int, int], str] = {}
        for p in panels_of(d):
            g = p.get("gridPos") or {}
            if g.get("x", 0) + g.get("w", 0) > 24:
                fail(f"{where}: panel {p.get('title')!r} is wider than the 24-column grid")
            for x in range(g.get("x", 0), g.get("x", 0) + g.get("w", 0)):
                for y in range(g.get("y", 0), g.get("y", 0) + g.get("h", 0)):
                    if (x, y) in cells:
                        fail(f"{where}: panels {cells[(x, y)]!r} and {p.get('title')!r} overlap")
                    cells[(x, y)] = p.get("title")
        for p in panels_of(d):
            title = p.get("title", "")
            pw = f"{where}: panel {title!r}"
            if p.get("id") in ids:
                fail(f"{pw}: duplicate panel id {p.get('id')}")
            ids.add(p.get("id"))
            if not str(p.get("description", "")).strip():
                fail(f"{pw}: needs a description")
            if "gridPos" not in p:
                fail(f"{pw}: needs a gridPos")
            if not p.get("targets"):
                if p["type"] not in ("row", "text"):
                    fail(f"{pw}: has no query")
                continue
            if p.get("datasource", {}).get("uid") != "${datasource}":
                fail(f"{pw}: datasource must be ${{datasource}}")
            if not p.get("fieldConfig", {}).get("defaults", {}).get("unit"):
                fail(f"{pw}: needs a unit (fieldConfig.defaults.unit)")
            for t in p["targets"]:
                e = t.get("expr", "")
                if t.get("datasource", {}).get("uid") != "${datasource}":
                    fail(f"{pw}: query {t.get('refId')} must use ${{datasource}}")
                for fn, window in re.findall(r"\b(rate|irate|increase)\([^\[]*\[([^\]]*)\]", e):
                    if fn in ("rate", "irate") and window != "$__rate_interval":
                        fail(f"{pw}: {fn}() must use [$__rate_interval], not [{window}]: {e}")
                    if fn == "increase" and window not in ("$__rate_interval", "$__range"):
                        fail(f"{pw}: increase() must use [$__rate_interval] or [$__range]: {e}")
                unknown = metric_names(e) - SERIES
                if unknown:
                    fail(f"{pw}: unknown metric(s) {sorted(unknown)}")
                for h in HISTOGRAMS:
                    if f"{h}_bucket" in e and "histogram_quantile" not in e and 'le="' not in e and 'le=~"' not in e:
                        fail(f"{pw}: {h}_bucket used without histogram_quantile or an le matcher")
                all_exprs.append((f.name, title, e))
    for what, (metric, pattern) in REQUIRED_PANELS.items():
        if not any(metric in e and re.search(pattern, e) for _, _, e in all_exprs):
            fail(f"dashboards: no panel shows {what} ({metric})")
    used = {m for _, _, e in all_exprs for m in metric_names(e)}
    for c in COUNTERS:
        if c not in used:
            fail(f"dashboards: metric {c} is on no panel")
    ok(f"dashboards: {len(files)} dashboards, {len(all_exprs)} queries: uid, schemaVersion, "
       f"datasource+tenant variables, description+unit per panel, $__rate_interval, required panels")


# ---------------------------------------------------------- prometheusrule


class _Block(str):
    pass


def _block_repr(dumper, data):
    return dumper.represent_scalar("tag:yaml.org,2002:str", data, style="|")


def prometheusrule_text() -> str:
    groups = copy.deepcopy(load_yaml(ALERTS)["groups"])
    for g in groups:
        for r in g["rules"]:
            for k, v in list(r.items()):
                if isinstance(v, str) and "\n" in v:
                    r[k] = _Block(v)
    doc = {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {"name": "tollgate", "labels": {"app.kubernetes.io/name": "tollgate"}},
        "spec": {"groups": groups},
    }
    dumper = yaml.SafeDumper
    dumper.add_representer(_Block, _block_repr)
    body = yaml.dump(doc, Dumper=dumper, sort_keys=False, width=1000, allow_unicode=True)
    return (
        "# GENERATED from deploy/prometheus/alerts.yaml: edit that file, then run\n"
        "#   target/ops-venv/bin/python tests/ops/check_static.py --write-prometheusrule\n"
        "# scripts/ops-check.sh fails when the two differ.\n" + body
    )


def first_difference(a, b, path="spec.groups"):
    if type(a) is not type(b):
        return f"{path}: {a!r} != {b!r}"
    if isinstance(a, dict):
        for k in sorted(set(a) | set(b)):
            if k not in a or k not in b:
                return f"{path}.{k}: only in {'alerts.yaml' if k in b else 'PrometheusRule'}"
            d = first_difference(a[k], b[k], f"{path}.{k}")
            if d:
                return d
    elif isinstance(a, list):
        if len(a) != len(b):
            return f"{path}: {len(a)} items != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            d = first_difference(x, y, f"{path}[{i}]")
            if d:
                return d
    elif a != b:
        return f"{path}: {a!r} != {b!r}"
    return None


def compare_rules(pr: dict, where: str) -> None:
    want = load_yaml(ALERTS)["groups"]
    if pr.get("kind") != "PrometheusRule" or pr.get("apiVersion") != "monitoring.coreos.com/v1":
        fail(f"{where}: not a monitoring.coreos.com/v1 PrometheusRule")
    got = (pr.get("spec") or {}).get("groups")
    d = first_difference(got, want)
    if d:
        fail(f"{where} differs from deploy/prometheus/alerts.yaml at {d} "
             f"(regenerate: target/ops-venv/bin/python tests/ops/check_static.py --write-prometheusrule)")


def check_prometheusrule() -> None:
    compare_rules(load_yaml(PROMETHEUSRULE), rel(PROMETHEUSRULE))
    n = sum(len(g["rules"]) for g in load_yaml(ALERTS)["groups"])
    ok(f"PrometheusRule ({rel(PROMETHEUSRULE)}) carries the same {n} rules as deploy/prometheus/alerts.yaml")


# --------------------------------------------------------------- kustomize


def kustomize(path: Path) -> list[dict]:
    r = subprocess.run(["kubectl", "kustomize", str(path)], capture_output=True, text=True)
    if r.returncode != 0:
        fail(f"kubectl kustomize {rel(path)} failed:\n{r.stderr.strip()}")
    return [d for d in yaml.safe_load_all(r.stdout) if d]


def ts_props(dts: Path, cache: dict) -> dict | None:
    """Property name -> type text of the main interface in a @kubernetes-models .d.ts."""
    if dts in cache:
        return cache[dts]
    if not dts.is_file():
        cache[dts] = None
        return None
    text = dts.read_text()
    imports = {}
    for names, src in re.findall(r"import \{([^}]*)\} from \"([^\"]+)\"", text):
        for n in names.split(","):
            n = n.strip().split(" as ")[-1].strip()
            if n:
                imports[n] = src
    m = re.search(r"^export interface \w+(?: extends [\w, ]+)? \{\n(.*?)^\}", text, re.S | re.M)
    if not m:
        cache[dts] = None
        return None
    props = {}
    cur = None
    for line in m.group(1).splitlines():
        pm = re.match(r'^    "([^"]+)"\??: (.*)$', line)
        if pm:
            cur = pm.group(1)
            props[cur] = pm.group(2)
        elif cur and not line.strip().startswith(("*", "/**", "*/")):
            props[cur] += "\n" + line
    cache[dts] = (props, imports)
    return cache[dts]


def resolve_import(dts: Path, src: str) -> Path:
    if src.startswith("."):
        return (dts.parent / src).with_suffix(".d.ts")
    return (NODE_MODULES / src).with_suffix(".d.ts") if not src.endswith(".js") else NODE_MODULES / src.replace(".js", ".d.ts")


def unknown_fields(obj, dts: Path, path: str, cache: dict, out: list) -> None:
    """Reports keys that the CRD's schema does not define (kubectl's strict
    field validation rejects them; the API server would drop them)."""
    info = ts_props(dts, cache)
    if info is None or not isinstance(obj, dict):
        return
    props, imports = info
    for k, v in obj.items():
        if k not in props:
            out.append(f"{path}.{k}")
            continue
        t = props[k].strip().rstrip(";").strip()
        am = re.fullmatch(r"Array<(\w+)>", t)
        name = am.group(1) if am else t
        if name in imports:
            sub = resolve_import(dts, imports[name])
            items = v if am and isinstance(v, list) else [v] if not am else []
            for i, item in enumerate(items):
                unknown_fields(item, sub, f"{path}.{k}" + (f"[{i}]" if am else ""), cache, out)


def validate_crds(docs: list[dict], where: str) -> None:
    if not NODE_MODULES.is_dir():
        fail(f"{NODE_MODULES} missing: run scripts/ops-check.sh (it installs tests/ops/package.json)")
    with tempfile.TemporaryDirectory() as tmp:
        f = Path(tmp) / "docs.json"
        f.write_text(json.dumps(docs))
        r = subprocess.run(
            ["node", str(ROOT / "tests/ops/crd_validate.mjs"), str(NODE_MODULES), str(f)],
            capture_output=True, text=True,
        )
    if r.returncode != 0:
        fail(f"{where}: CRD schema validation failed:\n{(r.stdout + r.stderr).strip()}")
    cache: dict = {}
    for d in docs:
        module = CRDS[d["kind"]][1]
        out: list = []
        unknown_fields(d, NODE_MODULES / f"{module}.d.ts", d["kind"], cache, out)
        if out:
            fail(f"{where}: {d['kind']}/{d['metadata']['name']}: fields not in the CRD schema: {', '.join(out)}")


def validate_core(doc: dict, where: str) -> None:
    import kubernetes_validate
    from kubernetes_validate.utils import SchemaNotFoundError, ValidationError

    for v in K8S_VERSIONS:
        try:
            kubernetes_validate.validate(doc, v, strict=True)
        except ValidationError as e:
            path = ".".join(str(p) for p in e.path)
            fail(f"{where}: {doc['kind']}/{doc['metadata']['name']} invalid for Kubernetes {v}: {path}: {e.message}")
        except SchemaNotFoundError:
            fail(f"{where}: {doc['kind']} ({doc['apiVersion']}) is neither a core kind of Kubernetes {v} nor a known CRD")


def labels_match(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in (selector.get("matchLabels") or {}).items())


def secret_values(s: dict) -> dict[str, str]:
    out = {k: base64.b64decode(v).decode() for k, v in (s.get("data") or {}).items()}
    out.update(s.get("stringData") or {})
    return out


def check_secret_example() -> str:
    doc = load_yaml(SECRET_EXAMPLE)
    where = rel(SECRET_EXAMPLE)
    validate_core(doc, where)
    if doc.get("kind") != "Secret" or doc["metadata"].get("name") != "tollgate-secrets":
        fail(f"{where}: must be the Secret tollgate-secrets")
    values = secret_values(doc)
    if set(values) != set(SECRET_KEYS.values()):
        fail(f"{where}: keys must be exactly {sorted(SECRET_KEYS.values())}, got {sorted(values)}")
    for k, v in values.items():
        if PLACEHOLDER not in v:
            fail(f"{where}: {k} must be a placeholder containing {PLACEHOLDER}")
    text = SECRET_EXAMPLE.read_text()
    if "EXAMPLE" not in text.splitlines()[0]:
        fail(f"{where}: must say on its first line that it is an example")
    for k in sorted(K8S.rglob("kustomization.yaml")):
        if SECRET_EXAMPLE.name in yaml.safe_dump(load_yaml(k)):  # comments may name it
            fail(f"{rel(k)} refers to {SECRET_EXAMPLE.name}: the example must never be applied by kustomize")
    return f"{where} valid (placeholders, keys {', '.join(sorted(values))}, in no kustomization)"


def check_network_policy(policies: list[dict], container_ports: dict, urls: dict, where: str) -> None:
    pol = [p for p in policies if p["metadata"]["name"] == "tollgate"]
    if len(pol) != 1:
        fail(f"{where}: expected the NetworkPolicy tollgate")
    p = pol[0]["spec"]
    pw = f"{where}: NetworkPolicy/tollgate"
    if sorted(p.get("policyTypes", [])) != ["Egress", "Ingress"]:
        fail(f"{pw}: policyTypes must be Ingress and Egress")
    http = {"http", container_ports.get("http")}
    for rule in p.get("ingress") or []:
        ps = rule.get("ports") or []
        if not ps or any(x.get("port") not in http or x.get("protocol", "TCP") != "TCP" for x in ps):
            fail(f"{pw}: every ingress rule must allow only the HTTP port (http, 9090/TCP): {rule}")
    if not p.get("ingress"):
        fail(f"{pw}: no ingress rule: Prometheus could not scrape port 9090")
    rules = p.get("egress") or []

    def allowed(port: int, proto: str = "TCP") -> bool:
        return any(not r.get("ports") or any(x.get("port") == port and x.get("protocol", "TCP") == proto
                                             for x in r["ports"]) for r in rules)

    for proto in ("UDP", "TCP"):
        if not allowed(53, proto):
            fail(f"{pw}: egress must allow DNS (53/{proto})")
    for what, url in sorted(urls.items()):
        u = urlsplit(url)
        port = u.port or DEFAULT_PORTS.get(u.scheme)
        if port is None:
            fail(f"{where}: {what}: cannot tell the port of {u.scheme}://{u.hostname}")
        if not allowed(port):
            fail(f"{pw}: egress does not allow port {port}/TCP, which {what} ({u.scheme}://{u.hostname}:{port}) needs")


def check_overlay(path: Path) -> str:
    where = f"kubectl kustomize {rel(path)}"
    docs = kustomize(path)
    by_kind: dict[str, list[dict]] = {}
    for d in docs:
        by_kind.setdefault(d["kind"], []).append(d)
    crd_docs = [d for d in docs if d["kind"] in CRDS]
    for d in docs:
        if d["kind"] in CRDS:
            if d["apiVersion"] != CRDS[d["kind"]][0]:
                fail(f"{where}: {d['kind']} must be {CRDS[d['kind']][0]}, not {d['apiVersion']}")
        else:
            validate_core(d, where)
    if crd_docs:
        validate_crds(crd_docs, where)

    ns = {d["metadata"].get("namespace") for d in docs if d["kind"] != "Namespace"}
    if len(ns) != 1 or None in ns:
        fail(f"{where}: every resource must be in one namespace, got {ns}")
    namespaces = [d["metadata"]["name"] for d in by_kind.get("Namespace", [])]
    if namespaces and namespaces != list(ns):
        fail(f"{where}: Namespace {namespaces} but resources in {ns}")

    deps = [d for d in by_kind.get("Deployment", []) if d["metadata"]["name"] == "tollgate"]
    if len(deps) != 1:
        fail(f"{where}: expected one Deployment tollgate")
    dep = deps[0]
    pod = dep["spec"]["template"]
    spec = pod["spec"]
    labels = pod["metadata"]["labels"]
    if not labels_match(dep["spec"]["selector"], labels):
        fail(f"{where}: Deployment selector does not match its pod labels")
    sc = spec.get("securityContext", {})
    if not sc.get("runAsNonRoot"):
        fail(f"{where}: pod securityContext.runAsNonRoot must be true")
    c = [c for c in spec["containers"] if c["name"] == "tollgate"]
    if len(c) != 1:
        fail(f"{where}: expected one container named tollgate")
    c = c[0]
    if c.get("args", [None])[0] != "worker":
        fail(f"{where}: the container must run `tollgate worker`")
    csc = c.get("securityContext", {})
    if csc.get("allowPrivilegeEscalation") is not False or csc.get("readOnlyRootFilesystem") is not True:
        fail(f"{where}: container needs allowPrivilegeEscalation: false and readOnlyRootFilesystem: true")
    ports = {p.get("name"): p["containerPort"] for p in c.get("ports", [])}
    if ports.get("http") != 9090:
        fail(f"{where}: container port `http` must be 9090 (TOLLGATE_HTTP_ADDR / http_addr)")
    for probe, path_ in (("readinessProbe", "/readyz"), ("livenessProbe", "/healthz")):
        hg = (c.get(probe) or {}).get("httpGet") or {}
        if hg.get("path") != path_ or hg.get("port") not in ("http", 9090):
            fail(f"{where}: {probe} must GET {path_} on port http")
    env = {e["name"]: e for e in c.get("env", [])}
    check_env_keys(env, where)
    mounts = {m["name"]: m for m in c.get("volumeMounts", [])}
    vols = {v["name"]: v for v in spec.get("volumes", [])}

    # Credentials: files of a read-only Secret volume, named by TOLLGATE_*_FILE.
    secret_names = set()
    file_vars = {f"TOLLGATE_{k.upper()}_FILE": k for k in FILE_KEYS}
    for var, e in env.items():
        plain = var.removeprefix("TOLLGATE_").lower()
        if plain in SECRET_KEYS:
            fail(f"{where}: {var} carries a credential: mount the Secret and set {var}_FILE instead")
        if var not in file_vars:
            continue
        path_ = e.get("value")
        if not path_ or "valueFrom" in e:
            fail(f"{where}: {var} must be a literal path to a file of the mounted Secret")
        mdir, _, fname = path_.rpartition("/")
        m = [m for m in mounts.values() if m["mountPath"].rstrip("/") == mdir]
        vol = vols.get(m[0]["name"], {}) if m else {}
        if "secret" not in vol:
            fail(f"{where}: {var}={path_}: no Secret volume is mounted at {mdir}")
        if m[0].get("readOnly") is not True:
            fail(f"{where}: the Secret volume {m[0]['name']} must be mounted readOnly")
        if vol["secret"].get("optional"):
            fail(f"{where}: the Secret volume {m[0]['name']} must not be optional")
        items = {i["path"]: i["key"] for i in vol["secret"].get("items", [])} or None
        key = items.get(fname) if items is not None else fname
        want = SECRET_KEYS.get(file_vars[var], file_vars[var].replace("_", "-"))
        if key != want:
            fail(f"{where}: {var} must read key {want!r} of the Secret, reads {key!r}")
        secret_names.add(vol["secret"]["secretName"])
    for k in SECRET_KEYS:
        if f"TOLLGATE_{k.upper()}_FILE" not in env:
            fail(f"{where}: TOLLGATE_{k.upper()}_FILE is missing (the {SECRET_KEYS[k]} file of the Secret)")
    if len(secret_names) != 1:
        fail(f"{where}: the secret files must come from one Secret, got {secret_names}")
    secret_name = secret_names.pop()
    secrets = {d["metadata"]["name"]: d for d in by_kind.get("Secret", [])}
    for s in secrets.values():
        for k, v in secret_values(s).items():
            if PLACEHOLDER in v:
                fail(f"{where}: Secret {s['metadata']['name']} key {k} holds a placeholder ({PLACEHOLDER}): "
                     f"{rel(SECRET_EXAMPLE)} must never be a resource of an overlay")
    if path.name.startswith("prod") and secrets:
        fail(f"{where}: the prod overlay must not render a Secret (it is created out of band): {sorted(secrets)}")
    if secrets:
        s = secrets.get(secret_name)
        if not s:
            fail(f"{where}: Secret {secret_name} referenced by the Deployment is not in the output")
        secret_data = secret_values(s)
        needed = set(SECRET_KEYS.values()) | ({"provider-url"} if "TOLLGATE_PROVIDER_URL_FILE" in env else set())
        missing = needed - set(secret_data)
        if missing:
            fail(f"{where}: Secret {secret_name} lacks keys {sorted(missing)}")
    elif secret_name != "tollgate-secrets":
        fail(f"{where}: external Secret must be named tollgate-secrets (documented in docs/operations.md)")
    else:
        secret_data = secret_values(load_yaml(SECRET_EXAMPLE))  # the shape operators create

    # Configuration file: mounted where TOLLGATE_CONFIG says, keys known.
    cfg_path = (env.get("TOLLGATE_CONFIG") or {}).get("value")
    if not cfg_path:
        fail(f"{where}: TOLLGATE_CONFIG must point at the mounted tollgate.toml")
    cm_name = None
    for vname, m in mounts.items():
        if cfg_path.startswith(m["mountPath"].rstrip("/") + "/") and "configMap" in vols.get(vname, {}):
            cm_name = vols[vname]["configMap"]["name"]
    cms = {d["metadata"]["name"]: d for d in by_kind.get("ConfigMap", [])}
    if cm_name not in cms:
        fail(f"{where}: no ConfigMap mounted at {cfg_path}")
    fname = cfg_path.rsplit("/", 1)[1]
    toml_text = cms[cm_name].get("data", {}).get(fname)
    if toml_text is None:
        fail(f"{where}: ConfigMap {cm_name} has no key {fname}")
    with tempfile.NamedTemporaryFile("w", suffix=".toml") as t:
        t.write(toml_text)
        t.flush()
        cfg = check_toml(Path(t.name), f"{where}: ConfigMap {cm_name} key {fname}")
    grace_ms = int(cfg.get("shutdown_grace_ms", 25000))
    if spec.get("terminationGracePeriodSeconds", 30) * 1000 <= grace_ms:
        fail(f"{where}: terminationGracePeriodSeconds must exceed shutdown_grace_ms ({grace_ms} ms)")
    shards = int(cfg.get("shards", 4))
    prefix = cfg.get("prefix", "tollgate")

    for kind in ("Service", "PodDisruptionBudget", "PodMonitor", "NetworkPolicy"):
        for d in by_kind.get(kind, []):
            sel = d["spec"]["podSelector" if kind == "NetworkPolicy" else "selector"]
            sel = sel if kind != "Service" else {"matchLabels": sel}
            if not labels_match(sel, labels):
                fail(f"{where}: {kind}/{d['metadata']['name']} selector does not match the worker pods")
    for d in by_kind.get("PodMonitor", []):
        for ep in d["spec"].get("podMetricsEndpoints", []):
            if ep.get("port") not in ports or ep.get("path", "/metrics") != "/metrics":
                fail(f"{where}: PodMonitor endpoint must scrape port http, path /metrics")
        if d["spec"].get("jobLabel") and labels.get(d["spec"]["jobLabel"]) != "tollgate":
            fail(f"{where}: PodMonitor jobLabel must give job=\"tollgate\" (runbooks use it)")
    for d in by_kind.get("PrometheusRule", []):
        compare_rules(d, f"{where}: PrometheusRule/{d['metadata']['name']}")

    # NetworkPolicy: ingress only to the HTTP port; egress to DNS and to the
    # ports of every URL the workers use (Secret, env, configuration file).
    urls = {k: v for k, v in secret_data.items() if k.endswith("-url")}
    for var, e in env.items():
        if var.endswith("_URL") or (var.startswith("TOLLGATE_ROUTES__") and var.endswith("__URL")):
            if e.get("value"):
                urls[var] = e["value"]
    for k in ("provider_url", "eligibility_url"):
        if cfg.get(k):
            urls[k] = cfg[k]
    for kind_, r in (cfg.get("routes") or {}).items():
        if r.get("url"):
            urls[f"routes.{kind_}.url"] = r["url"]
    check_network_policy(by_kind.get("NetworkPolicy", []), ports, urls, where)

    boards = [d for d in by_kind.get("ConfigMap", []) if (d["metadata"].get("labels") or {}).get("grafana_dashboard") == "1"]
    if by_kind.get("PodMonitor"):
        want = {f.name: f.read_text() for f in DASHBOARDS.glob("*.json")}
        got = {}
        for b in boards:
            got.update(b.get("data", {}))
        if got != want:
            fail(f"{where}: dashboard ConfigMaps (label grafana_dashboard: \"1\") must hold exactly dashboards/*.json")

    scaled = by_kind.get("ScaledObject", [])
    for so in scaled:
        s = so["spec"]
        sw = f"{where}: ScaledObject/{so['metadata']['name']}"
        if s["scaleTargetRef"].get("name") != dep["metadata"]["name"]:
            fail(f"{sw}: scaleTargetRef must be the Deployment {dep['metadata']['name']}")
        if not isinstance(s.get("maxReplicaCount"), int):
            fail(f"{sw}: maxReplicaCount must be set (more pods do not help quota-bound tenants)")
        if "replicas" in dep["spec"]:
            fail(f"{where}: Deployment must not set spec.replicas when KEDA owns it")
        queues = []
        for t in s["triggers"]:
            md = t.get("metadata", {})
            if t.get("type") != "rabbitmq" or md.get("mode") != "QueueLength":
                fail(f"{sw}: every trigger must be rabbitmq with mode QueueLength")
            queues.append(md.get("queueName"))
            ref = (t.get("authenticationRef") or {}).get("name")
            tas = {d["metadata"]["name"]: d for d in by_kind.get("TriggerAuthentication", [])}
            if ref not in tas:
                fail(f"{sw}: authenticationRef {ref!r} is not a TriggerAuthentication in the output")
            for st in tas[ref]["spec"].get("secretTargetRef", []):
                if st.get("name") != secret_name:
                    fail(f"{sw}: TriggerAuthentication {ref} must read the Secret {secret_name}")
                # KEDA takes one URL: a key other than amqp-url (which may
                # list every node) must be one the example Secret documents.
                if st.get("key") not in secret_data and f"# {st.get('key')}:" not in SECRET_EXAMPLE.read_text():
                    fail(f"{sw}: TriggerAuthentication {ref} reads key {st.get('key')!r}, which "
                         f"{rel(SECRET_EXAMPLE)} neither has nor documents")
        want_q = [f"{prefix}.work.{i}" for i in range(shards)]
        if sorted(queues) != want_q:
            fail(f"{sw}: triggers must be exactly the work queues {want_q} (shards={shards}, prefix={prefix}), got {queues}")
    return f"{rel(path)} ({len(docs)} objects: {', '.join(sorted(by_kind))})"


def check_rabbitmq_cluster() -> str:
    """services/rabbitmq-cluster: what tollgate needs of each node. Its kind
    (the RabbitMQ Cluster Operator's RabbitmqCluster) has no schema package
    here, so the fields tollgate relies on are checked by name."""
    path = K8S / "services/rabbitmq-cluster"
    where = f"kubectl kustomize {rel(path)}"
    docs = kustomize(path)
    rc = [d for d in docs if d["kind"] == "RabbitmqCluster"]
    if len(rc) != 1 or rc[0]["apiVersion"] != "rabbitmq.com/v1beta1":
        fail(f"{where}: expected one rabbitmq.com/v1beta1 RabbitmqCluster")
    for d in docs:
        if d["kind"] != "RabbitmqCluster":
            validate_core(d, where)
    spec = rc[0]["spec"]
    known = {"replicas", "rabbitmq", "persistence", "resources", "image", "service", "override", "tls",
             "affinity", "tolerations", "terminationGracePeriodSeconds", "secretBackend", "skipPostDeploySteps",
             "delayStartSeconds", "imagePullSecrets", "autoEnableAllFeatureFlags"}
    if set(spec) - known:
        fail(f"{where}: RabbitmqCluster.spec has fields the operator does not know: {sorted(set(spec) - known)}")
    if set(spec.get("rabbitmq", {})) - {"additionalPlugins", "additionalConfig", "advancedConfig", "envConfig",
                                         "erlangInetConfig"}:
        fail(f"{where}: RabbitmqCluster.spec.rabbitmq has unknown fields: {sorted(spec['rabbitmq'])}")
    if spec.get("replicas", 1) < 3:
        fail(f"{where}: replicas must be at least 3 (quorum queues survive one node's loss of three)")
    rabbit = spec.get("rabbitmq", {})
    if "rabbitmq_consistent_hash_exchange" not in rabbit.get("additionalPlugins", []):
        fail(f"{where}: additionalPlugins must enable rabbitmq_consistent_hash_exchange")
    if not re.search(r"dead_letter_worker_publisher_confirm_timeout,\s*\d+", rabbit.get("advancedConfig", "")):
        fail(f"{where}: advancedConfig must set dead_letter_worker_publisher_confirm_timeout")
    return f"{rel(path)} (RabbitmqCluster: {spec['replicas']} nodes, plugin, forwarder timeout)"


def check_kustomize() -> None:
    overlays = sorted(p for p in (K8S / "overlays").iterdir() if (p / "kustomization.yaml").is_file())
    if not overlays:
        fail("no overlays under deploy/kubernetes/overlays")
    results = [check_secret_example()] + [check_overlay(o) for o in overlays] + [check_rabbitmq_cluster()]
    prod = [r for r in results if "ScaledObject" in r and "PrometheusRule" in r]
    if not prod:
        fail("no overlay builds the KEDA ScaledObject and the PrometheusRule together")
    ok(f"kubernetes: core kinds valid (strict, Kubernetes {' and '.join(K8S_VERSIONS)}), CRDs valid against "
       f"their schemas, consistency checks pass: {'; '.join(results)}")


# ----------------------------------------------------------------- compose


def compose_schema() -> dict:
    import importlib.util

    spec = importlib.util.find_spec("compose")
    if not spec or not spec.submodule_search_locations:
        fail("compose spec schema missing: pip install --no-deps docker-compose==1.29.2 into the venv")
    return json.loads((Path(spec.submodule_search_locations[0]) / "config/compose_spec.json").read_text())


def check_compose() -> None:
    import jsonschema

    doc = load_yaml(COMPOSE)
    where = rel(COMPOSE)
    base = COMPOSE.parent
    try:
        jsonschema.validate(doc, compose_schema())
    except jsonschema.ValidationError as e:
        fail(f"{where}: not valid against the compose spec schema at {'.'.join(map(str, e.path))}: {e.message}")
    services = doc.get("services") or {}
    for need in ("rabbitmq", "redis", "worker"):
        if need not in services:
            fail(f"{where}: service {need} missing")
    refs = 0

    def local(p: str, what: str) -> Path:
        nonlocal refs
        path = (base / p).resolve()
        if not path.exists():
            fail(f"{where}: {what} refers to {p}, which does not exist ({rel(path)})")
        refs += 1
        return path

    mounted: dict[str, Path] = {}
    for name, s in services.items():
        b = s.get("build")
        if b:
            ctx = local(b if isinstance(b, str) else b.get("context", "."), f"services.{name}.build")
            if isinstance(b, dict) and b.get("dockerfile"):
                df = (ctx / b["dockerfile"]).resolve()
                if not df.is_file():
                    fail(f"{where}: services.{name}.build.dockerfile {b['dockerfile']} does not exist")
                refs += 1
        for v in s.get("volumes", []):
            src = v.split(":")[0] if isinstance(v, str) else v.get("source", "")
            if src.startswith((".", "/")):
                p = local(src, f"services.{name}.volumes")
                target = v.split(":")[1] if isinstance(v, str) else v.get("target")
                mounted[f"{name}:{target}"] = p
        for ef in ([s["env_file"]] if isinstance(s.get("env_file"), str) else s.get("env_file", [])):
            local(ef if isinstance(ef, str) else ef["path"], f"services.{name}.env_file")
        for dep in s.get("depends_on", {}) or {}:
            if dep not in services:
                fail(f"{where}: services.{name}.depends_on names unknown service {dep}")
    for top in ("configs", "secrets"):
        for name, c in (doc.get(top) or {}).items():
            if c.get("file"):
                local(c["file"], f"{top}.{name}.file")

    plugins = [p for k, p in mounted.items() if k.startswith("rabbitmq:") and k.endswith("enabled_plugins")]
    if not plugins or "rabbitmq_consistent_hash_exchange" not in plugins[0].read_text():
        fail(f"{where}: rabbitmq must mount an enabled_plugins file enabling rabbitmq_consistent_hash_exchange")
    if not re.fullmatch(r"\[[a-z_,\s]+\]\.\s*", plugins[0].read_text()):
        fail(f"{rel(plugins[0])}: must be an Erlang list term like [rabbitmq_consistent_hash_exchange].")

    w = services["worker"]
    env = w.get("environment") or {}
    env = dict(e.split("=", 1) for e in env) if isinstance(env, list) else env
    check_env_keys(env, f"{where}: services.worker.environment")
    cfg = env.get("TOLLGATE_CONFIG")
    if cfg:
        src = mounted.get(f"worker:{cfg}")
        if not src:
            fail(f"{where}: TOLLGATE_CONFIG={cfg} but nothing is mounted there")
        check_toml(src)
    if (w.get("command") or [None])[0] != "worker":
        fail(f"{where}: services.worker.command must be [worker]")

    nodes = check_compose_cluster(services, mounted, where)

    prom = [p for k, p in mounted.items() if k.startswith("prometheus:") and k.endswith("prometheus.yml")]
    if prom:
        # promtool check config, with the files laid out as in the container.
        pdir = Path(tempfile.mkdtemp())
        try:
            for k, p in mounted.items():
                if k.startswith("prometheus:/etc/prometheus/") and p.is_file():
                    shutil.copy(p, pdir / k.rsplit("/", 1)[1])
            r = subprocess.run(["promtool", "check", "config", str(pdir / "prometheus.yml")],
                               capture_output=True, text=True)
            if r.returncode != 0:
                fail(f"{rel(prom[0])}: promtool check config failed:\n{(r.stdout + r.stderr).strip()}")
        finally:
            shutil.rmtree(pdir)
    for k, p in mounted.items():
        if p.is_file() and p.suffix in (".yaml", ".yml"):
            load_yaml(p)
    ok(f"compose: {where} valid against the compose spec, {len(services)} services, "
       f"{refs} local file references exist, worker config/env and Prometheus config valid, "
       f"profile cluster: {nodes} RabbitMQ nodes in one cluster and a 6-node Redis Cluster, its workers name each")


def check_compose_cluster(services: dict, mounted: dict[str, Path], where: str) -> int:
    """The `cluster` profile: RabbitMQ nodes that form one cluster with what
    tollgate needs on each (the consistent-hash plugin, the dead-letter
    forwarder's short confirm timeout), and workers that name every node."""
    nodes = sorted(n for n, s in services.items() if "cluster" in s.get("profiles", []) and n.startswith("rabbit-"))
    if len(nodes) < 3:
        fail(f"{where}: the cluster profile needs 3 RabbitMQ nodes rabbit-N, has {nodes}")
    for n in nodes:
        s = services[n]
        if s.get("hostname") != n:
            fail(f"{where}: services.{n}.hostname must be {n} (its node name rabbit@{n})")
        files = {t: mounted.get(f"{n}:/etc/rabbitmq/{t}") for t in ("enabled_plugins", "rabbitmq.conf", "advanced.config")}
        for t, f in files.items():
            if not f:
                fail(f"{where}: services.{n} must mount /etc/rabbitmq/{t}")
        if "rabbitmq_consistent_hash_exchange" not in files["enabled_plugins"].read_text():
            fail(f"{where}: services.{n}: enabled_plugins lacks rabbitmq_consistent_hash_exchange")
        if not re.search(r"dead_letter_worker_publisher_confirm_timeout,\s*\d+", files["advanced.config"].read_text()):
            fail(f"{rel(files['advanced.config'])}: must set dead_letter_worker_publisher_confirm_timeout")
        listed = re.findall(r"classic_config\.nodes\.\d+\s*=\s*rabbit@(\S+)", files["rabbitmq.conf"].read_text())
        if sorted(listed) != nodes:
            fail(f"{rel(files['rabbitmq.conf'])}: classic_config nodes {listed} are not the services {nodes}")
        cookies = {s.get("environment", {}).get(k) for k in ("RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS", "RABBITMQ_CTL_ERL_ARGS")}
        if len(cookies) != 1 or None in cookies or "-setcookie" not in cookies.pop():
            fail(f"{where}: services.{n}: the node and its CLI tools need the same -setcookie")
    w = services.get("worker-cluster")
    if not w or "cluster" not in w.get("profiles", []):
        fail(f"{where}: the cluster profile needs a service worker-cluster")
    env = w.get("environment") or {}
    check_env_keys(env, f"{where}: services.worker-cluster.environment")
    urls = env.get("TOLLGATE_AMQP_URL", "").split(",")
    hosts = sorted(re.sub(r"^amqps?://(?:[^@/]*@)?([^:/]+).*$", r"\1", u) for u in urls)
    if hosts != nodes:
        fail(f"{where}: worker-cluster's TOLLGATE_AMQP_URL names {hosts}, not every node {nodes}")
    if env.get("TOLLGATE_PREFIX") in (None, (services["worker"].get("environment") or {}).get("TOLLGATE_PREFIX")):
        fail(f"{where}: worker-cluster needs a TOLLGATE_PREFIX of its own")

    # The Redis Cluster: nodes started with cluster mode, formed by one
    # init service that names each, and the workers' redis URL naming each.
    redis_nodes = sorted(n for n, s in services.items() if "cluster" in s.get("profiles", []) and re.fullmatch(r"redis-c\d+", n))
    if len(redis_nodes) < 6:
        fail(f"{where}: the cluster profile needs 6 Redis Cluster nodes redis-cN (3 masters, 3 replicas), has {redis_nodes}")
    for n in redis_nodes:
        s = services[n]
        cmd = " ".join(s.get("command") or [])
        if s.get("hostname") != n or "--cluster-enabled yes" not in cmd:
            fail(f"{where}: services.{n} needs hostname {n} and --cluster-enabled yes")
    init = services.get("redis-cluster-init") or {}
    create = " ".join(init.get("command") or [])
    named = sorted(re.findall(r"(redis-c\d+):6379", create.split("--cluster create", 1)[-1]))
    if "--cluster-replicas 1" not in create or named != redis_nodes:
        fail(f"{where}: redis-cluster-init must `redis-cli --cluster create` every node with 1 replica, names {named}")
    deps = w.get("depends_on") or {}
    if (deps.get("redis-cluster-init") or {}).get("condition") != "service_completed_successfully":
        fail(f"{where}: worker-cluster must wait for redis-cluster-init to complete")
    hosts = sorted(re.sub(r"^rediss?://(?:[^@/]*@)?([^:/]+).*$", r"\1", u)
                   for u in env.get("TOLLGATE_REDIS_URL", "").split(","))
    if hosts != redis_nodes:
        fail(f"{where}: worker-cluster's TOLLGATE_REDIS_URL names {hosts}, not every Redis node {redis_nodes}")
    return len(nodes)


# -------------------------------------------------------------- dockerfile


def dockerfile_instructions(text: str) -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", text)
    out = []
    for line in text.splitlines():
        s = line.strip()
        if not s or s.startswith("#"):
            continue
        word, _, rest = s.partition(" ")
        out.append((word.upper(), rest.strip()))
    return out


def check_dockerfile() -> None:
    where = rel(DOCKERFILE)
    ins = dockerfile_instructions(DOCKERFILE.read_text())
    stages = []
    for word, rest in ins:
        if word == "FROM":
            m = re.match(r"(?:--platform=\S+\s+)?(\S+)(?:\s+AS\s+(\S+))?$", rest, re.I)
            stages.append({"image": m.group(1), "name": m.group(2), "ins": []})
        elif stages:
            stages[-1]["ins"].append((word, rest))
    if len(stages) < 2:
        fail(f"{where}: expected a build stage and a runtime stage")
    build, runtime = stages[0], stages[-1]
    if build["image"] != "rust:1.95-bookworm":
        fail(f"{where}: build stage must be FROM rust:1.95-bookworm, got {build['image']}")
    runs = [r for w, r in build["ins"] if w == "RUN"]
    cmds = [c.strip() for r in runs for c in re.split(r"&&|;", re.sub(r"--mount=\S+", "", r))]
    if BUILD_COMMAND not in cmds:
        fail(f"{where}: the build stage must run exactly `{BUILD_COMMAND}`")
    if runtime["image"] not in ("gcr.io/distroless/cc-debian12:nonroot",) and not runtime["image"].startswith("debian:bookworm"):
        fail(f"{where}: runtime must be gcr.io/distroless/cc-debian12:nonroot or debian bookworm-slim")
    user = [r for w, r in runtime["ins"] if w == "USER"]
    if not user or user[-1].split(":")[0] in ("root", "0"):
        fail(f"{where}: the runtime stage must set a non-root USER")
    copies = [r for w, r in runtime["ins"] if w == "COPY" and f"--from={build['name']}" in r]
    if not copies:
        fail(f"{where}: the runtime stage must COPY the binary --from={build['name']}")
    ep = [r for w, r in runtime["ins"] if w == "ENTRYPOINT"]
    if not ep or not ep[-1].startswith("["):
        fail(f"{where}: ENTRYPOINT must be exec form (tollgate is PID 1 and gets SIGTERM)")
    if "9090" not in " ".join(r for w, r in runtime["ins"] if w == "EXPOSE"):
        fail(f"{where}: EXPOSE 9090")
    di = ROOT / ".dockerignore"
    if not di.is_file() or "target" not in di.read_text():
        fail(".dockerignore must exclude target/ (the build context is the repository)")
    mk = (ROOT / "Makefile").read_text()
    m = re.search(r"^release:.*\n((?:\t.*\n)+)", mk, re.M)
    if not m or BUILD_COMMAND not in m.group(1).replace("$(CARGO)", "cargo"):
        fail(f"Makefile: target `release` must run `{BUILD_COMMAND}`")
    r = subprocess.run(["cargo", "metadata", "--locked", "--format-version", "1"],
                       cwd=ROOT, capture_output=True, text=True)
    if r.returncode != 0:
        fail(f"Cargo.lock is not in sync with the manifests (`--locked` would fail in the image build):\n{r.stderr.strip()}")
    ok(f"dockerfile: {where} builds with `{BUILD_COMMAND}` on rust:1.95-bookworm, runs as non-root on "
       f"{runtime['image']}; Makefile `release` runs the same; Cargo.lock in sync")


CHECKS = {
    "alerts": check_alerts,
    "dashboards": check_dashboards,
    "prometheusrule": check_prometheusrule,
    "kustomize": check_kustomize,
    "compose": check_compose,
    "dockerfile": check_dockerfile,
}

if __name__ == "__main__":
    args = sys.argv[1:]
    if args == ["--write-prometheusrule"]:
        PROMETHEUSRULE.write_text(prometheusrule_text())
        print(f"wrote {rel(PROMETHEUSRULE)}")
        sys.exit(0)
    sys.exit(run_checks(CHECKS, args))
