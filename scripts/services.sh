#!/usr/bin/env bash
# Makes sure the local RabbitMQ (with the plugin tollgate's topology needs)
# and Redis are up on 127.0.0.1. `make demo` and `make test` call this first.
#
#   - running already: nothing to do;
#   - installed but stopped: started;
#   - not installed: installed from Debian's packages when run as root with apt,
#     otherwise it stops with a message saying what to install.
#
# With --browser (`make test`) it also installs Chromium and chromedriver for
# the console's browser test when they are missing.
#
# TOLLGATE_SKIP_SERVICES=1 skips the services (services elsewhere, URLs in
# TOLLGATE_AMQP_URL / TOLLGATE_REDIS_URL).
set -euo pipefail

PLUGIN=rabbitmq_consistent_hash_exchange
say() { echo "services: $*" >&2; }
die() { echo "services: $*" >&2; exit 1; }
have() { command -v "$1" >/dev/null 2>&1; }
port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

wait_for() { # what, seconds, command...
    local what=$1 secs=$2; shift 2
    for _ in $(seq 1 $((secs * 2))); do
        if "$@" >/dev/null 2>&1; then return 0; fi
        sleep 0.5
    done
    die "$what did not come up within ${secs}s"
}

install() { # debian packages...
    if [ "$(id -u)" = 0 ] && have apt-get; then
        say "installing $* from Debian's packages"
        DEBIAN_FRONTEND=noninteractive apt-get update -qq >/dev/null
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
    else
        die "$* is not installed: install it (Debian/Ubuntu: sudo apt-get install $*) or point TOLLGATE_*_URL elsewhere and set TOLLGATE_SKIP_SERVICES=1"
    fi
}

redis_up() { redis-cli -h 127.0.0.1 -p 6379 ping | grep -q PONG; }

ensure_redis() {
    if port_open 6379; then return; fi
    have redis-server || install redis-server
    say "starting redis-server"
    redis-server --daemonize yes --bind 127.0.0.1 --port 6379 --save "" --appendonly no >/dev/null
    wait_for "redis" 20 redis_up
}

rabbit_up() { rabbitmq-diagnostics -q check_port_connectivity; }

ensure_rabbitmq() {
    if ! port_open 5672; then
        have rabbitmq-server || install rabbitmq-server
        if rabbitmq-diagnostics -q ping >/dev/null 2>&1; then
            say "the RabbitMQ node runs but its app is stopped: starting it"
            rabbitmqctl -q start_app >/dev/null
        else
            say "starting rabbitmq-server"
            rabbitmq-server -detached >/dev/null 2>&1 || true
        fi
        wait_for "rabbitmq" 120 rabbit_up
    fi
    if ! rabbitmq-plugins -q is_enabled "$PLUGIN" >/dev/null 2>&1; then
        say "enabling $PLUGIN"
        rabbitmq-plugins -q enable "$PLUGIN" >/dev/null
    fi
}

# Tools the tests use: socat (a TLS front for amqps:// tests) and openssl
# (the tests' throw-away CA).
ensure_tools() {
    local missing=()
    have socat || missing+=(socat)
    have openssl || missing+=(openssl)
    if [ ${#missing[@]} -gt 0 ]; then install "${missing[@]}"; fi
}

# The console's browser test: Debian's Chromium and its WebDriver (only for
# `make test`, which asks for them with --browser).
ensure_browser() {
    local missing=()
    have chromium || missing+=(chromium)
    have chromedriver || missing+=(chromium-driver)
    if [ ${#missing[@]} -gt 0 ]; then install "${missing[@]}"; fi
}

if [ "${1:-}" = --browser ]; then
    ensure_browser
fi
if [ "${TOLLGATE_SKIP_SERVICES:-0}" = 1 ]; then
    say "skipped (TOLLGATE_SKIP_SERVICES=1)"
    exit 0
fi
ensure_tools
ensure_redis
ensure_rabbitmq
say "RabbitMQ (with $PLUGIN) and Redis are up"
