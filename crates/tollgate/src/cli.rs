//! The command line: `tollgate <verb>`. Each verb's `--help` ends with an
//! example; the implementations are small functions over the adapters.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, bail};
use clap::{Args, Parser, Subcommand};
use futures::StreamExt;
use futures::stream::FuturesUnordered;
use serde_json::value::RawValue;
use tollgate_amqp::{Broker, headers};
use tollgate_core::{
    Clock, DeadReason, IdempotencyKey, Job, JobId, Kind, Quota, Rate, TenantId, UnixMillis,
};
use tollgate_quota::{Keys, QuotaStore, Redis};

use crate::config::Config;
use crate::demo::DemoArgs;
use crate::system_clock::SystemClock;

#[derive(Debug, Parser)]
#[command(
    name = "tollgate",
    version,
    about = "A multi-tenant, quota-aware worker pool on RabbitMQ and Redis",
    after_help = "Configuration: --config FILE (TOML) and TOLLGATE_* environment variables.\n\
                  Example: TOLLGATE_PROVIDER_URL=http://provider.internal/send tollgate worker"
)]
pub struct Cli {
    /// TOML config file; every key can be overridden by TOLLGATE_<KEY>.
    #[arg(long, global = true, env = "TOLLGATE_CONFIG")]
    pub config: Option<PathBuf>,

    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run a worker: consume jobs, take permits, call the provider.
    #[command(
        after_help = "Example: TOLLGATE_PROVIDER_URL=http://127.0.0.1:8080/send tollgate worker"
    )]
    Worker,
    /// Publish jobs to the jobs exchange (routing key = tenant).
    #[command(
        after_help = "Example: tollgate publish --tenant acme --count 100 --due-in 30s --payload '{\"to\":\"x\"}'"
    )]
    Publish(PublishArgs),
    /// Read and change tenant quotas, live for the whole fleet.
    #[command(subcommand)]
    Quota(QuotaCommand),
    /// Declare the RabbitMQ topology.
    #[command(subcommand)]
    Topology(TopologyCommand),
    /// Inspect the dead-letter queue.
    #[command(subcommand)]
    Dlq(DlqCommand),
    /// Measure throughput and the permit path; writes target/bench/report.{json,md}.
    #[command(after_help = "Example: tollgate bench --jobs 10000 --runs 3")]
    Bench(crate::bench::BenchArgs),
    /// A self-contained live demonstration on the local RabbitMQ and Redis.
    #[command(after_help = "Example: tollgate demo --duration 30s --workers 3")]
    Demo(DemoArgs),
}

#[derive(Debug, Args)]
pub struct PublishArgs {
    #[arg(long)]
    pub tenant: String,
    /// Selects the provider route.
    #[arg(long, default_value = "default")]
    pub kind: String,
    /// Due this long from now (e.g. 30s, 5m, 2h).
    #[arg(long, value_parser = humantime::parse_duration, conflicts_with = "due_at")]
    pub due_in: Option<Duration>,
    /// Due at this RFC 3339 instant.
    #[arg(long)]
    pub due_at: Option<String>,
    /// Dead-letter as `expired` if not sent within this long from now.
    #[arg(long, value_parser = humantime::parse_duration)]
    pub expires_in: Option<Duration>,
    #[arg(long, default_value_t = 1)]
    pub count: u32,
    /// JSON forwarded to the provider.
    #[arg(long, default_value = "{}")]
    pub payload: String,
    /// Job id (only with --count 1); default: a random id.
    #[arg(long)]
    pub id: Option<String>,
    /// Idempotency key for every published job; default: the job id.
    #[arg(long)]
    pub idempotency_key: Option<String>,
}

#[derive(Debug, Subcommand)]
pub enum QuotaCommand {
    /// Set a tenant's quota; applies to the next decision of every pod.
    #[command(after_help = "Example: tollgate quota set acme --rate 20/s --burst 1")]
    Set {
        tenant: String,
        /// N/s, N/m or N/h.
        #[arg(long)]
        rate: String,
        #[arg(long, default_value_t = 1)]
        burst: u32,
    },
    /// Show a tenant's quota (or the default it falls back to).
    #[command(after_help = "Example: tollgate quota get acme")]
    Get { tenant: String },
    /// List every tenant with a stored quota.
    #[command(after_help = "Example: tollgate quota list")]
    List,
}

#[derive(Debug, Subcommand)]
pub enum TopologyCommand {
    /// Declare exchanges and queues (idempotent).
    #[command(after_help = "Example: TOLLGATE_PREFIX=tollgate tollgate topology declare")]
    Declare,
}

#[derive(Debug, Subcommand)]
pub enum DlqCommand {
    /// Counts by reason and tenant, then the newest dead letters.
    #[command(after_help = "Example: tollgate dlq list --limit 20")]
    List {
        /// Newest dead letters to show.
        #[arg(long, default_value_t = 20)]
        limit: usize,
        /// Most messages read for the counts.
        #[arg(long, default_value_t = 10_000)]
        scan: usize,
        /// Also print each payload (hidden by default: it may hold personal data).
        #[arg(long)]
        show_payload: bool,
    },
}

/// What a command needs to talk to RabbitMQ.
pub async fn connect_broker(config: &Config, role: &str) -> anyhow::Result<Broker> {
    let name = format!("{}-{role}", config.name());
    Ok(Broker::connect(
        config.amqp_url.expose(),
        &config.amqp_url.redacted(),
        &name,
        config.topology()?,
    )
    .await?)
}

pub fn quota_store(config: &Config) -> anyhow::Result<QuotaStore> {
    let redis = Arc::new(Redis::new(&config.redis_settings())?);
    Ok(QuotaStore::new(redis, Keys::new(&config.prefix)))
}

/// Builds the jobs `tollgate publish` would publish.
pub fn build_jobs(args: &PublishArgs, now: UnixMillis) -> anyhow::Result<Vec<Job>> {
    let tenant = TenantId::parse(args.tenant.as_str()).context("--tenant")?;
    let kind = Kind::parse(args.kind.as_str()).context("--kind")?;
    let payload = RawValue::from_string(args.payload.clone()).context("--payload is not JSON")?;
    let due_at = match (&args.due_in, &args.due_at) {
        (Some(d), _) => Some(now.saturating_add(*d)),
        (None, Some(at)) => Some(UnixMillis::parse_rfc3339(at).context("--due-at")?),
        (None, None) => None,
    };
    let expires_at = args.expires_in.map(|d| now.saturating_add(d));
    if args.id.is_some() && args.count != 1 {
        bail!("--id needs --count 1 (job ids are unique)");
    }
    let key = args
        .idempotency_key
        .as_deref()
        .map(IdempotencyKey::parse)
        .transpose()
        .context("--idempotency-key")?;
    (0..args.count)
        .map(|_| {
            let id = match &args.id {
                Some(id) => JobId::parse(id.as_str()).context("--id")?,
                None => JobId::parse(format!("{tenant}-{}", uuid::Uuid::new_v4()))?,
            };
            Ok(Job {
                idempotency_key: key.clone().unwrap_or_else(|| IdempotencyKey::from(&id)),
                id,
                tenant: tenant.clone(),
                kind: kind.clone(),
                due_at,
                expires_at,
                payload: payload.clone(),
            })
        })
        .collect()
}

/// Publishes jobs with confirms, many in flight at once.
pub async fn publish_jobs(broker: &Broker, jobs: &[Job], now: UnixMillis) -> anyhow::Result<()> {
    const IN_FLIGHT: usize = 256;
    let mut pending = FuturesUnordered::new();
    for job in jobs {
        if pending.len() >= IN_FLIGHT
            && let Some(result) = pending.next().await
        {
            let result: Result<(), tollgate_amqp::AmqpError> = result;
            result.context("publishing")?;
        }
        pending.push(broker.publish_job(job, now));
    }
    while let Some(result) = pending.next().await {
        result.context("publishing")?;
    }
    Ok(())
}

pub async fn publish(config: &Config, args: &PublishArgs) -> anyhow::Result<()> {
    let now = SystemClock.now();
    let jobs = build_jobs(args, now)?;
    let broker = connect_broker(config, "publish").await?;
    broker.declare_topology().await?;
    publish_jobs(&broker, &jobs, now).await?;
    broker.close().await;
    match jobs.as_slice() {
        [job] => println!("published job {} for tenant {}", job.id, job.tenant),
        _ => println!("published {} jobs for tenant {}", jobs.len(), args.tenant),
    }
    Ok(())
}

pub async fn quota(config: &Config, command: &QuotaCommand) -> anyhow::Result<()> {
    let store = quota_store(config)?;
    match command {
        QuotaCommand::Set {
            tenant,
            rate,
            burst,
        } => {
            let tenant = TenantId::parse(tenant.as_str()).context("tenant")?;
            let rate: Rate = rate.parse().context("--rate")?;
            let quota = Quota::new(rate, *burst).context("--burst")?;
            let who = std::env::var("USER").unwrap_or_else(|_| "cli".into());
            store.set(&tenant, quota, &format!("cli:{who}")).await?;
            println!("{tenant}: {quota}");
        }
        QuotaCommand::Get { tenant } => {
            let tenant = TenantId::parse(tenant.as_str()).context("tenant")?;
            match store.get(&tenant).await? {
                Some(entry) => println!(
                    "{tenant}: {} (set by {} at {})",
                    entry.quota,
                    entry.updated_by.as_deref().unwrap_or("?"),
                    entry
                        .updated_at_ms
                        .map(|t| UnixMillis(t).to_string())
                        .unwrap_or_default(),
                ),
                None => println!(
                    "{tenant}: no quota stored; the default {} applies",
                    config.default_quota()?
                ),
            }
        }
        QuotaCommand::List => {
            let entries = store.list().await?;
            if entries.is_empty() {
                println!(
                    "no quotas stored; every tenant gets the default {}",
                    config.default_quota()?
                );
            }
            println!("{:<32} {:>12} {:>6}  updated by", "TENANT", "RATE", "BURST");
            for (tenant, entry) in entries {
                println!(
                    "{:<32} {:>12} {:>6}  {}",
                    tenant.as_str(),
                    entry.quota.rate.to_string(),
                    entry.quota.burst,
                    entry.updated_by.unwrap_or_default()
                );
            }
        }
    }
    Ok(())
}

pub async fn topology(config: &Config, command: &TopologyCommand) -> anyhow::Result<()> {
    match command {
        TopologyCommand::Declare => {
            let broker = connect_broker(config, "topology").await?;
            broker.declare_topology().await?;
            let t = broker.topology();
            println!(
                "declared {} → {} work queue(s), {} delay tier(s), {}",
                t.jobs_exchange(),
                t.work_queues().len(),
                t.all_queues().len() - t.work_queues().len() - 1,
                t.dead_queue()
            );
            broker.close().await;
        }
    }
    Ok(())
}

/// One dead letter as `dlq list` shows it.
#[derive(Debug)]
pub struct DeadLetter {
    pub reason: String,
    pub tenant: String,
    pub detail: String,
    pub dead_at: Option<UnixMillis>,
    pub job_id: String,
    pub payload: String,
}

pub fn describe_dead_letter(delivery: &tollgate_amqp::lapin::message::Delivery) -> DeadLetter {
    let h = delivery.properties.headers().clone().unwrap_or_default();
    // Messages RabbitMQ itself dead-lettered (delivery limit) carry no
    // tollgate reason: those are poison.
    let reason =
        headers::text(&h, headers::REASON).unwrap_or_else(|| DeadReason::Poison.as_str().into());
    let dead_at = match h.inner().get(headers::DEAD_AT_MS) {
        Some(tollgate_amqp::lapin::types::AMQPValue::LongLongInt(ms)) => Some(UnixMillis(*ms)),
        _ => None,
    };
    let body: Option<serde_json::Value> = serde_json::from_slice(&delivery.data).ok();
    let field = |name: &str| {
        body.as_ref()
            .and_then(|b| b.get(name))
            .and_then(|v| v.as_str())
            .unwrap_or("?")
            .to_owned()
    };
    DeadLetter {
        reason,
        tenant: TenantId::parse(delivery.routing_key.as_str())
            .map(|t| t.to_string())
            .unwrap_or_else(|_| "?".into()),
        detail: headers::text(&h, headers::DETAIL).unwrap_or_default(),
        dead_at,
        job_id: field("id"),
        payload: body
            .as_ref()
            .and_then(|b| b.get("payload"))
            .map(|p| p.to_string())
            .unwrap_or_else(|| String::from_utf8_lossy(&delivery.data).into_owned()),
    }
}

pub async fn dlq(config: &Config, command: &DlqCommand) -> anyhow::Result<()> {
    match command {
        DlqCommand::List {
            limit,
            scan,
            show_payload,
        } => {
            let broker = connect_broker(config, "dlq").await?;
            let queue = broker.topology().dead_queue();
            let depth = broker.queue_depth(&queue).await?;
            let mut letters: Vec<DeadLetter> = broker
                .peek(&queue, *scan)
                .await?
                .iter()
                .map(describe_dead_letter)
                .collect();
            broker.close().await;
            println!("{queue}: {depth} dead letter(s)");
            let mut counts = std::collections::BTreeMap::<(String, String), usize>::new();
            for l in &letters {
                *counts
                    .entry((l.reason.clone(), l.tenant.clone()))
                    .or_default() += 1;
            }
            if !counts.is_empty() {
                println!("\n{:<12} {:<32} {:>8}", "REASON", "TENANT", "COUNT");
                for ((reason, tenant), n) in &counts {
                    println!("{reason:<12} {tenant:<32} {n:>8}");
                }
            }
            letters.sort_by_key(|l| std::cmp::Reverse(l.dead_at));
            if !letters.is_empty() {
                println!("\nnewest {}:", limit.min(&letters.len()));
            }
            for l in letters.iter().take(*limit) {
                println!(
                    "{}  {:<10} {:<20} {:<40} {}",
                    l.dead_at
                        .map(|t| t.to_string())
                        .unwrap_or_else(|| "?".into()),
                    l.reason,
                    l.tenant,
                    l.job_id,
                    l.detail
                );
                if *show_payload {
                    println!("    payload: {}", l.payload);
                }
            }
        }
    }
    Ok(())
}
