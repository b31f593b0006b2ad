//! `tollgate-dev bench`: figures measured side by side on the same machine in
//! the same run, written to `target/bench/report.json` and `report.md`.
//! This machine is shared and noisy, so repeated figures are reported as
//! median, min and max, and comparisons as ratios measured in one run.
//!
//! Scenarios (each its own module):
//! - `throughput`: a bare lapin consume→ack loop vs one tollgate worker
//!   process with an unlimited quota and an instant provider; Redis round
//!   trips per job, jobs per CPU-second, peak RSS holding a full prefetch.
//! - `permits`: the permit script vs a trivial `EVALSHA`; round trips per
//!   decision.
//! - `redis_cost`: instructions Redis executes for a permit decision and a
//!   completion (a private `redis-server` under callgrind; skipped without
//!   valgrind).
//! - `pacing`: 8 worker processes on one 20/s quota against a strict
//!   provider (adherence, utilization); seconds from `quota set` to the
//!   fleet obeying a lowered and a raised quota.
//! - `fairness`: a noisy neighbour's effect on a quiet tenant, parks per
//!   sent job of a backlog, due precision of scheduled jobs.
//! - `sweep`: the noisy neighbour (quiet tenants on the noisy queue and on
//!   another), scheduled jobs, the 8-process adherence and 200 tenants at
//!   once, with worker processes at `TOLLGATE_CONCURRENCY` 4, 16, 64, 256.
//! - `adaptive`: an adaptive quota (20/s ceiling) against a provider that
//!   allows 8/s, then 12/s, then 4/s, beside fixed quotas at 20/s and 8/s.
//! - `peer`: the peers, each through the throughput, adherence,
//!   noisy-neighbour and due-precision scenarios, their figures set beside
//!   tollgate's in one comparison table (tollgate vs Dramatiq vs BullMQ):
//!   `peer_dramatiq` (scenario keys `peer_*`), Dramatiq (from PyPI,
//!   installed into a venv under `target/`) with its RabbitMQ broker and a
//!   Redis-backed rate limiter per tenant; `peer_bullmq` (keys
//!   `peer_bullmq_*`), BullMQ (from npm, `npm ci` of a committed lockfile
//!   into `target/bench-node`) on Redis alone, with a queue and its rate
//!   limit per tenant.

mod adaptive;
mod fairness;
mod pacing;
mod peer;
mod permits;
mod pipeline;
mod redis_cost;
mod rig;
mod sweep;
mod throughput;

/// A worker's counter or gauge from its /metrics (the tests read them too).
pub use rig::scrape;

use std::borrow::Cow;
use std::path::PathBuf;

use anyhow::Context;
use clap::Args;
use serde_json::json;

use tollgate::config::Config;

#[derive(Debug, Args)]
pub struct BenchArgs {
    /// Jobs per throughput run.
    #[arg(long, default_value_t = 10_000)]
    pub jobs: u32,
    /// Repetitions of the throughput and permit-path runs.
    #[arg(long, default_value_t = 3)]
    pub runs: usize,
    /// Seconds per permit-path measurement.
    #[arg(long, default_value_t = 3)]
    pub permit_seconds: u64,
    /// Only these scenarios (throughput, pipeline, permits, pacing,
    /// fairness, sweep, adaptive, peer; or one point of the pipeline comparison:
    /// pipeline_p4, pipeline_p16, pipeline_p64, pipeline_p256; or of the
    /// sweep: sweep_c4, sweep_c16, sweep_c64, sweep_c256, sweep_p4, or one
    /// part of a point: sweep_c64.noisy_neighbour, .parks, .scheduled,
    /// .adherence, .many_tenants, .thousand_tenants, .weighted_share,
    /// .weight_raised, .route_raised, .priority, .quota_below_share,
    /// .shared_account; or one quota of the adaptive comparison:
    /// adaptive_learned, adaptive_fixed_20, adaptive_fixed_8; or one peer:
    /// peer_dramatiq, peer_bullmq). `peer` runs both peers.
    #[arg(long, value_delimiter = ',')]
    pub only: Vec<String>,
    /// Where report.json and report.md go.
    #[arg(long, default_value = "target/bench")]
    pub out: PathBuf,
    /// The venv the Dramatiq peer is installed into (created if missing).
    #[arg(long, default_value = "target/bench-venv")]
    pub peer_venv: PathBuf,
    /// The directory the BullMQ peer is installed into with `npm ci`
    /// (created if missing; reinstalled when its lockfile changed).
    #[arg(long, default_value = "target/bench-node")]
    pub peer_node_dir: PathBuf,
}

/// One measured figure: its samples, unit and target.
pub struct Figure {
    pub name: Cow<'static, str>,
    pub unit: &'static str,
    pub samples: Vec<f64>,
    pub target: Option<Cow<'static, str>>,
}

impl Figure {
    pub fn new(name: impl Into<Cow<'static, str>>, unit: &'static str, samples: Vec<f64>) -> Self {
        Self {
            name: name.into(),
            unit,
            samples,
            target: None,
        }
    }

    pub fn target(mut self, target: impl Into<Cow<'static, str>>) -> Self {
        self.target = Some(target.into());
        self
    }

    /// The median of the samples.
    pub fn median(&self) -> f64 {
        let mut s = self.samples.clone();
        s.sort_by(f64::total_cmp);
        median(&s)
    }

    fn json(&self) -> serde_json::Value {
        let mut s = self.samples.clone();
        s.sort_by(f64::total_cmp);
        json!({
            "unit": self.unit,
            "median": round(median(&s)),
            "min": round(s.first().copied().unwrap_or(f64::NAN)),
            "max": round(s.last().copied().unwrap_or(f64::NAN)),
            "samples": s.iter().map(|v| round(*v)).collect::<Vec<_>>(),
            "target": self.target,
        })
    }
}

/// A scenario's parameters and figures.
pub struct Scenario {
    pub key: &'static str,
    pub title: &'static str,
    pub parameters: serde_json::Value,
    pub figures: Vec<Figure>,
}

/// A figure measured by at least two sides in this run: tollgate's median
/// and each peer's, where it ran.
pub struct Compared {
    pub scenario: &'static str,
    pub figure: &'static str,
    pub unit: &'static str,
    pub tollgate: Option<f64>,
    /// In [`peer::Framework::ALL`] order.
    pub peers: [Option<f64>; peer::Framework::ALL.len()],
}

impl Compared {
    /// A peer's median / tollgate's, when that means something.
    fn ratio(&self, peer: usize) -> Option<f64> {
        let (t, p) = (self.tollgate?, self.peers[peer]?);
        let r = p / t;
        (t != 0.0 && r.is_finite()).then_some(r)
    }

    fn json(&self) -> serde_json::Value {
        let mut j = json!({
            "scenario": self.scenario, "figure": self.figure, "unit": self.unit,
            "tollgate": self.tollgate.map(round),
        });
        for (i, f) in peer::Framework::ALL.into_iter().enumerate() {
            let id = peer::id(f);
            j[id] = json!(self.peers[i].map(round));
            j[format!("{id}_over_tollgate")] = json!(self.ratio(i).map(round));
        }
        j
    }
}

pub fn median(sorted: &[f64]) -> f64 {
    match sorted.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => sorted[n / 2],
        n => (sorted[n / 2 - 1] + sorted[n / 2]) / 2.0,
    }
}

/// The `p`-quantile (0..=1) by nearest rank of an unsorted sample.
pub fn percentile(values: &[f64], p: f64) -> f64 {
    let mut s = values.to_vec();
    s.sort_by(f64::total_cmp);
    if s.is_empty() {
        return f64::NAN;
    }
    let rank = ((p * s.len() as f64).ceil() as usize).clamp(1, s.len());
    s[rank - 1]
}

fn round(v: f64) -> f64 {
    (v * 1000.0).round() / 1000.0
}

pub fn progress(msg: &str) {
    eprintln!("bench: {msg}");
}

/// Every name `--only` accepts.
fn known_keys() -> Vec<String> {
    let groups = [
        "throughput",
        "pipeline",
        "permits",
        "redis_cost",
        "pacing",
        "fairness",
        "sweep",
        "adaptive",
        "peer",
    ];
    groups
        .into_iter()
        .map(str::to_owned)
        .chain(pipeline::keys())
        .chain(sweep::keys())
        .chain(adaptive::keys())
        .chain(peer::Framework::ALL.map(|f| f.only_key().to_owned()))
        .collect()
}

pub async fn run(base: &Config, args: &BenchArgs) -> anyhow::Result<()> {
    let known = known_keys();
    if let Some(unknown) = args.only.iter().find(|o| !known.contains(o)) {
        anyhow::bail!(
            "--only {unknown}: no such scenario (known: {})",
            known.join(", ")
        );
    }
    let wanted = |name: &str| args.only.is_empty() || args.only.iter().any(|o| o == name);
    let mut scenarios = Vec::new();
    if wanted("throughput") {
        scenarios.extend(
            throughput::run(base, args)
                .await
                .context("throughput scenario")?,
        );
    }
    // `pipeline` runs every prefetch; `pipeline_p4`, … one each.
    let prefetch = |key: &str| wanted("pipeline") || (!args.only.is_empty() && wanted(key));
    scenarios.extend(
        pipeline::run(base, args, prefetch)
            .await
            .context("minimal-pipeline scenarios")?,
    );
    if wanted("permits") {
        scenarios.push(
            permits::run(base, args)
                .await
                .context("permit-path scenario")?,
        );
    }
    if wanted("redis_cost") {
        scenarios.extend(redis_cost::run(base).await.context("redis-cost scenario")?);
    }
    if wanted("pacing") {
        scenarios.extend(pacing::run(base).await.context("pacing scenarios")?);
    }
    if wanted("fairness") {
        scenarios.extend(fairness::run(base).await.context("fairness scenarios")?);
    }
    // `sweep` runs every point; `sweep_c4`, `sweep_p4`, … one each.
    let point = |key: &str| wanted("sweep") || (!args.only.is_empty() && wanted(key));
    scenarios.extend(sweep::run(base, point).await.context("concurrency sweep")?);
    // `adaptive` runs all three quotas; `adaptive_learned`, … one each.
    let setting = |key: &str| wanted("adaptive") || (!args.only.is_empty() && wanted(key));
    scenarios.extend(
        adaptive::run(base, setting)
            .await
            .context("adaptive quotas")?,
    );
    // `peer` runs every peer; `peer_dramatiq`, `peer_bullmq` one each.
    let mut peer_versions = serde_json::Map::new();
    for framework in peer::Framework::ALL {
        if wanted("peer") || (!args.only.is_empty() && wanted(framework.only_key())) {
            let (peer, versions) = peer::run(framework, base, args)
                .await
                .with_context(|| format!("{} peer scenarios", framework.name()))?;
            scenarios.extend(peer);
            peer_versions.insert(peer::id(framework).to_owned(), versions);
        }
    }
    let compared = peer::compare(&scenarios);
    let notes = peer::caveats(&scenarios);

    let report = json!({
        "machine": {
            "cores": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0),
            "tollgate": env!("CARGO_PKG_VERSION"),
            "rabbitmq": command_version("rabbitmqctl", &["version"]),
            "redis": command_version("redis-server", &["--version"]),
            "profile": if cfg!(debug_assertions) { "debug" } else { "release" },
            "provider": crate::fake_provider::Priority::of_providers().map(|p| p.describe()),
            "peer": peer_versions,
        },
        "scenarios": scenarios.iter().map(|s| (s.key.to_owned(), json!({
            "title": s.title,
            "parameters": s.parameters,
            "figures": s.figures.iter().map(|f| (f.name.to_string(), f.json())).collect::<serde_json::Map<_, _>>(),
        }))).collect::<serde_json::Map<_, _>>(),
        "comparison": compared.iter().map(Compared::json).collect::<Vec<_>>(),
        "comparison_notes": notes,
    });
    std::fs::create_dir_all(&args.out)
        .with_context(|| format!("creating {}", args.out.display()))?;
    let json_path = args.out.join("report.json");
    std::fs::write(&json_path, serde_json::to_string_pretty(&report)?)?;
    let md = markdown(&report, &scenarios, &compared, &notes);
    let md_path = args.out.join("report.md");
    std::fs::write(&md_path, &md)?;
    println!("{md}");
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

fn markdown(
    report: &serde_json::Value,
    scenarios: &[Scenario],
    compared: &[Compared],
    notes: &[&str],
) -> String {
    let m = &report["machine"];
    let mut out = format!(
        "# tollgate bench\n\nMachine: {} cores; tollgate {}; RabbitMQ {}; {}; {} build.\n",
        m["cores"],
        m["tollgate"].as_str().unwrap_or("?"),
        m["rabbitmq"].as_str().unwrap_or("?"),
        m["redis"].as_str().unwrap_or("?"),
        m["profile"].as_str().unwrap_or("?"),
    );
    if let Some(provider) = m["provider"].as_str() {
        out.push_str(&format!("The provider: {provider}.\n"));
    }
    for line in peer::version_lines(&m["peer"]) {
        out.push_str(&format!("{line}\n"));
    }
    if !compared.is_empty() {
        // A column (and a ratio to tollgate) for each peer that ran.
        let peers: Vec<usize> = (0..peer::Framework::ALL.len())
            .filter(|&i| compared.iter().any(|c| c.peers[i].is_some()))
            .collect();
        let names: Vec<&str> = peers
            .iter()
            .map(|&i| peer::Framework::ALL[i].name())
            .collect();
        out.push_str(&format!(
            "\n## tollgate vs {}, same machine, same run\n\n\
             Medians, at equal concurrency where the setups allow (each side's setup is in its \
             scenario's parameters below); — where a side did not run.\n\n\
             | scenario | figure | tollgate | {} | {} | unit |\n|---|---|---|{}---|\n",
            names.join(" vs "),
            names.join(" | "),
            names
                .iter()
                .map(|n| format!("{n} / tollgate"))
                .collect::<Vec<_>>()
                .join(" | "),
            "---|---|".repeat(names.len()),
        ));
        let cell = |v: Option<f64>| v.map(|v| round(v).to_string()).unwrap_or("—".into());
        for c in compared {
            let values = peers.iter().map(|&i| cell(c.peers[i]));
            let ratios = peers.iter().map(|&i| {
                c.ratio(i)
                    .map(|r| format!("{r:.2}"))
                    .unwrap_or_else(|| "—".into())
            });
            out.push_str(&format!(
                "| {} | {} | {} | {} | {} | {} |\n",
                c.scenario,
                c.figure,
                cell(c.tollgate),
                values.collect::<Vec<_>>().join(" | "),
                ratios.collect::<Vec<_>>().join(" | "),
                c.unit
            ));
        }
    }
    if !notes.is_empty() {
        out.push_str("\nRead the peers' figures with care:\n\n");
        for note in notes {
            out.push_str(&format!("- {note}\n"));
        }
    }
    for s in scenarios {
        out.push_str(&format!(
            "\n## {}\n\nParameters: `{}`\n\n| figure | median | min | max | unit | target |\n|---|---|---|---|---|---|\n",
            s.title, s.parameters
        ));
        for f in &s.figures {
            let j = f.json();
            out.push_str(&format!(
                "| {} | {} | {} | {} | {} | {} |\n",
                f.name,
                j["median"],
                j["min"],
                j["max"],
                f.unit,
                f.target.as_deref().unwrap_or("")
            ));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scenario(key: &'static str, figure: &'static str, value: f64) -> Scenario {
        Scenario {
            key,
            title: key,
            parameters: json!({}),
            figures: vec![Figure::new(figure, "jobs/s", vec![value])],
        }
    }

    /// A row for each figure two sides measured, a column and a ratio for
    /// each peer that ran, and each peer's notes.
    #[test]
    fn comparison_sets_the_peers_beside_tollgate() {
        let scenarios = [
            scenario("throughput", "tollgate, one worker", 100.0),
            scenario("peer_throughput", "dramatiq, one worker", 50.0),
            scenario(
                "peer_bullmq_throughput",
                "bullmq, one worker (2 node processes)",
                200.0,
            ),
        ];
        let compared = peer::compare(&scenarios);
        assert_eq!(compared.len(), 1);
        assert_eq!(compared[0].tollgate, Some(100.0));
        assert_eq!(compared[0].peers, [Some(50.0), Some(200.0)]);
        let j = compared[0].json();
        assert_eq!(j["dramatiq_over_tollgate"], json!(0.5));
        assert_eq!(j["bullmq_over_tollgate"], json!(2.0));
        let notes = peer::caveats(&scenarios);
        let report = json!({ "machine": {} });
        let md = markdown(&report, &[], &compared, &notes);
        assert!(md.contains(
            "| tollgate | Dramatiq | BullMQ | Dramatiq / tollgate | BullMQ / tollgate | unit |"
        ));
        assert!(md.contains("| 100 | 50 | 200 | 0.50 | 2.00 | jobs/s |"));
        assert!(notes.iter().any(|n| n.contains("BullMQ")));

        // BullMQ alone beside tollgate: one peer column.
        let [tollgate, _, bullmq] = scenarios;
        let compared = peer::compare(&[tollgate, bullmq]);
        let md = markdown(&report, &[], &compared, &[]);
        assert!(md.contains("| tollgate | BullMQ | BullMQ / tollgate | unit |"));
    }

    #[test]
    fn only_names_every_scenario_and_part_and_nothing_else() {
        let known = known_keys();
        for key in [
            "sweep",
            "sweep_p4",
            "sweep_c64.weighted_share",
            "sweep_c4.noisy_neighbour",
            "pipeline_p256",
            "adaptive_fixed_8",
            "peer_bullmq",
        ] {
            assert!(known.iter().any(|k| k == key), "{key} is not accepted");
        }
        for typo in ["sweep_c64.nope", "sweep_c8", "adaptive_fixed_12", ""] {
            assert!(!known.iter().any(|k| k == typo), "{typo:?} is accepted");
        }
    }
}
