//! `tollgate bench`: figures measured side by side on the same machine in
//! the same run, written to `target/bench/report.json` and `report.md`.
//!
//! Scenarios so far:
//! - **ceiling vs tollgate**: jobs/s of a bare lapin consume→ack loop on a
//!   quorum queue of the same broker, then of one tollgate worker with an
//!   unlimited quota and an instant local provider; and their ratio.
//! - **permit path**: decisions/s of the permit script against a trivial
//!   `EVALSHA` on the same Redis, and Redis round trips per job measured on
//!   the server (`INFO commandstats`) during the tollgate run.
//!
//! Each scenario runs `--runs` times; the report gives the median and the
//! spread, because this machine is shared and noisy.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Args;
use futures::StreamExt;
use futures::stream::FuturesUnordered;
use serde_json::json;
use tokio::sync::watch;
use tollgate_amqp::lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, BasicQosOptions,
    ConfirmSelectOptions, QueueDeclareOptions, QueueDeleteOptions,
};
use tollgate_amqp::lapin::types::{AMQPValue, FieldTable, LongString};
use tollgate_amqp::lapin::{Connection, ConnectionProperties};
use tollgate_core::ports::{PermitRequest, PermitStore};
use tollgate_core::{Clock, IdempotencyKey, JobId, Kind, Quota, TenantId};
use tollgate_quota::{Keys, Redis, RedisPermits};

use crate::cli::{self, PublishArgs};
use crate::config::{Config, SecretUrl};
use crate::fake_provider::{FakeProvider, always_ok};
use crate::metrics::Metrics;
use crate::system_clock::SystemClock;
use crate::worker::LiveWorker;

#[derive(Debug, Args)]
pub struct BenchArgs {
    /// Jobs per throughput run.
    #[arg(long, default_value_t = 10_000)]
    pub jobs: u32,
    /// Repetitions of each scenario (median and spread are reported).
    #[arg(long, default_value_t = 3)]
    pub runs: usize,
    /// Seconds per permit-path measurement.
    #[arg(long, default_value_t = 3)]
    pub permit_seconds: u64,
    /// Where report.json and report.md go.
    #[arg(long, default_value = "target/bench")]
    pub out: PathBuf,
}

/// Median, min and max of a sample.
fn stats(samples: &[f64]) -> serde_json::Value {
    let mut s = samples.to_vec();
    s.sort_by(f64::total_cmp);
    let median = if s.is_empty() {
        0.0
    } else if s.len() % 2 == 1 {
        s[s.len() / 2]
    } else {
        (s[s.len() / 2 - 1] + s[s.len() / 2]) / 2.0
    };
    json!({
        "median": round(median),
        "min": round(*s.first().unwrap_or(&0.0)),
        "max": round(*s.last().unwrap_or(&0.0)),
        "samples": s.iter().map(|v| round(*v)).collect::<Vec<_>>(),
    })
}

fn round(v: f64) -> f64 {
    (v * 100.0).round() / 100.0
}

fn progress(msg: &str) {
    eprintln!("bench: {msg}");
}

pub async fn run(base: &Config, args: &BenchArgs) -> anyhow::Result<()> {
    let mut ceiling = Vec::new();
    let mut tollgate = Vec::new();
    let mut round_trips = Vec::new();
    for i in 1..=args.runs {
        progress(&format!(
            "run {i}/{}: bare lapin consume→ack, {} messages",
            args.runs, args.jobs
        ));
        ceiling.push(bare_consume_ack(base, args.jobs).await?);
        progress(&format!(
            "run {i}/{}: tollgate worker, {} jobs",
            args.runs, args.jobs
        ));
        let (rate, trips) = tollgate_throughput(base, args.jobs).await?;
        tollgate.push(rate);
        round_trips.push(trips);
    }
    let ratios: Vec<f64> = tollgate.iter().zip(&ceiling).map(|(t, c)| t / c).collect();

    progress("permit path: permit script vs trivial EVALSHA");
    let mut permit = Vec::new();
    let mut trivial = Vec::new();
    for _ in 0..args.runs {
        let (p, t) = permit_path(base, Duration::from_secs(args.permit_seconds)).await?;
        permit.push(p);
        trivial.push(t);
    }
    let permit_ratios: Vec<f64> = permit.iter().zip(&trivial).map(|(p, t)| p / t).collect();

    let report = json!({
        "machine": {
            "cores": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0),
            "tollgate": env!("CARGO_PKG_VERSION"),
            "rabbitmq": command_version("rabbitmqctl", &["version"]),
            "redis": command_version("redis-server", &["--version"]),
            "profile": if cfg!(debug_assertions) { "debug" } else { "release" },
        },
        "scenarios": {
            "ceiling_vs_tollgate": {
                "parameters": {
                    "jobs": args.jobs, "runs": args.runs, "queue_type": "quorum",
                    "prefetch": base.concurrency, "tollgate_workers": 1, "tenants": 8,
                    "quota": "1000000/s burst 1000", "provider": "local, answers 200 at once",
                },
                "bare_lapin_jobs_per_s": stats(&ceiling),
                "tollgate_jobs_per_s": stats(&tollgate),
                "ratio": stats(&ratios),
                "target_ratio": 0.8,
                "redis_round_trips_per_job": stats(&round_trips),
                "target_round_trips_per_job": 1,
            },
            "permit_path": {
                "parameters": { "seconds": args.permit_seconds, "runs": args.runs, "concurrency": 64 },
                "permit_decisions_per_s": stats(&permit),
                "trivial_evalsha_per_s": stats(&trivial),
                "ratio": stats(&permit_ratios),
            },
        },
    });

    std::fs::create_dir_all(&args.out)
        .with_context(|| format!("creating {}", args.out.display()))?;
    let json_path = args.out.join("report.json");
    std::fs::write(&json_path, serde_json::to_string_pretty(&report)?)?;
    let md_path = args.out.join("report.md");
    std::fs::write(&md_path, markdown(&report))?;
    println!("{}", markdown(&report));
    progress(&format!(
        "wrote {} and {}",
        json_path.display(),
        md_path.display()
    ));
    Ok(())
}

fn command_version(cmd: &str, args: &[&str]) -> String {
    std::process::Command::new(cmd)
        .args(args)
        .output()
        .ok()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "unknown".into())
}

fn markdown(r: &serde_json::Value) -> String {
    let m = &r["machine"];
    let c = &r["scenarios"]["ceiling_vs_tollgate"];
    let p = &r["scenarios"]["permit_path"];
    let row = |name: &str, v: &serde_json::Value| {
        format!(
            "| {name} | {} | {} | {} |\n",
            v["median"], v["min"], v["max"]
        )
    };
    let mut out = format!(
        "# tollgate bench\n\nMachine: {} cores; tollgate {}; RabbitMQ {}; {}; {} build.\n\n",
        m["cores"],
        m["tollgate"],
        m["rabbitmq"].as_str().unwrap_or("?"),
        m["redis"].as_str().unwrap_or("?"),
        m["profile"].as_str().unwrap_or("?")
    );
    out.push_str(&format!(
        "## Ceiling vs tollgate\n\nParameters: {}\n\n| figure | median | min | max |\n|---|---|---|---|\n",
        c["parameters"]
    ));
    out.push_str(&row(
        "bare lapin consume→ack, jobs/s",
        &c["bare_lapin_jobs_per_s"],
    ));
    out.push_str(&row("tollgate, jobs/s", &c["tollgate_jobs_per_s"]));
    out.push_str(&row("ratio (target ≥ 0.8)", &c["ratio"]));
    out.push_str(&row(
        "Redis round trips per job (target 1)",
        &c["redis_round_trips_per_job"],
    ));
    out.push_str(&format!(
        "\n## Permit path\n\nParameters: {}\n\n| figure | median | min | max |\n|---|---|---|---|\n",
        p["parameters"]
    ));
    out.push_str(&row(
        "permit script, decisions/s",
        &p["permit_decisions_per_s"],
    ));
    out.push_str(&row(
        "trivial EVALSHA, calls/s",
        &p["trivial_evalsha_per_s"],
    ));
    out.push_str(&row("ratio", &p["ratio"]));
    out
}

fn bench_prefix() -> String {
    format!("bench-{}", &uuid::Uuid::new_v4().simple().to_string()[..8])
}

/// The physical limit: publish `n` messages to a quorum queue, then consume
/// and ack them with the same prefetch as a worker. Returns messages/s.
async fn bare_consume_ack(base: &Config, n: u32) -> anyhow::Result<f64> {
    let conn = Connection::connect(base.amqp_url.expose(), ConnectionProperties::default())
        .await
        .context("connecting to RabbitMQ")?;
    let channel = conn.create_channel().await?;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await?;
    let queue = format!("{}.ceiling", bench_prefix());
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

    let consumer_channel = conn.create_channel().await?;
    consumer_channel
        .basic_qos(base.concurrency, BasicQosOptions::default())
        .await?;
    let mut consumer = consumer_channel
        .basic_consume(
            queue.as_str().into(),
            "ceiling".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;
    let mut started = None;
    let mut acked = 0;
    while acked < n {
        let delivery = consumer.next().await.context("consumer ended")??;
        started.get_or_insert_with(Instant::now);
        delivery.ack(BasicAckOptions::default()).await?;
        acked += 1;
    }
    let elapsed = started.map(|s| s.elapsed()).unwrap_or_default();
    channel
        .queue_delete(queue.as_str().into(), QueueDeleteOptions::default())
        .await?;
    let _ = conn.close(200, "bench done".into()).await;
    Ok(f64::from(n) / elapsed.as_secs_f64())
}

/// Redis calls that are round trips from a client (not commands run inside
/// scripts), from `INFO commandstats`.
async fn client_round_trips(redis: &Redis) -> anyhow::Result<u64> {
    let mut conn = redis.conn().await?;
    let info: String = tollgate_quota::redis_cmd("INFO")
        .arg("commandstats")
        .query_async(&mut conn)
        .await?;
    let mut total = 0;
    for line in info.lines() {
        let Some((name, rest)) = line
            .strip_prefix("cmdstat_")
            .and_then(|l| l.split_once(':'))
        else {
            continue;
        };
        if matches!(name, "evalsha" | "eval" | "script|load" | "ping") {
            let calls = rest
                .split(',')
                .find_map(|kv| kv.strip_prefix("calls="))
                .and_then(|v| v.parse::<u64>().ok())
                .unwrap_or(0);
            total += calls;
        }
    }
    Ok(total)
}

/// One worker, 8 tenants with unlimited quotas, an instant provider.
/// Returns (jobs/s, Redis round trips per job).
async fn tollgate_throughput(base: &Config, n: u32) -> anyhow::Result<(f64, f64)> {
    let provider = FakeProvider::start(always_ok()).await?;
    let config = Config {
        prefix: bench_prefix(),
        provider_url: Some(SecretUrl::new(provider.url())),
        ..base.clone()
    };
    let broker = cli::connect_broker(&config, "bench").await?;
    broker.declare_topology().await?;
    let store = cli::quota_store(&config)?;
    let tenants: Vec<String> = (0..8).map(|i| format!("bench-{i}")).collect();
    for t in &tenants {
        cli::set_tenant_quota(&store, t, Quota::new("1000000/s".parse()?, 1000)?, "bench").await?;
    }
    let now = SystemClock.now();
    let per_tenant = n / tenants.len() as u32;
    for t in &tenants {
        let publish = PublishArgs {
            tenant: t.clone(),
            kind: "default".into(),
            due_in: None,
            due_at: None,
            expires_in: None,
            count: per_tenant,
            payload: "{}".into(),
            id: None,
            idempotency_key: None,
        };
        cli::publish_jobs(&broker, &cli::build_jobs(&publish, now)?, now).await?;
    }
    let total = per_tenant * tenants.len() as u32;

    let redis = Redis::new(&config.redis_settings())?;
    let trips_before = client_round_trips(&redis).await?;
    let metrics = Metrics::new(config.tenant_label_limit, &[]);
    let worker = Arc::new(LiveWorker::new(&config, metrics.clone())?);
    let (stop, mut stopped) = watch::channel(false);
    let started = Instant::now();
    let task = tokio::spawn(worker.run(async move {
        let _ = stopped.wait_for(|&s| s).await;
    }));
    while provider.accepted() < total as usize {
        tokio::time::sleep(Duration::from_millis(5)).await;
        anyhow::ensure!(
            started.elapsed() < Duration::from_secs(600),
            "tollgate run did not finish"
        );
    }
    let elapsed = started.elapsed();
    // Let the last completions and acks land before counting round trips.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let trips = client_round_trips(&redis).await? - trips_before;
    let _ = stop.send(true);
    task.await??;
    broker.delete_topology().await?;
    broker.close().await;
    store.purge_prefix().await?;
    Ok((
        f64::from(total) / elapsed.as_secs_f64(),
        trips as f64 / f64::from(total),
    ))
}

/// Decisions/s of the permit script vs a trivial EVALSHA, 64 in flight.
async fn permit_path(base: &Config, window: Duration) -> anyhow::Result<(f64, f64)> {
    let prefix = bench_prefix();
    let config = Config {
        prefix: prefix.clone(),
        ..base.clone()
    };
    let redis = Arc::new(Redis::new(&config.redis_settings())?);
    let permits = Arc::new(RedisPermits::new(
        Arc::clone(&redis),
        Keys::new(&prefix),
        config.permit_settings()?,
    ));
    let store = tollgate_quota::QuotaStore::new(Arc::clone(&redis), Keys::new(&prefix));
    let tenant = TenantId::parse("bench")?;
    cli::set_tenant_quota(
        &store,
        "bench",
        Quota::new("1000000/s".parse()?, 1000)?,
        "bench",
    )
    .await?;

    let count = Arc::new(AtomicU64::new(0));
    let deadline = Instant::now() + window;
    let mut tasks = Vec::new();
    for worker in 0..64 {
        let (permits, count, tenant) = (Arc::clone(&permits), Arc::clone(&count), tenant.clone());
        let route = Kind::default_kind();
        tasks.push(tokio::spawn(async move {
            let mut i = 0u64;
            while Instant::now() < deadline {
                i += 1;
                let id = JobId::parse(format!("{worker}-{i}")).expect("valid id");
                let key = IdempotencyKey::from(&id);
                let request = PermitRequest {
                    tenant: &tenant,
                    route: &route,
                    job_id: &id,
                    key: &key,
                    lease_token: "t",
                    returning: None,
                };
                if permits.acquire(request).await.is_ok() {
                    count.fetch_add(1, Ordering::Relaxed);
                }
            }
        }));
    }
    for t in tasks {
        t.await?;
    }
    let permit_rate = count.load(Ordering::Relaxed) as f64 / window.as_secs_f64();

    let trivial = Arc::new(tollgate_quota::Script::new("return 1"));
    let count = Arc::new(AtomicU64::new(0));
    let deadline = Instant::now() + window;
    let mut tasks = Vec::new();
    for _ in 0..64 {
        let (redis, count, trivial) =
            (Arc::clone(&redis), Arc::clone(&count), Arc::clone(&trivial));
        tasks.push(tokio::spawn(async move {
            while Instant::now() < deadline {
                let Ok(mut conn) = redis.conn().await else {
                    continue;
                };
                let reply: Result<i64, _> = trivial.invoke_async(&mut conn).await;
                if reply.is_ok() {
                    count.fetch_add(1, Ordering::Relaxed);
                }
            }
        }));
    }
    for t in tasks {
        t.await?;
    }
    let trivial_rate = count.load(Ordering::Relaxed) as f64 / window.as_secs_f64();
    store.purge_prefix().await?;
    Ok((permit_rate, trivial_rate))
}
