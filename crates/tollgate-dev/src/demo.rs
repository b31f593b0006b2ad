//! `tollgate-dev demo`: a self-contained live demonstration on the local RabbitMQ
//! and Redis. A fake provider enforces its own per-tenant limits (429 over
//! them); several workers share the tenants' quotas through Redis; a table
//! shows, per tenant, what was sent, parked and throttled, the achieved rate
//! against the quota and the due lag.

use std::collections::HashMap;
use std::io::{IsTerminal, Write};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Args;
use tokio::sync::watch;
use tollgate_amqp::Broker;
use tollgate_core::{Adaptive, Clock, Quota, TenantId, UnixMillis};
use tollgate_quota::{Actor, CallKind, Change, QuotaStore, Target};

use crate::fake_provider::{FakeProvider, Received, strict_limits};
use tollgate::cli::{self, PublishArgs};
use tollgate::config::Config;
use tollgate_core::SecretUrl;
use tollgate_runtime::metrics::Metrics;
use tollgate_runtime::system_clock::SystemClock;
use tollgate_runtime::worker::LiveWorker;

#[derive(Debug, Args)]
pub struct DemoArgs {
    /// How long the demonstration runs.
    #[arg(long, default_value = "30s", value_parser = humantime::parse_duration)]
    pub duration: Duration,
    /// Worker instances (each with its own RabbitMQ and Redis connections).
    #[arg(long, default_value_t = 3)]
    pub workers: usize,
}

/// One tenant of the demonstration.
struct Plan {
    tenant: &'static str,
    rate: &'static str,
    burst: u32,
    /// What the fake provider itself allows per second.
    provider_limit: u32,
    /// Jobs published at once at the start.
    backlog: u32,
    /// Jobs published per second while the demo runs.
    live_per_sec: u32,
    /// Jobs due 3–15 s after the start.
    scheduled: u32,
    /// The quota learns the provider's real limit from its 429s (`rate` is
    /// the ceiling).
    adaptive: bool,
    story: &'static str,
}

const PLANS: [Plan; 4] = [
    Plan {
        tenant: "noisy",
        rate: "20/s",
        burst: 1,
        provider_limit: 20,
        backlog: 1200,
        live_per_sec: 0,
        scheduled: 0,
        adaptive: false,
        story: "a 1200-job backlog, drained at exactly its quota",
    },
    Plan {
        tenant: "steady",
        rate: "10/s",
        burst: 1,
        provider_limit: 10,
        backlog: 0,
        live_per_sec: 5,
        scheduled: 0,
        adaptive: false,
        story: "live traffic at 5/s: never waits behind noisy's backlog",
    },
    Plan {
        tenant: "scheduled",
        rate: "5/s",
        burst: 1,
        provider_limit: 5,
        backlog: 0,
        live_per_sec: 0,
        scheduled: 40,
        adaptive: false,
        story: "40 jobs due 3-15 s after the start: sent on time, never early",
    },
    Plan {
        tenant: "drifty",
        rate: "12/s",
        burst: 1,
        provider_limit: 8,
        backlog: 200,
        live_per_sec: 0,
        scheduled: 0,
        adaptive: true,
        story: "quota set above the provider's real limit (8/s), adaptive: learns it from the 429s",
    },
];

fn tenant_target(name: &str) -> anyhow::Result<Target> {
    Ok(Target::Tenant(TenantId::parse(name)?))
}

/// When each job was due (its due_at, or when it was published).
type DueTimes = Arc<Mutex<HashMap<String, UnixMillis>>>;

pub async fn run(base: &Config, args: &DemoArgs) -> anyhow::Result<()> {
    let limits = PLANS
        .iter()
        .map(|p| (p.tenant.to_owned(), p.provider_limit))
        .collect();
    let provider = FakeProvider::start(strict_limits(limits)).await?;
    let config = Config {
        prefix: format!("demo-{}", &uuid::Uuid::new_v4().simple().to_string()[..8]),
        provider_url: Some(SecretUrl::new(provider.url())),
        concurrency: 64,
        ..base.clone()
    };
    config.validate()?;

    let broker = cli::connect_broker(&config, "demo")
        .await
        .context("the demo needs RabbitMQ (run `make services`)")?;
    broker.declare_topology().await?;
    let broker = Arc::new(broker);
    let store = cli::quota_store(&config)?;
    // Whatever happens from here (an error, Ctrl-C), the prefix's queues
    // and keys go: a demo never leaves a thousand messages behind.
    let shown = show(&config, &broker, &store, &provider, args).await;
    let cleaned = async {
        broker.delete_topology().await?;
        broker.close().await;
        store.purge_prefix().await?;
        anyhow::Ok(())
    }
    .await;
    match (&shown, cleaned) {
        (_, Ok(())) => println!("cleaned up prefix {}", config.prefix),
        (Ok(()), Err(e)) => return Err(e.context(format!("cleaning up prefix {}", config.prefix))),
        (Err(_), Err(e)) => eprintln!("could not clean up prefix {}: {e:#}", config.prefix),
    }
    shown
}

/// The demonstration itself, on a declared topology: quotas, workers,
/// jobs, the live table and the summary; stops early on Ctrl-C.
async fn show(
    config: &Config,
    broker: &Arc<Broker>,
    store: &QuotaStore,
    provider: &FakeProvider,
    args: &DemoArgs,
) -> anyhow::Result<()> {
    let clock = SystemClock;
    let actor = Actor {
        who: "demo".into(),
        source: "cli",
    };
    for plan in &PLANS {
        let quota = Quota::new(plan.rate.parse()?, plan.burst)?;
        let adaptive = plan
            .adaptive
            .then(|| Adaptive::new(quota.rate, None, None, None, None))
            .transpose()?;
        let change = Change::SetQuota {
            quota,
            concurrency: None,
            weight: None,
            adaptive,
        };
        store
            .apply(&tenant_target(plan.tenant)?, change, &actor)
            .await?;
    }

    println!(
        "tollgate-dev demo: {} workers, prefix {}, fake provider at {}",
        args.workers,
        config.prefix,
        provider.url()
    );
    for plan in &PLANS {
        println!(
            "  {:<10} {:>5} burst {}  {}",
            plan.tenant, plan.rate, plan.burst, plan.story
        );
    }

    let metrics = Metrics::new(config.tenant_label_limit, &config.tenant_label_allowlist);
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut workers = Vec::new();
    for i in 0..args.workers {
        let worker_config = Config {
            name: Some(format!("demo-worker-{i}")),
            ..config.clone()
        };
        let worker = Arc::new(LiveWorker::new(
            &worker_config.worker_settings()?,
            metrics.clone(),
        )?);
        let mut stop = stop_rx.clone();
        workers.push(tokio::spawn(worker.run(async move {
            let _ = stop.wait_for(|&s| s).await;
        })));
    }

    let due: DueTimes = Arc::default();
    let mut published: HashMap<&str, u32> = HashMap::new();
    let start = clock.now();
    for plan in &PLANS {
        if plan.backlog > 0 {
            publish(broker, &due, plan.tenant, plan.backlog, None).await?;
        }
        for i in 0..plan.scheduled {
            let due_in =
                Duration::from_millis(3_000 + u64::from(i) * 12_000 / u64::from(plan.scheduled));
            publish(broker, &due, plan.tenant, 1, Some(due_in)).await?;
        }
        *published.entry(plan.tenant).or_default() += plan.backlog + plan.scheduled;
    }
    let live = Arc::new(Mutex::new(HashMap::<&'static str, u32>::new()));
    let producer = tokio::spawn(live_traffic(
        Arc::clone(broker),
        Arc::clone(&due),
        Arc::clone(&live),
    ));

    let started = Instant::now();
    let tty = std::io::stdout().is_terminal();
    let mut ticks = 0u64;
    let mut interrupted = false;
    while started.elapsed() < args.duration {
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_secs(1)) => {}
            _ = tokio::signal::ctrl_c() => {
                interrupted = true;
                break;
            }
        }
        ticks += 1;
        if tty || ticks.is_multiple_of(5) {
            let counts = totals(&published, &live.lock().expect("not poisoned"));
            let table = render(
                &provider.received(),
                &due,
                &metrics,
                &counts,
                started.elapsed(),
                args.duration,
                clock.now(),
            );
            if tty {
                print!("\x1b[2J\x1b[H");
            }
            print!("{table}");
            let _ = std::io::stdout().flush();
        }
    }
    producer.abort();
    let _ = stop_tx.send(true);
    for worker in workers {
        worker.await.context("worker task")??;
    }
    if interrupted {
        anyhow::bail!("interrupted");
    }

    let counts = totals(&published, &live.lock().expect("not poisoned"));
    let received = provider.received();
    println!(
        "\n{}",
        render(
            &received,
            &due,
            &metrics,
            &counts,
            started.elapsed(),
            args.duration,
            clock.now()
        )
    );
    print!("{}", summary(&received, &due, start));
    // Redis is every job's other wait, shared by the whole fleet.
    let mean = |call| {
        metrics.redis_call_mean(call).map_or("-".to_owned(), |d| {
            format!("{:.1} ms", d.as_secs_f64() * 1e3)
        })
    };
    println!(
        "Redis, as the workers saw it (tollgate_redis_call_duration_seconds): a permit decision \
         took {} and the record of a call {}, on average.",
        mean(CallKind::Permit),
        mean(CallKind::Complete),
    );
    for plan in PLANS.iter().filter(|p| p.adaptive) {
        let settings = store.get(&tenant_target(plan.tenant)?).await?;
        let learned = settings.and_then(|s| s.effective).unwrap_or(f64::NAN);
        println!(
            "{}: the adaptive quota learned {} (ceiling {}; the provider allows {}/s).\n\
             `tollgate quota get {}` shows it; `tollgate quota history {}` shows each step.",
            plan.tenant,
            tollgate_quota::per_second(learned),
            plan.rate,
            plan.provider_limit,
            plan.tenant,
            plan.tenant,
        );
    }

    Ok(())
}

fn totals(initial: &HashMap<&str, u32>, live: &HashMap<&'static str, u32>) -> HashMap<String, u32> {
    let mut all: HashMap<String, u32> =
        initial.iter().map(|(k, v)| ((*k).to_owned(), *v)).collect();
    for (k, v) in live {
        *all.entry((*k).to_owned()).or_default() += v;
    }
    all
}

async fn publish(
    broker: &tollgate_amqp::Broker,
    due: &DueTimes,
    tenant: &str,
    count: u32,
    due_in: Option<Duration>,
) -> anyhow::Result<()> {
    let args = PublishArgs {
        due_in,
        payload: r#"{"demo":true}"#.into(),
        ..PublishArgs::new(tenant, count)
    };
    let now = SystemClock.now();
    let jobs = cli::build_jobs(&args, now)?;
    {
        let mut due = due.lock().expect("not poisoned");
        for job in &jobs {
            due.insert(job.id.to_string(), job.due_at.unwrap_or(now));
        }
    }
    cli::publish_jobs(broker, &jobs, now).await
}

/// Publishes each plan's live traffic, evenly spaced.
async fn live_traffic(
    broker: Arc<tollgate_amqp::Broker>,
    due: DueTimes,
    counts: Arc<Mutex<HashMap<&'static str, u32>>>,
) {
    let mut tick = tokio::time::interval(Duration::from_millis(100));
    let mut n: u64 = 0;
    loop {
        tick.tick().await;
        n += 1;
        for plan in PLANS.iter().filter(|p| p.live_per_sec > 0) {
            // Every 10/live_per_sec ticks of 100 ms.
            if n.is_multiple_of((10 / u64::from(plan.live_per_sec)).max(1)) {
                if let Err(e) = publish(&broker, &due, plan.tenant, 1, None).await {
                    tracing::warn!(error = %e, "demo publish failed");
                    continue;
                }
                *counts
                    .lock()
                    .expect("not poisoned")
                    .entry(plan.tenant)
                    .or_default() += 1;
            }
        }
    }
}

fn percentile(sorted: &[f64], p: f64) -> Option<f64> {
    if sorted.is_empty() {
        return None;
    }
    let rank = ((p * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    Some(sorted[rank - 1])
}

/// Lateness of each job's first provider request, in seconds.
fn due_lags(received: &[Received], due: &DueTimes, tenant: &str) -> Vec<f64> {
    let due = due.lock().expect("not poisoned");
    let mut first: HashMap<&str, UnixMillis> = HashMap::new();
    for r in received.iter().filter(|r| r.tenant == tenant) {
        first.entry(r.job_id.as_str()).or_insert(r.at);
    }
    let mut lags: Vec<f64> = first
        .iter()
        .filter_map(|(id, at)| due.get(*id).map(|d| (at.0 - d.0) as f64 / 1000.0))
        .collect();
    lags.sort_by(f64::total_cmp);
    lags
}

fn fmt_secs(s: Option<f64>) -> String {
    match s {
        None => "-".into(),
        Some(s) if s.abs() < 1.0 => format!("{:.0} ms", s * 1000.0),
        Some(s) => format!("{s:.1} s"),
    }
}

fn render(
    received: &[Received],
    due: &DueTimes,
    metrics: &Metrics,
    published: &HashMap<String, u32>,
    elapsed: Duration,
    total: Duration,
    now: UnixMillis,
) -> String {
    let mut out = format!(
        "tollgate demo  {:>4.0} s / {:.0} s\n\n{:<10} {:>6} {:>9} {:>9} {:>6} {:>8} {:>7} {:>6} {:>14} {:>12}\n",
        elapsed.as_secs_f64(),
        total.as_secs_f64(),
        "TENANT",
        "QUOTA",
        "PROVIDER",
        "PUBLISHED",
        "SENT",
        "PENDING",
        "PARKED",
        "429s",
        "RATE(5s)/QUOTA",
        "DUE LAG p95"
    );
    let mut all_sent = 0;
    for plan in &PLANS {
        let mine: Vec<&Received> = received
            .iter()
            .filter(|r| r.tenant == plan.tenant)
            .collect();
        let sent = mine.iter().filter(|r| r.status == 200).count();
        all_sent += sent;
        let throttled = mine.iter().filter(|r| r.status == 429).count();
        let recent = mine
            .iter()
            .filter(|r| r.status == 200 && now.0 - r.at.0 <= 5_000)
            .count();
        let parked = metrics.counter_sum("tollgate_parked_total", &[("tenant", plan.tenant)]);
        let publ = published.get(plan.tenant).copied().unwrap_or(0);
        let lags = due_lags(received, due, plan.tenant);
        let quota_per_sec = plan
            .rate
            .parse::<tollgate_core::Rate>()
            .map(|r| r.per_second())
            .unwrap_or(0.0);
        out.push_str(&format!(
            "{:<10} {:>6} {:>7}/s {:>9} {:>6} {:>8} {:>7.0} {:>6} {:>7.1} / {:<4} {:>12}\n",
            plan.tenant,
            plan.rate,
            plan.provider_limit,
            publ,
            sent,
            publ as usize - sent.min(publ as usize),
            parked,
            throttled,
            recent as f64 / 5.0,
            quota_per_sec,
            fmt_secs(percentile(&lags, 0.95)),
        ));
    }
    out.push_str(&format!(
        "\nprovider accepted {all_sent} requests ({:.1}/s overall)\n",
        all_sent as f64 / elapsed.as_secs_f64().max(0.001)
    ));
    out
}

/// The figures that matter, measured at the provider.
fn summary(received: &[Received], due: &DueTimes, start: UnixMillis) -> String {
    let mut out = String::from("\nsummary (measured at the provider)\n");
    out.push_str(&format!(
        "{:<10} {:>6} {:>16} {:>10} {:>8} {:>10} {:>10} {:>10}\n",
        "TENANT", "QUOTA", "ACHIEVED RATE", "MAX IN 1s", "429s", "LAG p50", "LAG p95", "LAG max"
    ));
    for plan in &PLANS {
        let mine: Vec<&Received> = received
            .iter()
            .filter(|r| r.tenant == plan.tenant)
            .collect();
        let ok: Vec<&Received> = mine.iter().copied().filter(|r| r.status == 200).collect();
        let rate = match (ok.first(), ok.last()) {
            (Some(a), Some(b)) if ok.len() > 1 => {
                (ok.len() - 1) as f64 / ((b.at.0 - a.at.0).max(1) as f64 / 1000.0)
            }
            _ => 0.0,
        };
        let mut max_window = 0;
        let mut lo = 0;
        for hi in 0..mine.len() {
            while mine[hi].instant.duration_since(mine[lo].instant) >= Duration::from_secs(1) {
                lo += 1;
            }
            max_window = max_window.max(hi - lo + 1);
        }
        let lags = due_lags(received, due, plan.tenant);
        out.push_str(&format!(
            "{:<10} {:>6} {:>14.1}/s {:>10} {:>8} {:>10} {:>10} {:>10}\n",
            plan.tenant,
            plan.rate,
            rate,
            max_window,
            mine.iter().filter(|r| r.status == 429).count(),
            fmt_secs(percentile(&lags, 0.5)),
            fmt_secs(percentile(&lags, 0.95)),
            fmt_secs(lags.last().copied()),
        ));
    }
    let early = received
        .iter()
        .filter(|r| {
            due.lock()
                .expect("not poisoned")
                .get(&r.job_id)
                .is_some_and(|d| r.at < *d)
        })
        .count();
    let keys: std::collections::HashSet<&str> = received
        .iter()
        .filter(|r| r.status == 200)
        .map(|r| r.idempotency_key.as_str())
        .collect();
    let accepted = received.iter().filter(|r| r.status == 200).count();
    out.push_str(&format!(
        "\nsent before due: {early}   accepted twice: {}   run started {}\n",
        accepted - keys.len(),
        start
    ));
    out.push_str(
        "429s on `drifty` are the provider disagreeing with a quota set above its limit: each one\n\
         parks the job for Retry-After and pushes the tenant's bucket past it, so every worker backs\n\
         off; no attempt is burnt and nothing is lost. Its quota is adaptive: the 429s lower the\n\
         rate the whole fleet enforces until they stop, and probes above it find a raised limit.\n",
    );
    out
}
