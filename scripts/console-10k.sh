#!/bin/bash
# Times the console's tenant list (`/v1/console/tenants`) against 10,000
# tenants, each with a stored quota and a parked hash of 31 fields, on the
# local Redis, served by a release `tollgate worker` (build it first:
# `cargo build --release -p tollgate`). Cleans up its keys afterwards.
set -e
cd "$(dirname "$0")/.."
P=tgmeasure$RANDOM
T=measure-token-0123456789abcdef
PORT=$(python3 -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
python3 - "$P" <<'PY' | redis-cli --pipe > /dev/null
import sys
p = sys.argv[1]
def cmd(*a):
    out = f"*{len(a)}\r\n"
    for x in a:
        x = str(x).encode()
        out += f"${len(x)}\r\n" + x.decode() + "\r\n"
    return out
buf = []
for i in range(10000):
    t = f"t{i:05d}"
    buf.append(cmd("HSET", f"{p}:quota:{{{t}}}", "count", 10, "period_ms", 1000, "burst", 1))
    buf.append(cmd("SADD", f"{p}:tenants", t))
    # a parked hash for every tenant, a few dozen fields
    fields = []
    for j in range(30):
        fields += [f"quota:{4102444800000 + j * 416}", 3]
    buf.append(cmd("HSET", f"{p}:parked:{{{t}}}", *fields))
sys.stdout.write("".join(buf))
PY
echo "seeded $(redis-cli scard $P:tenants) tenants under $P"
TOLLGATE_PREFIX=$P TOLLGATE_ADMIN_TOKEN=$T TOLLGATE_HTTP_ADDR=127.0.0.1:$PORT \
  TOLLGATE_PROVIDER_URL=http://127.0.0.1:9/send RUST_LOG=warn \
  target/release/tollgate worker > /dev/null 2>&1 &
W=$!
for i in $(seq 100); do curl -sf localhost:$PORT/readyz > /dev/null && break; sleep 0.2; done
for sort in name behind; do
  for q in "sort=$sort&limit=50" "sort=$sort&limit=50&offset=5000" "sort=$sort&limit=50&prefix=t09"; do
    times=$(for r in 1 2 3 4 5; do curl -s -o /dev/null -w '%{time_total}\n' -H "Authorization: Bearer $T" "localhost:$PORT/v1/console/tenants?$q"; done | sort -n | tr '\n' ' ')
    echo "$q: $times"
  done
done
curl -s -H "Authorization: Bearer $T" "localhost:$PORT/v1/console/tenants?limit=1" | head -c 600; echo
kill $W; wait $W 2>/dev/null || true
redis-cli --scan --pattern "$P:*" | xargs -n 1000 redis-cli del > /dev/null
echo "cleaned $(redis-cli --scan --pattern "$P:*" | wc -l) left"
