//! tollgate against the minimal pipeline, at prefetch 4, 16, 64 and 256.
//! The minimal pipeline is the least any worker must do per job: consume,
//! one Redis `EVALSHA`, POST to the provider, ack, as a bare loop with that
//! many deliveries in flight. It runs on the same broker, Redis and local
//! provider as one tollgate worker process with `TOLLGATE_CONCURRENCY` and
//! `TOLLGATE_PREFETCH` both set to that number. That is the honest ceiling
//! for this work; a bare consume→ack loop is not. For tollgate it also
//! reports Redis round trips per job, CPU-seconds per 1,000 jobs and the
//! worker's peak RSS at each prefetch, and for both where a job's time
//! goes: each delivery slot's turn per job, and within it the waits for
//! Redis and for the provider (tollgate's from its own histograms).

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use anyhow::Context;
use futures::{StreamExt, TryStreamExt};
use serde_json::json;
use tollgate_amqp::lapin::options::BasicAckOptions;
use tollgate_amqp::lapin::{Connection, ConnectionProperties};
use tollgate_quota::{Redis, Script};

use super::rig::ServicesCpu;
use super::throughput::{JobWaits, consume, delete_queue, fill_queue, tollgate_process};
use super::{BenchArgs, Figure, Scenario, progress};
use crate::fake_provider::{FakeProvider, always_ok};
use tollgate::config::Config;

/// The prefetch values measured, with their scenario keys and titles.
const POINTS: [(u16, &str, &str); 4] = [
    (4, "pipeline_p4", "Minimal pipeline vs tollgate: prefetch 4"),
    (
        16,
        "pipeline_p16",
        "Minimal pipeline vs tollgate: prefetch 16",
    ),
    (
        64,
        "pipeline_p64",
        "Minimal pipeline vs tollgate: prefetch 64",
    ),
    (
        256,
        "pipeline_p256",
        "Minimal pipeline vs tollgate: prefetch 256",
    ),
];

/// The scenario keys `--only` may name here.
pub fn keys() -> impl Iterator<Item = String> {
    POINTS.into_iter().map(|(_, key, _)| key.to_owned())
}

/// The one Redis call of the minimal pipeline: a counter per run, about
/// what the smallest rate limiter does.
const PERMIT_LUA: &str =
    "local n = redis.call('INCR', KEYS[1]) redis.call('PEXPIRE', KEYS[1], 60000) return n";

/// Runs the prefetch values whose key `wanted` accepts.
pub async fn run(
    base: &Config,
    args: &BenchArgs,
    wanted: impl Fn(&str) -> bool,
) -> anyhow::Result<Vec<Scenario>> {
    let mut out = Vec::new();
    for (prefetch, key, title) in POINTS {
        if !wanted(key) {
            continue;
        }
        let (mut minimal, mut tollgate, mut trips) = (vec![], vec![], vec![]);
        let (mut cpu, mut rss) = (vec![], vec![]);
        // Milliseconds per job: each delivery slot's turn (prefetch ÷ the
        // rate), and the waits for Redis and the provider within it; the
        // minimal pipeline's, then tollgate's.
        let (mut turn, mut redis_ms, mut provider_ms) =
            ([vec![], vec![]], [vec![], vec![]], [vec![], vec![]]);
        let (mut permit_ms, mut complete_ms) = (vec![], vec![]);
        // CPU-seconds per 1,000 jobs of Redis and the broker: the minimal
        // pipeline's, then tollgate's.
        let (mut redis_cpu, mut broker_cpu) = ([vec![], vec![]], [vec![], vec![]]);
        for i in 1..=args.runs {
            progress(&format!(
                "pipeline prefetch {prefetch} {i}/{}: minimal pipeline, {} jobs",
                args.runs, args.jobs
            ));
            let (rate, services, waits) = minimal_pipeline(base, args.jobs, prefetch).await?;
            minimal.push(rate);
            turn[0].push(f64::from(prefetch) * 1e3 / rate);
            redis_ms[0].push(waits.permit_ms);
            provider_ms[0].push(waits.provider_ms);
            redis_cpu[0].push(services.redis);
            broker_cpu[0].extend(services.broker);
            progress(&format!(
                "pipeline prefetch {prefetch} {i}/{}: one tollgate worker process, {} jobs",
                args.runs, args.jobs
            ));
            let p = prefetch.to_string();
            let run = tollgate_process(
                base,
                args.jobs,
                &[("TOLLGATE_CONCURRENCY", &p), ("TOLLGATE_PREFETCH", &p)],
            )
            .await?;
            tollgate.push(run.jobs_per_s);
            turn[1].push(f64::from(prefetch) * 1e3 / run.jobs_per_s);
            permit_ms.push(run.waits.permit_ms);
            complete_ms.push(run.waits.complete_ms);
            redis_ms[1].push(run.waits.permit_ms + run.waits.complete_ms);
            provider_ms[1].push(run.waits.provider_ms);
            trips.push(run.round_trips_per_job);
            cpu.push(1_000.0 / run.jobs_per_cpu_second);
            rss.push(run.peak_rss_mib);
            redis_cpu[1].push(run.services.redis);
            broker_cpu[1].extend(run.services.broker);
        }
        let ratios = tollgate.iter().zip(&minimal).map(|(t, m)| t / m).collect();
        let mut figures = vec![
            Figure::new("minimal pipeline", "jobs/s", minimal),
            Figure::new("tollgate, one worker", "jobs/s", tollgate),
            Figure::new("tollgate / minimal pipeline", "ratio", ratios).target(">= 0.8"),
            Figure::new("tollgate: Redis round trips per job", "calls", trips)
                .target("<= 1.0 at prefetch >= 16"),
            Figure::new("tollgate: CPU-seconds per 1,000 jobs", "cpu-s", cpu),
            Figure::new("tollgate: peak RSS of the worker", "MiB", rss),
        ];
        let [turn_minimal, turn_tollgate] = turn;
        let [redis_minimal, redis_tollgate] = redis_ms;
        let [provider_minimal, provider_tollgate] = provider_ms;
        figures.extend([
            Figure::new(
                "minimal pipeline: a delivery slot's turn per job (prefetch / jobs/s)",
                "ms",
                turn_minimal,
            ),
            Figure::new(
                "tollgate: a delivery slot's turn per job (prefetch / jobs/s)",
                "ms",
                turn_tollgate,
            ),
            Figure::new(
                "minimal pipeline: a job's wait for Redis (its EVALSHA)",
                "ms",
                redis_minimal,
            ),
            Figure::new(
                "tollgate: a job's wait for Redis (permit + sent record)",
                "ms",
                redis_tollgate,
            ),
            Figure::new("tollgate: … for its permit decision", "ms", permit_ms),
            Figure::new("tollgate: … for its sent record", "ms", complete_ms),
            Figure::new(
                "minimal pipeline: a job's wait for the provider",
                "ms",
                provider_minimal,
            ),
            Figure::new(
                "tollgate: a job's wait for the provider",
                "ms",
                provider_tollgate,
            ),
        ]);
        // The broker's only with the broker on this machine.
        let services = [
            (
                [
                    "minimal pipeline: Redis CPU-seconds per 1,000 jobs",
                    "tollgate: Redis CPU-seconds per 1,000 jobs",
                ],
                redis_cpu,
            ),
            (
                [
                    "minimal pipeline: RabbitMQ CPU-seconds per 1,000 jobs",
                    "tollgate: RabbitMQ CPU-seconds per 1,000 jobs",
                ],
                broker_cpu,
            ),
        ];
        for (names, runs) in services {
            if runs.iter().any(Vec::is_empty) {
                continue;
            }
            for (name, values) in names.into_iter().zip(runs) {
                figures.push(Figure::new(name, "cpu-s", values));
            }
        }
        out.push(Scenario {
            key,
            title,
            parameters: json!({
                "jobs": args.jobs, "runs": args.runs, "prefetch": prefetch,
                "minimal_pipeline": "consume → one EVALSHA (INCR + PEXPIRE) → POST → ack, \
                    `prefetch` jobs in flight, in the bench process",
                "tollgate": "one worker process, TOLLGATE_CONCURRENCY = TOLLGATE_PREFETCH = prefetch, \
                    unlimited quota, 8 tenants spread evenly over the work queues",
                "provider": "local, answers 200 at once", "queue_type": "quorum",
            }),
            figures,
        });
    }
    Ok(out)
}

/// Jobs/s of the minimal pipeline over `n` jobs with `prefetch` in flight,
/// what they cost Redis and the broker per 1,000 jobs, and a job's mean
/// waits for its Redis call (as `permit_ms`) and for the provider.
async fn minimal_pipeline(
    base: &Config,
    n: u32,
    prefetch: u16,
) -> anyhow::Result<(f64, ServicesCpu, JobWaits)> {
    let provider = FakeProvider::start(always_ok()).await?;
    let url = format!("{}/send", provider.url());
    let conn = Connection::connect(base.amqp_url.expose(), ConnectionProperties::default())
        .await
        .context("connecting to RabbitMQ")?;
    let queue = fill_queue(&conn, n, "minimal").await?;
    let redis = Redis::new(&base.redis_settings())?;
    let script = Script::new(PERMIT_LUA);
    let counter = format!("{queue}:permits");
    let http = reqwest::Client::new();
    let services_before = ServicesCpu::now(&redis).await?;
    let mut consumer = consume(&conn, &queue, prefetch).await?;
    let mut started = None;
    // Nanoseconds waited, over all jobs: for Redis, for the provider.
    let (redis_waited, provider_waited) = (AtomicU64::new(0), AtomicU64::new(0));
    // By reference: dropping the consumer closes its channel, and the last
    // jobs' acks are still on their way when the stream of n ends.
    consumer
        .by_ref()
        .take(n as usize)
        .map(|delivery| {
            started.get_or_insert_with(Instant::now);
            delivery.context("consuming")
        })
        .try_for_each_concurrent(usize::from(prefetch), |delivery| {
            let (redis, script, counter, http, url) = (&redis, &script, &counter, &http, &url);
            let (redis_waited, provider_waited) = (&redis_waited, &provider_waited);
            let waited = |since: Instant| since.elapsed().as_nanos() as u64;
            async move {
                let asked = Instant::now();
                let mut r = redis.conn().await?;
                let permit: i64 = script.key(counter).invoke_async(&mut r).await?;
                redis_waited.fetch_add(waited(asked), Ordering::Relaxed);
                let called = Instant::now();
                let status = http
                    .post(url)
                    .header("x-tollgate-tenant", "minimal")
                    .header("idempotency-key", permit.to_string())
                    .body(delivery.data.clone())
                    .send()
                    .await?
                    .status();
                provider_waited.fetch_add(waited(called), Ordering::Relaxed);
                anyhow::ensure!(status.is_success(), "the provider answered {status}");
                delivery.ack(BasicAckOptions::default()).await?;
                Ok(())
            }
        })
        .await?;
    let elapsed = started.map(|s| s.elapsed()).unwrap_or_default();
    let services = ServicesCpu::now(&redis)
        .await?
        .per_1000_jobs_since(&services_before, n as usize);
    let mut redis_conn = redis.conn().await?;
    let _: i64 = tollgate_quota::redis_cmd("DEL")
        .arg(&counter)
        .query_async(&mut redis_conn)
        .await?;
    delete_queue(&conn, &queue).await?;
    let _ = conn.close(200, "bench done".into()).await;
    let mean_ms = |waited: AtomicU64| waited.into_inner() as f64 / 1e6 / f64::from(n);
    let waits = JobWaits {
        permit_ms: mean_ms(redis_waited),
        complete_ms: 0.0,
        provider_ms: mean_ms(provider_waited),
    };
    Ok((f64::from(n) / elapsed.as_secs_f64(), services, waits))
}
