// The BullMQ peer of `tollgate-dev bench`: the same job, done the idiomatic
// open-source BullMQ way, so it can be measured beside tollgate and Dramatiq
// against the same fake provider in the same run.
//
// `tollgate-dev bench` embeds this file and bullmq/package.json and
// package-lock.json, installs them with `npm ci` into target/bench-node and
// runs this file from there four ways:
//
// - `node bullmq_peer.js worker`: one worker process. A BullMQ Worker per
//   tenant queue (concurrency PEER_CONCURRENCY each) POSTs a job's payload to
//   PEER_PROVIDER_URL with the headers tollgate sends (X-Tollgate-Tenant,
//   X-Tollgate-Job-Id, Idempotency-Key). The per-tenant quota is the tenant
//   queue's own rate limit (`queue.setGlobalRateLimit(rate, 1000)`, set by
//   the producer): BullMQ OSS limits a queue, not a group of jobs in it, so a
//   tenant gets a queue. A 429 from the provider rate-limits the tenant's
//   queue for Retry-After (`queue.rateLimit(ms)`) and throws
//   `Worker.RateLimitError()`: the job goes back to wait without using up an
//   attempt. Once every Worker is connected it increments
//   `{PEER_PREFIX}:bench:ready`, which the bench polls.
// - `node bullmq_peer.js enqueue --stdin`: creates the tenant queues of
//   PEER_QUOTAS, sets their rate limits and prints `{"declared": prefix}`,
//   then reads one request per line as JSON (`{"tenant", "count",
//   "due_in_ms"}`), adds the jobs (`addBulk`, or `add` with `delay` for
//   scheduled jobs) and answers `{"jobs": [[id, published_at_ms], ...]}`.
// - `node bullmq_peer.js cleanup`: obliterates the run's queues, deletes
//   every Redis key under PEER_PREFIX and prints what they held.
// - `node bullmq_peer.js version`: the installed versions.
//
// Configuration comes from the environment: TOLLGATE_REDIS_URL, PEER_PREFIX
// (BullMQ's key prefix, unique per run), PEER_PROVIDER_URL, PEER_QUOTAS
// (`tenant=rate_per_s,...`: the tenants, so the queues, of the run),
// PEER_LIMITER (`global`: the queue's rate limit; `none`: no limit, to
// measure the framework alone), PEER_CONCURRENCY (per Worker, so per tenant
// queue in each process), PEER_MIN_BACKOFF_MS (exponential backoff of a
// failed job), PEER_MAX_ATTEMPTS.

'use strict';

const fs = require('node:fs');
const http = require('node:http');
const path = require('node:path');
const readline = require('node:readline');
const { randomUUID } = require('node:crypto');

const IORedis = require('ioredis');
const { Queue, Worker } = require('bullmq');

const REDIS_URL = process.env.TOLLGATE_REDIS_URL || 'redis://127.0.0.1:6379';
const PREFIX = process.env.PEER_PREFIX || 'tollgate_peer';
const PROVIDER_URL = process.env.PEER_PROVIDER_URL || '';
const LIMITER = process.env.PEER_LIMITER || 'global';
const CONCURRENCY = Number(process.env.PEER_CONCURRENCY || '8');
const MIN_BACKOFF_MS = Number(process.env.PEER_MIN_BACKOFF_MS || '1000');
const MAX_ATTEMPTS = Number(process.env.PEER_MAX_ATTEMPTS || '8');
const READY_KEY = `${PREFIX}:bench:ready`;
// Jobs per addBulk call: one round trip for many jobs, bounded in size.
const BULK = 500;

/** `a=20,b=100` → Map { a → 20, b → 100 } (requests per second). */
function parseQuotas(text) {
  const quotas = new Map();
  for (const item of text.split(',').map((s) => s.trim()).filter(Boolean)) {
    const [tenant, rate] = item.split('=');
    quotas.set(tenant, Number(rate));
  }
  return quotas;
}

const QUOTAS = parseQuotas(process.env.PEER_QUOTAS || '');

if (!['global', 'none'].includes(LIMITER)) {
  throw new Error(`PEER_LIMITER must be global or none, not ${LIMITER}`);
}

/** One connection per process for every Queue and Worker of it (a Worker
 * duplicates it for its blocking fetch, as BullMQ does by itself). */
function connect() {
  return new IORedis(REDIS_URL, { maxRetriesPerRequest: null });
}

/** What a new job carries besides its data: retries of real failures with
 * exponential backoff; no record of completed jobs kept in Redis. */
const JOB_OPTIONS = {
  attempts: MAX_ATTEMPTS,
  backoff: { type: 'exponential', delay: MIN_BACKOFF_MS },
  removeOnComplete: true,
};

function queueFor(connection, tenant) {
  return new Queue(tenant, { connection, prefix: PREFIX, defaultJobOptions: JOB_OPTIONS });
}

const provider = PROVIDER_URL ? new URL(PROVIDER_URL) : null;
const agent = new http.Agent({ keepAlive: true });

/** POSTs over a kept-alive connection; resolves to { status, retryAfter }.
 * A kept-alive connection the server had closed is tried once more on a
 * new one; any other failure is the job's. */
function post(tenant, jobId, key, payload, retried = false) {
  return new Promise((resolve, reject) => {
    const body = Buffer.from(payload);
    const req = http.request(
      {
        agent,
        hostname: provider.hostname,
        port: provider.port,
        path: provider.pathname,
        method: 'POST',
        headers: {
          'Content-Type': 'application/json',
          'Content-Length': body.length,
          'X-Tollgate-Tenant': tenant,
          'X-Tollgate-Job-Id': jobId,
          'Idempotency-Key': key,
        },
        timeout: 10_000,
      },
      (res) => {
        res.resume();
        res.on('end', () => resolve({ status: res.statusCode, retryAfter: res.headers['retry-after'] }));
        res.on('error', reject);
      },
    );
    req.on('timeout', () => req.destroy(new Error('provider timed out')));
    req.on('error', (err) => {
      if (req.reusedSocket && !retried && err.code === 'ECONNRESET') {
        post(tenant, jobId, key, payload, true).then(resolve, reject);
      } else {
        reject(err);
      }
    });
    req.end(body);
  });
}

/** Retry-After (seconds or an HTTP date) in ms; 1 s when absent. */
function retryAfterMs(value) {
  if (value === undefined) return 1000;
  const seconds = Number(value);
  if (Number.isFinite(seconds)) return Math.max(0, Math.round(seconds * 1000));
  const at = Date.parse(value);
  return Number.isFinite(at) ? Math.max(0, at - Date.now()) : 1000;
}

async function worker() {
  const connection = connect();
  const workers = [];
  for (const tenant of QUOTAS.keys()) {
    const queue = queueFor(connection, tenant);
    const processor = async (job) => {
      const { job_id: jobId, key, payload } = job.data;
      const { status, retryAfter } = await post(tenant, jobId, key, payload);
      if (status === 429) {
        // The provider's own limit: hold the tenant's queue for Retry-After
        // and put the job back, without using up an attempt.
        await queue.rateLimit(retryAfterMs(retryAfter));
        throw Worker.RateLimitError();
      }
      if (status < 200 || status >= 300) {
        throw new Error(`provider answered ${status}`);
      }
    };
    const w = new Worker(tenant, processor, { connection, prefix: PREFIX, concurrency: CONCURRENCY });
    w.on('error', (err) => console.error(`worker ${tenant}: ${err.stack || err}`));
    w.on('failed', (job, err) => console.error(`job ${job && job.id} of ${tenant} failed: ${err.message}`));
    workers.push(w);
  }
  await Promise.all(workers.map((w) => w.waitUntilReady()));
  await connection.incr(READY_KEY);
  let closing = false;
  const close = async () => {
    if (closing) return;
    closing = true;
    await Promise.all(workers.map((w) => w.close()));
    await connection.quit();
    agent.destroy();
    process.exit(0);
  };
  process.on('SIGTERM', close);
  process.on('SIGINT', close);
}

/** Adds `count` jobs for `tenant`; resolves to [[job_id, published_at_ms], ...]. */
async function enqueue(queues, connection, tenant, count, dueInMs, payload = '{}') {
  let queue = queues.get(tenant);
  if (!queue) {
    queue = queueFor(connection, tenant);
    queues.set(tenant, queue);
  }
  const jobs = [];
  const newJob = () => {
    const id = randomUUID().replaceAll('-', '');
    return { id, data: { tenant, job_id: id, key: id, payload } };
  };
  if (dueInMs != null) {
    for (let i = 0; i < count; i++) {
      const job = newJob();
      const at = Date.now();
      await queue.add('send', job.data, { delay: dueInMs });
      jobs.push([job.id, at]);
    }
    return jobs;
  }
  for (let done = 0; done < count; done += BULK) {
    const batch = Array.from({ length: Math.min(BULK, count - done) }, newJob);
    const at = Date.now();
    await queue.addBulk(batch.map((job) => ({ name: 'send', data: job.data })));
    jobs.push(...batch.map((job) => [job.id, at]));
  }
  return jobs;
}

async function producer() {
  const connection = connect();
  const queues = new Map();
  for (const [tenant, rate] of QUOTAS) {
    const queue = queueFor(connection, tenant);
    queues.set(tenant, queue);
    await queue.waitUntilReady();
    if (LIMITER === 'global') {
      await queue.setGlobalRateLimit(rate, 1000);
    }
  }
  console.log(JSON.stringify({ declared: PREFIX }));
  const lines = readline.createInterface({ input: process.stdin, crlfDelay: Infinity });
  for await (const line of lines) {
    if (!line.trim()) continue;
    const req = JSON.parse(line);
    const jobs = await enqueue(queues, connection, req.tenant, req.count, req.due_in_ms, req.payload);
    console.log(JSON.stringify({ jobs }));
  }
  await Promise.all([...queues.values()].map((q) => q.close()));
  await connection.quit();
}

/** Obliterates the run's queues (those of PEER_QUOTAS and any other with a
 * meta key under the prefix), then deletes every key under the prefix. */
async function cleanup() {
  const connection = connect();
  const names = new Set(QUOTAS.keys());
  const scan = async (match) => {
    const keys = [];
    for await (const batch of connection.scanStream({ match, count: 1000 })) keys.push(...batch);
    return keys;
  };
  for (const key of await scan(`${PREFIX}:*:meta`)) {
    names.add(key.slice(PREFIX.length + 1, -':meta'.length));
  }
  const held = {};
  for (const name of names) {
    const queue = queueFor(connection, name);
    held[name] = await queue.getJobCounts();
    await queue.obliterate({ force: true });
    await queue.close();
  }
  const keys = await scan(`${PREFIX}:*`);
  for (let i = 0; i < keys.length; i += 500) {
    await connection.del(...keys.slice(i, i + 500));
  }
  await connection.quit();
  return { queues: held, keys: keys.length };
}

function versions() {
  const version = (name) =>
    JSON.parse(fs.readFileSync(path.join(__dirname, 'node_modules', name, 'package.json'), 'utf8')).version;
  return { bullmq: version('bullmq'), ioredis: version('ioredis'), node: process.versions.node };
}

async function main() {
  const [verb, flag] = process.argv.slice(2);
  switch (verb) {
    case 'worker':
      return worker();
    case 'enqueue':
      if (flag !== '--stdin') throw new Error('usage: bullmq_peer.js enqueue --stdin');
      return producer();
    case 'cleanup':
      console.log(JSON.stringify(await cleanup()));
      return;
    case 'version':
      console.log(JSON.stringify(versions()));
      return;
    default:
      throw new Error('usage: bullmq_peer.js worker | enqueue --stdin | cleanup | version');
  }
}

main().catch((err) => {
  console.error(err && err.stack ? err.stack : err);
  process.exit(1);
});
