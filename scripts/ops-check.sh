#!/usr/bin/env bash
# Checks every operator-facing asset: alert rules and their unit tests,
# dashboards, the Kubernetes manifests (kustomize overlays, strict schema
# validation of core kinds and CRDs), the compose file, the Dockerfile, and a
# live run where Debian's Prometheus scrapes a real `tollgate worker` and
# evaluates every dashboard and alert query. `make ops-check` runs it after
# scripts/services.sh (RabbitMQ + Redis).
#
# Installs what it needs, once: Debian's `prometheus` (promtool) with apt when
# run as root, a Python venv in target/ops-venv (tests/ops/requirements*.txt),
# the CRD schemas from npm in target/ops-node (tests/ops/package-lock.json),
# and target/debug/tollgate (cargo build -p tollgate) if it is missing.
#
# Each check prints `ok: <what>`; the first failure stops with a message.
# Re-runnable; a few minutes on 2 cores (about one when everything is installed).
set -euo pipefail

cd "$(dirname "$0")/.."
ROOT=$PWD
VENV=$ROOT/target/ops-venv
NODE_DIR=$ROOT/target/ops-node
TOLLGATE=${TOLLGATE_BIN:-$ROOT/target/debug/tollgate}
START=$(date +%s)

die() { echo "FAIL: $*" >&2; exit 1; }
have() { command -v "$1" >/dev/null 2>&1; }
ok() { echo "ok: $*"; }

apt_install() { # packages...
    [ "$(id -u)" = 0 ] && have apt-get || die "$* missing: install it (Debian: apt-get install $*)"
    echo "ops-check: installing $* from Debian's packages" >&2
    DEBIAN_FRONTEND=noninteractive apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" >/dev/null
}

install_prometheus() {
    apt_install prometheus
    # Where init allows it, the package starts a system-wide Prometheus on
    # :9090 (tollgate's default port too); the checks run their own: stop it.
    if have systemctl && systemctl is-active --quiet prometheus 2>/dev/null; then
        systemctl disable --now prometheus >/dev/null 2>&1 || true
    elif have service; then
        service prometheus stop >/dev/null 2>&1 || true
    fi
}

# ---- tools ------------------------------------------------------------------
export PYTHONDONTWRITEBYTECODE=1
have promtool && have prometheus || install_prometheus
have kubectl || die "kubectl missing (needed for kubectl kustomize): install kubectl"
have node && have npm || apt_install nodejs npm
have python3 || apt_install python3 python3-venv

# Python venv, reinstalled only when the pinned requirements change.
REQS=$(cat tests/ops/requirements.txt tests/ops/requirements-nodeps.txt)
if [ ! -x "$VENV/bin/python" ] || [ "$(cat "$VENV/.ops-requirements" 2>/dev/null)" != "$REQS" ]; then
    echo "ops-check: preparing $VENV" >&2
    python3 -m venv "$VENV" 2>/dev/null || { apt_install python3-venv; python3 -m venv "$VENV"; }
    "$VENV/bin/pip" install -q --disable-pip-version-check -r tests/ops/requirements.txt
    "$VENV/bin/pip" install -q --disable-pip-version-check --no-deps -r tests/ops/requirements-nodeps.txt
    printf '%s' "$REQS" >"$VENV/.ops-requirements"
fi
PY=$VENV/bin/python

# CRD schemas (npm), reinstalled only when the lockfile changes.
if ! cmp -s tests/ops/package-lock.json "$NODE_DIR/package-lock.json" || [ ! -d "$NODE_DIR/node_modules" ]; then
    echo "ops-check: installing CRD schemas into $NODE_DIR" >&2
    rm -rf "$NODE_DIR" && mkdir -p "$NODE_DIR"
    cp tests/ops/package.json tests/ops/package-lock.json "$NODE_DIR/"
    (cd "$NODE_DIR" && npm ci --no-audit --no-fund --loglevel=error >/dev/null)
fi
export OPS_NODE_MODULES=$NODE_DIR/node_modules

# ---- Prometheus rules ---------------------------------------------------------
out=$(promtool check rules deploy/prometheus/alerts.yaml 2>&1) || die "promtool check rules deploy/prometheus/alerts.yaml:
$out"
ok "promtool check rules deploy/prometheus/alerts.yaml ($(grep -o '[0-9]* rules found' <<<"$out"))"
out=$(promtool test rules deploy/prometheus/tests/*.yaml 2>&1) || die "promtool test rules deploy/prometheus/tests/*.yaml:
$out"
ok "promtool test rules: $(ls deploy/prometheus/tests/*.yaml | wc -l) test files pass"

# ---- static checks (see tests/ops/check_static.py) ------------------------------
"$PY" tests/ops/check_static.py alerts dashboards prometheusrule kustomize compose dockerfile

# ---- live: Prometheus scraping a real worker ----------------------------------
if [ ! -x "$TOLLGATE" ]; then
    echo "ops-check: building tollgate (cargo build -p tollgate)" >&2
    cargo build -q -p tollgate
fi
"$PY" tests/ops/check_promql.py --tollgate "$TOLLGATE"

ok "ops-check passed in $(($(date +%s) - START))s"
