//! The concurrency sweep: the fairness, precision and adherence scenarios
//! again at `TOLLGATE_CONCURRENCY` 4, 16, 64 and 256 (provider calls per
//! pod; the prefetch follows, at least 64), and once with the prefetch
//! itself forced down to 4, with worker processes of the product binary and
//! a strict provider (429 beyond each tenant's quota in any sliding second).
//! What a promise is worth one step off the defaults.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use serde_json::json;
use tollgate_core::UnixMillis;

use super::fairness::lags_ms;
use super::pacing::{adherence_figures, utilization};
use super::rig::{Rig, scrape};
use super::{Figure, Scenario, percentile, progress};
use crate::fake_provider::{Received, max_in_window, strict_account, strict_limits};
use tollgate::config::Config;

/// The settings swept (concurrency, prefetch if forced), with their
/// scenario keys and titles.
const SWEEP: [(u16, Option<u16>, &str, &str); 5] = [
    (4, None, "sweep_c4", "Sweep: TOLLGATE_CONCURRENCY=4"),
    (16, None, "sweep_c16", "Sweep: TOLLGATE_CONCURRENCY=16"),
    (
        64,
        None,
        "sweep_c64",
        "Sweep: TOLLGATE_CONCURRENCY=64 (default)",
    ),
    (256, None, "sweep_c256", "Sweep: TOLLGATE_CONCURRENCY=256"),
    (
        4,
        Some(4),
        "sweep_p4",
        "Sweep: TOLLGATE_CONCURRENCY=4, TOLLGATE_PREFETCH=4",
    ),
];

const WORKERS: usize = 4;

/// The parts of each point, as `--only sweep_c64.<part>` names them.
const PARTS: [&str; 12] = [
    "noisy_neighbour",
    "parks",
    "scheduled",
    "adherence",
    "many_tenants",
    "thousand_tenants",
    "weighted_share",
    "weight_raised",
    "route_raised",
    "priority",
    "quota_below_share",
    "shared_account",
];

/// The scenario keys `--only` may name here: each point, and each part of
/// each point.
pub fn keys() -> impl Iterator<Item = String> {
    SWEEP.into_iter().flat_map(|(_, _, key, _)| {
        std::iter::once(key.to_owned())
            .chain(PARTS.into_iter().map(move |part| format!("{key}.{part}")))
    })
}

/// Runs the points of the sweep whose key `wanted` accepts.
pub async fn run(base: &Config, wanted: impl Fn(&str) -> bool) -> anyhow::Result<Vec<Scenario>> {
    let mut out = Vec::new();
    for (concurrency, prefetch, key, title) in SWEEP {
        // `sweep_c64` runs every part of the point; `sweep_c64.weighted_share`,
        // … one each.
        let part = |name: &str| wanted(key) || wanted(&format!("{key}.{name}"));
        if !PARTS.iter().any(|name| part(name)) {
            continue;
        }
        let setting = Setting {
            concurrency,
            prefetch,
        };
        let mut figures = Vec::new();
        for name in PARTS.into_iter().filter(|name| part(name)) {
            figures.extend(run_part(name, base, setting).await?);
        }
        out.push(Scenario {
            key,
            title,
            parameters: json!({
                "concurrency": concurrency,
                "prefetch": prefetch.map_or_else(|| "max(concurrency, 64)".to_owned(), |p| p.to_string()),
                "shards": base.shards,
                "noisy_neighbour": format!(
                    "{WORKERS} worker processes; noisy: 2000 jobs at once, quota 10/s burst 1; \
                     quiet: one job every 0.5 s for 20 s at 100/s, one on the noisy tenant's \
                     work queue, one on another"
                ),
                "scheduled": format!("{WORKERS} worker processes; 150 jobs due 2–20 s ahead, quota 100/s burst 10"),
                "adherence": "8 worker processes; one tenant at 20/s burst 1, 400-job backlog",
                "parks": format!("{WORKERS} worker processes; 300 jobs at 20/s burst 1, drained"),
                "many_tenants": HUNDREDS.parameters(base),
                "thousand_tenants": THOUSAND.parameters(base),
                "weighted_share": format!(
                    "{WORKERS} worker processes; 3 tenants with weights 1, 2, 3 and {SHARE_BACKLOG} jobs \
                     each on one route of 30/s burst 1 (their own quotas 100/s); shares counted from \
                     when all three backlogs are queued to the last send of the first to finish"
                ),
                "weight_raised": format!(
                    "{WORKERS} worker processes; 2 tenants of weight 1 with {SHARE_BACKLOG} jobs each \
                     on one route of 30/s burst 1 (their own quotas 100/s); one's weight set to \
                     {RAISED_TO} {RAISE_AFTER:?} after both backlogs are queued"
                ),
                "route_raised": format!(
                    "{WORKERS} worker processes; 2 tenants with {SHARE_BACKLOG} jobs each on one route \
                     of {ROUTE_BEFORE}/s burst 1 (their own quotas 100/s), raised to {ROUTE_AFTER}/s \
                     {RAISE_AFTER:?} after both backlogs are queued; the provider allows {ROUTE_AFTER} \
                     in any sliding second"
                ),
                "priority": format!(
                    "{WORKERS} worker processes; one tenant at 10/s burst 1: {LOW_BACKLOG} low jobs, \
                     then {URGENT} normal and {URGENT} high {URGENT_AFTER:?} later"
                ),
                "quota_below_share": format!(
                    "{WORKERS} worker processes; one route of 30/s burst 1; held: {HELD_BACKLOG} jobs at \
                     its own quota of 10/s burst 1 (below its half of the route); wide: {WIDE_BACKLOG} \
                     jobs at 100/s; rates counted from when both backlogs are queued to the last send \
                     of the first to finish"
                ),
                "shared_account": format!(
                    "{WORKERS} worker processes; a route quota of 1000/s; noisy: 500 jobs at once, \
                     quota 10/s burst 1; quiet: one job every 0.5 s for 10 s at 100/s, on another \
                     work queue"
                ),
                "provider": "strict: 429 beyond each tenant's quota (and, in weighted_share, \
                             beyond the route's 30) in any sliding second",
            }),
            figures,
        });
    }
    Ok(out)
}

/// The figures of one part of a point, by its name in [`PARTS`].
async fn run_part(name: &str, base: &Config, setting: Setting) -> anyhow::Result<Vec<Figure>> {
    match name {
        "noisy_neighbour" => noisy_neighbour(base, setting).await,
        "parks" => parks_drained(base, setting).await,
        "scheduled" => scheduled(base, setting).await,
        "adherence" => adherence(base, setting).await,
        "many_tenants" => many_tenants(base, setting, HUNDREDS).await,
        "thousand_tenants" => many_tenants(base, setting, THOUSAND).await,
        "weighted_share" => weighted_share(base, setting).await,
        "weight_raised" => weight_raised(base, setting).await,
        "route_raised" => route_raised(base, setting).await,
        "priority" => priority(base, setting).await,
        "quota_below_share" => quota_below_share(base, setting).await,
        "shared_account" => shared_account(base, setting).await,
        _ => unreachable!("{name} is not in PARTS"),
    }
}

/// One point of the sweep.
#[derive(Clone, Copy)]
struct Setting {
    concurrency: u16,
    prefetch: Option<u16>,
}

impl std::fmt::Display for Setting {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "c={}", self.concurrency)?;
        match self.prefetch {
            Some(p) => write!(f, " prefetch={p}"),
            None => Ok(()),
        }
    }
}

/// A series summed over the workers' /metrics (a worker that does not
/// answer counts 0).
async fn scrape_sum(ports: &[u16], series: &str) -> f64 {
    let mut sum = 0.0;
    for port in ports {
        sum += scrape(*port, series).await.unwrap_or(0.0);
    }
    sum
}

async fn spawn_workers(rig: &mut Rig, setting: Setting, n: usize) -> anyhow::Result<Vec<u16>> {
    let mut vars = vec![("TOLLGATE_CONCURRENCY", setting.concurrency.to_string())];
    if let Some(prefetch) = setting.prefetch {
        vars.push(("TOLLGATE_PREFETCH", prefetch.to_string()));
    }
    let extra: Vec<(&str, &str)> = vars.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let mut ports = Vec::with_capacity(n);
    for _ in 0..n {
        ports.push(rig.spawn_process(&extra).await?.http_port);
    }
    Ok(ports)
}

fn times(received: &[Received], tenant: &str) -> Vec<Instant> {
    received
        .iter()
        .filter(|r| r.tenant == tenant)
        .map(|r| r.instant)
        .collect()
}

/// Parks per sent job of a backlog drained to the end: 300 jobs at 20/s
/// on the worker processes, every park of every job counted.
async fn parks_drained(base: &Config, setting: Setting) -> anyhow::Result<Vec<Figure>> {
    const JOBS: usize = 300;
    progress(&format!(
        "sweep {setting}: parks per job, {JOBS} jobs at 20/s drained"
    ));
    let mut rig = Rig::new(
        base,
        strict_limits(HashMap::from([("noisy".to_owned(), 20)])),
    )
    .await?;
    rig.set_quota("noisy", "20/s", 1).await?;
    let ports = spawn_workers(&mut rig, setting, WORKERS).await?;
    rig.publish("noisy", JOBS as u32, None, "{}").await?;
    rig.until_accepted(JOBS, Duration::from_secs(60)).await?;
    let parks = scrape_sum(&ports, "tollgate_parked_total{").await;
    rig.cleanup().await?;
    Ok(vec![
        Figure::new(
            "parks per sent job, a 300-job backlog drained",
            "parks/job",
            vec![parks / JOBS as f64],
        )
        .target("<= 1.5"),
    ])
}

async fn noisy_neighbour(base: &Config, setting: Setting) -> anyhow::Result<Vec<Figure>> {
    const QUIET_SECONDS: u64 = 20;
    progress(&format!(
        "sweep {setting}: noisy neighbour, {WORKERS} worker processes"
    ));
    // The quiet tenants are picked among beside-1…64 and apart-1…64 once
    // the work queues exist (which queue a tenant hashes to depends on them).
    let mut limits = HashMap::from([("noisy".to_owned(), 10)]);
    for i in 1..=64 {
        limits.insert(format!("beside-{i}"), 100);
        limits.insert(format!("apart-{i}"), 100);
    }
    let mut rig = Rig::new(base, strict_limits(limits)).await?;
    let noisy_shard = rig.shard_of("noisy").await?;
    let beside = rig.tenant_where("beside", |s| s == noisy_shard).await?;
    let apart = rig.tenant_where("apart", |s| s != noisy_shard).await?;
    rig.set_quota("noisy", "10/s", 1).await?;
    for quiet in [&beside, &apart] {
        rig.set_quota(quiet, "100/s", 1).await?;
    }
    let ports = spawn_workers(&mut rig, setting, WORKERS).await?;
    rig.publish("noisy", 2000, None, "{}").await?;
    let mut quiet: [Vec<(String, UnixMillis)>; 2] = Default::default();
    for _ in 0..QUIET_SECONDS * 2 {
        for (tenant, sent) in [&beside, &apart].into_iter().zip(&mut quiet) {
            let (jobs, at) = rig.publish(tenant, 1, None, "{}").await?;
            sent.extend(jobs.into_iter().map(|j| (j.id.to_string(), at)));
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    let received = rig.provider.received();
    let parks = scrape_sum(&ports, "tollgate_parked_total{").await;
    rig.cleanup().await?;

    let noisy: Vec<&Received> = received.iter().filter(|r| r.tenant == "noisy").collect();
    let sent = received.iter().filter(|r| r.status == 200).count();
    let beside_lags = lags_ms(&received, &quiet[0]);
    let apart_lags = lags_ms(&received, &quiet[1]);
    Ok(vec![
        Figure::new(
            "quiet on the noisy queue: sent of published",
            "fraction",
            vec![beside_lags.len() as f64 / quiet[0].len() as f64],
        )
        .target("1"),
        Figure::new(
            "quiet on the noisy queue: due lag p50",
            "ms",
            vec![percentile(&beside_lags, 0.5)],
        ),
        Figure::new(
            "quiet on the noisy queue: due lag p99",
            "ms",
            vec![percentile(&beside_lags, 0.99)],
        )
        .target("< 50"),
        Figure::new(
            "quiet on another queue: due lag p50",
            "ms",
            vec![percentile(&apart_lags, 0.5)],
        ),
        Figure::new(
            "quiet on another queue: due lag p99",
            "ms",
            vec![percentile(&apart_lags, 0.99)],
        )
        .target("< 50"),
        Figure::new(
            "noisy: max requests in any 1 s (quota 10)",
            "requests",
            vec![max_in_window(&times(&received, "noisy"), Duration::from_secs(1)) as f64],
        )
        .target("<= 10"),
        Figure::new(
            "noisy: 429s",
            "requests",
            vec![noisy.iter().filter(|r| r.status == 429).count() as f64],
        )
        .target("0"),
        Figure::new(
            "noisy: quota use",
            "fraction",
            vec![utilization(&noisy, 10.0)],
        )
        .target(">= 0.97"),
        Figure::new(
            "noisy: slots missed (gaps between sends over 1.5 of its 100 ms spacing)",
            "gaps",
            vec![missed_slots(&noisy, Duration::from_millis(150)) as f64],
        ),
        Figure::new(
            "parks in the 20 s window per job sent in it (the backlog's first pass counts whole)",
            "parks/job",
            vec![parks / sent.max(1) as f64],
        ),
    ])
}

/// Gaps longer than `over` between a tenant's accepted sends: where its
/// quota use goes.
fn missed_slots(received: &[&Received], over: Duration) -> usize {
    let sent: Vec<Instant> = received
        .iter()
        .filter(|r| r.status == 200)
        .map(|r| r.instant)
        .collect();
    gaps_over(&sent, over)
}

/// Gaps between consecutive `sends` longer than `over`.
fn gaps_over(sends: &[Instant], over: Duration) -> usize {
    sends.windows(2).filter(|w| w[1] - w[0] > over).count()
}

/// `n` due offsets, uniform over 2–20 s, the same on every run.
fn due_offsets(n: u64) -> Vec<Duration> {
    let mut seed: u64 = 0x5eed;
    (0..n)
        .map(|_| {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            Duration::from_millis(2_000 + (seed >> 33) % 18_000)
        })
        .collect()
}

async fn scheduled(base: &Config, setting: Setting) -> anyhow::Result<Vec<Figure>> {
    const JOBS: u64 = 150;
    progress(&format!("sweep {setting}: {JOBS} jobs due 2–20 s ahead"));
    let mut rig = Rig::new(base, crate::fake_provider::always_ok()).await?;
    rig.set_quota("cron", "100/s", 10).await?;
    spawn_workers(&mut rig, setting, WORKERS).await?;
    let mut due = Vec::new();
    for due_in in due_offsets(JOBS) {
        let (jobs, _) = rig.publish("cron", 1, Some(due_in), "{}").await?;
        due.extend(
            jobs.into_iter()
                .map(|j| (j.id.to_string(), j.due_at.expect("scheduled"))),
        );
    }
    let finished = rig
        .until_accepted(JOBS as usize, Duration::from_secs(40))
        .await;
    let lags = lags_ms(&rig.provider.received(), &due);
    rig.cleanup().await?;
    finished?;
    let early = lags.iter().filter(|&&l| l < 0.0).count();
    Ok(vec![
        Figure::new("scheduled: due lag p50", "ms", vec![percentile(&lags, 0.5)]),
        Figure::new(
            "scheduled: due lag p99",
            "ms",
            vec![percentile(&lags, 0.99)],
        )
        .target("< 100"),
        Figure::new("scheduled: sent before due", "jobs", vec![early as f64]).target("0"),
    ])
}

async fn adherence(base: &Config, setting: Setting) -> anyhow::Result<Vec<Figure>> {
    const PROCESSES: usize = 8;
    const JOBS: u32 = 400;
    progress(&format!(
        "sweep {setting}: adherence, {PROCESSES} worker processes on one 20/s quota"
    ));
    let strict = strict_limits(HashMap::from([("fleet".to_owned(), 20)]));
    let mut rig = Rig::new(base, strict).await?;
    rig.set_quota("fleet", "20/s", 1).await?;
    spawn_workers(&mut rig, setting, PROCESSES).await?;
    rig.publish("fleet", JOBS, None, "{}").await?;
    let finished = rig
        .until_accepted(JOBS as usize, Duration::from_secs(120))
        .await;
    let received = rig.provider.received();
    rig.cleanup().await?;
    finished?;
    Ok(adherence_figures(&received)
        .into_iter()
        .map(|f| Figure {
            name: match &*f.name {
                super::pacing::MAX_IN_1S => "adherence (8 processes): max in any 1 s (quota 20)",
                super::pacing::OVER_QUOTA => "adherence (8 processes): 429s",
                _ => "adherence (8 processes): quota use",
            }
            .into(),
            ..f
        })
        .collect())
}

/// Many tenants, each with a small backlog at a small quota of its own: the
/// fleet's send rate should approach the sum of their quotas, however many
/// tenants a pod can hold or park at once.
#[derive(Clone, Copy)]
struct Crowd {
    /// The figures' prefix.
    label: &'static str,
    tenants: usize,
    jobs: u32,
    /// Each tenant's quota, per second, burst 1.
    rate: u32,
}

/// 200 tenants × 20 jobs at 2/s: 4,000 jobs, 400/s for the fleet.
const HUNDREDS: Crowd = Crowd {
    label: "many tenants",
    tenants: 200,
    jobs: 20,
    rate: 2,
};

/// 1,000 tenants × 10 jobs at 1/s: 10,000 jobs, 1,000/s for the fleet.
const THOUSAND: Crowd = Crowd {
    label: "1,000 tenants",
    tenants: 1_000,
    jobs: 10,
    rate: 1,
};

impl Crowd {
    /// Seconds from each tenant's first send to its last, every send on
    /// its slot: the quota's interval widened by the pacing margin.
    fn ideal_s(self, base: &Config) -> f64 {
        f64::from(self.jobs - 1) * (1.0 + base.pacing_margin_pct / 100.0) / f64::from(self.rate)
    }

    fn parameters(self, base: &Config) -> String {
        format!(
            "{WORKERS} worker processes; {} tenants × {} jobs at {}/s burst 1 each, published \
             in one stream (ideal drain {:.1} s, from the first send)",
            self.tenants,
            self.jobs,
            self.rate,
            self.ideal_s(base)
        )
    }
}

async fn many_tenants(
    base: &Config,
    setting: Setting,
    crowd: Crowd,
) -> anyhow::Result<Vec<Figure>> {
    const LIMIT: Duration = Duration::from_secs(60);
    let Crowd {
        label,
        tenants,
        jobs,
        rate,
    } = crowd;
    progress(&format!(
        "sweep {setting}: {tenants} tenants × {jobs} jobs at {rate}/s each"
    ));
    let names: Vec<String> = (0..tenants).map(|i| format!("many-{i}")).collect();
    let limits = names.iter().map(|t| (t.clone(), rate)).collect();
    let mut rig = Rig::new(base, strict_limits(limits)).await?;
    let quota = format!("{rate}/s");
    for tenant in &names {
        rig.set_quota(tenant, &quota, 1).await?;
    }
    let ports = spawn_workers(&mut rig, setting, WORKERS).await?;
    let started = Instant::now();
    rig.publish_each(&names, jobs).await?;
    let published = started.elapsed();
    let total = tenants * jobs as usize;
    // Not finishing within the limit is a figure (sent within 60 s), not an error.
    let _ = rig.until_accepted(total, LIMIT).await;
    let drain = started.elapsed();
    let received = rig.provider.received();
    let late = scrape_sum(&ports, "tollgate_late_permits_total{").await;
    let redelivered = scrape_sum(&ports, "tollgate_redelivered_total{").await;
    let poison = scrape_sum(&ports, r#"tollgate_dead_letters_total{reason="poison""#).await;
    rig.cleanup().await?;
    let sent = received.iter().filter(|r| r.status == 200).count();
    let worst = names
        .iter()
        .map(|t| max_in_window(&times(&received, t), Duration::from_secs(1)))
        .max()
        .unwrap_or(0);
    Ok(vec![
        Figure::new(
            format!("{label}: drain time (ideal {:.1} s)", crowd.ideal_s(base)),
            "s",
            vec![drain.as_secs_f64()],
        ),
        Figure::new(
            format!("{label}: of which publishing the backlogs"),
            "s",
            vec![published.as_secs_f64()],
        ),
        Figure::new(
            format!("{label}: sent within 60 s"),
            "jobs",
            vec![sent as f64],
        )
        .target(total.to_string()),
        Figure::new(
            format!("{label}: 429s"),
            "requests",
            vec![received.iter().filter(|r| r.status == 429).count() as f64],
        )
        .target("0"),
        Figure::new(
            format!("{label}: busiest tenant in any 1 s (quota {rate})"),
            "requests",
            vec![worst as f64],
        )
        .target(format!("<= {rate}")),
        Figure::new(
            format!("{label}: permits read past their leeway (let go, asked again)"),
            "permits",
            vec![late],
        ),
        Figure::new(
            format!("{label}: deliveries redelivered (each counts toward poison)"),
            "deliveries",
            vec![redelivered],
        ),
        Figure::new(
            format!("{label}: dead-lettered as poison"),
            "jobs",
            vec![poison],
        )
        .target("0"),
    ])
}

/// Jobs per tenant in the weighted-share scenario.
const SHARE_BACKLOG: u32 = 300;

/// Who the bench's quota changes are made by, in the audit.
fn bench_actor() -> tollgate_quota::Actor {
    tollgate_quota::Actor {
        who: "bench".into(),
        source: "cli",
    }
}

/// Gives the default route (every job of the bench) a quota of `rate`
/// burst 1: one provider account for every tenant.
async fn set_route_quota(rig: &Rig, rate: &str) -> anyhow::Result<()> {
    let change = tollgate_quota::Change::SetQuota {
        quota: tollgate_core::Quota::parse(rate, 1)?,
        concurrency: None,
        weight: None,
        adaptive: None,
    };
    let target = tollgate_quota::Target::Route(tollgate_core::Kind::default_kind());
    rig.store.apply(&target, change, &bench_actor()).await?;
    Ok(())
}

/// Two tenants on one provider account far from full (a route quota of
/// 1000/s): noisy, paced by its own quota (10/s) through a 500-job backlog,
/// reserves each send ahead; quiet (100/s, on another work queue) sends one
/// job every 0.5 s for 10 s. The noisy tenant's reservations must not hold
/// the quiet one back (the route's bucket has one "next free" time).
async fn shared_account(base: &Config, setting: Setting) -> anyhow::Result<Vec<Figure>> {
    const QUIET_SECONDS: u64 = 10;
    progress(&format!(
        "sweep {setting}: a provider account of 1000/s shared by a self-paced backlog and a quiet tenant"
    ));
    let mut limits = HashMap::from([("noisy".to_owned(), 10)]);
    for i in 1..=64 {
        limits.insert(format!("apart-{i}"), 100);
    }
    let mut rig = Rig::new(base, strict_limits(limits)).await?;
    let noisy_shard = rig.shard_of("noisy").await?;
    let apart = rig.tenant_where("apart", |s| s != noisy_shard).await?;
    set_route_quota(&rig, "1000/s").await?;
    rig.set_quota("noisy", "10/s", 1).await?;
    rig.set_quota(&apart, "100/s", 1).await?;
    spawn_workers(&mut rig, setting, WORKERS).await?;
    rig.publish("noisy", 500, None, "{}").await?;
    let mut quiet = Vec::new();
    for _ in 0..QUIET_SECONDS * 2 {
        let (jobs, at) = rig.publish(&apart, 1, None, "{}").await?;
        quiet.extend(jobs.into_iter().map(|j| (j.id.to_string(), at)));
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    let received = rig.provider.received();
    rig.cleanup().await?;
    let noisy: Vec<&Received> = received.iter().filter(|r| r.tenant == "noisy").collect();
    let lags = lags_ms(&received, &quiet);
    Ok(vec![
        Figure::new(
            "shared account: quiet sent of published",
            "fraction",
            vec![lags.len() as f64 / quiet.len() as f64],
        )
        .target("1"),
        Figure::new(
            "shared account: quiet due lag p50",
            "ms",
            vec![percentile(&lags, 0.5)],
        ),
        Figure::new(
            "shared account: quiet due lag p99",
            "ms",
            vec![percentile(&lags, 0.99)],
        )
        .target("< 50"),
        Figure::new(
            "shared account: noisy 429s",
            "requests",
            vec![noisy.iter().filter(|r| r.status == 429).count() as f64],
        )
        .target("0"),
        Figure::new(
            "shared account: noisy quota use",
            "fraction",
            vec![utilization(&noisy, 10.0)],
        )
        .target(">= 0.97"),
    ])
}

const HELD_BACKLOG: u32 = 100;
const WIDE_BACKLOG: u32 = 400;

/// Two tenants with backlogs on one route of 30/s: one held by its own
/// quota (10/s) below its half of the route, one that could take all of it.
/// Max-min fair: the held tenant sends at its quota and the other takes the
/// rest (20/s), and the held one never waits long between sends.
async fn quota_below_share(base: &Config, setting: Setting) -> anyhow::Result<Vec<Figure>> {
    const LIMIT: Duration = Duration::from_secs(60);
    progress(&format!(
        "sweep {setting}: a 10/s tenant beside a 100/s one on one 30/s route"
    ));
    let rig = Rig::new(base, strict_account(30)).await?;
    set_route_quota(&rig, "30/s").await?;
    rig.set_quota("held", "10/s", 1).await?;
    rig.set_quota("wide", "100/s", 1).await?;
    let mut rig = rig;
    spawn_workers(&mut rig, setting, WORKERS).await?;
    rig.publish("held", HELD_BACKLOG, None, "{}").await?;
    rig.publish("wide", WIDE_BACKLOG, None, "{}").await?;
    let started = Instant::now();
    let sent_of = |received: &[Received], tenant: &str| {
        received
            .iter()
            .filter(|r| r.status == 200 && r.tenant == tenant)
            .count()
    };
    loop {
        let received = rig.provider.received();
        let done = sent_of(&received, "held") >= HELD_BACKLOG as usize
            || sent_of(&received, "wide") >= WIDE_BACKLOG as usize;
        if done || started.elapsed() > LIMIT {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let received = rig.provider.received();
    rig.cleanup().await?;
    let sent: Vec<&Received> = received.iter().filter(|r| r.status == 200).collect();
    let sends_of = |tenant: &str| -> Vec<Instant> {
        sent.iter()
            .filter(|r| r.tenant == tenant)
            .map(|r| r.instant)
            .collect()
    };
    let (held, wide) = (sends_of("held"), sends_of("wide"));
    // While both have work: from the backlogs queued to the last send of
    // the first to finish.
    let to = [held.iter().max(), wide.iter().max()]
        .into_iter()
        .flatten()
        .min()
        .copied()
        .unwrap_or(started);
    let span = to
        .saturating_duration_since(started)
        .as_secs_f64()
        .max(1e-3);
    let within = |t: &[Instant]| t.iter().filter(|&&at| at >= started && at <= to).count() as f64;
    let longest_gap = held
        .windows(2)
        .map(|w| w[1].duration_since(w[0]).as_secs_f64() * 1e3)
        .fold(0.0, f64::max);
    let all: Vec<Instant> = sent.iter().map(|r| r.instant).collect();
    Ok(vec![
        Figure::new(
            "quota below its share: held tenant, achieved ÷ its own 10/s while both have work",
            "ratio",
            vec![within(&held) / span / 10.0],
        )
        .target(">= 0.97"),
        Figure::new(
            "quota below its share: wide tenant, achieved ÷ the rest of the route (20/s)",
            "ratio",
            vec![within(&wide) / span / 20.0],
        ),
        Figure::new(
            "quota below its share: held tenant's longest wait between sends",
            "ms",
            vec![longest_gap],
        ),
        Figure::new(
            "quota below its share: held tenant's slots missed (gaps over 1.5 of its 100 ms spacing)",
            "gaps",
            vec![gaps_over(&held, Duration::from_millis(150)) as f64],
        ),
        Figure::new(
            "quota below its share: held tenant max in any 1 s (quota 10)",
            "requests",
            vec![max_in_window(&held, Duration::from_secs(1)) as f64],
        )
        .target("<= 10"),
        Figure::new(
            "quota below its share: route max in any 1 s (limit 30)",
            "requests",
            vec![max_in_window(&all, Duration::from_secs(1)) as f64],
        )
        .target("<= 30"),
        Figure::new(
            "quota below its share: 429s",
            "requests",
            vec![received.iter().filter(|r| r.status == 429).count() as f64],
        )
        .target("0"),
    ])
}

/// Three tenants with backlogs on one route of 30/s, weights 1, 2 and 3:
/// each one's part of the route's sends while all three have work, against
/// its weight's part (1/6, 2/6, 3/6).
async fn weighted_share(base: &Config, setting: Setting) -> anyhow::Result<Vec<Figure>> {
    const WEIGHTS: [u32; 3] = [1, 2, 3];
    const LIMIT: Duration = Duration::from_secs(60);
    progress(&format!(
        "sweep {setting}: weighted share, weights {WEIGHTS:?} on one 30/s route"
    ));
    let rig = Rig::new(base, strict_account(30)).await?;
    set_route_quota(&rig, "30/s").await?;
    let names: Vec<String> = WEIGHTS.iter().map(|w| format!("weight-{w}")).collect();
    for (name, &w) in names.iter().zip(&WEIGHTS) {
        rig.set_quota(name, "100/s", 1).await?;
        let target = tollgate_quota::Target::Tenant(tollgate_core::TenantId::parse(name.as_str())?);
        rig.store
            .apply(
                &target,
                tollgate_quota::Change::SetWeight(w),
                &bench_actor(),
            )
            .await?;
    }
    let mut rig = rig;
    spawn_workers(&mut rig, setting, WORKERS).await?;
    for name in &names {
        rig.publish(name, SHARE_BACKLOG, None, "{}").await?;
    }
    // From here all three have work queued. Until the first is done.
    let started = Instant::now();
    let done = |received: &[Received]| {
        names.iter().any(|t| {
            received
                .iter()
                .filter(|r| r.status == 200 && &r.tenant == t)
                .count()
                >= SHARE_BACKLOG as usize
        })
    };
    while !done(&rig.provider.received()) && started.elapsed() < LIMIT {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let received = rig.provider.received();
    rig.cleanup().await?;
    let sent: Vec<&Received> = received.iter().filter(|r| r.status == 200).collect();
    // While all three have work: from the moment the last backlog is
    // queued to the last send of the first to finish. Not from the first
    // send of the last to start: the first published has the route to
    // itself until the others' jobs arrive, as it should, and reserves its
    // slots up to the horizon ahead; the others' first sends wait behind
    // those reservations, which go out while all three have work and are
    // charged to its share (its next place moves on by its new spacing for
    // each). Counted from the others' first send, its reserved sends fell
    // outside the span and the pause that pays for them inside (weight 1
    // at 0.92 of its share where the same run, counted from here, gives
    // 1.01).
    let to = names
        .iter()
        .filter_map(|t| times(&received, t).into_iter().max())
        .min();
    let sent: Vec<&Received> = match to {
        Some(to) => sent
            .into_iter()
            .filter(|r| r.instant >= started && r.instant <= to)
            .collect(),
        None => sent,
    };
    let counts: Vec<usize> = names
        .iter()
        .map(|t| sent.iter().filter(|r| &r.tenant == t).count())
        .collect();
    let total = counts.iter().sum::<usize>().max(1) as f64;
    let weight_sum: u32 = WEIGHTS.iter().sum();
    let all: Vec<Instant> = sent.iter().map(|r| r.instant).collect();
    let mut figures: Vec<Figure> = WEIGHTS
        .iter()
        .zip(&counts)
        .map(|(&w, &n)| {
            let share = n as f64 / total;
            let expected = f64::from(w) / f64::from(weight_sum);
            Figure::new(
                match w {
                    1 => "weighted share: weight 1, achieved ÷ its weight's share (1/6)",
                    2 => "weighted share: weight 2, achieved ÷ its weight's share (2/6)",
                    _ => "weighted share: weight 3, achieved ÷ its weight's share (3/6)",
                },
                "ratio",
                vec![share / expected],
            )
            .target("0.95–1.05")
        })
        .collect();
    figures.push(
        Figure::new(
            "weighted share: route max in any 1 s (limit 30)",
            "requests",
            vec![max_in_window(&all, Duration::from_secs(1)) as f64],
        )
        .target("<= 30"),
    );
    figures.push(
        Figure::new(
            "weighted share: 429s",
            "requests",
            vec![received.iter().filter(|r| r.status == 429).count() as f64],
        )
        .target("0"),
    );
    figures.push(
        Figure::new(
            "weighted share: route use while all three have work",
            "fraction of 30/s",
            vec![utilization(&sent, 30.0)],
        )
        .target(">= 0.97"),
    );
    Ok(figures)
}

/// The weight-raised part: the weight one tenant is raised to, and when.
const RAISED_TO: u32 = 5;
const RAISE_AFTER: Duration = Duration::from_secs(5);

/// The two tenants of the raised parts; a weight raise is for the first.
const RAISED: [&str; 2] = ["raised", "other"];

/// Two tenants of weight 1 (their own quotas 100/s) share a route of
/// `route`, each with a backlog of [`SHARE_BACKLOG`], on a provider that
/// allows `account` in any second; `change` is made to `target`
/// [`RAISE_AFTER`] after the backlogs are queued, while most of them are
/// parked for their places. What the provider received, when the backlogs
/// were queued, and when the change was made.
async fn changed_live(
    base: &Config,
    setting: Setting,
    (route, account): (&str, u32),
    target: tollgate_quota::Target,
    change: tollgate_quota::Change,
) -> anyhow::Result<(Vec<Received>, Instant, Instant)> {
    const LIMIT: Duration = Duration::from_secs(90);
    let rig = Rig::new(base, strict_account(account)).await?;
    set_route_quota(&rig, route).await?;
    for name in RAISED {
        rig.set_quota(name, "100/s", 1).await?;
    }
    let mut rig = rig;
    spawn_workers(&mut rig, setting, WORKERS).await?;
    for name in RAISED {
        rig.publish(name, SHARE_BACKLOG, None, "{}").await?;
    }
    let started = Instant::now();
    tokio::time::sleep(RAISE_AFTER).await;
    rig.store.apply(&target, change, &bench_actor()).await?;
    let changed_at = Instant::now();
    let received = wait_for_sends(&rig, 2 * SHARE_BACKLOG as usize, started, LIMIT).await;
    rig.cleanup().await?;
    Ok((received, started, changed_at))
}

/// Two tenants of weight 1 share a 30/s route, each with a backlog; one's
/// weight is raised live while most of both backlogs are parked for their
/// places. The route should stay full, the raised tenant get its new share
/// from about a second after the raise, and the other's backlog drain at
/// the whole route once the raised one is done.
async fn weight_raised(base: &Config, setting: Setting) -> anyhow::Result<Vec<Figure>> {
    progress(&format!(
        "sweep {setting}: a weight raised from 1 to {RAISED_TO} live on one 30/s route"
    ));
    let names = RAISED;
    let target = tollgate_quota::Target::Tenant(tollgate_core::TenantId::parse(names[0])?);
    let change = tollgate_quota::Change::SetWeight(RAISED_TO);
    let (received, started, raised_at) =
        changed_live(base, setting, ("30/s", 30), target, change).await?;
    let sent: Vec<&Received> = received.iter().filter(|r| r.status == 200).collect();
    // From a second after the raise (every parked job has asked once) to
    // the raised tenant's last send.
    let from = raised_at + Duration::from_secs(1);
    let until = times(&received, names[0]).into_iter().max().unwrap_or(from);
    let span: Vec<&Received> = sent
        .iter()
        .copied()
        .filter(|r| r.instant >= from && r.instant <= until)
        .collect();
    let raised = span.iter().filter(|r| r.tenant == names[0]).count() as f64;
    let expected = f64::from(RAISED_TO) / f64::from(RAISED_TO + 1);
    // Both backlogs at the route's rate, with the 2 % pacing margin.
    let ideal = 2.0 * f64::from(SHARE_BACKLOG) / 30.0 * 1.02;
    Ok(vec![
        Figure::new(
            "weight raised: route use from 1 s after the raise to the raised tenant's last send",
            "fraction of 30/s",
            vec![
                span.len() as f64
                    / (until.saturating_duration_since(from).as_secs_f64() * 30.0).max(1e-9),
            ],
        )
        .target(">= 0.97"),
        Figure::new(
            "weight raised: the raised tenant's sends over that span ÷ its new share (5/6)",
            "ratio",
            vec![raised / span.len().max(1) as f64 / expected],
        )
        .target("0.95–1.05"),
    ]
    .into_iter()
    .chain(drain_figures(
        [
            "weight raised: longest gap between two sends of the route",
            "weight raised: both backlogs drained ÷ the route's ideal",
            "weight raised: 429s",
        ],
        "< 1",
        &received,
        started,
        ideal,
    ))
    .collect())
}

/// The route-raised part: the route's quota before and after.
const ROUTE_BEFORE: u32 = 15;
const ROUTE_AFTER: u32 = 45;

/// Two tenants with backlogs share a route of 15/s, raised live to 45/s
/// while most of both backlogs are parked for places spaced for 15/s. The
/// route should run at its new rate within about a second (the parked jobs
/// hop back at least every `quota_recheck_ms`), never beyond it.
async fn route_raised(base: &Config, setting: Setting) -> anyhow::Result<Vec<Figure>> {
    progress(&format!(
        "sweep {setting}: a route raised from {ROUTE_BEFORE}/s to {ROUTE_AFTER}/s live"
    ));
    let target = tollgate_quota::Target::Route(tollgate_core::Kind::default_kind());
    let change = tollgate_quota::Change::SetQuota {
        quota: tollgate_core::Quota::new(format!("{ROUTE_AFTER}/s").parse()?, 1)?,
        concurrency: None,
        weight: None,
        adaptive: None,
    };
    let before = format!("{ROUTE_BEFORE}/s");
    let (received, started, raised_at) =
        changed_live(base, setting, (&before, ROUTE_AFTER), target, change).await?;
    let mut sent: Vec<Instant> = received
        .iter()
        .filter(|r| r.status == 200 && r.instant >= raised_at)
        .map(|r| r.instant)
        .collect();
    sent.sort_unstable();
    // The first second after the raise that holds 0.9 of the new rate.
    let window = (f64::from(ROUTE_AFTER) * 0.9).ceil() as usize;
    let reached = sent
        .windows(window)
        .find(|w| w[window - 1] - w[0] <= Duration::from_secs(1))
        .map_or(f64::INFINITY, |w| (w[window - 1] - raised_at).as_secs_f64());
    // From a second after the raise (every parked job has asked once) to
    // the first tenant's last send (the other alone may have fewer jobs
    // left than the route has room for).
    let from = raised_at + Duration::from_secs(1);
    let until = RAISED
        .iter()
        .filter_map(|name| times(&received, name).into_iter().max())
        .min()
        .unwrap_or(from);
    let span = sent.iter().filter(|&&t| t >= from && t <= until).count();
    // The route's rates before and after, with the 2 % pacing margin.
    let ahead = RAISE_AFTER.as_secs_f64();
    let before_raise = f64::from(ROUTE_BEFORE) * ahead / 1.02;
    let ideal =
        ahead + (2.0 * f64::from(SHARE_BACKLOG) - before_raise) / f64::from(ROUTE_AFTER) * 1.02;
    Ok(vec![
        Figure::new(
            "route raised: seconds from the raise until a second holds 0.9 of the new rate",
            "s",
            vec![reached],
        ),
        Figure::new(
            "route raised: route use from 1 s after the raise to the first tenant's last send",
            "fraction of 45/s",
            vec![
                span as f64
                    / (until.saturating_duration_since(from).as_secs_f64()
                        * f64::from(ROUTE_AFTER))
                    .max(1e-9),
            ],
        )
        .target(">= 0.97"),
    ]
    .into_iter()
    .chain(drain_figures(
        [
            "route raised: longest gap between two sends of the route",
            "route raised: both backlogs drained ÷ the ideal (5 s at 15/s, then 45/s)",
            "route raised: 429s",
        ],
        "< 1",
        &received,
        started,
        ideal,
    ))
    .collect())
}

/// The priority part: a low backlog, then as many normal and high jobs
/// each, this long after.
const LOW_BACKLOG: u32 = 200;
const URGENT: u32 = 20;
const URGENT_AFTER: Duration = Duration::from_secs(2);

/// One tenant's backlog of low-priority jobs, parked for their places, then
/// normal and high jobs: the higher classes go first, in order, and the low
/// jobs they displaced take the room made for them, so the tenant's quota
/// stays in use.
async fn priority(base: &Config, setting: Setting) -> anyhow::Result<Vec<Figure>> {
    use tollgate_core::Priority;
    const LIMIT: Duration = Duration::from_secs(90);
    const TENANT: &str = "classes";
    progress(&format!(
        "sweep {setting}: {LOW_BACKLOG} low jobs, then {URGENT} normal and {URGENT} high, at 10/s"
    ));
    let rig = Rig::new(
        base,
        strict_limits(HashMap::from([(TENANT.to_owned(), 10)])),
    )
    .await?;
    rig.set_quota(TENANT, "10/s", 1).await?;
    let mut rig = rig;
    spawn_workers(&mut rig, setting, WORKERS).await?;
    let publish = |priority: Priority, count: u32| tollgate::cli::PublishArgs {
        priority,
        payload: format!(r#"{{"class":"{}"}}"#, priority.as_str()),
        ..tollgate::cli::PublishArgs::new(TENANT, count)
    };
    rig.publish_args(publish(Priority::Low, LOW_BACKLOG))
        .await?;
    let started = Instant::now();
    tokio::time::sleep(URGENT_AFTER).await;
    rig.publish_args(publish(Priority::Normal, URGENT)).await?;
    rig.publish_args(publish(Priority::High, URGENT)).await?;
    let total = (LOW_BACKLOG + 2 * URGENT) as usize;
    let received = wait_for_sends(&rig, total, started, LIMIT).await;
    rig.cleanup().await?;
    let mut sent: Vec<&Received> = received.iter().filter(|r| r.status == 200).collect();
    sent.sort_by_key(|r| r.instant);
    // The order the classes are served in: high, normal, low.
    let rank = |r: &Received| {
        [Priority::High, Priority::Normal, Priority::Low]
            .into_iter()
            .position(|p| r.body.contains(&format!(r#""{}""#, p.as_str())))
    };
    // Out of order: a send while a job of a class served before its own
    // was still to go. From a second after the normal and high jobs were
    // published: low jobs reserved before they came go out first.
    let settled = URGENT_AFTER + Duration::from_secs(1);
    let out_of_order = sent
        .iter()
        .enumerate()
        .filter(|(i, r)| {
            r.instant.duration_since(started) >= settled
                && sent[i + 1..].iter().any(|s| rank(s) < rank(r))
        })
        .count();
    // Every job at the quota, with the 2 % pacing margin.
    let ideal = total as f64 / 10.0 * 1.02;
    Ok(vec![
        Figure::new(
            "priority: sends of a class while an earlier class's published job waited",
            "requests",
            vec![out_of_order as f64],
        )
        .target("0"),
    ]
    .into_iter()
    .chain(drain_figures(
        [
            "priority: longest gap between two of the tenant's sends",
            "priority: all drained ÷ the quota's ideal",
            "priority: 429s",
        ],
        "< 0.5",
        &received,
        started,
        ideal,
    ))
    .collect())
}

/// Waits until the provider accepted `total` requests, or `limit` from
/// `started`; returns what it received.
async fn wait_for_sends(
    rig: &Rig,
    total: usize,
    started: Instant,
    limit: Duration,
) -> Vec<Received> {
    let accepted = |received: &[Received]| received.iter().filter(|r| r.status == 200).count();
    while accepted(&rig.provider.received()) < total && started.elapsed() < limit {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    rig.provider.received()
}

/// A drain's figures, named `names`: the longest gap between two accepted
/// sends, when the last went out (from `started`) ÷ `ideal` seconds, and
/// the 429s.
fn drain_figures(
    names: [&'static str; 3],
    gap_target: &'static str,
    received: &[Received],
    started: Instant,
    ideal: f64,
) -> [Figure; 3] {
    let mut sent: Vec<Instant> = received
        .iter()
        .filter(|r| r.status == 200)
        .map(|r| r.instant)
        .collect();
    sent.sort_unstable();
    let longest_gap = sent
        .windows(2)
        .map(|w| w[1] - w[0])
        .max()
        .unwrap_or_default();
    let drained = sent
        .last()
        .map(|last| last.duration_since(started).as_secs_f64());
    [
        Figure::new(names[0], "seconds", vec![longest_gap.as_secs_f64()]).target(gap_target),
        Figure::new(
            names[1],
            "ratio",
            vec![drained.map_or(f64::INFINITY, |d| d / ideal)],
        )
        .target("<= 1.1"),
        Figure::new(
            names[2],
            "requests",
            vec![received.iter().filter(|r| r.status == 429).count() as f64],
        )
        .target("0"),
    ]
}
