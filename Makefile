# tollgate: the two commands a new user runs are `make demo` and `make test`.
# Both first make sure RabbitMQ (with its consistent-hash plugin) and Redis are
# up on localhost (scripts/services.sh).

CARGO ?= cargo

.PHONY: all build fmt lint test demo bench services fuzz clean release ops-check

all: build

services:
	@scripts/services.sh

build:
	$(CARGO) build --workspace --all-targets

fmt:
	$(CARGO) fmt --all

lint:
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --workspace --all-targets -- -D warnings

# Unit tests (pure core, property tests) and integration tests against the
# real RabbitMQ and Redis; each test uses its own random prefix. Then a serial
# phase for the tests that stop the shared RabbitMQ (they restart it) and
# those that start private clusters (scripts/clusters.sh, on free ports). The
# console's test drives headless Chromium, installed here when missing.
test:
	@scripts/services.sh --browser
	$(CARGO) build --workspace --all-targets
	$(CARGO) test --workspace
	$(CARGO) test -p tollgate-tests --test faults --test fairness --test clusters -- --ignored --test-threads=1
	scripts/ops-check.sh

# A live demonstration: fake provider with its own per-tenant limits, four
# tenants, three workers, a table per tenant; about 30 s, exits 0.
demo: services
	$(CARGO) build --release --quiet -p tollgate -p tollgate-dev
	target/release/tollgate-dev demo $(DEMO_ARGS)

# Throughput and pacing figures, written to target/bench/.
bench: services
	$(CARGO) build --release --quiet -p tollgate -p tollgate-dev
	target/release/tollgate-dev bench $(BENCH_ARGS)

# Fuzz the message decoder/validator for FUZZ_SECONDS (default 60) from the
# committed seed corpus (fuzz/corpus/decode); new inputs go to
# fuzz/target/corpus. Installs cargo-fuzz if missing; RUSTC_BOOTSTRAP lets
# the stable toolchain build with the sanitizer flags.
FUZZ_SECONDS ?= 60
fuzz:
	@command -v cargo-fuzz >/dev/null || $(CARGO) install cargo-fuzz --locked
	mkdir -p fuzz/target/corpus
	cd fuzz && RUSTC_BOOTSTRAP=1 $(CARGO) fuzz run decode target/corpus corpus/decode -- -max_total_time=$(FUZZ_SECONDS)

clean:
	$(CARGO) clean


# The release binary, exactly as deploy/docker/Dockerfile builds it.
release:
	$(CARGO) build --release --locked -p tollgate

# Operator assets: alert rules and their tests, dashboards, Kubernetes
# manifests, compose file, Dockerfile, and a live Prometheus scraping a real
# worker that evaluates every dashboard and alert query (a few minutes).
ops-check: services
	scripts/ops-check.sh
