//! Quota adherence of a fleet, and how fast a live quota change is obeyed.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use serde_json::json;

use super::rig::Rig;
use super::{Figure, Scenario, progress};
use crate::fake_provider::{Received, always_ok, max_in_window, strict_limits};
use tollgate::config::Config;

pub async fn run(base: &Config) -> anyhow::Result<Vec<Scenario>> {
    Ok(vec![adherence(base).await?, live_change(base).await?])
}

/// Accepted requests per second over the span of the accepted requests,
/// as a fraction of `quota_per_s`.
pub(super) fn utilization(received: &[&Received], quota_per_s: f64) -> f64 {
    let ok: Vec<Instant> = received
        .iter()
        .filter(|r| r.status == 200)
        .map(|r| r.instant)
        .collect();
    match (ok.first(), ok.last()) {
        (Some(a), Some(b)) if ok.len() > 1 => {
            (ok.len() - 1) as f64 / b.duration_since(*a).as_secs_f64() / quota_per_s
        }
        _ => 0.0,
    }
}

async fn adherence(base: &Config) -> anyhow::Result<Scenario> {
    const PROCESSES: usize = 8;
    const JOBS: u32 = 400;
    progress(&format!(
        "adherence: {PROCESSES} worker processes, one tenant at 20/s burst 1, {JOBS}-job backlog"
    ));
    let strict = strict_limits(HashMap::from([("fleet".to_owned(), 20)]));
    let mut rig = Rig::new(base, strict).await?;
    rig.set_quota("fleet", "20/s", 1).await?;
    for _ in 0..PROCESSES {
        rig.spawn_process(&[]).await?;
    }
    rig.publish("fleet", JOBS, None, "{}").await?;
    rig.until_accepted(JOBS as usize, Duration::from_secs(120))
        .await?;
    let received = rig.provider.received();
    rig.cleanup().await?;
    Ok(Scenario {
        key: "adherence",
        title: "Quota adherence: 8 worker processes share one tenant quota",
        parameters: json!({
            "worker_processes": PROCESSES, "quota": "20/s burst 1", "backlog": JOBS,
            "provider": "strict: 429 beyond 20 accepted in any sliding second",
        }),
        figures: adherence_figures(&received),
    })
}

pub(super) const MAX_IN_1S: &str = "max requests in any 1 s window";
pub(super) const OVER_QUOTA: &str = "over-quota requests (429 from the strict provider)";
pub(super) const UTILIZATION: &str = "utilization of the quota while the backlog lasts";

/// What the strict provider saw of a fleet sharing one 20/s quota: the
/// busiest second, the 429s, and how much of the quota was used.
pub(super) fn adherence_figures(received: &[Received]) -> Vec<Figure> {
    let all: Vec<&Received> = received.iter().collect();
    let times: Vec<Instant> = all.iter().map(|r| r.instant).collect();
    let over = all.iter().filter(|r| r.status == 429).count();
    let busiest = max_in_window(&times, Duration::from_secs(1));
    vec![
        Figure::new(MAX_IN_1S, "requests", vec![busiest as f64]).target("<= 20"),
        Figure::new(OVER_QUOTA, "requests", vec![over as f64]).target("0"),
        Figure::new(UTILIZATION, "fraction", vec![utilization(&all, 20.0)]).target(">= 0.97"),
    ]
}

/// Seconds from `changed` until consecutive sends are spaced at the new
/// interval: the second send of the last pair closer than 90 % of it.
fn obeys_after(sends: &[Instant], changed: Instant, until: Instant, interval: Duration) -> f64 {
    let after: Vec<Instant> = sends
        .iter()
        .copied()
        .filter(|&t| t >= changed && t < until)
        .collect();
    let last_fast = after
        .windows(2)
        .filter(|w| w[1].duration_since(w[0]) < interval.mul_f64(0.9))
        .map(|w| w[1])
        .next_back();
    last_fast
        .map(|t| t.duration_since(changed).as_secs_f64())
        .unwrap_or(0.0)
}

/// Seconds from `changed` until some 1 s window holds `target` sends.
fn reaches_after(sends: &[Instant], changed: Instant, target: usize) -> f64 {
    let after: Vec<Instant> = sends.iter().copied().filter(|&t| t >= changed).collect();
    let mut start = 0;
    for end in 0..after.len() {
        while after[end].duration_since(after[start]) >= Duration::from_secs(1) {
            start += 1;
        }
        if end - start + 1 >= target {
            return after[end].duration_since(changed).as_secs_f64();
        }
    }
    f64::NAN
}

async fn live_change(base: &Config) -> anyhow::Result<Scenario> {
    progress("live change: 20/s → 5/s → 20/s on two worker processes with a backlog");
    let mut rig = Rig::new(base, always_ok()).await?;
    rig.set_quota("live", "20/s", 1).await?;
    rig.spawn_process(&[]).await?;
    rig.spawn_process(&[]).await?;
    rig.publish("live", 1000, None, "{}").await?;
    rig.until_accepted(60, Duration::from_secs(30)).await?;
    let lowered = Instant::now();
    rig.set_quota("live", "5/s", 1).await?;
    tokio::time::sleep(Duration::from_secs(8)).await;
    let raised = Instant::now();
    rig.set_quota("live", "20/s", 1).await?;
    tokio::time::sleep(Duration::from_secs(12)).await;
    let sends: Vec<Instant> = rig.provider.received().iter().map(|r| r.instant).collect();
    rig.cleanup().await?;
    let lower = obeys_after(&sends, lowered, raised, Duration::from_millis(200));
    let raise = reaches_after(&sends, raised, 18);
    Ok(Scenario {
        key: "live_change",
        title: "Live quota change",
        parameters: json!({
            "worker_processes": 2, "backlog": 1000,
            "steps": "20/s, then 5/s for 8 s, then 20/s again",
            "lowered_obeyed": "last pair of sends closer than 90 % of the new 200 ms interval",
            "raised_obeyed": "first 1 s window with 18 sends (90 % of 20/s)",
        }),
        figures: vec![
            Figure::new(
                "seconds from quota set (lowered) to the fleet obeying",
                "s",
                vec![lower],
            )
            .target("< 1"),
            Figure::new(
                "seconds from quota set (raised) to 90 % of the new rate",
                "s",
                vec![raise],
            ),
        ],
    })
}
