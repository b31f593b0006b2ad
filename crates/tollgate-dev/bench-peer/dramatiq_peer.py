"""The Dramatiq peer of `tollgate-dev bench`: the same job, done the idiomatic
Dramatiq way, so both can be measured side by side against the same fake
provider in the same run.

`tollgate-dev bench` embeds this file, writes it into its venv
(target/bench-venv/peer/) and uses it three ways:

- as the worker module: `dramatiq dramatiq_peer --processes P --threads T`.
  Actor `send` POSTs a job's payload to PEER_PROVIDER_URL with the headers
  tollgate sends (X-Tollgate-Tenant, X-Tollgate-Job-Id, Idempotency-Key),
  inside a per-tenant Redis-backed Dramatiq rate limiter. A denied job
  raises RateLimitExceeded and the Retries middleware enqueues it again
  with exponential backoff (Dramatiq's documented pattern); a 429 from the
  provider raises Retry with the provider's Retry-After.
- `python dramatiq_peer.py enqueue --tenant T --count N [--due-in-ms D]`
  publishes N jobs and prints `{"jobs": [[id, published_at_ms], ...]}`;
  with `--stdin` it first declares the queues and prints
  `{"declared": queue}`, then reads one request per line as JSON
  (`{"tenant", "count", "due_in_ms"}`) and answers one line each, so one
  producer process serves a whole scenario.
- `python dramatiq_peer.py cleanup` deletes the run's queues (the queue,
  its delay queue `.DQ` and dead-letter queue `.XQ`) and Redis keys, and
  prints what they held; `version` prints the installed versions.

Configuration comes from the environment: TOLLGATE_AMQP_URL,
TOLLGATE_REDIS_URL, PEER_QUEUE (unique per run), PEER_PREFIX (Redis key
prefix, unique per run), PEER_PROVIDER_URL, PEER_QUOTAS
(`tenant=rate_per_s,...`), PEER_DEFAULT_RATE, PEER_LIMITER (`window`:
WindowRateLimiter(limit=rate, window=1 s); `none`: no limiter, to measure
the framework alone), PEER_MIN_BACKOFF_MS,
PEER_MAX_BACKOFF_MS, PEER_MAX_ATTEMPTS, PEER_CONFIRM (publisher confirms).
"""

import argparse
import contextlib
import http.client
import json
import logging
import os
import sys
import threading
import time
import urllib.parse
import uuid

import dramatiq
from dramatiq.brokers.rabbitmq import RabbitmqBroker
from dramatiq.errors import RateLimitExceeded
from dramatiq.rate_limits import WindowRateLimiter
from dramatiq.rate_limits.backends import RedisBackend

AMQP_URL = os.environ.get("TOLLGATE_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2f")
REDIS_URL = os.environ.get("TOLLGATE_REDIS_URL", "redis://127.0.0.1:6379")
QUEUE = os.environ.get("PEER_QUEUE", "tollgate_peer")
PREFIX = os.environ.get("PEER_PREFIX", QUEUE)
PROVIDER_URL = os.environ.get("PEER_PROVIDER_URL", "")
DEFAULT_RATE = int(os.environ.get("PEER_DEFAULT_RATE", "10"))
LIMITER = os.environ.get("PEER_LIMITER", "window")
MIN_BACKOFF_MS = int(os.environ.get("PEER_MIN_BACKOFF_MS", "1000"))
MAX_BACKOFF_MS = int(os.environ.get("PEER_MAX_BACKOFF_MS", "5000"))
MAX_ATTEMPTS = int(os.environ.get("PEER_MAX_ATTEMPTS", "8"))
CONFIRM = os.environ.get("PEER_CONFIRM", "1") == "1"


def parse_quotas(text):
    """`a=20,b=100` → {"a": 20, "b": 100} (requests per second)."""
    quotas = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        tenant, _, rate = item.partition("=")
        quotas[tenant] = int(rate)
    return quotas


QUOTAS = parse_quotas(os.environ.get("PEER_QUOTAS", ""))

# As quiet as tollgate's workers in the bench (RUST_LOG=warn).
logging.getLogger("dramatiq").setLevel(logging.WARNING)
logging.getLogger("pika").setLevel(logging.WARNING)

broker = RabbitmqBroker(url=AMQP_URL, confirm_delivery=CONFIRM)
dramatiq.set_broker(broker)
backend = RedisBackend(url=REDIS_URL)

_limiters = {}


class _NoLimit:
    """No limiter at all: the framework's own cost, for comparison."""

    @contextlib.contextmanager
    def acquire(self):
        yield True


def limiter_for(tenant):
    """The tenant's limiter, keyed `{PREFIX}:rate:{tenant}` in Redis."""
    limiter = _limiters.get(tenant)
    if limiter is None:
        rate = QUOTAS.get(tenant, DEFAULT_RATE)
        key = f"{PREFIX}:rate:{tenant}"
        if LIMITER == "window":
            limiter = WindowRateLimiter(backend, key, limit=rate, window=1)
        elif LIMITER == "none":
            limiter = _NoLimit()
        else:
            raise ValueError(f"PEER_LIMITER must be window or none, not {LIMITER!r}")
        _limiters[tenant] = limiter
    return limiter


_local = threading.local()
_provider = urllib.parse.urlsplit(PROVIDER_URL)
_STALE = (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError)


def post(tenant, job_id, key, payload):
    """POSTs over this thread's keep-alive connection; returns (status, Retry-After)."""
    headers = {
        "Content-Type": "application/json",
        "X-Tollgate-Tenant": tenant,
        "X-Tollgate-Job-Id": job_id,
        "Idempotency-Key": key,
    }
    while True:
        conn = getattr(_local, "conn", None)
        fresh = conn is None
        if fresh:
            conn = http.client.HTTPConnection(_provider.hostname, _provider.port, timeout=10)
            _local.conn = conn
        try:
            conn.request("POST", _provider.path or "/", body=payload.encode(), headers=headers)
            response = conn.getresponse()
            response.read()
            return response.status, response.getheader("Retry-After")
        except Exception as e:
            conn.close()
            _local.conn = None
            # A kept-alive connection the server had closed: once more on a
            # new one; any other failure is the job's.
            if fresh or not isinstance(e, _STALE):
                raise


class ProviderError(Exception):
    """The provider answered neither 2xx nor 429."""


def retry_when(retries, exception):
    """Throttling (our limiter or the provider's 429) never uses up an
    attempt, like tollgate; other failures get MAX_ATTEMPTS attempts."""
    if isinstance(exception, (RateLimitExceeded, dramatiq.Retry)):
        return True
    return retries + 1 < MAX_ATTEMPTS


@dramatiq.actor(
    actor_name="send",
    queue_name=QUEUE,
    min_backoff=MIN_BACKOFF_MS,
    max_backoff=MAX_BACKOFF_MS,
    retry_when=retry_when,
)
def send(tenant, job_id, key, payload):
    with limiter_for(tenant).acquire():
        status, retry_after = post(tenant, job_id, key, payload)
    if status == 429:
        seconds = float(retry_after) if retry_after else 1.0
        raise dramatiq.Retry(delay=int(seconds * 1000))
    if not 200 <= status < 300:
        raise ProviderError(f"provider answered {status}")


def enqueue(tenant, count, due_in_ms=None, payload="{}"):
    """Publishes `count` jobs for `tenant`; returns [[job_id, published_at_ms], ...]."""
    jobs = []
    for _ in range(count):
        job_id = uuid.uuid4().hex
        at = int(time.time() * 1000)
        send.send_with_options(args=(tenant, job_id, job_id, payload), delay=due_in_ms)
        jobs.append([job_id, at])
    return jobs


def cleanup():
    """Deletes the run's queues and Redis keys; returns what they held."""
    import pika
    import redis

    held = {}
    connection = pika.BlockingConnection(pika.URLParameters(AMQP_URL))
    channel = connection.channel()
    for name in (QUEUE, f"{QUEUE}.DQ", f"{QUEUE}.XQ"):
        try:
            held[name] = channel.queue_declare(name, passive=True).method.message_count
            channel.queue_delete(name)
        except pika.exceptions.ChannelClosedByBroker as e:
            if e.reply_code != 404:
                raise
            channel = connection.channel()
    connection.close()
    client = redis.Redis.from_url(REDIS_URL)
    keys = list(client.scan_iter(match=f"{PREFIX}:*", count=1000))
    for i in range(0, len(keys), 500):
        client.delete(*keys[i : i + 500])
    return {"queues": held, "keys": len(keys)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    verbs = parser.add_subparsers(dest="verb", required=True)
    publish = verbs.add_parser("enqueue", help="publish N jobs for a tenant")
    publish.add_argument("--tenant")
    publish.add_argument("--count", type=int, default=1)
    publish.add_argument("--due-in-ms", type=int)
    publish.add_argument("--payload", default="{}")
    publish.add_argument("--stdin", action="store_true", help="one JSON request per line")
    verbs.add_parser("cleanup", help="delete this run's queues and Redis keys")
    verbs.add_parser("version", help="print the installed versions")
    args = parser.parse_args()

    if args.verb == "version":
        import importlib.metadata as meta

        names = ("dramatiq", "pika", "redis")
        versions = {name: meta.version(name) for name in names}
        versions["python"] = sys.version.split()[0]
        print(json.dumps(versions))
    elif args.verb == "cleanup":
        print(json.dumps(cleanup()))
    elif args.stdin:
        broker.declare_queue(QUEUE, ensure=True)
        print(json.dumps({"declared": QUEUE}), flush=True)
        for line in sys.stdin:
            if line.strip():
                req = json.loads(line)
                jobs = enqueue(req["tenant"], req["count"], req.get("due_in_ms"), req.get("payload", "{}"))
                print(json.dumps({"jobs": jobs}), flush=True)
    else:
        if not args.tenant:
            parser.error("enqueue needs --tenant (or --stdin)")
        print(json.dumps({"jobs": enqueue(args.tenant, args.count, args.due_in_ms, args.payload)}))
    broker.close()


if __name__ == "__main__":
    main()
