//! The peer in the same run: Dramatiq (from PyPI) doing tollgate's job the
//! idiomatic Dramatiq way, measured with the same fake provider and the
//! same helpers as tollgate's scenarios, so the report can put both side
//! by side.
//!
//! Setup installs the pinned `bench-peer/requirements.txt` into a venv
//! (`--peer-venv`, `target/bench-venv`) and writes the embedded
//! `bench-peer/dramatiq_peer.py` (actor, `enqueue`, `cleanup`) into it.
//! Every scenario gets its own queue and Redis key prefix, a fresh
//! [`FakeProvider`], one `dramatiq` worker command (`--processes`,
//! `--threads`), one long-lived producer process, and ends by deleting its
//! queues and keys. Worker and producer logs go to `<out>/peer/*.log`.

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
const MODULE: &str = include_str!("../../bench-peer/dramatiq_peer.py");
const MODULE_NAME: &str = "dramatiq_peer";

/// Retries middleware backoff of a denied job: the limiter's window, then
/// doubling with Dramatiq's jitter up to tollgate's longest hop (5 s).
/// With Dramatiq's defaults (15 s, 7 days) a job denied once waits at
/// least 15 s, twice at least 30 s: minutes for the adherence backlog.
const MIN_BACKOFF_MS: u32 = 1_000;
const MAX_BACKOFF_MS: u32 = 5_000;
/// Dramatiq's default worker threads per process.
const THREADS: u32 = 8;
/// One `dramatiq` worker for the throughput run: a process per core (the
/// GIL keeps one process on one core), like one tollgate process using both.
const THROUGHPUT_PROCESSES: u32 = 2;
const TENANTS: u32 = 8;

/// Figures measured on both sides, as (tollgate's scenario, the row's
/// label, tollgate's figure, the peer's figure); the peer's scenario is
/// `peer_<tollgate's>`.
const COMPARED: &[(&str, &str, &str, &str)] = &[
    (
        "throughput",
        "jobs/s, one worker",
        "tollgate, one worker",
        "dramatiq, one worker",
    ),
    ("throughput", JOBS_PER_CPU, JOBS_PER_CPU, JOBS_PER_CPU),
    ("adherence", MAX_IN_1S, MAX_IN_1S, MAX_IN_1S),
    ("adherence", OVER_QUOTA, OVER_QUOTA, OVER_QUOTA),
    ("adherence", UTILIZATION, UTILIZATION, UTILIZATION),
    ("noisy_neighbour", QUIET_P50, QUIET_P50, QUIET_P50),
    ("noisy_neighbour", QUIET_P99, QUIET_P99, QUIET_P99),
    ("noisy_neighbour", QUIET_MAX, QUIET_MAX, QUIET_MAX),
    ("noisy_neighbour", QUIET_LOST, QUIET_LOST, QUIET_LOST),
    ("noisy_neighbour", NOISY_MAX, NOISY_MAX, NOISY_MAX),
    ("due_precision", DUE_P50, DUE_P50, DUE_P50),
    ("due_precision", DUE_P99, DUE_P99, DUE_P99),
    ("due_precision", EARLY, EARLY, EARLY),
];
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

/// What to keep in mind reading the comparison, printed under it.
pub const CAVEATS: &[&str] = &[
    "Queues: Dramatiq declares its own classic durable queues; tollgate uses quorum queues, which cost more per message. This favours Dramatiq in throughput.",
    "Both publish with confirms: the peer's broker has confirm_delivery=True (Dramatiq's default is False), so a retried job's new copy is confirmed before the old one is acked, as in tollgate.",
    "Dramatiq's WindowRateLimiter counts whole seconds: with window=1 it is a fixed 1 s window, so up to twice the quota can land in a sliding second; the strict provider counts a sliding second, as a real provider may. tollgate's quota is GCRA with burst 1 (evenly spaced).",
    "Dramatiq's backoff is tuned for a rate limiter (min_backoff 1 s, max_backoff 5 s, throttling retried without limit) instead of its defaults (15 s, 7 days, 20 retries), with which a job denied once waits at least 15 s and twice at least 30 s.",
    "Delayed messages (due precision) are released when the worker checks them, at least every dramatiq_worker_timeout (1000 ms, the default, kept): about 0.5 s lag on average by design.",
    "Workers: Dramatiq runs --processes × --threads 8 (the GIL needs a process per core: 2 in the throughput and noisy-neighbour runs, 8 in adherence); tollgate runs one process (two in-process workers in the noisy-neighbour run, sharing the bench process with the provider) with a prefetch of 64.",
    "CPU-seconds count the workers only: Dramatiq's main and worker processes; the producers (a Python process for Dramatiq, the bench itself for tollgate) are not counted on either side.",
];

/// The figures both sides measured in this run, for the comparison table.
pub fn compare(scenarios: &[Scenario]) -> Vec<Compared> {
    let figure = |key: &str, name: &str| {
        scenarios
            .iter()
            .filter(|s| s.key == key)
            .flat_map(|s| &s.figures)
            .find(|f| f.name == name)
    };
    COMPARED
        .iter()
        .filter_map(|&(key, label, t_name, p_name)| {
            let tollgate = figure(key, t_name)?;
            let peer = figure(&format!("peer_{key}"), p_name)?;
            Some(Compared {
                scenario: key,
                figure: label,
                unit: tollgate.unit,
                tollgate: tollgate.median(),
                peer: peer.median(),
            })
        })
        .collect()
}

/// Runs every peer scenario; returns them and the installed versions.
pub async fn run(
    base: &Config,
    args: &BenchArgs,
) -> anyhow::Result<(Vec<Scenario>, serde_json::Value)> {
    let peer = Peer::install(&args.peer_venv, &args.out.join("peer"))?;
    let scenarios = vec![
        throughput(&peer, base, args).await?,
        adherence(&peer, base).await?,
        noisy_neighbour(&peer, base).await?,
        due_precision(&peer, base).await?,
    ];
    Ok((scenarios, peer.versions))
}

/// The venv with Dramatiq and the peer module written into it.
struct Peer {
    venv: PathBuf,
    module_dir: PathBuf,
    logs: PathBuf,
    versions: serde_json::Value,
}

impl Peer {
    /// Creates the venv and installs the pinned requirements unless the
    /// venv already holds exactly these; a failure is an error.
    fn install(venv: &Path, logs: &Path) -> anyhow::Result<Self> {
        std::fs::create_dir_all(venv)?;
        let venv = &venv.canonicalize()?;
        let stamp = venv.join(".peer-requirements");
        let python = venv.join("bin/python");
        if !python.exists() || std::fs::read_to_string(&stamp).ok().as_deref() != Some(REQUIREMENTS)
        {
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
            std::fs::write(&stamp, REQUIREMENTS)?;
        } else {
            progress(&format!(
                "peer: {} already holds the pinned Dramatiq",
                venv.display()
            ));
        }
        let module_dir = venv.join("peer");
        std::fs::create_dir_all(&module_dir)?;
        std::fs::write(module_dir.join(format!("{MODULE_NAME}.py")), MODULE)?;
        std::fs::create_dir_all(logs)?;
        let output = run_checked(
            Command::new(&python)
                .arg(format!("{MODULE_NAME}.py"))
                .arg("version")
                .current_dir(&module_dir),
            "the peer module",
        )?;
        let versions = serde_json::from_slice(&output).context("peer versions")?;
        progress(&format!("peer: ready, {versions}"));
        Ok(Self {
            venv: venv.clone(),
            module_dir,
            logs: logs.to_path_buf(),
            versions,
        })
    }

    fn version(&self) -> String {
        format!(
            "dramatiq {}",
            self.versions["dramatiq"].as_str().unwrap_or("?")
        )
    }
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

/// The per-tenant limiter the actor takes a slot from.
#[derive(Clone, Copy)]
enum Limiter {
    /// Dramatiq's `WindowRateLimiter(limit=quota, window=1)` on its Redis
    /// backend: "quota per second", the idiomatic way. (It counts whole
    /// seconds, so with `window=1` it is a fixed 1 s window.)
    Window,
    /// No limiter: Dramatiq's own cost, in the throughput run only.
    None,
}

impl Limiter {
    fn env(self) -> &'static str {
        match self {
            Limiter::Window => "window",
            Limiter::None => "none",
        }
    }

    fn describe(self) -> &'static str {
        match self {
            Limiter::Window => {
                "dramatiq.rate_limits.WindowRateLimiter(limit=quota, window=1 s) on RedisBackend, key {prefix}:rate:{tenant}"
            }
            Limiter::None => "none",
        }
    }
}

/// How the peer is set up, for every scenario's parameters.
fn setup(peer: &Peer, limiter: Limiter, processes: u32) -> serde_json::Value {
    json!({
        "peer": peer.version(),
        "workers": format!("one `dramatiq` command, --processes {processes} --threads {THREADS}"),
        "limiter": limiter.describe(),
        "denied": format!(
            "`with limiter.acquire()` raises RateLimitExceeded; the Retries middleware re-enqueues via the delay queue \
             (min_backoff {MIN_BACKOFF_MS} ms, max_backoff {MAX_BACKOFF_MS} ms, Dramatiq's jitter); throttling never uses up an attempt"
        ),
        "provider_429": "raise dramatiq.Retry(delay=Retry-After)",
        "broker": "RabbitmqBroker(confirm_delivery=True), Dramatiq's classic durable queues",
    })
}

/// One scenario's Dramatiq installation: queue, key prefix, provider,
/// worker command and producer.
struct PeerRig<'a> {
    peer: &'a Peer,
    name: &'static str,
    queue: String,
    env: Vec<(&'static str, String)>,
    provider: FakeProvider,
    amqp: Connection,
    worker: Option<Child>,
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
        let provider = FakeProvider::start(behavior).await?;
        let queue = format!(
            "bench_peer_{}",
            &uuid::Uuid::new_v4().simple().to_string()[..8]
        );
        let quotas = quotas
            .iter()
            .map(|(t, r)| format!("{t}={r}"))
            .collect::<Vec<_>>()
            .join(",");
        let env = vec![
            ("TOLLGATE_AMQP_URL", base.amqp_url.expose().to_owned()),
            ("TOLLGATE_REDIS_URL", base.redis_url.expose().to_owned()),
            ("PEER_QUEUE", queue.clone()),
            ("PEER_PREFIX", queue.clone()),
            ("PEER_PROVIDER_URL", provider.url()),
            ("PEER_QUOTAS", quotas),
            ("PEER_LIMITER", limiter.env().to_owned()),
            ("PEER_MIN_BACKOFF_MS", MIN_BACKOFF_MS.to_string()),
            ("PEER_MAX_BACKOFF_MS", MAX_BACKOFF_MS.to_string()),
            ("PEER_MAX_ATTEMPTS", base.max_attempts.to_string()),
            ("PEER_CONFIRM", "1".to_owned()),
            ("PYTHONDONTWRITEBYTECODE", "1".to_owned()),
        ];
        let amqp = Connection::connect(base.amqp_url.expose(), ConnectionProperties::default())
            .await
            .context("connecting to RabbitMQ")?;
        Ok(Self {
            peer,
            name,
            queue,
            env,
            provider,
            amqp,
            worker: None,
            producer: None,
            cleaned: false,
        })
    }

    fn log(&self, what: &str) -> anyhow::Result<File> {
        let path = self.peer.logs.join(format!("{}-{what}.log", self.name));
        File::options()
            .create(true)
            .append(true)
            .open(&path)
            .with_context(|| format!("opening {}", path.display()))
    }

    /// Starts the `dramatiq` worker command and waits until each of its
    /// processes consumes the queue.
    async fn start_workers(&mut self, processes: u32) -> anyhow::Result<u32> {
        // The producer declares the queues, so the readiness check below
        // never asks for a queue that does not exist yet.
        self.producer().await?;
        let log = self.log("worker")?;
        let child = Command::new(self.peer.venv.join("bin/dramatiq"))
            .arg(MODULE_NAME)
            .args(["--processes", &processes.to_string()])
            .args(["--threads", &THREADS.to_string()])
            .args(["--worker-shutdown-timeout", "5000"])
            .envs(self.env.iter().map(|(k, v)| (*k, v)))
            .current_dir(&self.peer.module_dir)
            .process_group(0)
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .context("starting dramatiq")?;
        let pid = child.id();
        self.worker = Some(child);
        let started = Instant::now();
        loop {
            if self.consumers().await >= processes {
                return Ok(pid);
            }
            if let Some(status) = self
                .worker
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten())
            {
                bail!(
                    "dramatiq exited ({status}); see {}",
                    self.peer.logs.display()
                );
            }
            ensure!(
                started.elapsed() < Duration::from_secs(60),
                "dramatiq workers not consuming after 60 s; see {}",
                self.peer.logs.display()
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Consumers on the queue, 0 while it does not exist yet.
    async fn consumers(&self) -> u32 {
        let Ok(channel) = self.amqp.create_channel().await else {
            return 0;
        };
        let passive = QueueDeclareOptions {
            passive: true,
            ..Default::default()
        };
        let count = channel
            .queue_declare(self.queue.as_str().into(), passive, FieldTable::default())
            .await
            .map(|q| q.consumer_count())
            .unwrap_or(0);
        let _ = channel.close(200, "".into()).await;
        count
    }

    /// The scenario's producer process, started (and the queues declared)
    /// on first use.
    async fn producer(&mut self) -> anyhow::Result<&mut Producer> {
        if self.producer.is_none() {
            let log = self.log("producer")?;
            let mut child = tokio::process::Command::new(self.peer.venv.join("bin/python"))
                .arg(format!("{MODULE_NAME}.py"))
                .args(["enqueue", "--stdin"])
                .envs(self.env.iter().map(|(k, v)| (*k, v)))
                .current_dir(&self.peer.module_dir)
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(log)
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
                "dramatiq: only {} of {n} accepted after {limit:?}",
                self.provider.accepted()
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        Ok(())
    }

    /// Stops the workers (SIGTERM to the main process, then SIGKILL to
    /// its process group), closes the producer, deletes the queues and keys.
    async fn cleanup(mut self) -> anyhow::Result<()> {
        if let Some(mut child) = self.worker.take() {
            signal("-TERM", &child.id().to_string());
            let started = Instant::now();
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
        let _ = self.amqp.close(200, "bench done".into()).await;
        Ok(())
    }

    /// `dramatiq_peer.py cleanup`: the queue, its `.DQ` and `.XQ`, and
    /// every Redis key under the prefix.
    fn delete_queues_and_keys(&mut self) -> anyhow::Result<()> {
        self.cleaned = true;
        run_checked(
            Command::new(self.peer.venv.join("bin/python"))
                .arg(format!("{MODULE_NAME}.py"))
                .arg("cleanup")
                .envs(self.env.iter().map(|(k, v)| (*k, v)))
                .current_dir(&self.peer.module_dir),
            "the peer cleanup",
        )?;
        Ok(())
    }
}

impl Drop for PeerRig<'_> {
    /// On an error path: no worker process outlives its scenario, and its
    /// queues and keys go too (best effort).
    fn drop(&mut self) {
        if let Some(mut child) = self.worker.take() {
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

/// CPU seconds of a process and all its descendants (a `dramatiq`
/// command is a main process and one child per `--processes`).
fn tree_cpu_seconds(root: u32) -> anyhow::Result<f64> {
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
    let (mut total, mut todo, mut seen) = (rig::cpu_seconds(root)?, vec![root], HashSet::new());
    while let Some(pid) = todo.pop() {
        for &child in children.get(&pid).into_iter().flatten() {
            if seen.insert(child) {
                total += rig::cpu_seconds(child).unwrap_or(0.0);
                todo.push(child);
            }
        }
    }
    Ok(total)
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
}

/// `jobs` spread over the tenants, published first, then drained by one
/// `dramatiq` command.
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
        Limiter::Window => "throughput",
        Limiter::None => "throughput-no-limiter",
    };
    let mut rig = PeerRig::new(peer, base, name, always_ok(), &tenants, limiter).await?;
    let per_tenant = jobs / TENANTS;
    for (t, _) in &tenants {
        rig.enqueue(t, per_tenant, None).await?;
    }
    let total = (per_tenant * TENANTS) as usize;
    let redis = Redis::new(&base.redis_settings())?;
    let pid = rig.start_workers(THROUGHPUT_PROCESSES).await?;
    // The workers may have started on the backlog while readiness was
    // polled: CPU and Redis commands from here on are charged to the jobs
    // accepted from here on.
    let (cpu_before, done_before, commands_before) = (
        tree_cpu_seconds(pid)?,
        rig.provider.accepted(),
        redis_commands(&redis).await?,
    );
    rig.until_accepted(total, Duration::from_secs(600)).await?;
    // The last acks land before counting.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let cpu = tree_cpu_seconds(pid)? - cpu_before;
    let commands = redis_commands(&redis).await? - commands_before;
    let ok = accepted(&rig.provider.received());
    rig.cleanup().await?;
    let counted = (total - done_before) as f64;
    ensure!(counted > 0.0, "the backlog was done before it was measured");
    let span = ok[ok.len() - 1].duration_since(ok[0]).as_secs_f64();
    Ok(ThroughputRun {
        jobs_per_s: (ok.len() - 1) as f64 / span,
        jobs_per_cpu_second: counted / cpu,
        redis_commands_per_job: commands as f64 / counted,
    })
}

async fn throughput(peer: &Peer, base: &Config, args: &BenchArgs) -> anyhow::Result<Scenario> {
    let (mut rates, mut per_cpu, mut commands) = (vec![], vec![], vec![]);
    for i in 1..=args.runs {
        progress(&format!(
            "peer throughput {i}/{}: dramatiq --processes {THROUGHPUT_PROCESSES} --threads {THREADS}, {} jobs, with its limiter",
            args.runs, args.jobs
        ));
        let run = throughput_run(peer, base, args.jobs, Limiter::Window).await?;
        rates.push(run.jobs_per_s);
        per_cpu.push(run.jobs_per_cpu_second);
        commands.push(run.redis_commands_per_job);
    }
    // A reference, once: what the limiter costs.
    progress("peer throughput: the same without a limiter");
    let run = throughput_run(peer, base, args.jobs, Limiter::None).await?;
    let (bare_rate, bare_per_cpu) = (run.jobs_per_s, run.jobs_per_cpu_second);
    Ok(Scenario {
        key: "peer_throughput",
        title: "Peer: Dramatiq throughput (unlimited quota, instant provider)",
        parameters: json!({
            "jobs": args.jobs, "runs": args.runs, "tenants": TENANTS,
            "quota": "1000000/s per tenant", "provider": "local, answers 200 at once",
            "setup": setup(peer, Limiter::Window, THROUGHPUT_PROCESSES),
            "jobs_per_s": "first to last accepted request at the provider",
            "without_a_limiter": "PEER_LIMITER=none, one run, after the others",
            "cpu": "user + system of the dramatiq main process and its worker processes",
            "redis_commands": "every command Redis executed (INFO commandstats), not round trips: \
                               the limiter is optimistic (WATCH … MULTI/EXEC) and starts over on every conflict",
        }),
        figures: vec![
            Figure::new("dramatiq, one worker", "jobs/s", rates),
            Figure::new(JOBS_PER_CPU, "jobs/cpu-s", per_cpu),
            Figure::new("Redis commands per job", "commands", commands),
            Figure::new(
                "dramatiq without a limiter (the framework alone)",
                "jobs/s",
                vec![bare_rate],
            ),
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
    progress(&format!(
        "peer adherence: dramatiq --processes {PROCESSES}, one tenant at 20/s, {JOBS}-job backlog"
    ));
    let strict = strict_limits(HashMap::from([("fleet".to_owned(), 20)]));
    let quota = [("fleet".to_owned(), 20)];
    let mut rig = PeerRig::new(peer, base, "adherence", strict, &quota, Limiter::Window).await?;
    rig.start_workers(PROCESSES).await?;
    rig.enqueue("fleet", JOBS, None).await?;
    rig.until_accepted(JOBS as usize, Duration::from_secs(120))
        .await?;
    let received = rig.provider.received();
    rig.cleanup().await?;
    Ok(Scenario {
        key: "peer_adherence",
        title: "Peer: Dramatiq quota adherence, 8 worker processes share one tenant quota",
        parameters: json!({
            "worker_processes": PROCESSES, "quota": "20/s", "backlog": JOBS,
            "provider": "strict: 429 beyond 20 accepted in any sliding second",
            "setup": setup(peer, Limiter::Window, PROCESSES),
        }),
        figures: pacing::adherence_figures(&received),
    })
}

async fn noisy_neighbour(peer: &Peer, base: &Config) -> anyhow::Result<Scenario> {
    const SECONDS: u64 = 30;
    const PROCESSES: u32 = 2;
    progress(&format!(
        "peer noisy neighbour: 3000 jobs at 10/s against one job every 0.5 s at 100/s, dramatiq --processes {PROCESSES}"
    ));
    let quotas = [("noisy".to_owned(), 10), ("quiet".to_owned(), 100)];
    let mut rig = PeerRig::new(
        peer,
        base,
        "noisy-neighbour",
        always_ok(),
        &quotas,
        Limiter::Window,
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
        key: "peer_noisy_neighbour",
        title: "Peer: Dramatiq noisy neighbour",
        parameters: json!({
            "noisy": "3000 jobs published at once, quota 10/s",
            "quiet": format!("one job every 0.5 s for {SECONDS} s, quota 100/s"),
            "lag": "provider receive time − publish time",
            "setup": setup(peer, Limiter::Window, PROCESSES),
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
    progress(
        "peer due precision: 100 jobs due 1–10 s ahead (send_with_options delay), dramatiq --processes 1",
    );
    let mut rig = PeerRig::new(
        peer,
        base,
        "due-precision",
        always_ok(),
        &[("cron".into(), 100)],
        Limiter::Window,
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
        key: "peer_due_precision",
        title: "Peer: Dramatiq due precision at light load",
        parameters: json!({
            "jobs": JOBS, "due_in": "uniform 1–10 s, the same sequence as tollgate's", "quota": "100/s",
            "how": "send_with_options(delay=…): Dramatiq's delay queue, held by the worker until the eta, \
                    checked at least every dramatiq_worker_timeout (1000 ms, the default)",
            "setup": setup(peer, Limiter::Window, 1),
        }),
        figures: vec![
            Figure::new(DUE_P50, "ms", vec![percentile(&lags, 0.5)]),
            Figure::new(DUE_P99, "ms", vec![percentile(&lags, 0.99)]).target("< 100"),
            Figure::new(EARLY, "jobs", vec![early as f64]).target("0"),
        ],
    })
}
