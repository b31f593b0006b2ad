//! A benchmark's private installation: its own prefix (queues, Redis keys),
//! a local fake provider, worker processes or in-process workers, cleanup.

use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::watch;
use tokio::task::JoinHandle;
use tollgate_amqp::Broker;
use tollgate_core::{Clock, Job, Quota, UnixMillis};
use tollgate_quota::QuotaStore;

use crate::fake_provider::{Behavior, FakeProvider};
use tollgate::cli::{self, PublishArgs};
use tollgate::config::Config;
use tollgate_core::SecretUrl;
use tollgate_runtime::metrics::Metrics;
use tollgate_runtime::system_clock::SystemClock;
use tollgate_runtime::worker::LiveWorker;

pub struct Rig {
    pub config: Config,
    pub broker: Broker,
    pub store: QuotaStore,
    pub provider: FakeProvider,
    processes: Vec<Child>,
    stops: Vec<(watch::Sender<bool>, JoinHandle<anyhow::Result<()>>)>,
}

/// A worker process of this rig.
pub struct Process {
    pub pid: u32,
    pub http_port: u16,
}

impl Rig {
    pub async fn new(base: &Config, behavior: Behavior) -> anyhow::Result<Self> {
        let provider = FakeProvider::start_punctual(behavior).await?;
        let config = Config {
            prefix: format!("bench-{}", &uuid::Uuid::new_v4().simple().to_string()[..8]),
            provider_url: Some(SecretUrl::new(provider.url())),
            http_addr: ([127, 0, 0, 1], 0).into(),
            ..base.clone()
        };
        let broker = cli::connect_broker(&config, "bench").await?;
        broker.declare_topology().await?;
        let store = cli::quota_store(&config)?;
        Ok(Self {
            config,
            broker,
            store,
            provider,
            processes: Vec::new(),
            stops: Vec::new(),
        })
    }

    pub async fn set_quota(&self, tenant: &str, rate: &str, burst: u32) -> anyhow::Result<()> {
        cli::set_tenant_quota(
            &self.store,
            tenant,
            Quota::new(rate.parse()?, burst)?,
            "bench",
        )
        .await
    }

    /// Publishes `count` jobs; returns them with the publish time.
    pub async fn publish(
        &self,
        tenant: &str,
        count: u32,
        due_in: Option<Duration>,
        payload: &str,
    ) -> anyhow::Result<(Vec<Job>, UnixMillis)> {
        self.publish_args(PublishArgs {
            due_in,
            payload: payload.into(),
            ..PublishArgs::new(tenant, count)
        })
        .await
    }

    /// Publishes the jobs `args` describes, as `tollgate publish` would.
    pub async fn publish_args(&self, args: PublishArgs) -> anyhow::Result<(Vec<Job>, UnixMillis)> {
        let now = SystemClock.now();
        let jobs = cli::build_jobs(&args, now)?;
        cli::publish_jobs(&self.broker, &jobs, now).await?;
        Ok((jobs, now))
    }

    /// Publishes `count` jobs of each tenant, tenant after tenant, in one
    /// stream of publishes: a call per tenant would wait for each one's
    /// confirms, and a thousand tenants' backlogs would take the bench
    /// seconds to queue.
    pub async fn publish_each(&self, tenants: &[String], count: u32) -> anyhow::Result<()> {
        let now = SystemClock.now();
        let mut jobs = Vec::with_capacity(tenants.len() * count as usize);
        for tenant in tenants {
            jobs.extend(cli::build_jobs(&PublishArgs::new(tenant, count), now)?);
        }
        cli::publish_jobs(&self.broker, &jobs, now).await
    }

    /// The work queue (shard) a tenant's jobs land in: one probe job is
    /// published and found, then purged. Only before any worker consumes.
    pub async fn shard_of(&self, tenant: &str) -> anyhow::Result<usize> {
        self.publish(tenant, 1, None, "{}").await?;
        let queues = self.broker.topology().work_queues();
        for (shard, queue) in queues.iter().enumerate() {
            if self.broker.queue_depth(queue).await? > 0 {
                self.broker.purge(queue).await?;
                return Ok(shard);
            }
        }
        anyhow::bail!("the probe job for {tenant} reached no work queue")
    }

    /// The first of `{stem}-1`, `{stem}-2`, … whose shard `wanted` accepts.
    pub async fn tenant_where(
        &self,
        stem: &str,
        wanted: impl Fn(usize) -> bool,
    ) -> anyhow::Result<String> {
        for i in 1..=64 {
            let tenant = format!("{stem}-{i}");
            if wanted(self.shard_of(&tenant).await?) {
                return Ok(tenant);
            }
        }
        anyhow::bail!("no tenant named {stem}-1..64 lands on a wanted shard")
    }

    /// `n` tenants among `{stem}-1`, `{stem}-2`, … spread as evenly as `n`
    /// allows over the work queues. Which queue a tenant hashes to depends
    /// on the run's random prefix: 8 tenants picked blindly put 5 on one of
    /// 4 queues in one run, and the run then measured that queue alone.
    pub async fn tenants_spread(&self, stem: &str, n: usize) -> anyhow::Result<Vec<String>> {
        let shards = self.broker.topology().work_queues().len();
        let per_shard = n.div_ceil(shards);
        let mut on = vec![0; shards];
        let mut tenants = Vec::with_capacity(n);
        for i in 1..=64 * n {
            let tenant = format!("{stem}-{i}");
            let shard = self.shard_of(&tenant).await?;
            if on[shard] < per_shard {
                on[shard] += 1;
                tenants.push(tenant);
                if tenants.len() == n {
                    return Ok(tenants);
                }
            }
        }
        anyhow::bail!("{stem}-1..{} do not spread over the work queues", 64 * n)
    }

    /// Starts `tollgate worker` (the product binary, built beside this one)
    /// as a separate process.
    pub async fn spawn_process(&mut self, extra: &[(&str, &str)]) -> anyhow::Result<Process> {
        let http_port = std::net::TcpListener::bind("127.0.0.1:0")?
            .local_addr()?
            .port();
        let mut command = Command::new(crate::tollgate_binary()?);
        command
            .arg("worker")
            .env("TOLLGATE_PREFIX", &self.config.prefix)
            .env("TOLLGATE_SHARDS", self.config.shards.to_string())
            .env(
                "TOLLGATE_PROVIDER_URL",
                self.config.provider_url.as_ref().expect("set").expose(),
            )
            .env("TOLLGATE_HTTP_ADDR", format!("127.0.0.1:{http_port}"))
            .stdout(Stdio::null());
        // For a per-decision trace of a run: each worker logs at debug level
        // to DIR/worker-<port>.log.
        match std::env::var_os("BENCH_WORKER_LOG") {
            Some(dir) => {
                let log = std::path::Path::new(&dir).join(format!("worker-{http_port}.log"));
                command
                    .env(
                        "RUST_LOG",
                        "debug,lapin=warn,hyper=warn,reqwest=warn,h2=warn",
                    )
                    .stderr(std::fs::File::create(&log)?);
            }
            None => {
                command.env("RUST_LOG", "warn").stderr(Stdio::null());
            }
        }
        for (k, v) in extra {
            command.env(k, v);
        }
        let child = command.spawn()?;
        let pid = child.id();
        self.processes.push(child);
        let ready = format!("http://127.0.0.1:{http_port}/readyz");
        let started = Instant::now();
        loop {
            if reqwest::get(&ready).await.is_ok_and(|r| r.status() == 200) {
                return Ok(Process { pid, http_port });
            }
            anyhow::ensure!(
                started.elapsed() < Duration::from_secs(30),
                "worker process not ready"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Starts a worker inside this process, recording into `metrics`.
    pub async fn spawn_inprocess(&mut self, metrics: &Metrics) -> anyhow::Result<()> {
        let worker = Arc::new(LiveWorker::new(
            &self.config.worker_settings()?,
            metrics.clone(),
        )?);
        let (stop, mut stopped) = watch::channel(false);
        let task = tokio::spawn(Arc::clone(&worker).run(async move {
            let _ = stopped.wait_for(|&s| s).await;
        }));
        let started = Instant::now();
        while !worker.readiness().await.ready() {
            anyhow::ensure!(
                started.elapsed() < Duration::from_secs(30),
                "worker not ready"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        self.stops.push((stop, task));
        Ok(())
    }

    /// Waits until the provider accepted `n` requests, or fails after `limit`.
    pub async fn until_accepted(&self, n: usize, limit: Duration) -> anyhow::Result<()> {
        let started = Instant::now();
        while self.provider.accepted() < n {
            anyhow::ensure!(
                started.elapsed() < limit,
                "only {} of {n} accepted after {limit:?}",
                self.provider.accepted()
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        Ok(())
    }

    /// Writes what the provider received: microseconds since its first
    /// request, tenant, status, attempt and job id.
    fn dump_sends(&self, dir: &std::path::Path) -> anyhow::Result<()> {
        use std::io::Write as _;
        let received = self.provider.received();
        let Some(first) = received.iter().map(|r| r.instant).min() else {
            return Ok(());
        };
        let path = dir.join(format!("sends-{}.log", self.config.prefix));
        let mut out = std::io::BufWriter::new(std::fs::File::create(path)?);
        for r in &received {
            writeln!(
                out,
                "{} {} {} {} {}",
                r.instant.duration_since(first).as_micros(),
                r.tenant,
                r.status,
                r.attempt,
                r.job_id
            )?;
        }
        Ok(())
    }

    /// Stops every worker and deletes the prefix's queues and keys.
    pub async fn cleanup(mut self) -> anyhow::Result<()> {
        // For a per-send trace of a run: every request the provider saw,
        // one line each, to DIR/sends-<prefix>.log.
        if let Some(dir) = std::env::var_os("BENCH_SENDS_LOG") {
            self.dump_sends(std::path::Path::new(&dir))?;
        }
        for child in &mut self.processes {
            let _ = Command::new("kill")
                .args(["-TERM", &child.id().to_string()])
                .status();
        }
        for child in &mut self.processes {
            let _ = child.wait();
        }
        for (stop, task) in self.stops.drain(..) {
            let _ = stop.send(true);
            let _ = task.await;
        }
        self.broker.delete_topology().await?;
        self.broker.close().await;
        self.store.purge_prefix().await?;
        Ok(())
    }
}

/// CPU seconds (user + system) a process has used so far.
pub fn cpu_seconds(pid: u32) -> anyhow::Result<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // Fields after the parenthesised command name; utime and stime are the
    // 14th and 15th fields of the whole line.
    let after = stat.rsplit_once(')').map(|(_, rest)| rest).unwrap_or("");
    let fields: Vec<&str> = after.split_whitespace().collect();
    let ticks: f64 = fields[11].parse::<f64>()? + fields[12].parse::<f64>()?;
    Ok(ticks / 100.0) // USER_HZ is 100 on Linux
}

/// CPU-seconds the shared services have used: Redis by its own count
/// (`INFO cpu`, every master on a cluster) and RabbitMQ as every `beam.smp`
/// process on this machine (`None` when there is none: a broker elsewhere).
/// The difference over a run says what its jobs cost the services, which a
/// worker's own CPU does not show.
#[derive(Clone, Copy, Debug)]
pub struct ServicesCpu {
    pub redis: f64,
    pub broker: Option<f64>,
}

impl ServicesCpu {
    pub async fn now(redis: &tollgate_quota::Redis) -> anyhow::Result<Self> {
        let info = redis.info("cpu").await?.join("\n");
        let redis_cpu = info
            .lines()
            .filter_map(|line| line.split_once(':'))
            .filter(|(name, _)| matches!(*name, "used_cpu_sys" | "used_cpu_user"))
            .filter_map(|(_, value)| value.trim().parse::<f64>().ok())
            .sum();
        let mut broker = None;
        for entry in std::fs::read_dir("/proc")? {
            let Some(pid) = entry?
                .file_name()
                .to_str()
                .and_then(|n| n.parse::<u32>().ok())
            else {
                continue;
            };
            let is_beam = std::fs::read_to_string(format!("/proc/{pid}/comm"))
                .is_ok_and(|comm| comm.trim() == "beam.smp");
            if is_beam && let Ok(cpu) = cpu_seconds(pid) {
                *broker.get_or_insert(0.0) += cpu;
            }
        }
        Ok(Self {
            redis: redis_cpu,
            broker,
        })
    }

    /// CPU-seconds per 1,000 jobs from `before` to `self`.
    pub fn per_1000_jobs_since(&self, before: &Self, jobs: usize) -> Self {
        let per_1000 = |now: f64, then: f64| (now - then) * 1_000.0 / jobs as f64;
        Self {
            redis: per_1000(self.redis, before.redis),
            broker: self.broker.zip(before.broker).map(|(n, t)| per_1000(n, t)),
        }
    }
}

/// Peak resident set size of a process, in MiB.
pub fn peak_rss_mib(pid: u32) -> anyhow::Result<f64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let kib: f64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .ok_or_else(|| anyhow::anyhow!("no VmHWM for {pid}"))?;
    Ok(kib / 1024.0)
}

/// A worker's /metrics page, fetched with one client for the whole bench:
/// `reqwest::get` builds a client per call (loading the system's CA roots
/// each time), which a per-second trace paid many times a second on the
/// cores under test.
pub async fn metrics_page(port: u16) -> anyhow::Result<MetricsPage> {
    static CLIENT: std::sync::OnceLock<reqwest::Client> = std::sync::OnceLock::new();
    let client = CLIENT.get_or_init(reqwest::Client::new);
    let text = client
        .get(format!("http://127.0.0.1:{port}/metrics"))
        .send()
        .await?
        .text()
        .await?;
    Ok(MetricsPage(text))
}

/// One scrape of a worker's /metrics.
pub struct MetricsPage(String);

impl MetricsPage {
    /// The sum of the samples whose line starts with `series`.
    pub fn sum(&self, series: &str) -> f64 {
        self.0
            .lines()
            .filter(|l| l.starts_with(series))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    }
}

/// A gauge or counter's value from a worker's /metrics.
pub async fn scrape(port: u16, series: &str) -> anyhow::Result<f64> {
    Ok(metrics_page(port).await?.sum(series))
}
