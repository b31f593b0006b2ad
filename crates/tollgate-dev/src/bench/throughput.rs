//! The physical limit vs tollgate: jobs/s of a bare lapin consume→ack loop
//! on a quorum queue of the same broker, then of one tollgate worker process
//! with an unlimited quota and an instant local provider.

use std::time::{Duration, Instant};

use anyhow::Context;
use futures::StreamExt;
use futures::stream::FuturesUnordered;
use serde_json::json;
use tollgate_amqp::lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, BasicQosOptions,
    ConfirmSelectOptions, QueueDeclareOptions, QueueDeleteOptions,
};
use tollgate_amqp::lapin::types::{AMQPValue, FieldTable, LongString};
use tollgate_amqp::lapin::{Connection, ConnectionProperties};
use tollgate_quota::Redis;

use super::rig::{self, Rig};
use super::{BenchArgs, Figure, Scenario, progress};
use crate::fake_provider::always_ok;
use tollgate::config::Config;

const TENANTS: u32 = 8;

pub async fn run(base: &Config, args: &BenchArgs) -> anyhow::Result<Vec<Scenario>> {
    let (mut ceiling, mut tollgate, mut trips, mut per_cpu) = (vec![], vec![], vec![], vec![]);
    for i in 1..=args.runs {
        progress(&format!(
            "throughput {i}/{}: bare lapin consume→ack, {} messages",
            args.runs, args.jobs
        ));
        ceiling.push(bare_consume_ack(base, args.jobs).await?);
        progress(&format!(
            "throughput {i}/{}: one tollgate worker process, {} jobs",
            args.runs, args.jobs
        ));
        let run = tollgate_process(base, args.jobs, &[]).await?;
        tollgate.push(run.jobs_per_s);
        trips.push(run.round_trips_per_job);
        per_cpu.push(run.jobs_per_cpu_second);
    }
    let ratios: Vec<f64> = tollgate.iter().zip(&ceiling).map(|(t, c)| t / c).collect();
    progress("memory: one worker holding its full prefetch");
    let (rss, held) = memory_at_full_prefetch(base).await?;
    Ok(vec![
        Scenario {
            key: "throughput",
            title: "Ceiling vs tollgate",
            parameters: json!({
                "jobs": args.jobs, "runs": args.runs, "queue_type": "quorum", "prefetch": base.concurrency,
                "tollgate": "one worker process", "tenants": TENANTS, "tenants_spread": "evenly over the work queues", "quota": "1000000/s burst 1000",
                "provider": "local, answers 200 at once",
            }),
            figures: vec![
                Figure::new("bare lapin consume→ack", "jobs/s", ceiling),
                Figure::new("tollgate, one worker", "jobs/s", tollgate),
                Figure::new("tollgate / bare lapin", "ratio", ratios).target(">= 0.8"),
                Figure::new("Redis round trips per job", "calls", trips).target("1"),
                Figure::new("jobs per CPU-second of the worker", "jobs/cpu-s", per_cpu),
            ],
        },
        Scenario {
            key: "memory",
            title: "Memory of one worker holding its full prefetch",
            parameters: json!({
                "concurrency": base.concurrency, "payload_bytes": 4096,
                "how": "one job due in 3 s for each of 256 tenants, held in-process under the 1 s hold limit",
            }),
            figures: vec![
                Figure::new("peak RSS", "MiB", vec![rss]),
                Figure::new("deliveries held at the time", "jobs", vec![held]),
            ],
        },
    ])
}

/// Publishes `n` messages to a quorum queue, then consumes and acks them
/// with a worker's prefetch. Returns messages/s.
async fn bare_consume_ack(base: &Config, n: u32) -> anyhow::Result<f64> {
    let conn = Connection::connect(base.amqp_url.expose(), ConnectionProperties::default())
        .await
        .context("connecting to RabbitMQ")?;
    let queue = fill_queue(&conn, n, "ceiling").await?;
    let mut consumer = consume(&conn, &queue, base.concurrency).await?;
    let mut started = None;
    for _ in 0..n {
        let delivery = consumer.next().await.context("consumer ended")??;
        started.get_or_insert_with(Instant::now);
        delivery.ack(BasicAckOptions::default()).await?;
    }
    let elapsed = started.map(|s| s.elapsed()).unwrap_or_default();
    delete_queue(&conn, &queue).await?;
    let _ = conn.close(200, "bench done".into()).await;
    Ok(f64::from(n) / elapsed.as_secs_f64())
}

/// A new durable quorum queue `bench-<random>.<what>` holding `n` small
/// messages, every publish confirmed. Returns its name.
pub(super) async fn fill_queue(conn: &Connection, n: u32, what: &str) -> anyhow::Result<String> {
    let channel = conn.create_channel().await?;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await?;
    let queue = format!(
        "bench-{}.{what}",
        &uuid::Uuid::new_v4().simple().to_string()[..8]
    );
    let mut args = FieldTable::default();
    args.insert(
        "x-queue-type".into(),
        AMQPValue::LongString(LongString::from("quorum")),
    );
    let durable = QueueDeclareOptions {
        durable: true,
        ..Default::default()
    };
    channel
        .queue_declare(queue.as_str().into(), durable, args)
        .await?;
    let body = br#"{"id":"x","tenant":"bench"}"#;
    let mut pending = FuturesUnordered::new();
    for _ in 0..n {
        if pending.len() >= 256
            && let Some(confirm) = pending.next().await
        {
            let confirm: Result<_, tollgate_amqp::lapin::Error> = confirm;
            confirm?;
        }
        let publish = channel
            .basic_publish(
                "".into(),
                queue.as_str().into(),
                BasicPublishOptions::default(),
                body,
                tollgate_amqp::job_properties(),
            )
            .await?;
        pending.push(publish);
    }
    while let Some(confirm) = pending.next().await {
        confirm?;
    }
    Ok(queue)
}

/// A consumer of `queue` on a new channel holding at most `prefetch`
/// unacked deliveries.
pub(super) async fn consume(
    conn: &Connection,
    queue: &str,
    prefetch: u16,
) -> anyhow::Result<tollgate_amqp::lapin::Consumer> {
    let channel = conn.create_channel().await?;
    channel
        .basic_qos(prefetch, BasicQosOptions::default())
        .await?;
    Ok(channel
        .basic_consume(
            queue.into(),
            "bench".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?)
}

pub(super) async fn delete_queue(conn: &Connection, queue: &str) -> anyhow::Result<()> {
    conn.create_channel()
        .await?
        .queue_delete(queue.into(), QueueDeleteOptions::default())
        .await?;
    Ok(())
}

/// Calls Redis has executed so far of each command whose name `counted`
/// accepts, summed, from `INFO commandstats`.
pub async fn redis_calls(redis: &Redis, counted: impl Fn(&str) -> bool) -> anyhow::Result<u64> {
    // Every master's counts, on a cluster.
    let info = redis.info("commandstats").await?.join("\n");
    Ok(info
        .lines()
        .filter_map(|line| line.strip_prefix("cmdstat_")?.split_once(':'))
        .filter(|(name, _)| counted(name))
        .filter_map(|(_, rest)| {
            rest.split(',')
                .find_map(|kv| kv.strip_prefix("calls="))?
                .parse::<u64>()
                .ok()
        })
        .sum())
}

/// Redis round trips of tollgate's hot path: `EVALSHA` (with its `EVAL` /
/// `SCRIPT LOAD` fallback) and `PING`. Redis also counts the commands a
/// script runs inside itself (`GET`, `SET`, …), so those must not be
/// summed. The bench is Redis's only client.
pub async fn client_round_trips(redis: &Redis) -> anyhow::Result<u64> {
    redis_calls(redis, |name| {
        matches!(name, "evalsha" | "eval" | "script|load" | "ping")
    })
    .await
}

pub(super) struct ThroughputRun {
    pub jobs_per_s: f64,
    pub round_trips_per_job: f64,
    pub jobs_per_cpu_second: f64,
    /// Peak resident memory of the worker process over the run.
    pub peak_rss_mib: f64,
    /// What the run cost Redis and the broker, per 1,000 jobs.
    pub services: rig::ServicesCpu,
    /// Where a job's time went, from the worker's own histograms.
    pub waits: JobWaits,
}

/// Mean milliseconds a job waited for each of its calls.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct JobWaits {
    /// Its permit decision from Redis (in the pod's backlog lane or not).
    pub permit_ms: f64,
    /// The record of its call in Redis, which its ack waits for.
    pub complete_ms: f64,
    /// The provider's answer.
    pub provider_ms: f64,
}

impl JobWaits {
    /// From a scrape of the worker's /metrics.
    fn of(page: &rig::MetricsPage) -> Self {
        // Over the series of `histogram` whose labels start as one of
        // `labels` does (`""`: every series).
        let mean_ms = |histogram: &str, labels: &[&str]| {
            let total = |part: &str| -> f64 {
                let series = |l: &&str| page.sum(&format!("{histogram}_{part}{l}"));
                labels.iter().map(series).sum()
            };
            let count = total("count");
            if count == 0.0 {
                return 0.0;
            }
            total("sum") * 1e3 / count
        };
        let redis = "tollgate_redis_call_duration_seconds";
        Self {
            permit_ms: mean_ms(redis, &[r#"{call="permit"}"#, r#"{call="backlog_permit"}"#]),
            complete_ms: mean_ms(redis, &[r#"{call="complete"}"#]),
            provider_ms: mean_ms("tollgate_provider_request_duration_seconds", &[""]),
        }
    }
}

/// One tollgate worker process (with `extra` environment) through `n` jobs
/// of 8 tenants (two per work queue at the default 4 shards) with an
/// unlimited quota and an instant provider.
pub(super) async fn tollgate_process(
    base: &Config,
    n: u32,
    extra: &[(&str, &str)],
) -> anyhow::Result<ThroughputRun> {
    let mut rig = Rig::new(base, always_ok()).await?;
    let tenants = rig.tenants_spread("bench", TENANTS as usize).await?;
    for t in &tenants {
        rig.set_quota(t, "1000000/s", 1000).await?;
    }
    let per_tenant = n / TENANTS;
    for t in &tenants {
        rig.publish(t, per_tenant, None, "{}").await?;
    }
    let total = (per_tenant * TENANTS) as usize;
    let redis = Redis::new(&rig.config.redis_settings())?;
    let worker = rig.spawn_process(extra).await?;
    let (cpu_before, trips_before, services_before) = (
        rig::cpu_seconds(worker.pid)?,
        client_round_trips(&redis).await?,
        rig::ServicesCpu::now(&redis).await?,
    );
    rig.until_accepted(1, Duration::from_secs(30)).await?;
    let started = Instant::now();
    rig.until_accepted(total, Duration::from_secs(600)).await?;
    let elapsed = started.elapsed();
    // The last completions and acks land before counting.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let cpu = rig::cpu_seconds(worker.pid)? - cpu_before;
    let trips = client_round_trips(&redis).await? - trips_before;
    let services = rig::ServicesCpu::now(&redis)
        .await?
        .per_1000_jobs_since(&services_before, total);
    let peak_rss_mib = rig::peak_rss_mib(worker.pid)?;
    let waits = JobWaits::of(&rig::metrics_page(worker.http_port).await?);
    rig.cleanup().await?;
    Ok(ThroughputRun {
        jobs_per_s: (total - 1) as f64 / elapsed.as_secs_f64(),
        round_trips_per_job: trips as f64 / total as f64,
        jobs_per_cpu_second: total as f64 / cpu,
        peak_rss_mib,
        services,
        waits,
    })
}

/// Peak RSS of a worker process holding as many deliveries as it may.
async fn memory_at_full_prefetch(base: &Config) -> anyhow::Result<(f64, f64)> {
    let mut rig = Rig::new(base, always_ok()).await?;
    let payload = format!(r#"{{"blob":"{}"}}"#, "x".repeat(4096 - 12));
    let worker = rig
        .spawn_process(&[("TOLLGATE_HOLD_MAX_MS", "5000")])
        .await?;
    for t in 0..256 {
        rig.publish(
            &format!("mem-{t}"),
            1,
            Some(Duration::from_secs(3)),
            &payload,
        )
        .await?;
    }
    let started = Instant::now();
    let mut held = 0.0f64;
    while started.elapsed() < Duration::from_secs(2) {
        held = held.max(rig::scrape(worker.http_port, "tollgate_jobs_in_flight").await?);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let rss = rig::peak_rss_mib(worker.pid)?;
    rig.cleanup().await?;
    Ok((rss, held))
}
