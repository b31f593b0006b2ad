//! The worker runtime: consumes deliveries from every work queue and drives
//! each one through the core's state machine ([`JobRun`]), carrying out its
//! actions against RabbitMQ, Redis and the provider.
//!
//! [`Worker::run`] supervises RabbitMQ *sessions*: connect, declare, consume;
//! when a session is lost (broker restart, network, consumer cancelled) it
//! reconnects with backoff and jitter, and `/readyz` says not ready meanwhile.
//! Deliveries of a lost session are not acked: the broker hands them out
//! again, and the idempotency record stops a second send.
//! [`Worker::settle`] is one whole step: one delivery to its settled
//! outcome.

use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use futures::{FutureExt, StreamExt};
use governor::{DefaultDirectRateLimiter, RateLimiter};
use tokio::sync::watch;
use tokio::task::JoinSet;
use tollgate_amqp::headers;
use tollgate_amqp::lapin::message::Delivery;
use tollgate_amqp::{Acks, Broker, ConsumerControl, Consumption, Nodes, Source, Topology};
use tollgate_core::job::{Limits, decode};
use tollgate_core::outcome::classify;
use tollgate_core::ports::{
    Decided, Learned, Penalty, PermitRequest, PermitStore, PermitUse, Provider, ProviderCall,
};
use tollgate_core::{
    Action, Clock, Completion, DeadReason, Job, JobRun, Lane, Malformed, ParkReason,
    PermitDecision, Policy, Progress, ProviderOutcome, UnixMillis,
};
use tollgate_provider::HttpProvider;
use tollgate_quota::{QuotaStore, Redis, RedisPermits, Target};
use tracing::{Instrument, debug, error, info, info_span, warn};

use crate::baseline::Baseline;
use crate::commit::{CommitGate, Commitment, Shield};
use crate::health::Dependency;
use crate::holds::HoldGate;
use crate::lookahead::{Lookahead, Step, Via};
use crate::metrics::{Metrics, UNKNOWN_TENANT};
use crate::settings::WorkerSettings;
use crate::system_clock::SystemClock;
use crate::tally::{FLUSH_EVERY, Tally};
use crate::throttles::LocalThrottles;

/// How one delivery was settled.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Settled {
    /// Through the provider call (or past it: cancelled, a duplicate);
    /// `held`: held in the pod for a later slot or due time first.
    Completed {
        completion: Completion,
        held: bool,
    },
    Parked(ParkReason),
    DeadLettered(DeadReason),
    /// Not settled here (its successor could not be published, processing
    /// panicked or overran): handed back to the queue unharmed.
    Requeued,
}

pub struct Worker<P, V> {
    amqp_nodes: Arc<Nodes>,
    tls_ca_pem: Option<String>,
    topology: Topology,
    name: String,
    /// The current session's connection; `None` between sessions.
    broker: RwLock<Option<Arc<Broker>>>,
    permits: P,
    provider: V,
    metrics: Metrics,
    policy: Policy,
    limits: Limits,
    clock: Arc<dyn Clock>,
    /// Deliveries held at once (the AMQP prefetch).
    prefetch: u16,
    /// One permit per provider call in flight (`concurrency`).
    calls: Arc<tokio::sync::Semaphore>,
    shutdown_grace: Duration,
    /// Longest one delivery may take before it is handed back (a hang);
    /// never while its provider call or a broker retry is under way.
    delivery_timeout: Duration,
    /// Provider calls begin only while it is open; shutdown closes it.
    commits: CommitGate,
    /// What a provider call and its bookkeeping may take at most: shutdown
    /// stops new calls this long before its grace period ends.
    commit_reserve: Duration,
    redis_health: Dependency,
    amqp_health: Dependency,
    consuming: AtomicBool,
    /// The last Redis readiness check: when, and whether it answered.
    redis_checked: tokio::sync::Mutex<Option<(Instant, bool)>>,
    /// Set on shutdown: held jobs park at once instead of waiting.
    stopping: watch::Sender<bool>,
    holds: HoldGate,
    /// 429s this pod saw, to hold back the sends it had already reserved.
    throttles: LocalThrottles,
    /// Optional per-pod ceiling on provider calls (governor, local only).
    ceiling: Option<DefaultDirectRateLimiter>,
    /// Where the worker records how many work queues exist.
    quotas: QuotaStore,
    /// Re-seeds the quota baseline into Redis when quotas go missing.
    seeder: std::sync::Mutex<Option<Seeder>>,
    /// Parks and provider calls not yet counted in Redis (the console's
    /// figures).
    tally: Tally,
    /// Numbers the sessions, so a delivery settled after its session was
    /// lost is not counted against the next one's consumers.
    sessions: AtomicU64,
}

/// No look-ahead consumer opens while a pod holds this many bytes of
/// deliveries (a 2,000-job burst of 1 KiB bodies is 2 MiB).
const LOOKAHEAD_MAX_BYTES: usize = 64 << 20;

/// A delivery's task, done: what the look-ahead counts.
struct Done {
    session: u64,
    source: Source,
    bytes: usize,
    settled: Settled,
}

/// The quota baseline and how often to make sure Redis holds it.
struct Seeder {
    /// The file, re-read at every pass (a ConfigMap changes in place).
    path: String,
    /// The last version of it that parsed.
    baseline: Baseline,
    store: QuotaStore,
    every: Duration,
}

impl Seeder {
    /// Seeds now and then every `every`, until the worker stops.
    async fn run(mut self, mut stopping: watch::Receiver<bool>) {
        loop {
            match Baseline::load(&self.path) {
                Ok(baseline) => self.baseline = baseline,
                Err(e) => warn!(
                    error = format!("{e:#}"),
                    "the quota baseline no longer parses: seeding its last good version"
                ),
            }
            match self.baseline.seed(&self.store, false).await {
                Ok(written) if !written.is_empty() => {
                    let targets: Vec<String> = written.iter().map(Target::label).collect();
                    warn!(
                        ?targets,
                        "quotas were missing in Redis: seeded from the baseline"
                    );
                }
                Ok(_) => {}
                Err(e) => warn!(error = format!("{e:#}"), "seeding the quota baseline"),
            }
            tokio::select! {
                () = tokio::time::sleep(self.every) => {}
                _ = stopping.wait_for(|&s| s) => return,
            }
        }
    }
}

/// The worker wired to the real adapters.
pub type LiveWorker = Worker<RedisPermits, HttpProvider>;

impl LiveWorker {
    /// Builds the worker; nothing connects until [`Worker::run`].
    pub fn new(settings: &WorkerSettings, metrics: Metrics) -> anyhow::Result<Self> {
        let s = settings;
        let redis = Arc::new(Redis::new(&s.redis)?);
        let store = || QuotaStore::new(Arc::clone(&redis), redis.keys(&s.prefix));
        let seeder = s.baseline.as_ref().map(|b| Seeder {
            path: b.path.clone(),
            baseline: b.baseline.clone(),
            store: store(),
            every: b.every,
        });
        let calls = metrics.clone();
        let permits =
            RedisPermits::new(Arc::clone(&redis), redis.keys(&s.prefix), s.permits.clone())
                .observing_calls(Arc::new(move |call, took| calls.redis_call(call, took)));
        let provider = HttpProvider::new(s.routes.clone(), s.provider_timeout)?;
        Ok(Self {
            amqp_nodes: Arc::clone(&s.amqp_nodes),
            tls_ca_pem: s.tls_ca_pem.clone(),
            topology: s.topology.clone(),
            name: s.name.clone(),
            broker: RwLock::new(None),
            permits,
            provider,
            metrics,
            policy: s.policy.clone(),
            limits: s.limits,
            clock: Arc::new(SystemClock),
            prefetch: s.prefetch,
            calls: Arc::new(tokio::sync::Semaphore::new(usize::from(
                s.concurrency.max(1),
            ))),
            shutdown_grace: s.shutdown_grace,
            delivery_timeout: s.delivery_timeout,
            commits: CommitGate::default(),
            commit_reserve: longest_call(s.provider_timeout),
            redis_health: Dependency::new("Redis", s.redis_url_shown.clone()),
            amqp_health: Dependency::new("RabbitMQ", s.amqp_nodes.redacted()),
            consuming: AtomicBool::new(false),
            redis_checked: tokio::sync::Mutex::new(None),
            stopping: watch::channel(false).0,
            holds: HoldGate::new(s.tenant_hold_max),
            throttles: LocalThrottles::default(),
            seeder: std::sync::Mutex::new(seeder),
            tally: Tally::default(),
            sessions: AtomicU64::new(0),
            quotas: store(),
            ceiling: s.pod_max_rate.map(|rate| {
                let period = Duration::from_micros(rate.interval_micros());
                RateLimiter::direct(
                    governor::Quota::with_period(period).expect("a rate has a non-zero period"),
                )
            }),
        })
    }
}

/// What `/readyz` reports.
#[derive(Clone, Copy, Debug, serde::Serialize)]
pub struct Readiness {
    pub amqp: bool,
    pub redis: bool,
    pub consuming: bool,
}

impl Readiness {
    pub fn ready(&self) -> bool {
        self.amqp && self.redis && self.consuming
    }
}

/// How long a Redis readiness answer is reused.
const READINESS_TTL: Duration = Duration::from_secs(1);

/// A lane queue's delivery: its queue and the consumer it came by.
fn lane_of(source: Source) -> Option<(usize, Via)> {
    match source {
        Source::Lane { queue, via } => Some((queue, via)),
        Source::Draining => None,
    }
}

/// Carries out a look-ahead step on the session's consumers. A consumer
/// that cannot be opened or cancelled is logged: the channel is failing,
/// and the session ends with it.
async fn look_ahead(consumption: &mut Consumption, metrics: &Metrics, step: Step) {
    match step {
        Step::Open { queue, prefetch } => {
            match consumption.control.look_ahead(queue, prefetch).await {
                Ok(stream) => {
                    consumption.deliveries.push(stream);
                    let (lane, name) = consumption.control.lane_queue(queue);
                    metrics.look_ahead_opened(lane.lane());
                    info!(
                        queue = name,
                        prefetch,
                        "a queue delivers only jobs to park or hold for later: looking further ahead"
                    );
                }
                Err(e) => warn!(error = %e, "opening a look-ahead consumer"),
            }
        }
        Step::Close { queue } => match consumption.control.stop_looking_ahead(queue).await {
            Ok(()) => info!(
                queue = consumption.control.lane_queue(queue).1,
                "a queue delivers due work or nothing: back to its share of the prefetch"
            ),
            Err(e) => warn!(error = %e, "cancelling look-ahead consumers"),
        },
    }
}

/// How a session ended.
enum SessionEnd {
    /// Shutdown was asked for; the consumers are cancelled and the channel
    /// stays open until in-flight deliveries are acked.
    Shutdown(Box<ConsumerControl>, Arc<Broker>),
    /// Shutdown was asked for before the session was consuming.
    Stopped,
    /// The connection or the consumer was lost.
    Lost(String),
}

/// Why a delivery was handed back to its queue instead of settled: its
/// successor could not be published and the connection is gone.
#[derive(Debug)]
struct Handback(tollgate_amqp::AmqpError);

/// How long a sent record is still retried once the worker is stopping
/// (until then, for as long as Redis is away: the delivery is kept
/// unacked, since a copy that asks once the call's lease has expired finds
/// no record and is sent again).
const RECORD_RETRY_FOR: Duration = Duration::from_secs(4);

/// The longest a provider call begun now may take to settle: its timeout,
/// its sent record's retries, and a second. Shutdown stops beginning calls
/// this long before its grace period ends, and waits for those begun even
/// past it (never abandons a send): a grace period shorter than this is
/// overrun by a call begun just before the stop.
pub fn longest_call(provider_timeout: Duration) -> Duration {
    provider_timeout + RECORD_RETRY_FOR + Duration::from_secs(1)
}

/// Reconnect backoff: 0.25 s doubling to 3 s, jittered to 50–100 %, so a
/// worker consumes again within about 3 s of the broker's return and a
/// fleet does not reconnect in step.
pub fn reconnect_delay(failures: u32) -> Duration {
    backoff(
        Duration::from_millis(250),
        Duration::from_secs(3),
        failures,
        rand::random(),
    )
}

/// Waits between retries of a publish the broker refused.
fn republish_delay(failures: u32) -> Duration {
    backoff(
        Duration::from_millis(200),
        Duration::from_secs(10),
        failures,
        rand::random(),
    )
}

/// `base` doubling per failure up to `max`, times 0.5 + 0.5 × `jitter`.
fn backoff(base: Duration, max: Duration, failures: u32, jitter: f64) -> Duration {
    let ceiling = base.saturating_mul(1 << failures.min(16)).min(max);
    ceiling.mul_f64(0.5 + 0.5 * jitter.clamp(0.0, 1.0))
}

/// Decrements the in-flight gauge however a delivery ends (even a panic).
struct InFlight(Metrics);

impl InFlight {
    fn new(metrics: &Metrics) -> Self {
        metrics.in_flight().inc();
        Self(metrics.clone())
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.in_flight().dec();
    }
}

impl<P: PermitStore, V: Provider> Worker<P, V> {
    fn set_consuming(&self, consuming: bool) {
        self.consuming.store(consuming, Ordering::Relaxed);
        self.metrics.set_consuming(consuming);
    }

    /// The current session's broker connection, if any.
    pub fn broker(&self) -> Option<Arc<Broker>> {
        self.broker.read().expect("not poisoned").clone()
    }

    /// Whether Redis answers. Asked at most once a second, whatever the
    /// probe rate (concurrent callers share one answer).
    async fn check_redis(&self) -> bool {
        let mut checked = self.redis_checked.lock().await;
        if let Some((at, up)) = *checked
            && at.elapsed() < READINESS_TTL
        {
            return up;
        }
        let answer = tokio::time::timeout(Duration::from_secs(1), self.permits.ping()).await;
        let up = match answer {
            Ok(Ok(())) => {
                self.redis_health.up();
                true
            }
            Ok(Err(e)) => {
                self.redis_health.down(&e.to_string());
                false
            }
            Err(_) => {
                self.redis_health.down("no answer to PING within 1 s");
                false
            }
        };
        *checked = Some((Instant::now(), up));
        up
    }

    /// What `/readyz` reports.
    pub async fn readiness(&self) -> Readiness {
        let redis = self.check_redis().await;
        Readiness {
            amqp: self.broker().is_some_and(|b| b.is_connected()),
            redis,
            consuming: self.consuming.load(Ordering::Relaxed),
        }
    }

    /// Runs sessions until `shutdown` resolves, reconnecting whenever one is
    /// lost. On shutdown: cancel the consumers (no new deliveries), park held
    /// jobs at once, let in-flight deliveries settle within the grace
    /// period, then close. Provider calls already begun always finish and
    /// are recorded and acked: late in the grace period no new one begins,
    /// so they finish within it. Returns an error only if deliveries were
    /// left unsettled (they return to their queue).
    pub async fn run(self: Arc<Self>, shutdown: impl Future<Output = ()>) -> anyhow::Result<()> {
        let mut tasks = JoinSet::new();
        tokio::pin!(shutdown);
        let mut failures = 0u32;
        let seeder = self.seeder.lock().expect("not poisoned").take();
        let seeding = seeder.map(|seeder| tokio::spawn(seeder.run(self.stopping.subscribe())));
        let watching = tokio::spawn(Arc::clone(&self).watch_redis());
        let counting = tokio::spawn(Arc::clone(&self).count_activity());
        let last = loop {
            match self.session(&mut tasks, &mut shutdown).await {
                Ok(SessionEnd::Shutdown(control, broker)) => break Some((control, broker)),
                Ok(SessionEnd::Stopped) => break None,
                Ok(SessionEnd::Lost(why)) => {
                    failures = 1;
                    self.amqp_health.down(&format!("session lost: {why}"));
                }
                Err(e) => {
                    failures += 1;
                    self.amqp_health.down(&format!("{e:#}"));
                }
            }
            self.set_consuming(false);
            let wait = reconnect_delay(failures);
            info!(
                retry_in_ms = wait.as_millis() as u64,
                "reconnecting to RabbitMQ"
            );
            tokio::select! {
                () = &mut shutdown => break None,
                () = tokio::time::sleep(wait) => {}
            }
        };
        self.set_consuming(false);
        self.stopping.send_replace(true);
        let grace_ends = tokio::time::Instant::now() + self.shutdown_grace;
        if let Some(seeding) = seeding {
            let _ = seeding.await;
        }
        let _ = watching.await;
        info!(in_flight = tasks.len(), "draining in-flight deliveries");
        let drain = async |tasks: &mut JoinSet<Done>| while tasks.join_next().await.is_some() {};
        let calls_end = grace_ends - self.commit_reserve.min(self.shutdown_grace);
        let _ = tokio::time::timeout_at(calls_end, drain(&mut tasks)).await;
        if !tasks.is_empty() {
            info!(
                in_flight = tasks.len(),
                "no new provider calls from now on; waiting for the calls begun"
            );
            self.commits.close().await;
            // What is left never began a call: it parks or is handed back.
            let deadline = grace_ends.max(tokio::time::Instant::now() + Duration::from_secs(1));
            let _ = tokio::time::timeout_at(deadline, drain(&mut tasks)).await;
        }
        let left = tasks.len();
        tasks.abort_all();
        // The parks and calls of the drain too, if Redis answers at once: a
        // console figure never holds up a shutdown.
        let _ = counting.await;
        let _ = tokio::time::timeout(Duration::from_secs(1), self.flush_tally()).await;
        if let Some((control, broker)) = last {
            control.close().await;
            broker.close().await;
        }
        *self.broker.write().expect("not poisoned") = None;
        if left > 0 {
            anyhow::bail!(
                "grace period over with {left} deliveries unsettled (none had begun a provider \
                 call): they return to their queue"
            );
        }
        Ok(())
    }

    /// Checks Redis every few seconds until the worker stops, so its state
    /// is logged (and `/readyz` current) even when no job asks it.
    async fn watch_redis(self: Arc<Self>) {
        let mut stopping = self.stopping.subscribe();
        loop {
            self.check_redis().await;
            tokio::select! {
                () = tokio::time::sleep(Duration::from_secs(2)) => {}
                _ = stopping.wait_for(|&s| s) => return,
            }
        }
    }

    /// Adds this pod's tally of parks and calls to the fleet-wide counts
    /// every [`FLUSH_EVERY`] until the worker stops.
    async fn count_activity(self: Arc<Self>) {
        let mut stopping = self.stopping.subscribe();
        loop {
            tokio::select! {
                () = tokio::time::sleep(FLUSH_EVERY) => {}
                _ = stopping.wait_for(|&s| s) => return,
            }
            self.flush_tally().await;
        }
    }

    async fn flush_tally(&self) {
        let now = self.clock.now();
        let taken = self.tally.take(now);
        if taken.is_empty() {
            return;
        }
        if let Err(not) = self.quotas.count_activity(&taken, now.0).await {
            // Console figures: what was not added is kept for the next
            // try, never in a job's way.
            debug!(error = %not.error, "counting parked jobs and provider calls in Redis");
            self.tally.restore(not.untaken);
        }
    }

    /// Connects, declares the topology and starts the consumers, each step
    /// bounded.
    async fn connect(&self) -> anyhow::Result<(Arc<Broker>, tollgate_amqp::Consumption)> {
        let broker = Arc::new(
            Broker::connect(
                &self.amqp_nodes,
                self.tls_ca_pem.as_deref(),
                &self.name,
                self.topology.clone(),
            )
            .await?,
        );
        let consuming = async {
            for queue in crate::topology::declare(&broker, &self.quotas, None).await? {
                let depth = broker.queue_depth(&queue).await.unwrap_or(0);
                warn!("{}", crate::topology::draining_note(&queue, depth));
            }
            anyhow::Ok(broker.consume(&self.name, self.prefetch).await?)
        };
        match consuming.await {
            Ok(consumption) => Ok((broker, consumption)),
            Err(e) => {
                // A node that takes connections but cannot serve the queues
                // (cut off from the rest of its cluster): try another next.
                self.amqp_nodes.lost(broker.node());
                broker.close().await;
                Err(e)
            }
        }
    }

    /// One connection: connect, declare, consume until shutdown or loss.
    /// Shutdown is heard at every step, connecting included.
    async fn session(
        self: &Arc<Self>,
        tasks: &mut JoinSet<Done>,
        shutdown: &mut std::pin::Pin<&mut impl Future<Output = ()>>,
    ) -> anyhow::Result<SessionEnd> {
        let (broker, mut consumption) = tokio::select! {
            connected = self.connect() => connected?,
            () = shutdown.as_mut() => return Ok(SessionEnd::Stopped),
        };
        *self.broker.write().expect("not poisoned") = Some(Arc::clone(&broker));
        self.amqp_health.up();
        self.set_consuming(true);
        info!(name = %self.name, prefetch = self.prefetch, "worker consuming");
        let session = self.sessions.fetch_add(1, Ordering::Relaxed);
        let mut lookahead = Lookahead::new(
            consumption.control.lane_count(),
            consumption.control.share(),
            LOOKAHEAD_MAX_BYTES,
        );
        let started = tokio::time::Instant::now();
        let ms = || started.elapsed().as_millis() as i64;
        let mut health = tokio::time::interval(Duration::from_secs(1));
        let lost = loop {
            let step = tokio::select! {
                () = shutdown.as_mut() => break None,
                next = consumption.deliveries.next() => match next {
                    Some((source, Ok(delivery))) => {
                        let bytes = delivery.data.len();
                        if delivery.redelivered {
                            // Counted toward the delivery limit: a pod that
                            // died, or a look-ahead cancelled mid-send.
                            let lane = match lane_of(source) {
                                Some((queue, _)) => consumption.control.lane_queue(queue).0.lane(),
                                None => "draining",
                            };
                            self.metrics.redelivered(lane);
                        }
                        let (worker, broker) = (Arc::clone(self), Arc::clone(&broker));
                        let acks = consumption.acks.clone();
                        // Boxed: the job's state machine (12.5 KB in a release
                        // build) is copied once into the box, then handed
                        // through spawn's layers by pointer (memmove fell from
                        // 7.3 % to 4.6 % of the worker's time at prefetch 64).
                        tasks.spawn(Box::pin(async move {
                            let settled = worker.settle(&broker, &acks, delivery).await;
                            Done { session, source, bytes, settled }
                        }));
                        lane_of(source).and_then(|(queue, via)| {
                            lookahead.delivered(queue, via, bytes, ms())
                        })
                    }
                    Some((_, Err(e))) => break Some(e.to_string()),
                    None => break Some("the broker cancelled the consumer".to_owned()),
                },
                Some(done) = tasks.join_next(), if !tasks.is_empty() => match done {
                    Ok(done) if done.session == session => {
                        lane_of(done.source).and_then(|(queue, via)| {
                            let not_due = match done.settled {
                                Settled::Parked(_) => true,
                                Settled::Completed { held, .. } => held,
                                Settled::DeadLettered(_) | Settled::Requeued => false,
                            };
                            lookahead.settled(queue, via, done.bytes, not_due)
                        })
                    }
                    _ => None,
                },
                _ = health.tick() => {
                    if !broker.connection_alive() {
                        break Some("the connection closed".to_owned());
                    }
                    if !broker.is_connected()
                        && let Err(e) = broker.repair_publisher(None).await
                    {
                        warn!(error = %e, "reopening the publisher channel");
                    }
                    for step in lookahead.tick(ms()) {
                        look_ahead(&mut consumption, &self.metrics, step).await;
                    }
                    None
                }
            };
            if let Some(step) = step {
                look_ahead(&mut consumption, &self.metrics, step).await;
            }
        };
        self.set_consuming(false);
        match lost {
            Some(why) => {
                // Its node may be down: the next session tries another first.
                self.amqp_nodes.lost(broker.node());
                broker.close().await;
                Ok(SessionEnd::Lost(why))
            }
            None => {
                if let Err(e) = consumption.control.cancel().await {
                    warn!(error = %e, "cancelling consumers");
                }
                Ok(SessionEnd::Shutdown(Box::new(consumption.control), broker))
            }
        }
    }

    /// Runs [`Worker::process`] guarded: a panic or an overrun hands the
    /// delivery back to its queue (its delivery count rises, so a message
    /// that keeps crashing workers ends in the DLQ as `poison`). An overrun
    /// while a provider call or a broker retry is under way is waited out:
    /// handing back a delivery whose call may have been accepted would send
    /// it twice, and a broker's refusal is not the job's fault.
    async fn settle(&self, broker: &Broker, acks: &Acks, delivery: Delivery) -> Settled {
        let (acker, tag) = (delivery.acker.clone(), delivery.delivery_tag);
        let shield = Shield::default();
        let work = AssertUnwindSafe(self.process(broker, acks, delivery, &shield)).catch_unwind();
        tokio::pin!(work);
        let failure = tokio::select! {
            done = &mut work => match done {
                Ok(settled) => return settled,
                Err(_) => "processing panicked",
            },
            () = tokio::time::sleep(self.delivery_timeout) => {
                if shield.raised() {
                    warn!("delivery_timeout_ms passed during a provider call or a broker retry: letting it finish");
                    match work.await {
                        Ok(settled) => return settled,
                        Err(_) => "processing panicked",
                    }
                } else {
                    "processing overran delivery_timeout_ms"
                }
            }
        };
        error!(failure, "handing the delivery back to its queue");
        if let Err(e) = acks.requeue(&acker, tag).await {
            warn!(error = %e, "requeue failed: the broker requeues it when the channel closes");
        }
        Settled::Requeued
    }

    /// Carries one delivery to a settled outcome and acks it (or hands it
    /// back when its successor could not be published).
    async fn process(
        &self,
        broker: &Broker,
        acks: &Acks,
        delivery: Delivery,
        shield: &Shield,
    ) -> Settled {
        let _in_flight = InFlight::new(&self.metrics);
        // Dropped only once the delivery is acked (or handed back).
        let mut commitment = Commitment::new(shield.clone());
        match self.handle(broker, &delivery, &mut commitment).await {
            Ok(settled) => {
                // Once asked for, the ack may go out in a frame with others:
                // an overrun must not hand the delivery back meanwhile.
                let _acking = shield.raise();
                if let Err(e) = acks.ack(&delivery).await {
                    warn!(error = %e, "ack failed: the broker will redeliver, idempotency stops a double send");
                }
                settled
            }
            Err(Handback(e)) => {
                error!(
                    error = %e,
                    "could not publish a parked or dead-lettered copy and the connection is gone"
                );
                if let Err(e) = acks.requeue(&delivery.acker, delivery.delivery_tag).await {
                    warn!(error = %e, "requeue failed: the broker requeues it when the channel closes");
                }
                Settled::Requeued
            }
        }
    }

    /// Publishes a delivery's successor (`publish`), retrying in place with
    /// backoff and jitter while the broker refuses it and the connection
    /// lives: the delivery stays unacked meanwhile and nothing counts
    /// against the job. A closed publisher channel is reopened (and the
    /// topology declared again). Gives up only when the connection is gone;
    /// the broker then hands the delivery out again.
    async fn publish_durably<F, Fut>(
        &self,
        broker: &Broker,
        shield: &Shield,
        what: &'static str,
        publish: F,
    ) -> Result<(), Handback>
    where
        F: Fn() -> Fut,
        Fut: Future<Output = Result<(), tollgate_amqp::AmqpError>>,
    {
        let mut failures = 0u32;
        let mut _shielded = None;
        loop {
            let error = match publish().await {
                Ok(()) => return Ok(()),
                Err(e) => e,
            };
            if !broker.connection_alive() {
                return Err(Handback(error));
            }
            _shielded.get_or_insert_with(|| shield.raise());
            if let Err(e) = broker.repair_publisher(Some(&error)).await {
                warn!(error = %e, "reopening the publisher channel");
            }
            let wait = republish_delay(failures);
            failures += 1;
            if matches!(error, tollgate_amqp::AmqpError::Timeout(_)) {
                // Unconfirmed is not refused: the copy may be there already,
                // and publishing again may leave it twice (a parked copy's
                // second is a `duplicate`; a dead letter may be listed twice).
                warn!(error = %error, what, failures, retry_in_ms = wait.as_millis() as u64,
                    "a publish went unconfirmed: publishing again, the delivery is kept (the copy \
                    may end up there twice)");
            } else {
                warn!(error = %error, what, failures, retry_in_ms = wait.as_millis() as u64,
                    "the broker refused a publish: retrying, the delivery is kept");
            }
            tokio::time::sleep(wait).await;
        }
    }

    async fn handle(
        &self,
        broker: &Broker,
        delivery: &Delivery,
        commitment: &mut Commitment,
    ) -> Result<Settled, Handback> {
        let now = self.clock.now();
        let progress = headers::read_delivery_progress(
            delivery.properties.headers().as_ref(),
            delivery.redelivered,
        );
        let job = progress
            .and_then(|p| Ok((decode(&delivery.data, &self.limits)?, p)))
            .and_then(|(job, p)| self.check_envelope(delivery, &job).map(|()| (job, p)));
        let (job, progress) = match job {
            Ok(ok) => ok,
            Err(malformed) => {
                return self
                    .reject_malformed(broker, delivery, &malformed, now, commitment)
                    .await;
            }
        };
        let tenant = self.metrics.tenant(job.tenant.as_str());
        if let Some(entered) = progress.enqueued_at.or_else(|| {
            delivery
                .properties
                .timestamp()
                // A producer's seconds; nonsense (nanoseconds) is no age.
                .and_then(|s| i64::try_from(s).ok()?.checked_mul(1000))
                .map(UnixMillis)
        }) {
            self.metrics.queue_age(&tenant, entered.until(now));
        }
        let span = info_span!(
            "job",
            job_id = %job.id,
            tenant_id = %job.tenant,
            attempt = progress.attempt.saturating_add(1),
        );
        self.drive(
            broker,
            delivery,
            &job,
            &tenant,
            JobRun::new(&job, progress, now),
            commitment,
        )
        .instrument(span)
        .await
    }

    /// The checks that need more than the body: the routing key must be the
    /// tenant (it decides the work queue) and the kind must have a route.
    fn check_envelope(&self, delivery: &Delivery, job: &Job) -> Result<(), Malformed> {
        if delivery.routing_key.as_str() != job.tenant.as_str() {
            return Err(Malformed::RoutingKey {
                routing_key: delivery.routing_key.as_str().to_owned(),
                tenant: job.tenant.as_str().to_owned(),
            });
        }
        if self.provider.route(job).is_none() {
            return Err(Malformed::UnknownKind(job.kind.to_string()));
        }
        Ok(())
    }

    async fn reject_malformed(
        &self,
        broker: &Broker,
        delivery: &Delivery,
        malformed: &Malformed,
        now: UnixMillis,
        commitment: &Commitment,
    ) -> Result<Settled, Handback> {
        // The error may quote the producer's bytes (an unknown field's name):
        // no escape sequence reaches a header, a log line or a terminal.
        let detail = tollgate_core::outcome::printable(&malformed.to_string());
        self.publish_durably(broker, commitment.shield(), "a dead letter", || {
            broker.dead_letter(delivery, None, DeadReason::Malformed, &detail, now)
        })
        .await?;
        // Only a valid tenant may become a label.
        let tenant = tollgate_core::TenantId::parse(delivery.routing_key.as_str())
            .map(|t| self.metrics.tenant(t.as_str()))
            .unwrap_or_else(|_| UNKNOWN_TENANT.to_owned());
        self.metrics
            .dead_lettered(&tenant, DeadReason::Malformed, Duration::ZERO);
        warn!(decision = "dead_lettered", reason = "malformed", detail = %detail, "malformed message");
        Ok(Settled::DeadLettered(DeadReason::Malformed))
    }

    async fn drive(
        &self,
        broker: &Broker,
        delivery: &Delivery,
        job: &Job,
        tenant: &str,
        mut run: JobRun,
        commitment: &mut Commitment,
    ) -> Result<Settled, Handback> {
        let lease_token = uuid::Uuid::new_v4().to_string();
        let mut request = PermitRequest {
            tenant: &job.tenant,
            route: &job.kind,
            job_id: &job.id,
            key: &job.idempotency_key,
            priority: job.priority,
            lease_token: &lease_token,
            returning: None,
            reserve_within: None,
        };
        let route = self.provider.route(job).unwrap_or("default");
        let mut now = self.clock.now();
        let mut action = run.next(&self.policy, now);
        // A call slot kept while a late permit is asked for again, so that
        // a permit granted for now is used at once, not late again.
        let mut kept_call: Option<tokio::sync::OwnedSemaphorePermit> = None;
        // Held in this pod for later at some point (see `Settled`).
        let mut held = false;
        loop {
            if !matches!(action, Action::AskPermit | Action::CallProvider) {
                kept_call = None;
            }
            action = match action {
                Action::AwaitSlot { until } => {
                    commitment.end();
                    // Held whatever the hold cap: the permit is taken, and
                    // shutdown lets it go out (the slot is at most one
                    // permit horizon away).
                    let _slot = self.holds.hold(&job.tenant, true);
                    held |= !now.until(until).is_zero();
                    debug!(
                        decision = "reserved",
                        wait_ms = now.until(until).as_millis() as u64
                    );
                    tokio::time::sleep(now.until(until)).await;
                    now = self.clock.now();
                    run.next(&self.policy, now)
                }
                Action::Hold { until, reason } => {
                    // Waiting again: nothing begun that cannot be stopped.
                    commitment.end();
                    // Held only while this pod holds few of the tenant's
                    // jobs, so one tenant's waits cannot fill the prefetch
                    // and block the tenants behind it; a copy back for its
                    // kept place, and a wait too short to park without
                    // going late, are held whatever the cap.
                    let forced = run.held_whatever_the_cap(&self.policy, now, until, reason);
                    let Some(_slot) = self.holds.hold(&job.tenant, forced) else {
                        action = run.park_instead(&self.policy, now, until, reason);
                        continue;
                    };
                    held |= !now.until(until).is_zero();
                    debug!(
                        decision = "held",
                        wait_ms = now.until(until).as_millis() as u64
                    );
                    let mut stopping = self.stopping.subscribe();
                    tokio::select! {
                        () = tokio::time::sleep(now.until(until)) => {}
                        // Shutting down: park it at once.
                        Ok(_) = stopping.wait_for(|&s| s) => {
                            now = self.clock.now();
                            action = run.park_instead(&self.policy, now, until, reason);
                            continue;
                        }
                    }
                    now = self.clock.now();
                    run.next(&self.policy, now)
                }
                Action::Park {
                    until,
                    reason,
                    tier,
                    hop,
                } => {
                    let wait = now.until(until);
                    let lane = Lane::of(wait, tier);
                    let stay = lane.stay(wait, tier);
                    let progress = Progress {
                        enqueued_at: Some(now.saturating_add(stay)),
                        ..run.progress().clone()
                    };
                    self.publish_durably(broker, commitment.shield(), "a parked copy", || {
                        broker.park(delivery, &job.tenant, &progress, tier, lane, stay)
                    })
                    .await?;
                    self.metrics.tier_publish(tier);
                    self.tally
                        .park(&job.tenant, reason, now.saturating_add(stay), tier);
                    if hop {
                        debug!(
                            reason = reason.as_str(),
                            tier_ms = tier.as_millis() as u64,
                            wait_ms = wait.as_millis() as u64,
                            "hop"
                        );
                    } else {
                        self.metrics.parked(tenant, reason);
                        self.log_decision(job, &run, "parked", wait, Some(reason.as_str()));
                    }
                    return Ok(Settled::Parked(reason));
                }
                Action::CheckEligibility => {
                    let eligibility = self.provider.eligibility(job).await;
                    now = self.clock.now();
                    run.on_eligibility(&self.policy, eligibility, now, rand::random())
                }
                Action::AskPermit => {
                    if let Some(ceiling) = &self.ceiling {
                        // This pod's own ceiling, before taking a fleet permit
                        // it could not use.
                        ceiling.until_ready().await;
                    }
                    request.returning = run.returning();
                    // A reservation is held until its slot: when the tenant
                    // has no hold room left here, take only one within the
                    // smallest tier (a wait that could not be parked
                    // anyway), else be given a place in line and park.
                    request.reserve_within =
                        (!self.holds.has_room(&job.tenant)).then(|| self.policy.tiers.shortest());
                    let decided = match self.permits.acquire(request).await {
                        Ok(decided) => {
                            self.redis_health.up();
                            decided
                        }
                        Err(e) => {
                            // Fail closed: no provider call without a permit.
                            self.redis_health.down(&e.to_string());
                            Decided {
                                decision: PermitDecision::Unavailable,
                                made_at: self.clock.now(),
                            }
                        }
                    };
                    self.metrics.permit(tenant, &decided.decision);
                    now = self.clock.now();
                    run.on_permit(
                        &self.policy,
                        decided.decision,
                        decided.made_at,
                        now,
                        rand::random(),
                    )
                }
                Action::CallProvider => {
                    let scope = self.provider.throttle_scope(job);
                    if let Some(until) =
                        self.throttles
                            .paused_until(scope, &job.tenant, &job.kind, now)
                    {
                        // Reserved before a 429 this pod saw: hold it back.
                        self.complete_permit(request, PermitUse::Unused, None).await;
                        action = run.hold_back(&self.policy, until, now);
                        continue;
                    }
                    // One of this pod's `concurrency` call slots; a job that
                    // waits for one holds its delivery (and its permit).
                    let call = match kept_call.take() {
                        Some(call) => call,
                        None => Arc::clone(&self.calls)
                            .acquire_owned()
                            .await
                            .expect("the call semaphore is never closed"),
                    };
                    now = self.clock.now();
                    if let Some(again) = run.too_late(now) {
                        // Its slot passed while it waited: sent now, it could
                        // put one more than the quota in the provider's
                        // window. The slot is spent; ask again, keeping the
                        // call slot.
                        self.metrics.late_permit(tenant);
                        debug!("permit too late to use: asking again");
                        self.complete_permit(request, PermitUse::Unused, None).await;
                        kept_call = Some(call);
                        action = again;
                        continue;
                    }
                    if !commitment.begin(&self.commits).await {
                        // Shutting down: too late in the grace period to
                        // begin a call. Release the permit and park it for
                        // the next pod, its progress with it. Handed back
                        // (a requeue), it counted as a delivery that never
                        // settled: five shutdowns in a row dead-lettered a
                        // job that never reached the provider as `poison`.
                        self.complete_permit(request, PermitUse::Unused, None).await;
                        drop(call);
                        now = self.clock.now();
                        action = run.park_instead(&self.policy, now, now, ParkReason::Backoff);
                        continue;
                    }
                    let attempt = run.attempt();
                    let due_lag = run.first_call().then(|| run.due_reference().until(now));
                    if let Some(lag) = due_lag {
                        self.metrics.due_lag(tenant, lag);
                    }
                    let started = Instant::now();
                    let began = self.clock.now();
                    let response = self.provider.call(ProviderCall { job, attempt }).await;
                    let took = started.elapsed();
                    // For a trace of a send that came late to the provider:
                    // how far past its permit's slot the call began, and
                    // how long it took.
                    debug!(
                        late_ms = run.slot().map(|slot| slot.until(began).as_millis() as u64),
                        took_ms = took.as_millis() as u64,
                        "provider called"
                    );
                    // The call is over: its slot goes to the next job now,
                    // not after the sent record's round trip. Held through
                    // it, a granted permit waiting for the slot went past
                    // its leeway (10 ms on a 30/s route) whenever Redis was
                    // slow to answer, and the route slot it let go idle
                    // went to whoever asked, whatever the shares.
                    drop(call);
                    now = self.clock.now();
                    let outcome = classify(&response, now);
                    self.metrics.provider(tenant, route, &outcome, took);
                    let sent = matches!(outcome, ProviderOutcome::Sent);
                    let penalty = match &outcome {
                        ProviderOutcome::Throttled { retry_after } => {
                            let wait = self.policy.throttle_wait(*retry_after);
                            let until = now.saturating_add(wait);
                            self.throttles
                                .record(scope, &job.tenant, &job.kind, now, until);
                            Some(Penalty { wait, scope })
                        }
                        _ => None,
                    };
                    let used = if sent {
                        PermitUse::Sent
                    } else if matches!(&outcome, ProviderOutcome::Failed(f) if f.may_be_working()) {
                        PermitUse::Unanswered
                    } else {
                        PermitUse::CallFailed {
                            retry_after: match &outcome {
                                ProviderOutcome::Failed(f) => f.retry_after(),
                                _ => None,
                            },
                        }
                    };
                    self.tally.call(&job.tenant, &outcome, due_lag);
                    self.complete_permit(request, used, penalty).await;
                    if !sent {
                        info!(decision = outcome.as_str(), response = ?response, "provider did not accept");
                    }
                    run.on_provider(&self.policy, outcome, now, rand::random::<f64>())
                }
                Action::DeadLetter { reason, detail } => {
                    self.publish_durably(broker, commitment.shield(), "a dead letter", || {
                        broker.dead_letter(delivery, Some(run.progress()), reason, &detail, now)
                    })
                    .await?;
                    self.metrics
                        .dead_lettered(tenant, reason, run.progress().quota_wait);
                    self.log_decision(
                        job,
                        &run,
                        "dead_lettered",
                        Duration::ZERO,
                        Some(reason.as_str()),
                    );
                    warn!(reason = reason.as_str(), detail = %detail, "dead-lettered");
                    return Ok(Settled::DeadLettered(reason));
                }
                Action::Complete(completion) => {
                    self.metrics
                        .completed(tenant, completion, run.progress().quota_wait);
                    self.log_decision(job, &run, completion.as_str(), Duration::ZERO, None);
                    return Ok(Settled::Completed { completion, held });
                }
            };
        }
    }

    /// Records a sent key and releases the lease. A sent key is retried
    /// with backoff (at most a second apart) for as long as Redis is away,
    /// the delivery unacked: the record is what stops a redelivered copy,
    /// or another job with the same key, from being sent again once the
    /// call's lease has expired. Only a stopping worker gives up, after
    /// [`RECORD_RETRY_FOR`], so that a stop ends while Redis is away.
    async fn complete_permit(
        &self,
        request: PermitRequest<'_>,
        used: PermitUse,
        penalty: Option<Penalty>,
    ) {
        let mut stop_seen: Option<Instant> = None;
        let mut failures = 0u32;
        loop {
            let error = match self.permits.complete(request, used, penalty).await {
                Ok(learned) => {
                    self.redis_health.up();
                    // A sent job may take away a learned rate this pod shows
                    // (its quota stopped adapting); without one, as in an
                    // installation with no adaptive quota, nothing to do.
                    let sent = matches!(used, PermitUse::Sent) && penalty.is_none();
                    if learned != Learned::default() || (sent && self.metrics.shows_learned_rates())
                    {
                        let tenant = self.metrics.tenant(request.tenant.as_str());
                        self.metrics
                            .learned(&tenant, request.route.as_str(), learned, sent);
                    }
                    return;
                }
                Err(e) => e,
            };
            self.redis_health.down(&error.to_string());
            let wait = backoff(
                Duration::from_millis(100),
                Duration::from_secs(1),
                failures,
                rand::random(),
            );
            failures += 1;
            if used != PermitUse::Sent {
                return;
            }
            if *self.stopping.borrow() {
                let since = *stop_seen.get_or_insert_with(Instant::now);
                if since.elapsed() + wait > RECORD_RETRY_FOR {
                    error!(error = %error, failures, "sent, but the idempotency record could not be \
                        written before the stop: a copy sent after the call's lease is deduplicated \
                        only by the provider's Idempotency-Key");
                    return;
                }
            }
            // The first failure, then one line in ten: a long outage with
            // many sent jobs waiting does not flood the log.
            if failures % 10 == 1 {
                warn!(error = %error, failures, "recording the sent key failed: retrying until \
                    Redis answers, the delivery kept unacked");
            }
            tokio::time::sleep(wait).await;
        }
    }

    /// One structured line per decision. Never the payload.
    fn log_decision(
        &self,
        job: &Job,
        run: &JobRun,
        decision: &str,
        wait: Duration,
        reason: Option<&str>,
    ) {
        info!(
            job_id = %job.id,
            tenant_id = %job.tenant,
            due_at = job.due_at.map(|t| t.to_string()),
            decision,
            reason,
            wait_ms = wait.as_millis() as u64,
            attempt = run.attempt(),
            idempotency_key = %job.idempotency_key,
            "decision"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_worker_reconnects_within_seconds_whatever_the_outage() {
        for failures in 0..100 {
            let wait = reconnect_delay(failures);
            assert!(
                wait <= Duration::from_secs(3),
                "after {failures} failures: {wait:?}"
            );
        }
        assert_eq!(
            backoff(Duration::from_millis(250), Duration::from_secs(3), 20, 0.0),
            Duration::from_millis(1_500),
            "jittered down to half the ceiling, never to zero"
        );
    }
}
