//! The peers in the same run: Dramatiq (from PyPI) and BullMQ (from npm),
//! each doing tollgate's job the idiomatic way of its framework, measured
//! with the same fake provider and the same helpers as tollgate's
//! scenarios, so the report can put all three side by side.
//!
//! Both peers go through the same four scenario drivers (throughput,
//! adherence, noisy neighbour, due precision); a [`Framework`] says how
//! its peer is installed, started, made ready and described:
//!
//! - Dramatiq: setup installs the pinned `bench-peer/requirements.txt` into
//!   a venv (`--peer-venv`, `target/bench-venv`) and writes the embedded
//!   `bench-peer/dramatiq_peer.py` (actor, `enqueue`, `cleanup`) into it.
//!   Workers are one `dramatiq` command (`--processes`, `--threads`), ready
//!   when each process consumes the queue.
//! - BullMQ: setup writes the embedded `bench-peer/bullmq/package.json` and
//!   its committed `package-lock.json` into `--peer-node-dir`
//!   (`target/bench-node`), runs `npm ci` there when the lockfile changed,
//!   and writes `bench-peer/bullmq_peer.js` (worker, `enqueue`, `cleanup`)
//!   beside them. Workers are one `node bullmq_peer.js worker` process per
//!   `--processes` (Node runs JavaScript on one thread, as the GIL keeps a
//!   Python process on one core), ready when each has counted itself in
//!   Redis.
//!
//! Every scenario gets its own queue names and Redis key prefix, a fresh
//! [`FakeProvider`], the worker processes, one long-lived producer process,
//! and ends by deleting its queues and keys. Worker and producer logs go to
//! `<out>/peer/*.log`.

use std::collections::{HashMap, HashSet};
use std::fs::File;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use serde_json::json;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader, Lines};
use tokio::process::{ChildStdin, ChildStdout};
use tollgate_amqp::lapin::options::QueueDeclareOptions;
use tollgate_amqp::lapin::types::FieldTable;
use tollgate_amqp::lapin::{Connection, ConnectionProperties};
use tollgate_core::UnixMillis;
use tollgate_quota::Redis;

use super::fairness::{due_offsets, lags_ms};
use super::pacing::{self, MAX_IN_1S, OVER_QUOTA, UTILIZATION};
use super::rig;
use super::{BenchArgs, Compared, Figure, Scenario, percentile, progress};
use crate::fake_provider::{
    Behavior, FakeProvider, Received, always_ok, max_in_window, strict_limits,
};
use tollgate::config::Config;

const REQUIREMENTS: &str = include_str!("../../bench-peer/requirements.txt");
const DRAMATIQ_MODULE: &str = include_str!("../../bench-peer/dramatiq_peer.py");
const DRAMATIQ_MODULE_NAME: &str = "dramatiq_peer";
const BULLMQ_PACKAGE: &str = include_str!("../../bench-peer/bullmq/package.json");
const BULLMQ_LOCK: &str = include_str!("../../bench-peer/bullmq/package-lock.json");
const BULLMQ_SCRIPT: &str = include_str!("../../bench-peer/bullmq_peer.js");
const BULLMQ_SCRIPT_NAME: &str = "bullmq_peer.js";

/// Retries middleware backoff of a denied job: the limiter's window, then
/// doubling with Dramatiq's jitter up to tollgate's longest hop (5 s).
/// With Dramatiq's defaults (15 s, 7 days) a job denied once waits at
/// least 15 s, twice at least 30 s: minutes for the adherence backlog.
/// BullMQ uses the minimum as its exponential backoff of a failed job.
const MIN_BACKOFF_MS: u32 = 1_000;
const MAX_BACKOFF_MS: u32 = 5_000;
/// Jobs in flight per worker process: Dramatiq's default worker threads,
/// and the concurrency a BullMQ process splits over its tenant Workers.
const SLOTS: u32 = 8;
/// Worker processes of the throughput run: one per core (the GIL, and
/// Node's one JavaScript thread, keep a process on one core), like one
/// tollgate process using both.
const THROUGHPUT_PROCESSES: u32 = 2;
const TENANTS: u32 = 8;

/// A peer framework.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Framework {
    Dramatiq,
    Bullmq,
}

impl Framework {
    /// Every peer, in the comparison's column order.
    pub const ALL: [Framework; 2] = [Framework::Dramatiq, Framework::Bullmq];

    /// The `--only` key that selects this peer alone (`peer` selects all).
    pub fn only_key(self) -> &'static str {
        self.names().only
    }

    /// The framework's name as written in the report.
    pub fn name(self) -> &'static str {
        self.names().name
    }

    fn names(self) -> &'static Names {
        match self {
            Framework::Dramatiq => &DRAMATIQ,
            Framework::Bullmq => &BULLMQ,
        }
    }
}

/// What differs between the peers in their scenarios' keys, titles, own
/// figures and notes (static, as the report keys them).
struct Names {
    /// Name in the report, and the key (lowercase) in report.json.
    name: &'static str,
    id: &'static str,
    only: &'static str,
    throughput: &'static str,
    adherence: &'static str,
    noisy_neighbour: &'static str,
    due_precision: &'static str,
    throughput_title: &'static str,
    adherence_title: &'static str,
    noisy_neighbour_title: &'static str,
    due_precision_title: &'static str,
    /// The throughput figure set beside tollgate's "tollgate, one worker".
    one_worker: &'static str,
    bare: &'static str,
    cpu: &'static str,
    redis_commands: &'static str,
    due_how: &'static str,
    caveats: &'static [&'static str],
}

impl Names {
    /// (tollgate's scenario, the peer's) for each scenario both run.
    fn keys(&self) -> [(&'static str, &'static str); 4] {
        [
            ("throughput", self.throughput),
            ("adherence", self.adherence),
            ("noisy_neighbour", self.noisy_neighbour),
            ("due_precision", self.due_precision),
        ]
    }

    /// The peer's key for tollgate's scenario `tollgate`.
    fn key(&self, tollgate: &str) -> Option<&'static str> {
        let keys = self.keys();
        keys.into_iter()
            .find(|&(t, _)| t == tollgate)
            .map(|(_, k)| k)
    }
}

const DRAMATIQ: Names = Names {
    name: "Dramatiq",
    id: "dramatiq",
    only: "peer_dramatiq",
    throughput: "peer_throughput",
    adherence: "peer_adherence",
    noisy_neighbour: "peer_noisy_neighbour",
    due_precision: "peer_due_precision",
    throughput_title: "Peer: Dramatiq throughput (unlimited quota, instant provider)",
    adherence_title: "Peer: Dramatiq quota adherence, 8 worker processes share one tenant quota",
    noisy_neighbour_title: "Peer: Dramatiq noisy neighbour",
    due_precision_title: "Peer: Dramatiq due precision at light load",
    one_worker: "dramatiq, one worker",
    bare: "dramatiq without a limiter (the framework alone)",
    cpu: "user + system of the dramatiq main process and its worker processes",
    redis_commands: "every command Redis executed (INFO commandstats), not round trips: \
                     the limiter is optimistic (WATCH … MULTI/EXEC) and starts over on every conflict",
    due_how: "send_with_options(delay=…): Dramatiq's delay queue, held by the worker until the eta, \
              checked at least every dramatiq_worker_timeout (1000 ms, the default)",
    caveats: &[
        "Queues: Dramatiq declares its own classic durable queues; tollgate uses quorum queues, which cost more per message. This favours Dramatiq in throughput.",
        "Both publish with confirms: the peer's broker has confirm_delivery=True (Dramatiq's default is False), so a retried job's new copy is confirmed before the old one is acked, as in tollgate.",
        "Dramatiq's WindowRateLimiter counts whole seconds: with window=1 it is a fixed 1 s window, so up to twice the quota can land in a sliding second; the strict provider counts a sliding second, as a real provider may. tollgate's quota is GCRA with burst 1 (evenly spaced).",
        "Dramatiq's backoff is tuned for a rate limiter (min_backoff 1 s, max_backoff 5 s, throttling retried without limit) instead of its defaults (15 s, 7 days, 20 retries), with which a job denied once waits at least 15 s and twice at least 30 s.",
        "Delayed messages (due precision) are released when the worker checks them, at least every dramatiq_worker_timeout (1000 ms, the default, kept): about 0.5 s lag on average by design.",
        "Workers: Dramatiq runs --processes × --threads 8 (the GIL needs a process per core: 2 in the throughput and noisy-neighbour runs, 8 in adherence); tollgate runs one process (two in-process workers in the noisy-neighbour run, sharing the bench process with the provider) with a prefetch of 64.",
        "CPU-seconds count the workers only: Dramatiq's main and worker processes; the producers (a Python process for Dramatiq, the bench itself for tollgate) are not counted on either side.",
    ],
};

const BULLMQ: Names = Names {
    name: "BullMQ",
    id: "bullmq",
    only: "peer_bullmq",
    throughput: "peer_bullmq_throughput",
    adherence: "peer_bullmq_adherence",
    noisy_neighbour: "peer_bullmq_noisy_neighbour",
    due_precision: "peer_bullmq_due_precision",
    throughput_title: "Peer: BullMQ throughput (unlimited quota, instant provider)",
    adherence_title: "Peer: BullMQ quota adherence, 8 worker processes share one tenant quota",
    noisy_neighbour_title: "Peer: BullMQ noisy neighbour",
    due_precision_title: "Peer: BullMQ due precision at light load",
    one_worker: "bullmq, one worker (2 node processes)",
    bare: "bullmq without a limiter (the framework alone)",
    cpu: "user + system of the node worker processes",
    redis_commands: "every command Redis executed (INFO commandstats), not round trips: \
                     the commands BullMQ's Lua scripts run count one each",
    due_how: "queue.add(…, {delay}): BullMQ's delayed set; a Worker blocks on the queue's marker \
              until the next delayed job's timestamp",
    caveats: &[
        "Per-tenant quota (BullMQ): BullMQ OSS rate-limits a queue, not a group of jobs in one (group limits are BullMQ Pro), so each tenant has its own queue with queue.setGlobalRateLimit(quota, 1000 ms), and every worker process runs a Worker, with its own blocking Redis connection, per tenant queue. The workers must know the tenants (a new tenant needs new Workers everywhere) and a process holds a Worker and a connection per tenant; tollgate's tenants share a few work queues.",
        "BullMQ's limiter is a fixed window: the first job taken after a window ended starts the next one (INCR + PEXPIRE on the queue's limiter key), so jobs of two windows can reach the provider less than 1 s apart; the strict provider counts a sliding second. A denied job stays in its queue: the Worker does not fetch from a limited queue until the window ends.",
        "Concurrency (BullMQ): a Worker's concurrency counts its own queue only (no pool shared across queues in OSS), so each process's 8 slots, Dramatiq's threads per process, are split over its tenant Workers: 1 each in the throughput run (8 tenants), 4 in the noisy-neighbour run (2 tenants), 8 with one tenant. A tenant cannot use the slots of an idle one.",
        "Broker (BullMQ): jobs live in Redis only (lists, sorted sets, a hash per job, an events stream), moved by Lua scripts; RabbitMQ is not used. Completed jobs are deleted (removeOnComplete); failed ones are kept, BullMQ's default.",
        "Delayed jobs (BullMQ): a Worker waits for the next delayed job with a blocking Redis command (BZPOPMIN on the queue's marker) timed to its timestamp; Redis times blocked commands out on its own ticks (hz, 10 a second by default), so a scheduled job can start up to about 100 ms late.",
        "A 429 (BullMQ): queue.rateLimit(Retry-After) holds the tenant's queue for every worker process, and Worker.RateLimitError() puts the job back to wait without using up an attempt (real failures get tollgate's max_attempts, with exponential backoff from 1 s).",
        "CPU-seconds (BullMQ) count the node worker processes (2 in the throughput run, one per core); the producer, a node process, is not counted. The npm packages are installed with --ignore-scripts: msgpackr's prebuilt native addon still loads, no install script runs.",
    ],
};

/// Figures measured on both sides under the same name, the row's label
/// too, as (tollgate's scenario, figure); the peer's scenario is its key
/// for tollgate's.
const COMPARED: &[(&str, &str)] = &[
    ("throughput", JOBS_PER_CPU),
    ("adherence", MAX_IN_1S),
    ("adherence", OVER_QUOTA),
    ("adherence", UTILIZATION),
    ("noisy_neighbour", QUIET_P50),
    ("noisy_neighbour", QUIET_P99),
    ("noisy_neighbour", QUIET_MAX),
    ("noisy_neighbour", QUIET_LOST),
    ("noisy_neighbour", NOISY_MAX),
    ("due_precision", DUE_P50),
    ("due_precision", DUE_P99),
    ("due_precision", EARLY),
];
/// The first row: jobs/s, set beside each peer's `one_worker`.
const ONE_WORKER: (&str, &str, &str) = ("throughput", "jobs/s, one worker", "tollgate, one worker");
// Figure names shared with tollgate's scenarios.
const JOBS_PER_CPU: &str = "jobs per CPU-second of the worker";
const QUIET_P50: &str = "quiet tenant due lag p50";
const QUIET_P99: &str = "quiet tenant due lag p99";
const QUIET_MAX: &str = "quiet tenant due lag max";
const QUIET_LOST: &str = "quiet jobs not sent by the end";
const NOISY_MAX: &str = "noisy: max requests in any 1 s";
const DUE_P50: &str = "due lag p50";
const DUE_P99: &str = "due lag p99";
const EARLY: &str = "sent before due";

/// The peers with a scenario in `scenarios`.
pub fn present(scenarios: &[Scenario]) -> Vec<Framework> {
    Framework::ALL
        .into_iter()
        .filter(|f| {
            let keys = f.names().keys();
            scenarios
                .iter()
                .any(|s| keys.iter().any(|&(_, k)| k == s.key))
        })
        .collect()
}

/// What to keep in mind reading the peers' figures, printed under the
/// comparison: the notes of each peer that ran.
pub fn caveats(scenarios: &[Scenario]) -> Vec<&'static str> {
    present(scenarios)
        .into_iter()
        .flat_map(|f| f.names().caveats.iter().copied())
        .collect()
}

/// The figures at least two sides measured in this run, for the
/// comparison table: tollgate's median and each peer's.
pub fn compare(scenarios: &[Scenario]) -> Vec<Compared> {
    let figure = |key: &str, name: &str| {
        scenarios
            .iter()
            .filter(|s| s.key == key)
            .flat_map(|s| &s.figures)
            .find(|f| f.name == name)
    };
    let (key, label, t_name) = ONE_WORKER;
    std::iter::once((key, label, t_name, None))
        .chain(
            COMPARED
                .iter()
                .map(|&(key, name)| (key, name, name, Some(name))),
        )
        .filter_map(|(key, label, t_name, p_name)| {
            let tollgate = figure(key, t_name);
            let peers = Framework::ALL.map(|f| {
                let n = f.names();
                figure(n.key(key)?, p_name.unwrap_or(n.one_worker))
            });
            let measured: Vec<&Figure> = std::iter::once(tollgate).chain(peers).flatten().collect();
            (measured.len() >= 2).then(|| Compared {
                scenario: key,
                figure: label,
                unit: measured[0].unit,
                tollgate: tollgate.map(Figure::median),
                peers: peers.map(|p| p.map(Figure::median)),
            })
        })
        .collect()
}

/// A line with the versions of each peer that ran, from report.json's
/// `machine.peer`.
pub fn version_lines(peers: &serde_json::Value) -> Vec<String> {
    let version = |v: &serde_json::Value, k: &str| v[k].as_str().unwrap_or("?").to_owned();
    Framework::ALL
        .into_iter()
        .filter_map(|f| {
            let v = peers.get(f.names().id)?;
            Some(match f {
                Framework::Dramatiq => format!(
                    "Peer: Dramatiq {} (pika {}, redis-py {}, Python {}).",
                    version(v, "dramatiq"),
                    version(v, "pika"),
                    version(v, "redis"),
                    version(v, "python"),
                ),
                Framework::Bullmq => format!(
                    "Peer: BullMQ {} (ioredis {}, Node.js {}).",
                    version(v, "bullmq"),
                    version(v, "ioredis"),
                    version(v, "node"),
                ),
            })
        })
        .collect()
}

/// The report key of a peer's versions.
pub fn id(framework: Framework) -> &'static str {
    framework.names().id
}

/// Runs one peer's scenarios; returns them and the installed versions.
pub async fn run(
    framework: Framework,
    base: &Config,
    args: &BenchArgs,
) -> anyhow::Result<(Vec<Scenario>, serde_json::Value)> {
    let peer = Peer::install(framework, args)?;
    let scenarios = vec![
        throughput(&peer, base, args).await?,
        adherence(&peer, base).await?,
        noisy_neighbour(&peer, base).await?,
        due_precision(&peer, base).await?,
    ];
    Ok((scenarios, peer.versions))
}

/// A peer installed: Dramatiq's venv with the peer module written into it,
/// or BullMQ's npm directory with the peer script beside `node_modules`.
struct Peer {
    framework: Framework,
    /// The venv, or the npm directory.
    root: PathBuf,
    /// Where the peer's script is, and runs.
    dir: PathBuf,
    logs: PathBuf,
    versions: serde_json::Value,
}

impl Peer {
    /// Installs the pinned packages unless `root` already holds exactly
    /// these (a failure is an error), writes the peer's script and asks it
    /// for the installed versions.
    fn install(framework: Framework, args: &BenchArgs) -> anyhow::Result<Self> {
        let root = match framework {
            Framework::Dramatiq => &args.peer_venv,
            Framework::Bullmq => &args.peer_node_dir,
        };
        std::fs::create_dir_all(root)?;
        let root = root.canonicalize()?;
        let (dir, script, text) = match framework {
            Framework::Dramatiq => {
                install_venv(&root)?;
                let file = format!("{DRAMATIQ_MODULE_NAME}.py");
                (root.join("peer"), file, DRAMATIQ_MODULE)
            }
            Framework::Bullmq => {
                install_npm(&root)?;
                (root.clone(), BULLMQ_SCRIPT_NAME.to_owned(), BULLMQ_SCRIPT)
            }
        };
        std::fs::create_dir_all(&dir)?;
        std::fs::write(dir.join(script), text)?;
        let logs = args.out.join("peer");
        std::fs::create_dir_all(&logs)?;
        let mut peer = Self {
            framework,
            root,
            dir,
            logs,
            versions: serde_json::Value::Null,
        };
        let output = run_checked(peer.script().arg("version"), "the peer script")?;
        peer.versions = serde_json::from_slice(&output).context("peer versions")?;
        progress(&format!(
            "peer: {} ready, {}",
            framework.name(),
            peer.versions
        ));
        Ok(peer)
    }

    /// The peer's script in its directory: `python dramatiq_peer.py` or
    /// `node bullmq_peer.js`.
    fn script(&self) -> Command {
        let mut command = match self.framework {
            Framework::Dramatiq => {
                let mut c = Command::new(self.root.join("bin/python"));
                c.arg(format!("{DRAMATIQ_MODULE_NAME}.py"));
                c
            }
            Framework::Bullmq => {
                let mut c = Command::new("node");
                c.arg(BULLMQ_SCRIPT_NAME);
                c
            }
        };
        command.current_dir(&self.dir);
        command
    }

    fn version(&self) -> String {
        let id = self.framework.names().id;
        format!("{id} {}", self.versions[id].as_str().unwrap_or("?"))
    }
}

/// Runs `install` unless `stamp` (in `root`) holds `pinned` and `installed`
/// exists; then writes the stamp.
fn install_pinned(
    root: &Path,
    pinned: &str,
    installed: &Path,
    what: &str,
    install: impl FnOnce() -> anyhow::Result<()>,
) -> anyhow::Result<()> {
    let stamp = root.join(".peer-pinned");
    if installed.exists() && std::fs::read_to_string(&stamp).ok().as_deref() == Some(pinned) {
        progress(&format!("peer: {} already holds {what}", root.display()));
        return Ok(());
    }
    install()?;
    std::fs::write(&stamp, pinned)?;
    Ok(())
}

/// A venv at `venv` with the pinned Dramatiq requirements.
fn install_venv(venv: &Path) -> anyhow::Result<()> {
    install_pinned(
        venv,
        REQUIREMENTS,
        &venv.join("bin/python"),
        "the pinned Dramatiq",
        || {
            progress(&format!(
                "peer: creating {} (python3 -m venv)",
                venv.display()
            ));
            run_checked(
                Command::new("python3").args(["-m", "venv"]).arg(venv),
                "python3 -m venv (Debian: apt-get install python3-venv)",
            )?;
            let requirements = venv.join("requirements.txt");
            std::fs::write(&requirements, REQUIREMENTS)?;
            let pinned: Vec<&str> = REQUIREMENTS
                .lines()
                .filter(|l| !l.trim().is_empty() && !l.starts_with('#'))
                .collect();
            progress(&format!("peer: pip install {}", pinned.join(" ")));
            run_checked(
                Command::new(venv.join("bin/pip"))
                    .args(["install", "--quiet", "--disable-pip-version-check", "-r"])
                    .arg(&requirements),
                "pip install of the peer's requirements",
            )?;
            Ok(())
        },
    )
}

/// `npm ci` of the pinned BullMQ package and lockfile in `dir`; reinstalled
/// when either changed. No package's install script runs.
fn install_npm(dir: &Path) -> anyhow::Result<()> {
    let pinned = format!("{BULLMQ_PACKAGE}\n{BULLMQ_LOCK}");
    install_pinned(
        dir,
        &pinned,
        &dir.join("node_modules/bullmq/package.json"),
        "the pinned BullMQ",
        || {
            std::fs::write(dir.join("package.json"), BULLMQ_PACKAGE)?;
            std::fs::write(dir.join("package-lock.json"), BULLMQ_LOCK)?;
            progress(&format!(
                "peer: npm ci in {} (bullmq and its dependencies, from the lockfile)",
                dir.display()
            ));
            run_checked(
                Command::new("npm")
                    .args(["ci", "--ignore-scripts", "--no-audit", "--no-fund"])
                    .args(["--loglevel", "error"])
                    .current_dir(dir),
                "npm ci of the BullMQ peer (needs Node.js 20+ and npm on PATH)",
            )?;
            Ok(())
        },
    )
}

/// Runs a command to its end; its stdout, or an error with its stderr.
fn run_checked(command: &mut Command, what: &str) -> anyhow::Result<Vec<u8>> {
    let output = command
        .output()
        .with_context(|| format!("starting {what}"))?;
    if !output.status.success() {
        bail!(
            "{what} failed ({}): {}",
            output.status,
            String::from_utf8_lossy(&output.stderr).trim()
        );
    }
    Ok(output.stdout)
}

/// The per-tenant limiter the peer obeys.
#[derive(Clone, Copy)]
enum Limiter {
    /// The framework's own, the idiomatic way. Dramatiq: a
    /// `WindowRateLimiter(limit=quota, window=1)` on its Redis backend,
    /// "quota per second" (it counts whole seconds, so with `window=1` it is
    /// a fixed 1 s window). BullMQ: the tenant queue's rate limit,
    /// `queue.setGlobalRateLimit(quota, 1000)`.
    Quota,
    /// No limiter: the framework's own cost, in the throughput run only.
    None,
}

impl Limiter {
    fn env(self, framework: Framework) -> &'static str {
        match (self, framework) {
            (Limiter::Quota, Framework::Dramatiq) => "window",
            (Limiter::Quota, Framework::Bullmq) => "global",
            (Limiter::None, _) => "none",
        }
    }

    fn describe(self, framework: Framework) -> &'static str {
        match (self, framework) {
            (Limiter::Quota, Framework::Dramatiq) => {
                "dramatiq.rate_limits.WindowRateLimiter(limit=quota, window=1 s) on RedisBackend, key {prefix}:rate:{tenant}"
            }
            (Limiter::Quota, Framework::Bullmq) => {
                "a queue per tenant with queue.setGlobalRateLimit(max=quota, duration=1000 ms): a fixed window \
                 (key {prefix}:{tenant}:limiter) that the Worker checks before it takes a job"
            }
            (Limiter::None, _) => "none",
        }
    }
}

/// Concurrency of one BullMQ Worker: a process's slots split over its
/// tenant Workers.
fn concurrency(tenants: usize) -> u32 {
    (SLOTS / tenants.max(1) as u32).max(1)
}

/// How the peer is set up, for every scenario's parameters.
fn setup(peer: &Peer, limiter: Limiter, processes: u32, tenants: usize) -> serde_json::Value {
    let f = peer.framework;
    match f {
        Framework::Dramatiq => json!({
            "peer": peer.version(),
            "workers": format!("one `dramatiq` command, --processes {processes} --threads {SLOTS}"),
            "limiter": limiter.describe(f),
            "denied": format!(
                "`with limiter.acquire()` raises RateLimitExceeded; the Retries middleware re-enqueues via the delay queue \
                 (min_backoff {MIN_BACKOFF_MS} ms, max_backoff {MAX_BACKOFF_MS} ms, Dramatiq's jitter); throttling never uses up an attempt"
            ),
            "provider_429": "raise dramatiq.Retry(delay=Retry-After)",
            "broker": "RabbitmqBroker(confirm_delivery=True), Dramatiq's classic durable queues",
        }),
        Framework::Bullmq => json!({
            "peer": peer.version(),
            "workers": format!(
                "{processes} `node {BULLMQ_SCRIPT_NAME} worker` process(es), each a Worker per tenant queue \
                 ({tenants}) at concurrency {}: {SLOTS} slots a process split over its Workers",
                concurrency(tenants)
            ),
            "limiter": limiter.describe(f),
            "denied": "not taken: moveToActive answers with the window's TTL and the Worker waits it out; the job stays in its queue",
            "provider_429": "queue.rateLimit(Retry-After) then throw Worker.RateLimitError(): the job goes back to wait, no attempt used",
            "failures": format!("attempts: the config's max_attempts; backoff exponential from {MIN_BACKOFF_MS} ms"),
            "broker": "Redis only (BullMQ's lists, sorted sets and Lua scripts), one ioredis connection a process plus one blocking connection a Worker; removeOnComplete",
        }),
    }
}

/// One scenario's peer installation: queue or key prefix, provider, worker
/// processes and producer.
struct PeerRig<'a> {
    peer: &'a Peer,
    name: &'static str,
    /// Dramatiq's queue, and either peer's Redis key prefix.
    prefix: String,
    env: Vec<(&'static str, String)>,
    provider: FakeProvider,
    /// Dramatiq's broker, to see its consumers.
    amqp: Option<Connection>,
    redis: Redis,
    workers: Vec<Child>,
    producer: Option<Producer>,
    cleaned: bool,
}

impl<'a> PeerRig<'a> {
    async fn new(
        peer: &'a Peer,
        base: &Config,
        name: &'static str,
        behavior: Behavior,
        quotas: &[(String, u32)],
        limiter: Limiter,
    ) -> anyhow::Result<Self> {
        let provider = FakeProvider::start_punctual(behavior).await?;
        let f = peer.framework;
        let prefix = format!(
            "bench_peer_{}{}",
            if f == Framework::Bullmq {
                "bullmq_"
            } else {
                ""
            },
            &uuid::Uuid::new_v4().simple().to_string()[..8]
        );
        let tenants = quotas.len();
        let quotas = quotas
            .iter()
            .map(|(t, r)| format!("{t}={r}"))
            .collect::<Vec<_>>()
            .join(",");
        let mut env = vec![
            ("TOLLGATE_REDIS_URL", base.redis_url.expose().to_owned()),
            ("PEER_PREFIX", prefix.clone()),
            ("PEER_PROVIDER_URL", provider.url()),
            ("PEER_QUOTAS", quotas),
            ("PEER_LIMITER", limiter.env(f).to_owned()),
            ("PEER_MIN_BACKOFF_MS", MIN_BACKOFF_MS.to_string()),
            ("PEER_MAX_ATTEMPTS", base.max_attempts.to_string()),
        ];
        let amqp = match f {
            Framework::Dramatiq => {
                env.extend([
                    ("TOLLGATE_AMQP_URL", base.amqp_url.expose().to_owned()),
                    ("PEER_QUEUE", prefix.clone()),
                    ("PEER_MAX_BACKOFF_MS", MAX_BACKOFF_MS.to_string()),
                    ("PEER_CONFIRM", "1".to_owned()),
                    ("PYTHONDONTWRITEBYTECODE", "1".to_owned()),
                ]);
                let amqp =
                    Connection::connect(base.amqp_url.expose(), ConnectionProperties::default())
                        .await
                        .context("connecting to RabbitMQ")?;
                Some(amqp)
            }
            Framework::Bullmq => {
                env.push(("PEER_CONCURRENCY", concurrency(tenants).to_string()));
                None
            }
        };
        Ok(Self {
            peer,
            name,
            prefix,
            env,
            provider,
            amqp,
            redis: Redis::new(&base.redis_settings())?,
            workers: Vec::new(),
            producer: None,
            cleaned: false,
        })
    }

    fn log(&self, what: &str) -> anyhow::Result<File> {
        let path = self.peer.logs.join(format!(
            "{}-{}-{what}.log",
            self.peer.framework.names().id,
            self.name
        ));
        File::options()
            .create(true)
            .append(true)
            .open(&path)
            .with_context(|| format!("opening {}", path.display()))
    }

    /// Starts the worker processes and waits until each of them consumes.
    async fn start_workers(&mut self, processes: u32) -> anyhow::Result<()> {
        // The producer declares the queues (and BullMQ's rate limits), so
        // the readiness check below never asks for a queue that does not
        // exist yet and no job is taken before its limit is set.
        self.producer().await?;
        let commands = match self.peer.framework {
            Framework::Dramatiq => {
                let mut c = Command::new(self.peer.root.join("bin/dramatiq"));
                c.arg(DRAMATIQ_MODULE_NAME)
                    .args(["--processes", &processes.to_string()])
                    .args(["--threads", &SLOTS.to_string()])
                    .args(["--worker-shutdown-timeout", "5000"])
                    .current_dir(&self.peer.dir);
                vec![c]
            }
            Framework::Bullmq => (0..processes)
                .map(|_| {
                    let mut c = self.peer.script();
                    c.arg("worker");
                    c
                })
                .collect(),
        };
        let name = self.peer.framework.name();
        for mut command in commands {
            let log = self.log("worker")?;
            let child = command
                .envs(self.env.iter().map(|(k, v)| (*k, v)))
                .process_group(0)
                .stdin(Stdio::null())
                .stdout(log.try_clone()?)
                .stderr(log)
                .spawn()
                .with_context(|| format!("starting the {name} workers"))?;
            self.workers.push(child);
        }
        let started = Instant::now();
        loop {
            if self.ready_workers().await >= processes {
                return Ok(());
            }
            for child in &mut self.workers {
                if let Some(status) = child.try_wait()? {
                    bail!(
                        "a {name} worker exited ({status}); see {}",
                        self.peer.logs.display()
                    );
                }
            }
            ensure!(
                started.elapsed() < Duration::from_secs(60),
                "{name} workers not consuming after 60 s; see {}",
                self.peer.logs.display()
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Worker processes consuming: Dramatiq's consumers on the queue (0
    /// while it does not exist yet), or the BullMQ processes that counted
    /// themselves ready in Redis.
    async fn ready_workers(&self) -> u32 {
        let Some(amqp) = &self.amqp else {
            let Ok(mut conn) = self.redis.conn().await else {
                return 0;
            };
            return tollgate_quota::redis_cmd("GET")
                .arg(format!("{}:bench:ready", self.prefix))
                .query_async::<Option<u32>>(&mut conn)
                .await
                .ok()
                .flatten()
                .unwrap_or(0);
        };
        let Ok(channel) = amqp.create_channel().await else {
            return 0;
        };
        let passive = QueueDeclareOptions {
            passive: true,
            ..Default::default()
        };
        let count = channel
            .queue_declare(self.prefix.as_str().into(), passive, FieldTable::default())
            .await
            .map(|q| q.consumer_count())
            .unwrap_or(0);
        let _ = channel.close(200, "".into()).await;
        count
    }

    /// `of` each worker process (and each of their children), summed:
    /// CPU seconds used so far, or each process's peak RSS.
    fn worker_sum(&self, of: fn(u32) -> anyhow::Result<f64>) -> anyhow::Result<f64> {
        let roots: Vec<u32> = self.workers.iter().map(Child::id).collect();
        Ok(process_trees(&roots)?
            .into_iter()
            .map(|p| of(p).unwrap_or(0.0))
            .sum())
    }

    /// The scenario's producer process, started (and the queues declared)
    /// on first use.
    async fn producer(&mut self) -> anyhow::Result<&mut Producer> {
        if self.producer.is_none() {
            let log = self.log("producer")?;
            let mut command = self.peer.script();
            command
                .args(["enqueue", "--stdin"])
                .envs(self.env.iter().map(|(k, v)| (*k, v)))
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(log);
            let mut child = tokio::process::Command::from(command)
                .kill_on_drop(true)
                .spawn()
                .context("starting the peer producer")?;
            let stdin = child.stdin.take().context("producer stdin")?;
            let stdout = child.stdout.take().context("producer stdout")?;
            let mut lines = BufReader::new(stdout).lines();
            let declared = lines.next_line().await?.unwrap_or_default();
            ensure!(
                declared.contains("declared"),
                "the peer producer did not declare its queues; see {}",
                self.peer.logs.display()
            );
            self.producer = Some(Producer {
                child,
                stdin,
                lines,
            });
        }
        Ok(self.producer.as_mut().expect("started above"))
    }

    /// Publishes through the scenario's producer process.
    async fn enqueue(
        &mut self,
        tenant: &str,
        count: u32,
        due_in: Option<Duration>,
    ) -> anyhow::Result<Vec<(String, UnixMillis)>> {
        let logs = self.peer.logs.clone();
        let producer = self.producer().await?;
        let request = json!({
            "tenant": tenant, "count": count,
            "due_in_ms": due_in.map(|d| d.as_millis() as u64),
        });
        producer
            .stdin
            .write_all(format!("{request}\n").as_bytes())
            .await?;
        producer.stdin.flush().await?;
        let line = producer
            .lines
            .next_line()
            .await?
            .with_context(|| format!("the peer producer exited; see {}", logs.display()))?;
        let reply: serde_json::Value = serde_json::from_str(&line)?;
        reply["jobs"]
            .as_array()
            .context("producer reply without jobs")?
            .iter()
            .map(|j| {
                Ok((
                    j[0].as_str().context("job id")?.to_owned(),
                    UnixMillis(j[1].as_i64().context("published at")?),
                ))
            })
            .collect()
    }

    /// Waits until the provider accepted `n` requests, or fails after `limit`.
    async fn until_accepted(&self, n: usize, limit: Duration) -> anyhow::Result<()> {
        let started = Instant::now();
        while self.provider.accepted() < n {
            ensure!(
                started.elapsed() < limit,
                "{}: only {} of {n} accepted after {limit:?}",
                self.peer.framework.name(),
                self.provider.accepted()
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        Ok(())
    }

    /// Stops the workers (SIGTERM to each worker's main process, then
    /// SIGKILL to its process group), closes the producer, deletes the
    /// queues and keys.
    async fn cleanup(mut self) -> anyhow::Result<()> {
        let mut workers = std::mem::take(&mut self.workers);
        for child in &workers {
            signal("-TERM", &child.id().to_string());
        }
        let started = Instant::now();
        for child in &mut workers {
            while child.try_wait()?.is_none() && started.elapsed() < Duration::from_secs(15) {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            signal("-KILL", &format!("-{}", child.id()));
            child.wait()?;
        }
        if let Some(producer) = self.producer.take() {
            drop(producer.stdin);
            let mut child = producer.child;
            if tokio::time::timeout(Duration::from_secs(10), child.wait())
                .await
                .is_err()
            {
                child.kill().await?;
            }
        }
        self.delete_queues_and_keys()?;
        if let Some(amqp) = self.amqp.take() {
            let _ = amqp.close(200, "bench done".into()).await;
        }
        Ok(())
    }

    /// The peer script's `cleanup`: Dramatiq's queue, its `.DQ` and `.XQ`,
    /// or BullMQ's tenant queues (obliterated); and every Redis key under
    /// the prefix.
    fn delete_queues_and_keys(&mut self) -> anyhow::Result<()> {
        self.cleaned = true;
        run_checked(
            self.peer
                .script()
                .arg("cleanup")
                .envs(self.env.iter().map(|(k, v)| (*k, v))),
            "the peer cleanup",
        )?;
        Ok(())
    }
}

impl Drop for PeerRig<'_> {
    /// On an error path: no worker process outlives its scenario, and its
    /// queues and keys go too (best effort).
    fn drop(&mut self) {
        for mut child in self.workers.drain(..) {
            signal("-KILL", &format!("-{}", child.id()));
            let _ = child.wait();
        }
        if !self.cleaned {
            let _ = self.delete_queues_and_keys();
        }
    }
}

struct Producer {
    child: tokio::process::Child,
    stdin: ChildStdin,
    lines: Lines<BufReader<ChildStdout>>,
}

/// `kill <sig> <target>`; a target already gone is not an error.
fn signal(sig: &str, target: &str) {
    let _ = Command::new("kill")
        .args([sig, "--", target])
        .stderr(Stdio::null())
        .status();
}

/// The processes `roots` and all their descendants (a `dramatiq` command
/// is a main process and one child per `--processes`).
fn process_trees(roots: &[u32]) -> anyhow::Result<Vec<u32>> {
    let mut children: HashMap<u32, Vec<u32>> = HashMap::new();
    for entry in std::fs::read_dir("/proc")? {
        let Some(pid) = entry?.file_name().to_str().and_then(|n| n.parse().ok()) else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        let ppid = stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().nth(1))
            .and_then(|p| p.parse::<u32>().ok());
        if let Some(ppid) = ppid {
            children.entry(ppid).or_default().push(pid);
        }
    }
    let mut seen: HashSet<u32> = roots.iter().copied().collect();
    let (mut all, mut todo) = (roots.to_vec(), roots.to_vec());
    while let Some(pid) = todo.pop() {
        for &child in children.get(&pid).into_iter().flatten() {
            if seen.insert(child) {
                all.push(child);
                todo.push(child);
            }
        }
    }
    Ok(all)
}

/// Commands Redis has executed, less the `INFO` calls that count them.
async fn redis_commands(redis: &Redis) -> anyhow::Result<u64> {
    super::throughput::redis_calls(redis, |name| name != "info").await
}

/// The instants of the accepted requests, in order.
fn accepted(received: &[Received]) -> Vec<Instant> {
    let mut ok: Vec<Instant> = received
        .iter()
        .filter(|r| (200..300).contains(&r.status))
        .map(|r| r.instant)
        .collect();
    ok.sort();
    ok
}

struct ThroughputRun {
    jobs_per_s: f64,
    jobs_per_cpu_second: f64,
    redis_commands_per_job: f64,
    peak_rss_mib: f64,
}

/// `jobs` spread over the tenants, published first, then drained by the
/// peer's worker processes.
async fn throughput_run(
    peer: &Peer,
    base: &Config,
    jobs: u32,
    limiter: Limiter,
) -> anyhow::Result<ThroughputRun> {
    let tenants: Vec<(String, u32)> = (0..TENANTS)
        .map(|i| (format!("bench-{i}"), 1_000_000))
        .collect();
    let name = match limiter {
        Limiter::Quota => "throughput",
        Limiter::None => "throughput-no-limiter",
    };
    let mut rig = PeerRig::new(peer, base, name, always_ok(), &tenants, limiter).await?;
    let per_tenant = jobs / TENANTS;
    for (t, _) in &tenants {
        rig.enqueue(t, per_tenant, None).await?;
    }
    let total = (per_tenant * TENANTS) as usize;
    rig.start_workers(THROUGHPUT_PROCESSES).await?;
    // The workers may have started on the backlog while readiness was
    // polled: CPU and Redis commands from here on are charged to the jobs
    // accepted from here on.
    let (cpu_before, done_before, commands_before) = (
        rig.worker_sum(rig::cpu_seconds)?,
        rig.provider.accepted(),
        redis_commands(&rig.redis).await?,
    );
    rig.until_accepted(total, Duration::from_secs(600)).await?;
    // The last acks land before counting.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let cpu = rig.worker_sum(rig::cpu_seconds)? - cpu_before;
    let commands = redis_commands(&rig.redis).await? - commands_before;
    let peak_rss_mib = rig.worker_sum(rig::peak_rss_mib)?;
    let ok = accepted(&rig.provider.received());
    rig.cleanup().await?;
    let counted = (total - done_before) as f64;
    ensure!(counted > 0.0, "the backlog was done before it was measured");
    let span = ok[ok.len() - 1].duration_since(ok[0]).as_secs_f64();
    Ok(ThroughputRun {
        jobs_per_s: (ok.len() - 1) as f64 / span,
        jobs_per_cpu_second: counted / cpu,
        redis_commands_per_job: commands as f64 / counted,
        peak_rss_mib,
    })
}

/// The worker setup in a progress line.
fn workers_line(peer: &Peer, processes: u32, tenants: usize) -> String {
    match peer.framework {
        Framework::Dramatiq => format!("dramatiq --processes {processes} --threads {SLOTS}"),
        Framework::Bullmq => format!(
            "{processes} node worker process(es), {tenants} tenant Worker(s) each at concurrency {}",
            concurrency(tenants)
        ),
    }
}

async fn throughput(peer: &Peer, base: &Config, args: &BenchArgs) -> anyhow::Result<Scenario> {
    let n = peer.framework.names();
    let workers = workers_line(peer, THROUGHPUT_PROCESSES, TENANTS as usize);
    let (mut rates, mut per_cpu, mut commands, mut rss) = (vec![], vec![], vec![], vec![]);
    for i in 1..=args.runs {
        progress(&format!(
            "peer {} throughput {i}/{}: {workers}, {} jobs, with its limiter",
            n.name, args.runs, args.jobs
        ));
        let run = throughput_run(peer, base, args.jobs, Limiter::Quota).await?;
        rates.push(run.jobs_per_s);
        per_cpu.push(run.jobs_per_cpu_second);
        commands.push(run.redis_commands_per_job);
        rss.push(run.peak_rss_mib);
    }
    let cpu_per_1000 = per_cpu.iter().map(|j| 1000.0 / j).collect();
    // A reference, once: what the limiter costs.
    progress(&format!(
        "peer {} throughput: the same without a limiter",
        n.name
    ));
    let run = throughput_run(peer, base, args.jobs, Limiter::None).await?;
    let (bare_rate, bare_per_cpu) = (run.jobs_per_s, run.jobs_per_cpu_second);
    Ok(Scenario {
        key: n.throughput,
        title: n.throughput_title,
        parameters: json!({
            "jobs": args.jobs, "runs": args.runs, "tenants": TENANTS,
            "quota": "1000000/s per tenant", "provider": "local, answers 200 at once",
            "setup": setup(peer, Limiter::Quota, THROUGHPUT_PROCESSES, TENANTS as usize),
            "jobs_per_s": "first to last accepted request at the provider",
            "without_a_limiter": "PEER_LIMITER=none, one run, after the others",
            "cpu": n.cpu,
            "redis_commands": n.redis_commands,
            "peak_rss": "VmHWM of each worker process at the end of the run, summed",
        }),
        figures: vec![
            Figure::new(n.one_worker, "jobs/s", rates),
            Figure::new(JOBS_PER_CPU, "jobs/cpu-s", per_cpu),
            Figure::new(
                "CPU-seconds of the worker per 1,000 jobs",
                "cpu-s",
                cpu_per_1000,
            ),
            Figure::new("Redis commands per job", "commands", commands),
            Figure::new("peak RSS of the worker processes", "MiB", rss),
            Figure::new(n.bare, "jobs/s", vec![bare_rate]),
            Figure::new(
                "without a limiter: jobs per CPU-second",
                "jobs/cpu-s",
                vec![bare_per_cpu],
            ),
        ],
    })
}

async fn adherence(peer: &Peer, base: &Config) -> anyhow::Result<Scenario> {
    const PROCESSES: u32 = 8;
    const JOBS: u32 = 400;
    let n = peer.framework.names();
    progress(&format!(
        "peer {} adherence: {}, one tenant at 20/s, {JOBS}-job backlog",
        n.name,
        workers_line(peer, PROCESSES, 1)
    ));
    let strict = strict_limits(HashMap::from([("fleet".to_owned(), 20)]));
    let quota = [("fleet".to_owned(), 20)];
    let mut rig = PeerRig::new(peer, base, "adherence", strict, &quota, Limiter::Quota).await?;
    rig.start_workers(PROCESSES).await?;
    rig.enqueue("fleet", JOBS, None).await?;
    rig.until_accepted(JOBS as usize, Duration::from_secs(120))
        .await?;
    let received = rig.provider.received();
    rig.cleanup().await?;
    Ok(Scenario {
        key: n.adherence,
        title: n.adherence_title,
        parameters: json!({
            "worker_processes": PROCESSES, "quota": "20/s", "backlog": JOBS,
            "provider": "strict: 429 beyond 20 accepted in any sliding second",
            "setup": setup(peer, Limiter::Quota, PROCESSES, 1),
        }),
        figures: pacing::adherence_figures(&received),
    })
}

async fn noisy_neighbour(peer: &Peer, base: &Config) -> anyhow::Result<Scenario> {
    const SECONDS: u64 = 30;
    const PROCESSES: u32 = 2;
    let n = peer.framework.names();
    progress(&format!(
        "peer {} noisy neighbour: 3000 jobs at 10/s against one job every 0.5 s at 100/s, {}",
        n.name,
        workers_line(peer, PROCESSES, 2)
    ));
    let quotas = [("noisy".to_owned(), 10), ("quiet".to_owned(), 100)];
    let mut rig = PeerRig::new(
        peer,
        base,
        "noisy-neighbour",
        always_ok(),
        &quotas,
        Limiter::Quota,
    )
    .await?;
    rig.start_workers(PROCESSES).await?;
    rig.enqueue("noisy", 3000, None).await?;
    let mut quiet = Vec::new();
    for _ in 0..SECONDS * 2 {
        quiet.extend(rig.enqueue("quiet", 1, None).await?);
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    rig.until_accepted(1, Duration::from_secs(5)).await?;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let received = rig.provider.received();
    rig.cleanup().await?;
    let noisy: Vec<Instant> = received
        .iter()
        .filter(|r| r.tenant == "noisy")
        .map(|r| r.instant)
        .collect();
    let noisy_rate = match (noisy.first(), noisy.last()) {
        (Some(a), Some(b)) if noisy.len() > 1 => {
            (noisy.len() - 1) as f64 / b.duration_since(*a).as_secs_f64()
        }
        _ => 0.0,
    };
    let lags = lags_ms(&received, &quiet);
    let lost = quiet.len() - lags.len();
    Ok(Scenario {
        key: n.noisy_neighbour,
        title: n.noisy_neighbour_title,
        parameters: json!({
            "noisy": "3000 jobs published at once, quota 10/s",
            "quiet": format!("one job every 0.5 s for {SECONDS} s, quota 100/s"),
            "lag": "provider receive time − publish time",
            "setup": setup(peer, Limiter::Quota, PROCESSES, 2),
        }),
        figures: vec![
            Figure::new(QUIET_P50, "ms", vec![percentile(&lags, 0.5)]),
            Figure::new(QUIET_P99, "ms", vec![percentile(&lags, 0.99)]).target("< 1000"),
            Figure::new(QUIET_MAX, "ms", vec![percentile(&lags, 1.0)]),
            Figure::new(QUIET_LOST, "jobs", vec![lost as f64]).target("0"),
            Figure::new(
                NOISY_MAX,
                "requests",
                vec![max_in_window(&noisy, Duration::from_secs(1)) as f64],
            )
            .target("<= 10"),
            Figure::new(
                "noisy: requests per second over the run",
                "requests/s",
                vec![noisy_rate],
            )
            .target("<= 10"),
        ],
    })
}

async fn due_precision(peer: &Peer, base: &Config) -> anyhow::Result<Scenario> {
    const JOBS: u64 = 100;
    let n = peer.framework.names();
    progress(&format!(
        "peer {} due precision: {JOBS} jobs due 1–10 s ahead, {}",
        n.name,
        workers_line(peer, 1, 1)
    ));
    let mut rig = PeerRig::new(
        peer,
        base,
        "due-precision",
        always_ok(),
        &[("cron".into(), 100)],
        Limiter::Quota,
    )
    .await?;
    rig.start_workers(1).await?;
    let mut due = Vec::new();
    for due_in in due_offsets(JOBS) {
        for (id, at) in rig.enqueue("cron", 1, Some(due_in)).await? {
            due.push((id, UnixMillis(at.0 + due_in.as_millis() as i64)));
        }
    }
    rig.until_accepted(JOBS as usize, Duration::from_secs(30))
        .await?;
    let lags = lags_ms(&rig.provider.received(), &due);
    rig.cleanup().await?;
    let early = lags.iter().filter(|&&l| l < 0.0).count();
    Ok(Scenario {
        key: n.due_precision,
        title: n.due_precision_title,
        parameters: json!({
            "jobs": JOBS, "due_in": "uniform 1–10 s, the same sequence as tollgate's", "quota": "100/s",
            "how": n.due_how,
            "setup": setup(peer, Limiter::Quota, 1, 1),
        }),
        figures: vec![
            Figure::new(DUE_P50, "ms", vec![percentile(&lags, 0.5)]),
            Figure::new(DUE_P99, "ms", vec![percentile(&lags, 0.99)]).target("< 100"),
            Figure::new(EARLY, "jobs", vec![early as f64]).target("0"),
        ],
    })
}
