//! Fairness and precision: a noisy tenant's backlog against a quiet tenant,
//! parks per sent job of a backlog, and due lag of scheduled jobs.

use std::time::{Duration, Instant};

use serde_json::json;
use tollgate_core::UnixMillis;

use super::rig::Rig;
use super::{Figure, Scenario, percentile, progress};
use crate::fake_provider::{always_ok, max_in_window};
use tollgate::config::Config;
use tollgate_runtime::metrics::Metrics;

pub async fn run(base: &Config) -> anyhow::Result<Vec<Scenario>> {
    Ok(vec![
        noisy_neighbour(base).await?,
        due_precision(base).await?,
    ])
}

/// Lateness (ms) of each job's first request after its due reference.
pub(super) fn lags_ms(
    received: &[crate::fake_provider::Received],
    due: &[(String, UnixMillis)],
) -> Vec<f64> {
    due.iter()
        .filter_map(|(id, at)| {
            received
                .iter()
                .find(|r| &r.job_id == id)
                .map(|r| (r.at.0 - at.0) as f64)
        })
        .collect()
}

/// Publishes one job for each of `tenants` every 0.5 s for `seconds`;
/// returns, per tenant, (id, publish time).
async fn quiet_traffic(
    rig: &Rig,
    tenants: &[&str],
    seconds: u64,
) -> anyhow::Result<Vec<Vec<(String, UnixMillis)>>> {
    let mut quiet = vec![Vec::new(); tenants.len()];
    for _ in 0..seconds * 2 {
        for (tenant, sent) in tenants.iter().zip(&mut quiet) {
            let (jobs, at) = rig.publish(tenant, 1, None, "{}").await?;
            sent.extend(jobs.into_iter().map(|j| (j.id.to_string(), at)));
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    Ok(quiet)
}

async fn noisy_neighbour(base: &Config) -> anyhow::Result<Scenario> {
    const SECONDS: u64 = 30;
    progress(
        "noisy neighbour: 3000 jobs at 10/s against one job every 0.5 s at 100/s, two workers",
    );
    let mut rig = Rig::new(base, always_ok()).await?;
    // One quiet tenant on another work queue than the noisy one, and one on
    // the same queue, where it waits behind the noisy backlog's first pass.
    let noisy_shard = rig.shard_of("noisy").await?;
    let apart = rig.tenant_where("quiet", |s| s != noisy_shard).await?;
    let beside = rig.tenant_where("beside", |s| s == noisy_shard).await?;
    rig.set_quota("noisy", "10/s", 1).await?;
    for quiet in [&apart, &beside] {
        rig.set_quota(quiet, "100/s", 1).await?;
    }
    let metrics = Metrics::new(50, &[]);
    rig.spawn_inprocess(&metrics).await?;
    rig.spawn_inprocess(&metrics).await?;
    rig.publish("noisy", 3000, None, "{}").await?;
    let quiet = quiet_traffic(&rig, &[&apart, &beside], SECONDS).await?;
    rig.until_accepted(1, Duration::from_secs(5)).await?;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let received = rig.provider.received();
    let noisy: Vec<Instant> = received
        .iter()
        .filter(|r| r.tenant == "noisy")
        .map(|r| r.instant)
        .collect();
    let lags = lags_ms(&received, &quiet[0]);
    let beside_lags = lags_ms(&received, &quiet[1]);
    let lost = quiet.iter().map(Vec::len).sum::<usize>() - lags.len() - beside_lags.len();
    rig.cleanup().await?;

    progress(
        "parks per sent job: 600 jobs at 20/s drained to the end, with the quiet tenant beside it",
    );
    let mut rig = Rig::new(base, always_ok()).await?;
    rig.set_quota("noisy", "20/s", 1).await?;
    rig.set_quota("quiet", "100/s", 1).await?;
    let metrics = Metrics::new(50, &[]);
    rig.spawn_inprocess(&metrics).await?;
    rig.spawn_inprocess(&metrics).await?;
    rig.publish("noisy", 600, None, "{}").await?;
    let quiet_during = quiet_traffic(&rig, &["quiet"], 30).await?;
    rig.until_accepted(600 + quiet_during[0].len(), Duration::from_secs(60))
        .await?;
    let parks = metrics.counter_sum("tollgate_parked_total", &[("tenant", "noisy")]);
    let hops: f64 = metrics.counter_sum("tollgate_tier_publishes_total", &[]);
    let sent = metrics.counter_sum(
        "tollgate_jobs_completed_total",
        &[("tenant", "noisy"), ("outcome", "sent")],
    );
    rig.cleanup().await?;

    Ok(Scenario {
        key: "noisy_neighbour",
        title: "Noisy neighbour",
        parameters: json!({
            "workers": 2, "shards": base.shards,
            "noisy": "3000 jobs published at once, quota 10/s burst 1",
            "quiet": format!(
                "two tenants, one job each every 0.5 s for {SECONDS} s, quota 100/s: \
                 {apart} on another work queue than the noisy tenant, {beside} on the same one"
            ),
            "parks_run": "noisy 600 jobs at 20/s drained to the end, beside one quiet tenant (one job every 0.5 s, 100/s)",
        }),
        figures: vec![
            Figure::new(
                "quiet tenant due lag p50",
                "ms",
                vec![percentile(&lags, 0.5)],
            ),
            Figure::new(
                "quiet tenant due lag p99",
                "ms",
                vec![percentile(&lags, 0.99)],
            )
            .target("< 1000"),
            Figure::new(
                "quiet tenant due lag max",
                "ms",
                vec![percentile(&lags, 1.0)],
            ),
            Figure::new(
                "same-queue quiet tenant due lag p50",
                "ms",
                vec![percentile(&beside_lags, 0.5)],
            ),
            Figure::new(
                "same-queue quiet tenant due lag p99",
                "ms",
                vec![percentile(&beside_lags, 0.99)],
            )
            .target("< 1000"),
            Figure::new(
                "same-queue quiet tenant due lag max",
                "ms",
                vec![percentile(&beside_lags, 1.0)],
            ),
            Figure::new("quiet jobs not sent by the end", "jobs", vec![lost as f64]).target("0"),
            Figure::new(
                "noisy: max requests in any 1 s",
                "requests",
                vec![max_in_window(&noisy, Duration::from_secs(1)) as f64],
            )
            .target("<= 10"),
            Figure::new("noisy: parks per sent job", "parks/job", vec![parks / sent])
                .target("<= 1.5"),
            Figure::new(
                "tier publishes per sent job (hops, both tenants)",
                "hops/job",
                vec![hops / sent],
            ),
        ],
    })
}

/// `n` due offsets, uniform over 1–10 s, the same sequence on every run
/// (and for the peer).
pub(super) fn due_offsets(n: u64) -> Vec<Duration> {
    let mut seed: u64 = 0x5eed;
    (0..n)
        .map(|_| {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            Duration::from_millis(1_000 + (seed >> 33) % 9_000)
        })
        .collect()
}

async fn due_precision(base: &Config) -> anyhow::Result<Scenario> {
    const JOBS: u64 = 100;
    progress("due precision: 100 jobs due 1–10 s ahead at light load");
    let mut rig = Rig::new(base, always_ok()).await?;
    rig.set_quota("cron", "100/s", 10).await?;
    let metrics = Metrics::new(50, &[]);
    rig.spawn_inprocess(&metrics).await?;
    let mut due = Vec::new();
    for due_in in due_offsets(JOBS) {
        let (jobs, _) = rig.publish("cron", 1, Some(due_in), "{}").await?;
        due.extend(
            jobs.into_iter()
                .map(|j| (j.id.to_string(), j.due_at.expect("scheduled"))),
        );
    }
    rig.until_accepted(JOBS as usize, Duration::from_secs(30))
        .await?;
    let lags = lags_ms(&rig.provider.received(), &due);
    let early = lags.iter().filter(|&&l| l < 0.0).count();
    rig.cleanup().await?;
    Ok(Scenario {
        key: "due_precision",
        title: "Due precision at light load",
        parameters: json!({ "jobs": JOBS, "due_in": "uniform 1–10 s", "quota": "100/s burst 10", "workers": 1 }),
        figures: vec![
            Figure::new("due lag p50", "ms", vec![percentile(&lags, 0.5)]),
            Figure::new("due lag p99", "ms", vec![percentile(&lags, 0.99)]).target("< 100"),
            Figure::new("sent before due", "jobs", vec![early as f64]).target("0"),
        ],
    })
}
