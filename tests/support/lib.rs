//! Shared test support: every test gets its own random prefix (queues,
//! exchanges, Redis keys), in-process workers on the real RabbitMQ and
//! Redis, and a local provider on port 0. `TEST_LOG=1` turns logs on.

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::watch;
use tokio::task::JoinHandle;
use tollgate::cli::{self, DeadLetter};
use tollgate::config::{Config, LogFormat};
use tollgate_amqp::lapin::BasicProperties;
use tollgate_amqp::{Broker, job_properties};
use tollgate_core::SecretUrl;
use tollgate_core::{Job, Quota, TenantId, UnixMillis};
use tollgate_quota::{Actor, Change, QuotaStore, Target};
use tollgate_runtime::{LiveWorker, Metrics};

pub use tollgate_dev::fake_provider::{self, FakeProvider, Received, Reply, max_in_window};

pub fn init_logs() {
    if std::env::var_os("TEST_LOG").is_some() {
        tollgate::logging::init(LogFormat::Pretty, "info");
    }
}

/// One test's private installation of tollgate.
pub struct TestEnv {
    pub config: Config,
    pub broker: Broker,
    pub quotas: QuotaStore,
    cleaned: bool,
}

/// A worker running in this process, with its own connections.
pub struct WorkerHandle {
    pub metrics: Metrics,
    pub worker: Arc<LiveWorker>,
    stop: watch::Sender<bool>,
    task: JoinHandle<anyhow::Result<()>>,
}

impl WorkerHandle {
    pub fn is_running(&self) -> bool {
        !self.task.is_finished()
    }

    /// Graceful stop; returns the worker's result.
    pub async fn stop(self) -> anyhow::Result<()> {
        let _ = self.stop.send(true);
        self.task.await?
    }
}

impl TestEnv {
    /// A fresh prefix with its topology declared. Settings are sized for
    /// tests: short backoff, few attempts, two shards.
    pub async fn new(provider_url: &str) -> Self {
        Self::new_with(provider_url, |_| {}).await
    }

    /// Like [`TestEnv::new`], with the config adjusted before anything is
    /// declared (delivery limit, Redis URL, …).
    pub async fn new_with(provider_url: &str, tweak: impl FnOnce(&mut Config)) -> Self {
        init_logs();
        let prefix = format!(
            "tgtest-{}",
            &uuid::Uuid::new_v4().simple().to_string()[..12]
        );
        let config = Config {
            prefix,
            provider_url: Some(SecretUrl::new(provider_url)),
            http_addr: ([127, 0, 0, 1], 0).into(),
            concurrency: 32,
            shards: 2,
            max_attempts: 3,
            backoff_base_ms: 100,
            backoff_max_ms: 400,
            provider_timeout_ms: 2_000,
            shutdown_grace_ms: 5_000,
            // Connection URLs still come from TOLLGATE_AMQP_URL / TOLLGATE_REDIS_URL.
            ..Config::load(None).expect("TOLLGATE_* environment is valid")
        };
        let mut config = config;
        tweak(&mut config);
        config.validate().expect("test config is valid");
        let broker = cli::connect_broker(&config, "test")
            .await
            .expect("RabbitMQ is reachable (run `make services`)");
        broker.declare_topology().await.expect("topology declares");
        let quotas = cli::quota_store(&config).expect("redis config");
        Self {
            config,
            broker,
            quotas,
            cleaned: false,
        }
    }

    /// How far ahead a permit may be reserved: sends already reserved when
    /// something changes (a quota, a 429, Redis gone) may still go out
    /// within it.
    pub fn horizon(&self) -> Duration {
        Duration::from_millis(self.config.permit_horizon_ms)
    }

    pub fn tenant(name: &str) -> TenantId {
        TenantId::parse(name).expect("valid tenant")
    }

    pub async fn set_quota(&self, tenant: &str, rate: &str, burst: u32) {
        let quota = Quota::new(rate.parse().expect("valid rate"), burst).expect("valid quota");
        cli::set_tenant_quota(&self.quotas, tenant, quota, "test")
            .await
            .expect("quota set");
    }

    /// Applies a quota change as the admin would.
    pub async fn change(&self, target: Target, change: Change) {
        let actor = Actor {
            who: "test".into(),
            source: "cli",
        };
        self.quotas
            .apply(&target, change, &actor)
            .await
            .expect("change applied");
    }

    /// Starts a worker with this env's config, adjusted by `tweak`.
    pub async fn spawn_worker_with(&self, tweak: impl FnOnce(&mut Config)) -> WorkerHandle {
        let mut config = self.config.clone();
        tweak(&mut config);
        self.spawn_worker_from(config.worker_settings().expect("valid worker config"))
            .await
    }

    /// Starts a worker that connects to broker node `node` first (of the
    /// nodes `amqp_url` lists) instead of one picked at random.
    pub async fn spawn_worker_at_node(&self, node: usize) -> WorkerHandle {
        let mut settings = self.config.worker_settings().expect("valid worker config");
        settings.amqp_nodes = Arc::new(
            tollgate_amqp::Nodes::parse(&self.config.amqp_url)
                .expect("valid amqp_url")
                .starting_at(node),
        );
        self.spawn_worker_from(settings).await
    }

    async fn spawn_worker_from(&self, settings: tollgate_runtime::WorkerSettings) -> WorkerHandle {
        let metrics = Metrics::new(50, &[]);
        let worker =
            Arc::new(LiveWorker::new(&settings, metrics.clone()).expect("valid worker config"));
        let (stop, mut stopped) = watch::channel(false);
        let task = tokio::spawn(Arc::clone(&worker).run(async move {
            let _ = stopped.wait_for(|&s| s).await;
        }));
        wait_for("the worker to consume", Duration::from_secs(20), || async {
            worker.readiness().await.consuming
        })
        .await;
        WorkerHandle {
            metrics,
            worker,
            stop,
            task,
        }
    }

    pub async fn spawn_worker(&self) -> WorkerHandle {
        self.spawn_worker_with(|_| {}).await
    }

    /// Publishes `count` jobs for `tenant` through the same path as
    /// `tollgate publish`; returns them.
    pub async fn publish(
        &self,
        tenant: &str,
        count: u32,
        tweak: impl Fn(&mut cli::PublishArgs),
    ) -> Vec<Job> {
        let mut args = cli::PublishArgs::new(tenant, count);
        tweak(&mut args);
        let now = now();
        let jobs = cli::build_jobs(&args, now).expect("valid publish args");
        cli::publish_jobs(&self.broker, &jobs, now)
            .await
            .expect("published");
        jobs
    }

    /// Publishes an arbitrary body, as a careless producer might.
    pub async fn publish_raw(&self, routing_key: &str, body: &[u8]) {
        self.publish_raw_with(routing_key, body, job_properties())
            .await;
    }

    pub async fn publish_raw_with(&self, routing_key: &str, body: &[u8], props: BasicProperties) {
        self.broker
            .publish(
                &self.broker.topology().jobs_exchange(),
                routing_key,
                body,
                props,
            )
            .await
            .expect("raw publish confirmed");
    }

    /// Ready messages in every work and delay queue (not the DLQ).
    pub async fn pending(&self) -> u32 {
        let topology = self.broker.topology();
        let mut total = 0;
        for queue in topology.all_queues() {
            if queue != topology.dead_queue() {
                total += self.broker.queue_depth(&queue).await.expect("queue exists");
            }
        }
        total
    }

    /// The dead letters in queue order, read as the CLI and the console
    /// read them (one read at a time: a read takes each letter and puts a
    /// copy back, so a test's read beside the console's would see part).
    pub async fn dead_letters(&self) -> Vec<DeadLetter> {
        cli::dlq_letters(&self.config, 10_000)
            .await
            .expect("read the DLQ")
    }

    /// A connection of the test's own, and a channel on it, for what
    /// tollgate would never do itself (delete an exchange under a worker,
    /// declare a queue differently). Close the connection when done.
    pub async fn raw_channel(
        &self,
    ) -> (
        tollgate_amqp::lapin::Connection,
        tollgate_amqp::lapin::Channel,
    ) {
        let conn = tollgate_amqp::lapin::Connection::connect(
            self.config.amqp_url.expose(),
            tollgate_amqp::lapin::ConnectionProperties::default(),
        )
        .await
        .expect("RabbitMQ is reachable");
        let channel = conn.create_channel().await.expect("a channel");
        (conn, channel)
    }

    /// A fresh connection after the broker was restarted under us.
    pub async fn reconnect(&mut self) {
        self.broker = cli::connect_broker(&self.config, "test")
            .await
            .expect("RabbitMQ is back");
    }

    /// What `tenant` is doing fleet-wide, as the console shows it.
    pub async fn activity(&self, tenant: &str) -> tollgate_quota::Activity {
        self.quotas
            .activity(&[Self::tenant(tenant)])
            .await
            .expect("redis answers")
            .remove(0)
    }

    /// The admin API's state for this installation, behind `token`.
    pub fn admin_state(&self, token: &str) -> tollgate::admin::AdminState {
        tollgate::admin::AdminState {
            store: Arc::new(cli::quota_store(&self.config).expect("redis config")),
            token: Some(
                tollgate::admin::AdminToken::new(tollgate_core::Secret::new(token))
                    .expect("a long enough test token"),
            ),
            config: Arc::new(self.config.clone()),
        }
    }

    /// Serves `router` on a free local port until the test ends; returns
    /// where.
    pub async fn serve(&self, router: axum::Router) -> std::net::SocketAddr {
        let (addr, _server) = tollgate::http::serve(
            ([127, 0, 0, 1], 0).into(),
            router,
            self.config.server_limits(),
            std::future::pending(),
        )
        .await
        .expect("a free local port");
        addr
    }

    /// The admin API and the console, behind `token`, on a free local port.
    pub async fn serve_admin(&self, token: &str) -> std::net::SocketAddr {
        self.serve(tollgate::admin::router(self.admin_state(token)))
            .await
    }

    /// Waits until every queue of this test is empty, stops `workers`, then
    /// cleans up: the end of a run whose every job must have gone.
    pub async fn stop_when_drained(self, workers: impl IntoIterator<Item = WorkerHandle>) {
        self.drain_and_stop(workers).await;
        self.cleanup().await;
    }

    /// Waits until every queue of this test is empty, then stops `workers`.
    pub async fn drain_and_stop(&self, workers: impl IntoIterator<Item = WorkerHandle>) {
        wait_for("queues to drain", Duration::from_secs(20), || async {
            self.pending().await == 0
        })
        .await;
        for w in workers {
            w.stop().await.unwrap();
        }
    }

    /// Deletes this test's queues, exchanges and Redis keys.
    pub async fn cleanup(mut self) {
        self.cleaned = true;
        cleanup(&self.config).await;
    }
}

async fn cleanup(config: &Config) {
    if let Ok(broker) = cli::connect_broker(config, "cleanup").await {
        let _ = broker.delete_topology().await;
        broker.close().await;
    }
    if let Ok(store) = cli::quota_store(config) {
        let _ = store.purge_prefix().await;
    }
}

impl Drop for TestEnv {
    /// A failed test still cleans up after itself.
    fn drop(&mut self) {
        if self.cleaned {
            return;
        }
        let config = self.config.clone();
        let _ = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build();
            if let Ok(rt) = rt {
                rt.block_on(cleanup(&config));
            }
        })
        .join();
    }
}

pub fn now() -> UnixMillis {
    use tollgate_core::Clock;
    tollgate_runtime::system_clock::SystemClock.now()
}

/// Polls `check` until it returns true; panics with `what` after `timeout`.
pub async fn wait_for<F, Fut>(what: &str, timeout: Duration, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let started = Instant::now();
    while !check().await {
        assert!(
            started.elapsed() < timeout,
            "timed out after {timeout:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The `tollgate` binary built next to this test (`make test` builds it
/// before running the tests).
pub fn tollgate_bin() -> std::path::PathBuf {
    let exe = std::env::current_exe().expect("test binary path");
    let dir = exe
        .parent()
        .and_then(|deps| deps.parent())
        .expect("target/<profile>/deps");
    let bin = dir.join("tollgate");
    assert!(
        bin.exists(),
        "{} is missing: build it first (`cargo build -p tollgate`; `make test` does)",
        bin.display()
    );
    bin
}

/// A free TCP port on 127.0.0.1.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

/// A `tollgate worker` process on this env's prefix; killed on drop.
pub struct WorkerProcess {
    pub child: std::process::Child,
    pub http_port: u16,
}

impl WorkerProcess {
    /// The command that starts `tollgate worker` on this env's prefix and
    /// `provider_url`, serving HTTP on `http_port`; callers add to it.
    pub fn command(env: &TestEnv, provider_url: &str, http_port: u16) -> std::process::Command {
        let mut command = std::process::Command::new(tollgate_bin());
        command
            .arg("worker")
            .env("TOLLGATE_PREFIX", &env.config.prefix)
            .env("TOLLGATE_SHARDS", env.config.shards.to_string())
            .env("TOLLGATE_PROVIDER_URL", provider_url)
            .env("TOLLGATE_HTTP_ADDR", format!("127.0.0.1:{http_port}"))
            .stdout(std::process::Stdio::null());
        command
    }

    pub fn spawn(env: &TestEnv, provider_url: &str, extra: &[(&str, &str)]) -> Self {
        let http_port = free_port();
        let mut command = Self::command(env, provider_url, http_port);
        command.env(
            "RUST_LOG",
            std::env::var("RUST_LOG").unwrap_or_else(|_| "warn".into()),
        );
        if std::env::var_os("TEST_LOG").is_none() {
            command.stderr(std::process::Stdio::null());
        }
        for (k, v) in extra {
            command.env(k, v);
        }
        let child = command.spawn().expect("tollgate worker starts");
        Self { child, http_port }
    }

    /// Waits until `/readyz` answers 200.
    pub async fn ready(&self) {
        let url = format!("http://127.0.0.1:{}/readyz", self.http_port);
        let http = reqwest::Client::new();
        wait_for(
            "a worker process to be ready",
            Duration::from_secs(30),
            || async { http.get(&url).send().await.is_ok_and(|r| r.status() == 200) },
        )
        .await;
    }

    /// The sum of the samples on its `/metrics` whose line starts with
    /// `series` (a name, or a name and the start of its labels).
    pub async fn metric_sum(&self, series: &str) -> f64 {
        tollgate_dev::bench::scrape(self.http_port, series)
            .await
            .expect("/metrics answers")
    }
}

impl Drop for WorkerProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A `redis-server` of this test's own on a free port, which the test may
/// stop and start without touching the shared one.
pub struct PrivateRedis {
    pub port: u16,
    /// More `redis-server` arguments (e.g. `--requirepass`).
    args: Vec<String>,
    child: Option<std::process::Child>,
}

impl PrivateRedis {
    pub async fn start() -> Self {
        Self::start_on(free_port(), &[]).await
    }

    pub async fn start_on(port: u16, args: &[&str]) -> Self {
        let mut redis = Self {
            port,
            args: args.iter().map(|a| a.to_string()).collect(),
            child: None,
        };
        redis.start_again().await;
        redis
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    pub async fn start_again(&mut self) {
        assert!(self.child.is_none(), "already running");
        let child = std::process::Command::new("redis-server")
            .args(["--port", &self.port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no"])
            .args(&self.args)
            .stdout(std::process::Stdio::null())
            .spawn()
            .expect("redis-server starts");
        self.child = Some(child);
        let port = self.port;
        wait_for(
            "the private redis",
            Duration::from_secs(10),
            || async move { std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() },
        )
        .await;
    }

    /// Kills it (state is lost, as in a crash without persistence).
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for PrivateRedis {
    fn drop(&mut self) {
        self.stop();
    }
}

/// When the provider received each request of `tenant`, in order.
pub fn arrivals_of(received: &[Received], tenant: &str) -> Vec<std::time::Instant> {
    received
        .iter()
        .filter(|r| r.tenant == tenant)
        .map(|r| r.instant)
        .collect()
}

/// Accepted sends per idempotency key: a provider that honours
/// `Idempotency-Key` performs each key's effect once, however many requests
/// carry it. Returns (keys with an effect, requests repeating a key).
pub fn effects(received: &[Received]) -> (std::collections::HashSet<String>, usize) {
    let ok: Vec<&Received> = received
        .iter()
        .filter(|r| (200..300).contains(&r.status))
        .collect();
    let keys: std::collections::HashSet<String> =
        ok.iter().map(|r| r.idempotency_key.clone()).collect();
    let repeats = ok.len() - keys.len();
    (keys, repeats)
}

/// `PTTL` of a Redis key on this env's Redis, in milliseconds (-2: absent,
/// -1: no expiry).
pub async fn pttl(config: &Config, key: &str) -> i64 {
    let redis = tollgate_quota::Redis::new(&config.redis_settings()).expect("redis config");
    let mut conn = redis.conn().await.expect("redis reachable");
    tollgate_quota::redis_cmd("PTTL")
        .arg(key)
        .query_async(&mut conn)
        .await
        .expect("PTTL")
}
