#!/usr/bin/env python3
"""Live check: every dashboard and alert query against a real worker's metrics.

    target/ops-venv/bin/python tests/ops/check_promql.py [--tollgate target/debug/tollgate]

Needs RabbitMQ and Redis (TOLLGATE_AMQP_URL / TOLLGATE_REDIS_URL or the local
defaults), Debian's `prometheus` and `promtool`, and the tollgate binary.

What it does, on loopback only, with a prefix of its own:

 1. starts the fake provider (deploy/compose/fake-provider.py) on a free port;
 2. sets an adaptive quota for tenant acme and its route, and a shadow quota
    (so effective rates and shadow verdicts exist), then starts
    `tollgate worker` with the shipped configuration file
    (deploy/kubernetes/base/tollgate.toml) plus local overrides;
 3. starts Prometheus (scrape and rule evaluation every 1 s, the rules of
    deploy/prometheus/alerts.yaml loaded) scraping that worker;
 4. publishes real jobs for three tenants: acme gets plain jobs, "flaky" jobs
    (the provider answers 429, then 500, then 200: throttled, failed, retried
    with backoff, sent), one job the provider rejects (400) and one body that
    is not JSON (malformed dead letter); globex plain jobs; initech jobs due
    in 3 s;
 5. waits until every job reached its outcome and Prometheus scraped it;
 6. `promtool check metrics` on a real scrape of /metrics (must be clean);
 7. evaluates, through Prometheus's HTTP API, every query of every dashboard
    (with $tenant = acme, $__rate_interval = 1m and again 15s, $__range = 5m)
    and asserts that it parses and returns data; also the tenant variable's
    label_values() query;
 8. evaluates every alert expression: the whole expression must parse, and
    each of its *data-bearing parts* must return data. An alert that does not
    fire is legitimately empty, so the expression is split at its top-level
    comparisons and set operators (`x > 30`, `a and b`, `a unless b`,
    `absent(x)`) and each non-literal side is evaluated on its own (see
    opslib.data_parts); every rule must also evaluate without error in
    Prometheus's rule manager, and TollgateNoWorkerConsuming must not be
    active (nor pending) while the worker consumes;
 9. runs the CLI commands the runbooks use (quota get, dlq list) and stops the
    worker with SIGTERM: it must drain and exit 0;
10. always cleans up: Prometheus, the worker and the provider are stopped, the
    prefix's queues and exchanges and its Redis keys deleted.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from pathlib import Path

import yaml

sys.dont_write_bytecode = True
sys.path.insert(0, str(Path(__file__).resolve().parent))
from opslib import ROOT, CheckFailed, data_parts, fail, ok  # noqa: E402

CONFIG = ROOT / "deploy/kubernetes/base/tollgate.toml"
ALERTS = ROOT / "deploy/prometheus/alerts.yaml"
PROVIDER = ROOT / "deploy/compose/fake-provider.py"
TENANT = "acme"
RATE_INTERVALS = ["1m", "15s"]

# jobs published below: tenant -> count (the malformed body is acme's)
JOBS = {"acme": 30 + 8 + 1 + 1, "globex": 20, "initech": 10}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(url: str, timeout: float = 5.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except (urllib.error.URLError, OSError) as e:
        return 0, str(e)


def wait_for(what: str, secs: float, probe) -> None:
    deadline = time.monotonic() + secs
    while time.monotonic() < deadline:
        if probe():
            return
        time.sleep(0.25)
    fail(f"{what} within {secs:.0f}s")


class Live:
    def __init__(self, tollgate: Path, verbose: bool):
        self.tollgate = tollgate
        self.verbose = verbose
        self.prefix = f"tgops{uuid.uuid4().hex[:10]}"
        self.tmp = Path(tempfile.mkdtemp(prefix="tollgate-ops-"))
        self.procs: dict[str, subprocess.Popen] = {}
        self.worker_addr = f"127.0.0.1:{free_port()}"
        self.prom_url = f"http://127.0.0.1:{free_port()}"
        self.amqp_url = os.environ.get("TOLLGATE_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2f")
        self.redis_url = os.environ.get("TOLLGATE_REDIS_URL", "redis://127.0.0.1:6379")
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("TOLLGATE_")}
        self.env.update(
            TOLLGATE_CONFIG=str(CONFIG),  # the shipped configuration file
            TOLLGATE_PREFIX=self.prefix,
            TOLLGATE_AMQP_URL=self.amqp_url,
            TOLLGATE_REDIS_URL=self.redis_url,
            TOLLGATE_HTTP_ADDR=self.worker_addr,
            TOLLGATE_NAME="ops-check",
            # Long enough that a retry's backoff (full jitter) is parked, not
            # held: parked_total{reason="backoff"} must exist.
            TOLLGATE_BACKOFF_BASE_MS="4000",
            TOLLGATE_ADMIN_TOKEN=uuid.uuid4().hex,
        )

    # -- processes ---------------------------------------------------------

    def spawn(self, name: str, args: list[str], **kw) -> subprocess.Popen:
        log = open(self.tmp / f"{name}.log", "w")
        p = subprocess.Popen(args, stdout=kw.pop("stdout", log), stderr=log, env=kw.pop("env", self.env),
                             start_new_session=True, **kw)
        self.procs[name] = p
        return p

    def log_tail(self, name: str, n: int = 15) -> str:
        try:
            lines = (self.tmp / f"{name}.log").read_text().splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-n:])

    def tollgate_cmd(self, *args: str, timeout: float = 60) -> str:
        r = subprocess.run([str(self.tollgate), *args], env=self.env, capture_output=True, text=True, timeout=timeout)
        if r.returncode != 0:
            fail(f"`tollgate {' '.join(args)}` exited {r.returncode}: {(r.stderr or r.stdout).strip()}")
        return r.stdout

    def stop(self, name: str, timeout: float = 10) -> int | None:
        p = self.procs.pop(name, None)
        if p is None or p.poll() is not None:
            return p.returncode if p else None
        p.send_signal(signal.SIGTERM)
        try:
            return p.wait(timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            return None

    # -- steps -------------------------------------------------------------

    def start_provider(self) -> None:
        p = self.spawn("provider", [sys.executable, str(PROVIDER), "--host", "127.0.0.1", "--port", "0"],
                       stdout=subprocess.PIPE, text=True)
        line = p.stdout.readline()
        m = re.search(r":(\d+)$", line.strip())
        if not m:
            fail(f"fake provider did not start: {line!r} {self.log_tail('provider')}")
        self.env["TOLLGATE_PROVIDER_URL"] = f"http://127.0.0.1:{m.group(1)}/send"

    def start_worker(self) -> None:
        self.tollgate_cmd("topology", "declare")
        # acme's quota and the route's adapt (so the effective-rate panels have
        # data: set by each completion); acme's shadow quota is separate.
        # --min at the rate: acme's flaky jobs answer 429 one after another,
        # and a learning quota would slow its 40 jobs past the wait below.
        self.tollgate_cmd("quota", "set", TENANT, "--rate", "10/s", "--adaptive", "--min", "10/s")
        self.tollgate_cmd("quota", "set", "--route", "default", "--rate", "1000/s", "--adaptive")
        self.tollgate_cmd("quota", "set", TENANT, "--rate", "5/s", "--shadow")
        p = self.spawn("worker", [str(self.tollgate), "worker"])

        def ready():
            if p.poll() is not None:
                fail(f"tollgate worker exited {p.returncode}:\n{self.log_tail('worker')}")
            return http_get(f"http://{self.worker_addr}/readyz")[0] == 200

        wait_for("the worker did not become ready (/readyz)", 30, ready)
        if http_get(f"http://{self.worker_addr}/healthz")[0] != 200:
            fail("/healthz is not 200 on a ready worker")
        # TollgateNoWorkerConsuming and the "Pods consuming" panel rely on it.
        if not re.search(r"^tollgate_consuming 1$", self.metrics(), re.M):
            fail("a ready worker does not report `tollgate_consuming 1` on /metrics")

    def start_prometheus(self) -> None:
        shutil.copy(ALERTS, self.tmp / "alerts.yaml")
        cfg = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "1s"},
            "rule_files": ["alerts.yaml"],
            "scrape_configs": [{"job_name": "tollgate", "static_configs": [{"targets": [self.worker_addr]}]}],
        }
        (self.tmp / "prometheus.yml").write_text(yaml.safe_dump(cfg))
        p = self.spawn("prometheus", [
            "prometheus",
            f"--config.file={self.tmp / 'prometheus.yml'}",
            f"--storage.tsdb.path={self.tmp / 'data'}",
            f"--web.listen-address={self.prom_url.removeprefix('http://')}",
            "--log.level=warn",
        ])

        def up():
            if p.poll() is not None:
                fail(f"prometheus exited {p.returncode}:\n{self.log_tail('prometheus')}")
            return http_get(f"{self.prom_url}/-/ready")[0] == 200

        wait_for("prometheus did not become ready", 30, up)

    def publish(self) -> None:
        t = self.tollgate_cmd
        t("publish", "--tenant", "acme", "--count", "30")
        t("publish", "--tenant", "acme", "--count", "8", "--payload", '{"mode":"flaky"}')
        t("publish", "--tenant", "acme", "--count", "1", "--payload", '{"mode":"reject"}')
        t("publish", "--tenant", "globex", "--count", "20")
        t("publish", "--tenant", "initech", "--count", "10", "--due-in", "3s")
        import pika

        conn = pika.BlockingConnection(pika.URLParameters(self.amqp_url))
        try:
            ch = conn.channel()
            ch.confirm_delivery()
            ch.basic_publish(f"{self.prefix}.jobs", "acme", b"this is not a job {",
                             pika.BasicProperties(content_type="application/json", delivery_mode=2),
                             mandatory=True)
        finally:
            conn.close()

    def metrics(self) -> str:
        code, body = http_get(f"http://{self.worker_addr}/metrics")
        if code != 200:
            fail(f"GET /metrics answered {code}")
        return body

    def wait_for_jobs(self) -> None:
        def done():
            total = {}
            for m in re.finditer(r'^tollgate_jobs_completed_total\{([^}]*)\} (\S+)$', self.metrics(), re.M):
                tenant = re.search(r'tenant="([^"]*)"', m.group(1)).group(1)
                total[tenant] = total.get(tenant, 0) + float(m.group(2))
            return all(total.get(k, 0) >= n for k, n in JOBS.items())

        wait_for(f"not every job reached an outcome ({JOBS}); worker log:\n{self.log_tail('worker')}\n", 120, done)
        # Let Prometheus scrape the final state a few times.
        time.sleep(4)

    def promtool_metrics(self) -> None:
        body = self.metrics()
        r = subprocess.run(["promtool", "check", "metrics"], input=body, capture_output=True, text=True)
        if r.returncode != 0 or r.stdout.strip() or r.stderr.strip():
            fail("promtool check metrics complains about tollgate's /metrics:\n" + (r.stdout + r.stderr).strip())
        ok(f"promtool check metrics: a live /metrics scrape ({len(body.splitlines())} lines) is clean")

    def query(self, expr: str) -> list:
        url = f"{self.prom_url}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        code, body = http_get(url, timeout=10)
        try:
            data = json.loads(body)
        except ValueError:
            fail(f"Prometheus answered {code} {body[:200]!r} for {expr}")
        if data.get("status") != "success":
            fail(f"query does not parse or evaluate: {data.get('errorType')}: {data.get('error')}\n    {expr}")
        return data["data"]["result"]

    def check_dashboards(self) -> None:
        n = 0
        for f in sorted((ROOT / "dashboards").glob("*.json")):
            d = json.loads(f.read_text())
            panels = []
            for p in d.get("panels", []):
                panels.append(p)
                panels.extend(p.get("panels", []))
            for p in panels:
                for t in p.get("targets", []):
                    for window in RATE_INTERVALS:
                        expr = (t["expr"].replace("${tenant}", TENANT).replace("$tenant", TENANT)
                                .replace("$__rate_interval", window).replace("$__range", "5m")
                                .replace("$__interval", "15s"))
                        if "$" in expr.replace("$labels", ""):
                            fail(f"{f.name}: panel {p['title']!r}: unsubstituted variable in {t['expr']}")
                        if not self.query(expr):
                            fail(f"{f.name}: panel {p['title']!r} query {t['refId']} returns no data "
                                 f"($__rate_interval={window}):\n    {expr}")
                        n += 1
                        if self.verbose:
                            print(f"  data: {f.name}: {p['title']}: {expr}")
        url = f"{self.prom_url}/api/v1/label/tenant/values?" + urllib.parse.urlencode(
            {"match[]": "tollgate_permit_decisions_total"})
        tenants = json.loads(http_get(url)[1])["data"]
        if not set(JOBS) <= set(tenants):
            fail(f"label_values(tollgate_permit_decisions_total, tenant) = {tenants}, expected {sorted(JOBS)}")
        ok(f"promql: {n} dashboard queries ($tenant={TENANT}, $__rate_interval={' and '.join(RATE_INTERVALS)}) "
           f"parse and return data; tenant variable lists {sorted(tenants)}")

    def check_alerts(self) -> None:
        rules = [r for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"]]
        parts = 0
        for r in rules:
            name = r.get("alert") or r.get("record")
            self.query(r["expr"])  # the whole expression parses and evaluates
            for part in data_parts(r["expr"]):
                parts += 1
                if not self.query(part):
                    fail(f"alert {name}: data-bearing part returns no data:\n    {' '.join(part.split())}")
                if self.verbose:
                    print(f"  data: {name}: {' '.join(part.split())}")
        # The rule manager evaluated every rule without error.
        def evaluated():
            groups = json.loads(http_get(f"{self.prom_url}/api/v1/rules")[1])["data"]["groups"]
            loaded = [x for g in groups for x in g["rules"]]
            if len(loaded) != len(rules):
                fail(f"Prometheus loaded {len(loaded)} rules from alerts.yaml, expected {len(rules)}")
            bad = [f"{x['name']}: {x.get('lastError')}" for x in loaded if x.get("health") not in ("ok", "unknown")]
            if bad:
                fail("rules fail to evaluate in Prometheus: " + "; ".join(bad))
            return all(x.get("health") == "ok" for x in loaded)

        wait_for("Prometheus did not evaluate every rule", 15, evaluated)
        active = json.loads(http_get(f"{self.prom_url}/api/v1/alerts")[1])["data"]["alerts"]
        if any(a["labels"].get("alertname") == "TollgateNoWorkerConsuming" for a in active):
            fail("TollgateNoWorkerConsuming is active although a worker is consuming")
        ok(f"promql: {len(rules)} alert expressions parse; their {parts} data-bearing parts return data; "
           f"Prometheus evaluates every rule without error")

    def check_cli_and_shutdown(self) -> None:
        q = self.tollgate_cmd("quota", "get", TENANT)
        if TENANT not in q:
            fail(f"`tollgate quota get {TENANT}` does not name the tenant: {q!r}")
        d = self.tollgate_cmd("dlq", "list")
        for reason in ("malformed", "rejected"):
            if reason not in d:
                fail(f"`tollgate dlq list` shows no {reason} dead letter:\n{d}")
        code = self.stop("worker", timeout=35)
        if code != 0:
            fail(f"the worker did not drain and exit 0 on SIGTERM (exit {code}):\n{self.log_tail('worker')}")
        ok("runbook CLI (`quota get`, `dlq list`) works; the worker drains and exits 0 on SIGTERM")

    # -- cleanup -----------------------------------------------------------

    def cleanup(self) -> None:
        for name in ("worker", "prometheus", "provider"):
            self.stop(name)
        problems = []
        try:
            import pika

            names = {}
            for what in ("queues", "exchanges"):
                r = subprocess.run(["rabbitmqctl", "-q", f"list_{what}", "name"], capture_output=True, text=True)
                names[what] = [n for n in r.stdout.split() if n.startswith(self.prefix + ".")]
            conn = pika.BlockingConnection(pika.URLParameters(self.amqp_url))
            ch = conn.channel()
            for q in names["queues"]:
                ch.queue_delete(q)
            for x in names["exchanges"]:
                ch.exchange_delete(x)
            conn.close()
        except Exception as e:  # noqa: BLE001 - report, keep cleaning
            problems.append(f"RabbitMQ cleanup of {self.prefix}.*: {e}")
        try:
            host, port = re.match(r"redis://(?:[^@]*@)?([^:/]+):?(\d+)?", self.redis_url).groups()
            cli = ["redis-cli", "-h", host, "-p", port or "6379"]
            keys = subprocess.run(cli + ["--scan", "--pattern", f"{self.prefix}:*"],
                                  capture_output=True, text=True).stdout.split()
            for i in range(0, len(keys), 500):
                subprocess.run(cli + ["unlink", *keys[i : i + 500]], capture_output=True)
        except Exception as e:  # noqa: BLE001
            problems.append(f"Redis cleanup of {self.prefix}:*: {e}")
        shutil.rmtree(self.tmp, ignore_errors=True)
        for p in problems:
            print(f"warning: {p}", file=sys.stderr)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tollgate", default=str(ROOT / "target/debug/tollgate"))
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args()
    tollgate = Path(args.tollgate).resolve()
    for tool in ("prometheus", "promtool", "rabbitmqctl", "redis-cli"):
        if not shutil.which(tool):
            print(f"FAIL: live-promql: {tool} is not installed", file=sys.stderr)
            return 1
    if not tollgate.is_file():
        print(f"FAIL: live-promql: {tollgate} missing (cargo build -p tollgate)", file=sys.stderr)
        return 1
    live = Live(tollgate, args.verbose)

    def on_signal(signum, _frame):
        live.cleanup()
        sys.exit(128 + signum)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    started = time.monotonic()
    try:
        live.start_provider()
        live.start_worker()
        live.start_prometheus()
        live.publish()
        live.wait_for_jobs()
        live.promtool_metrics()
        live.check_dashboards()
        live.check_alerts()
        live.check_cli_and_shutdown()
    except CheckFailed as e:
        print(f"FAIL: live-promql (prefix {live.prefix}): {e}", file=sys.stderr)
        return 1
    finally:
        live.cleanup()
    ok(f"live check took {time.monotonic() - started:.0f}s; prefix {live.prefix} cleaned up")
    return 0


if __name__ == "__main__":
    sys.exit(main())
