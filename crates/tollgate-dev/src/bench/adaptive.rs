//! Adaptive quotas against a provider whose real limit is not the one
//! configured and changes without notice: 8/s, then 12/s, then 4/s, while
//! the quota says 20/s. The same run compares a fixed quota at 20/s (what
//! the operator configured) and one set exactly at 8/s (what a perfect
//! operator would have guessed for the first phase).

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use serde_json::json;
use tollgate_core::{Adaptive, DelayTiers, Quota, TenantId};
use tollgate_quota::{Actor, Change, Target};

use super::rig::Rig;
use super::{Figure, Scenario, progress};
use crate::fake_provider::{Received, strict_live_limit};
use tollgate::config::Config;

const PROCESSES: usize = 4;
const BACKLOG: u32 = 2_000;
const TENANT: &str = "learner";
/// The provider's real limit, per second, and for how long. The first
/// phase's settled part (below) spans several probe cycles (one failed
/// probe every 17–20 s at the defaults): a 30 s window held one or two of
/// them depending on where the cycle fell, which halved or doubled its
/// 429s on phase alone.
const PHASES: [(u32, u64); 3] = [(8, 90), (12, 40), (4, 30)];
/// The first phase's steady part: from this many seconds into it to its end.
const SETTLED_AFTER: u64 = 30;
/// Windows over which the achieved rate is judged.
const WINDOW: Duration = Duration::from_secs(5);

/// The three quotas compared in one run.
#[derive(Clone, Copy)]
enum Setting {
    Adaptive,
    Fixed(&'static str),
}

impl Setting {
    fn key(self) -> &'static str {
        match self {
            Setting::Adaptive => "adaptive_learned",
            Setting::Fixed("20/s") => "adaptive_fixed_20",
            Setting::Fixed(_) => "adaptive_fixed_8",
        }
    }

    fn title(self) -> &'static str {
        match self {
            Setting::Adaptive => "Adaptive quota: 20/s ceiling, provider allows 8 → 12 → 4/s",
            Setting::Fixed("20/s") => {
                "Fixed quota at 20/s (as configured), provider allows 8 → 12 → 4/s"
            }
            Setting::Fixed(_) => {
                "Fixed quota at 8/s (right for the first phase only), provider allows 8 → 12 → 4/s"
            }
        }
    }
}

/// The settings compared, in the order they run.
const SETTINGS: [Setting; 3] = [
    Setting::Adaptive,
    Setting::Fixed("20/s"),
    Setting::Fixed("8/s"),
];

/// The scenario keys `--only` may name here.
pub fn keys() -> impl Iterator<Item = String> {
    SETTINGS.into_iter().map(|s| s.key().to_owned())
}

/// Each setting `wanted` says yes to (by its scenario key).
pub async fn run(base: &Config, wanted: impl Fn(&str) -> bool) -> anyhow::Result<Vec<Scenario>> {
    let mut out = Vec::new();
    for setting in SETTINGS {
        if wanted(setting.key()) {
            out.push(one(base, setting).await?);
        }
    }
    Ok(out)
}

async fn one(base: &Config, setting: Setting) -> anyhow::Result<Scenario> {
    progress(&format!(
        "{}: {PROCESSES} worker processes, {BACKLOG}-job backlog",
        setting.title()
    ));
    let limit = Arc::new(AtomicU32::new(PHASES[0].0));
    let mut rig = Rig::new(base, strict_live_limit(TENANT, Arc::clone(&limit))).await?;
    let (rate, adaptive) = match setting {
        Setting::Adaptive => {
            let ceiling = "20/s".parse()?;
            (
                "20/s",
                Some(Adaptive::new(ceiling, None, None, None, None)?),
            )
        }
        Setting::Fixed(rate) => (rate, None),
    };
    let target = Target::Tenant(TenantId::parse(TENANT)?);
    let change = Change::SetQuota {
        quota: Quota::parse(rate, 1)?,
        concurrency: None,
        weight: None,
        adaptive,
    };
    let actor = Actor {
        who: "bench".into(),
        source: "cli",
    };
    rig.store.apply(&target, change, &actor).await?;
    let mut ports = Vec::new();
    for _ in 0..PROCESSES {
        ports.push(rig.spawn_process(&[]).await?.http_port);
    }
    // Parks per tier over the fleet, for the per-second trace: herds of
    // copies coming back from a tier show as spikes. The tiers up to 2 m
    // (the longest a quota wait here takes).
    let traced: Vec<String> = base
        .delay_tiers_ms
        .iter()
        .filter(|&&ms| ms <= 120_000)
        .map(|&ms| DelayTiers::name(Duration::from_millis(ms)))
        .collect();
    let parks = async |ports: &[u16]| -> Vec<f64> {
        let mut by_tier = vec![0.0; traced.len()];
        for &port in ports {
            let Ok(page) = super::rig::metrics_page(port).await else {
                continue;
            };
            for (i, tier) in traced.iter().enumerate() {
                by_tier[i] +=
                    page.sum(&format!("tollgate_tier_publishes_total{{tier=\"{tier}\"}}"));
            }
        }
        by_tier
    };
    let mut parked_before = parks(&ports).await;
    rig.publish(TENANT, BACKLOG, None, "{}").await?;
    rig.until_accepted(1, Duration::from_secs(30)).await?;
    let start = Instant::now();
    let mut changes = vec![start];
    let mut learned = vec![];
    for (i, &(per_s, secs)) in PHASES.iter().enumerate() {
        if i > 0 {
            limit.store(per_s, Ordering::Relaxed);
            changes.push(Instant::now());
        }
        // Each second: the learned rate, and what the provider saw in it.
        // Seconds counted from the phase's start, so the trace's own work
        // does not stretch the phase.
        let phase_start = tokio::time::Instant::now();
        for second in 1..=secs {
            tokio::time::sleep_until(phase_start + Duration::from_secs(second)).await;
            let effective = rig.store.get(&target).await?.and_then(|s| s.effective);
            let now = Instant::now();
            let last: Vec<Received> = rig
                .provider
                .received()
                .into_iter()
                .filter(|r| now.duration_since(r.instant) < Duration::from_secs(1))
                .collect();
            let parked = parks(&ports).await;
            let hops: Vec<String> = parked
                .iter()
                .zip(&parked_before)
                .map(|(now, before)| format!("{}", now - before))
                .collect();
            parked_before = parked;
            progress(&format!(
                "  {:>5.1} s  provider allows {per_s}/s  effective {}  accepted {}  429s {}  \
                 parks {}: {}",
                now.duration_since(start).as_secs_f64(),
                effective.map_or("-".into(), tollgate_quota::per_second),
                last.iter().filter(|r| r.status == 200).count(),
                last.iter().filter(|r| r.status == 429).count(),
                traced.join("/"),
                hops.join("/"),
            ));
        }
        let effective = rig.store.get(&target).await?.and_then(|s| s.effective);
        learned.push(effective.unwrap_or(f64::NAN));
    }
    let received = rig.provider.received();
    rig.cleanup().await?;

    let phase = |i: usize| {
        let from = changes[i];
        let until = from + Duration::from_secs(PHASES[i].1);
        (from, until, f64::from(PHASES[i].0))
    };
    let mut figures = Vec::new();
    let (from, until, limit_0) = phase(0);
    let settled = from + Duration::from_secs(SETTLED_AFTER);
    figures.push(
        Figure::new(
            "seconds until 5 s at ≥ 90 % of the provider's 8/s without a 429",
            "s",
            vec![tracked_after(&received, from, until, limit_0)],
        )
        .target("<= 30"),
    );
    figures.push(
        Figure::new(
            "429s per 100 sends once settled (30–90 s)",
            "per 100",
            vec![throttled_per_100(&received, settled, until)],
        )
        .target("< 1"),
    );
    figures.push(
        Figure::new(
            "achieved ÷ the provider's limit once settled (30–90 s)",
            "ratio",
            vec![achieved(&received, settled, until) / limit_0],
        )
        .target(">= 0.9"),
    );
    for (i, name, name_ratio) in [
        (
            1,
            "seconds to track the raise to 12/s (5 s at ≥ 90 % of it without a 429)",
            "achieved ÷ the provider's 12/s in the raise's last 10 s",
        ),
        (
            2,
            "seconds to track the fall to 4/s (5 s at ≥ 90 % of it without a 429)",
            "achieved ÷ the provider's 4/s in the fall's last 10 s",
        ),
    ] {
        let (from, until, limit) = phase(i);
        figures.push(
            Figure::new(
                name,
                "s",
                vec![tracked_after(&received, from, until, limit)],
            )
            .target("<= 30"),
        );
        figures.push(Figure::new(
            name_ratio,
            "ratio",
            vec![achieved(&received, until - Duration::from_secs(10), until) / limit],
        ));
    }
    figures.push(Figure::new(
        "429s per 100 sends over the whole run",
        "per 100",
        vec![throttled_per_100(&received, changes[0], phase(2).1)],
    ));
    let learned_names = [
        "effective rate at the end of the 8/s phase",
        "effective rate at the end of the 12/s phase",
        "effective rate at the end of the 4/s phase",
    ];
    if matches!(setting, Setting::Adaptive) {
        for (name, rate) in learned_names.into_iter().zip(learned) {
            figures.push(Figure::new(name, "per s", vec![rate]));
        }
    }
    Ok(Scenario {
        key: setting.key(),
        title: setting.title(),
        parameters: json!({
            "worker_processes": PROCESSES, "backlog": BACKLOG, "quota": rate,
            "adaptive": adaptive.map(|a| a.to_string()),
            "provider": "strict: 429 (Retry-After: 1) beyond its limit in any sliding second; limit 8/s for 90 s, 12/s for 40 s, 4/s for 30 s",
            "tracked": "the end of the first 5 s window after the change with accepted sends ≥ 90 % of the limit and no 429",
        }),
        figures,
    })
}

fn between(
    received: &[Received],
    from: Instant,
    until: Instant,
) -> impl Iterator<Item = &Received> {
    received
        .iter()
        .filter(move |r| r.instant >= from && r.instant < until)
}

/// Accepted sends per second between `from` and `until`.
fn achieved(received: &[Received], from: Instant, until: Instant) -> f64 {
    let ok = between(received, from, until)
        .filter(|r| r.status == 200)
        .count();
    ok as f64 / until.duration_since(from).as_secs_f64()
}

fn throttled_per_100(received: &[Received], from: Instant, until: Instant) -> f64 {
    let (mut ok, mut throttled) = (0, 0);
    for r in between(received, from, until) {
        match r.status {
            200 => ok += 1,
            429 => throttled += 1,
            _ => {}
        }
    }
    100.0 * throttled as f64 / f64::from(ok.max(1))
}

/// Seconds from `from` to the end of the first [`WINDOW`] (sliding by
/// 100 ms) with accepted sends at ≥ 90 % of `limit` and no 429; NaN if
/// none before `until`.
fn tracked_after(received: &[Received], from: Instant, until: Instant, limit: f64) -> f64 {
    let mut start = from;
    while start + WINDOW <= until {
        let end = start + WINDOW;
        let window: Vec<&Received> = between(received, start, end).collect();
        let ok = window.iter().filter(|r| r.status == 200).count();
        let throttled = window.iter().any(|r| r.status == 429);
        if !throttled && ok as f64 >= 0.9 * limit * WINDOW.as_secs_f64() {
            return end.duration_since(from).as_secs_f64();
        }
        start += Duration::from_millis(100);
    }
    f64::NAN
}
