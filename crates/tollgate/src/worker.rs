//! The worker runtime: consumes deliveries from every work queue and drives
//! each one through the core's state machine ([`JobRun`]), carrying out its
//! actions against RabbitMQ, Redis and the provider.
//!
//! [`Worker::run`] supervises RabbitMQ *sessions*: connect, declare, consume;
//! when a session is lost (broker restart, network, consumer cancelled) it
//! reconnects with backoff and jitter, and `/readyz` says not ready meanwhile.
//! Deliveries of a lost session are not acked: the broker hands them out
//! again, and the idempotency record stops a second send.
//! [`Worker::process_one`] is one whole step: one delivery to its settled
//! outcome.

use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use futures::{FutureExt, StreamExt};
use governor::{DefaultDirectRateLimiter, RateLimiter};
use tokio::sync::watch;
use tokio::task::JoinSet;
use tollgate_amqp::headers;
use tollgate_amqp::lapin::message::Delivery;
use tollgate_amqp::{Broker, ConsumerControl, Topology};
use tollgate_core::job::{Limits, decode};
use tollgate_core::outcome::classify;
use tollgate_core::ports::{Penalty, PermitRequest, PermitStore, Provider, ProviderCall};
use tollgate_core::{
    Action, Clock, Completion, DeadReason, Job, JobRun, Malformed, ParkReason, PermitDecision,
    Policy, Progress, ProviderOutcome, UnixMillis,
};
use tollgate_provider::HttpProvider;
use tollgate_quota::{Keys, QuotaStore, Redis, RedisPermits, Target};
use tracing::{Instrument, debug, error, info, info_span, warn};

use crate::baseline::Baseline;
use crate::config::{Config, SecretUrl};
use crate::holds::HoldGate;
use crate::metrics::{Metrics, UNKNOWN_TENANT};
use crate::system_clock::SystemClock;
use crate::throttles::LocalThrottles;

/// How one delivery was settled.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Settled {
    Completed(Completion),
    Parked(ParkReason),
    DeadLettered(DeadReason),
    /// Not settled here (its successor could not be published, processing
    /// panicked or overran): handed back to the queue unharmed.
    Requeued,
}

pub struct Worker<P, V> {
    amqp_url: SecretUrl,
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
    concurrency: u16,
    shutdown_grace: Duration,
    /// Longest one delivery may take before it is handed back (a hang).
    delivery_timeout: Duration,
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
    /// Re-seeds the quota baseline into Redis when quotas go missing.
    seeder: std::sync::Mutex<Option<Seeder>>,
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
    pub fn new(config: &Config, metrics: Metrics) -> anyhow::Result<Self> {
        let redis = Arc::new(Redis::new(&config.redis_settings())?);
        let seeder = config.baseline()?.map(|baseline| Seeder {
            path: config.quotas_file.clone().expect("a baseline has a file"),
            baseline,
            store: QuotaStore::new(Arc::clone(&redis), Keys::new(&config.prefix)),
            every: Duration::from_millis(config.quota_seed_interval_ms),
        });
        let permits =
            RedisPermits::new(redis, Keys::new(&config.prefix), config.permit_settings()?);
        let provider = HttpProvider::new(
            config.routes()?,
            Duration::from_millis(config.provider_timeout_ms),
        )?;
        Ok(Self {
            amqp_url: config.amqp_url.clone(),
            tls_ca_pem: config.tls_ca_pem()?,
            topology: config.topology()?,
            name: config.name(),
            broker: RwLock::new(None),
            permits,
            provider,
            metrics,
            policy: config.policy()?,
            limits: config.limits(),
            clock: Arc::new(SystemClock),
            concurrency: config.concurrency,
            shutdown_grace: Duration::from_millis(config.shutdown_grace_ms),
            delivery_timeout: Duration::from_millis(config.delivery_timeout_ms),
            consuming: AtomicBool::new(false),
            redis_checked: tokio::sync::Mutex::new(None),
            stopping: watch::channel(false).0,
            holds: HoldGate::new(config.tenant_hold_max),
            throttles: LocalThrottles::default(),
            seeder: std::sync::Mutex::new(seeder),
            ceiling: config.pod_max_rate()?.map(|rate| {
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

/// How a session ended.
enum SessionEnd {
    /// Shutdown was asked for; the consumers are cancelled and the channel
    /// stays open until in-flight deliveries are acked.
    Shutdown(ConsumerControl, Arc<Broker>),
    /// The connection or the consumer was lost.
    Lost(String),
}

/// Reconnect backoff: 0.5 s doubling to 30 s, full jitter.
fn reconnect_delay(failures: u32) -> Duration {
    let ceiling = Duration::from_millis(500)
        .saturating_mul(1 << failures.min(6))
        .min(Duration::from_secs(30));
    ceiling.mul_f64(rand::random::<f64>().max(0.1))
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

    /// What `/readyz` reports. Redis is asked at most once a second,
    /// whatever the probe rate (concurrent probes share one answer).
    pub async fn readiness(&self) -> Readiness {
        let redis = {
            let mut checked = self.redis_checked.lock().await;
            match *checked {
                Some((at, up)) if at.elapsed() < READINESS_TTL => up,
                _ => {
                    let up = tokio::time::timeout(Duration::from_secs(1), self.permits.ping())
                        .await
                        .is_ok_and(|r| r.is_ok());
                    *checked = Some((Instant::now(), up));
                    up
                }
            }
        };
        Readiness {
            amqp: self.broker().is_some_and(|b| b.is_connected()),
            redis,
            consuming: self.consuming.load(Ordering::Relaxed),
        }
    }

    /// Runs sessions until `shutdown` resolves, reconnecting whenever one is
    /// lost. On shutdown: cancel the consumers (no new deliveries), park held
    /// jobs at once, let in-flight deliveries settle within the grace period,
    /// then close. Returns an error only if the grace period ran out.
    pub async fn run(self: Arc<Self>, shutdown: impl Future<Output = ()>) -> anyhow::Result<()> {
        let mut tasks = JoinSet::new();
        tokio::pin!(shutdown);
        let mut failures = 0u32;
        let seeder = self.seeder.lock().expect("not poisoned").take();
        let seeding = seeder.map(|seeder| tokio::spawn(seeder.run(self.stopping.subscribe())));
        let last = loop {
            match self.session(&mut tasks, &mut shutdown).await {
                Ok(SessionEnd::Shutdown(control, broker)) => break Some((control, broker)),
                Ok(SessionEnd::Lost(why)) => {
                    failures = 1;
                    warn!(reason = %why, "RabbitMQ session lost; reconnecting");
                }
                Err(e) => {
                    failures += 1;
                    warn!(
                        error = format!("{e:#}"),
                        failures, "RabbitMQ session failed"
                    );
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
        if let Some(seeding) = seeding {
            let _ = seeding.await;
        }
        info!(in_flight = tasks.len(), "draining in-flight deliveries");
        let drained = tokio::time::timeout(self.shutdown_grace, async {
            while tasks.join_next().await.is_some() {}
        })
        .await;
        let left = tasks.len();
        tasks.abort_all();
        if let Some((control, broker)) = last {
            control.close().await;
            broker.close().await;
        }
        *self.broker.write().expect("not poisoned") = None;
        match drained {
            Ok(()) => Ok(()),
            Err(_) => anyhow::bail!(
                "grace period over with {left} deliveries unsettled: they return to their queue"
            ),
        }
    }

    /// One connection: declare, consume until shutdown or loss.
    async fn session(
        self: &Arc<Self>,
        tasks: &mut JoinSet<Settled>,
        shutdown: &mut std::pin::Pin<&mut impl Future<Output = ()>>,
    ) -> anyhow::Result<SessionEnd> {
        let broker = Arc::new(
            Broker::connect(
                self.amqp_url.expose(),
                &self.amqp_url.redacted(),
                self.tls_ca_pem.as_deref(),
                &self.name,
                self.topology.clone(),
            )
            .await?,
        );
        for queue in broker.declare_topology().await? {
            let depth = broker.queue_depth(&queue).await.unwrap_or(0);
            warn!("{}", crate::cli::draining_note(&queue, depth));
        }
        let mut consumption = broker.consume(&self.name, self.concurrency).await?;
        *self.broker.write().expect("not poisoned") = Some(Arc::clone(&broker));
        self.set_consuming(true);
        info!(name = %self.name, concurrency = self.concurrency, "worker consuming");
        let lost = loop {
            tokio::select! {
                () = shutdown.as_mut() => break None,
                next = consumption.deliveries.next() => match next {
                    Some(Ok(delivery)) => {
                        let (worker, broker) = (Arc::clone(self), Arc::clone(&broker));
                        tasks.spawn(async move { worker.settle(&broker, delivery).await });
                    }
                    Some(Err(e)) => break Some(e.to_string()),
                    None => break Some("the broker cancelled the consumer".to_owned()),
                },
                Some(_) = tasks.join_next(), if !tasks.is_empty() => {}
            }
        };
        self.set_consuming(false);
        match lost {
            Some(why) => {
                broker.close().await;
                Ok(SessionEnd::Lost(why))
            }
            None => {
                if let Err(e) = consumption.control.cancel().await {
                    warn!(error = %e, "cancelling consumers");
                }
                Ok(SessionEnd::Shutdown(consumption.control, broker))
            }
        }
    }

    /// Runs [`Worker::process_one`] guarded: a panic or an overrun hands the
    /// delivery back to its queue (its delivery count rises, so a message
    /// that keeps crashing workers ends in the DLQ as `poison`).
    async fn settle(&self, broker: &Broker, delivery: Delivery) -> Settled {
        let acker = delivery.acker.clone();
        let work = AssertUnwindSafe(self.process_one(broker, delivery)).catch_unwind();
        let failure = match tokio::time::timeout(self.delivery_timeout, work).await {
            Ok(Ok(settled)) => return settled,
            Ok(Err(_)) => "processing panicked",
            Err(_) => "processing overran delivery_timeout_ms",
        };
        error!(failure, "handing the delivery back to its queue");
        if let Err(e) = tollgate_amqp::requeue(&acker).await {
            warn!(error = %e, "requeue failed: the broker requeues it when the channel closes");
        }
        Settled::Requeued
    }

    /// Carries one delivery to a settled outcome and acks it (or hands it
    /// back when its successor could not be published).
    pub async fn process_one(&self, broker: &Broker, delivery: Delivery) -> Settled {
        let _in_flight = InFlight::new(&self.metrics);
        match self.handle(broker, &delivery).await {
            Ok(settled) => {
                if let Err(e) = tollgate_amqp::ack(&delivery).await {
                    warn!(error = %e, "ack failed: the broker will redeliver, idempotency stops a double send");
                }
                settled
            }
            Err(e) => {
                error!(error = %e, "could not publish a parked or dead-lettered copy; requeueing");
                if let Err(e) = tollgate_amqp::requeue(&delivery.acker).await {
                    warn!(error = %e, "requeue failed: the broker requeues it when the channel closes");
                }
                Settled::Requeued
            }
        }
    }

    async fn handle(
        &self,
        broker: &Broker,
        delivery: &Delivery,
    ) -> Result<Settled, tollgate_amqp::AmqpError> {
        let now = self.clock.now();
        let progress = headers::read_progress(delivery.properties.headers().as_ref());
        let job = progress
            .and_then(|p| Ok((decode(&delivery.data, &self.limits)?, p)))
            .and_then(|(job, p)| self.check_envelope(delivery, &job).map(|()| (job, p)));
        let (job, progress) = match job {
            Ok(ok) => ok,
            Err(malformed) => {
                return self
                    .reject_malformed(broker, delivery, &malformed, now)
                    .await;
            }
        };
        let tenant = self.metrics.tenant(job.tenant.as_str());
        if let Some(entered) = progress.enqueued_at.or_else(|| {
            delivery
                .properties
                .timestamp()
                .map(|s| UnixMillis(s as i64 * 1000))
        }) {
            self.metrics.queue_age(&tenant, entered.until(now));
        }
        let span = info_span!(
            "job",
            job_id = %job.id,
            tenant_id = %job.tenant,
            attempt = progress.attempt + 1,
        );
        self.drive(
            broker,
            delivery,
            &job,
            &tenant,
            JobRun::new(&job, progress, now),
        )
        .instrument(span)
        .await
    }

    /// The checks that need more than the body: the routing key must be the
    /// tenant (it decides the work queue) and the kind must have a route.
    fn check_envelope(&self, delivery: &Delivery, job: &Job) -> Result<(), Malformed> {
        if delivery.routing_key.as_str() != job.tenant.as_str() {
            return Err(Malformed::Header {
                name: "routing key",
                reason: format!(
                    "{:?} is not the job's tenant {:?}",
                    delivery.routing_key.as_str(),
                    job.tenant.as_str()
                ),
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
    ) -> Result<Settled, tollgate_amqp::AmqpError> {
        let detail = malformed.to_string();
        broker
            .dead_letter(delivery, None, DeadReason::Malformed, &detail, now)
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
    ) -> Result<Settled, tollgate_amqp::AmqpError> {
        let lease_token = uuid::Uuid::new_v4().to_string();
        let mut request = PermitRequest {
            tenant: &job.tenant,
            route: &job.kind,
            job_id: &job.id,
            key: &job.idempotency_key,
            lease_token: &lease_token,
            returning: None,
        };
        let route = self.provider.route(job).unwrap_or("default");
        let mut now = self.clock.now();
        let mut action = run.next(&self.policy, now);
        loop {
            action = match action {
                Action::Hold { until, reason } => {
                    // A reservation (no reason) is always held: its permit is
                    // taken. Any other wait is held only while this pod holds
                    // few of the tenant's jobs, so one tenant's waits cannot
                    // fill the prefetch and block the tenants behind it.
                    let Some(_slot) = self.holds.hold(&job.tenant, reason.is_none()) else {
                        let reason = reason.expect("forced holds are never refused");
                        action = run.park_instead(&self.policy, now, until, reason);
                        continue;
                    };
                    debug!(
                        decision = "held",
                        wait_ms = now.until(until).as_millis() as u64
                    );
                    let mut stopping = self.stopping.subscribe();
                    tokio::select! {
                        () = tokio::time::sleep(now.until(until)) => {}
                        // Shutting down: park what may be parked, at once.
                        Ok(_) = stopping.wait_for(|&s| s), if reason.is_some() => {
                            now = self.clock.now();
                            let reason = reason.expect("guarded");
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
                    let progress = Progress {
                        enqueued_at: Some(now.saturating_add(tier)),
                        ..run.progress().clone()
                    };
                    broker.park(delivery, &job.tenant, &progress, tier).await?;
                    self.metrics.tier_publish(tier);
                    if !hop {
                        self.metrics.parked(tenant, reason);
                        self.log_decision(
                            job,
                            &run,
                            "parked",
                            now.until(until),
                            Some(reason.as_str()),
                        );
                    }
                    return Ok(Settled::Parked(reason));
                }
                Action::CheckEligibility => {
                    let eligibility = self.provider.eligibility(job).await;
                    now = self.clock.now();
                    run.on_eligibility(&self.policy, eligibility, now)
                }
                Action::AskPermit => {
                    if let Some(ceiling) = &self.ceiling {
                        // This pod's own ceiling, before taking a fleet permit
                        // it could not use.
                        ceiling.until_ready().await;
                    }
                    request.returning = run.returning(now);
                    let decision = self.permits.acquire(request).await.unwrap_or_else(|e| {
                        warn!(error = %e, "permit store unavailable: failing closed");
                        PermitDecision::Unavailable
                    });
                    self.metrics.permit(tenant, &decision);
                    now = self.clock.now();
                    run.on_permit(&self.policy, decision, now)
                }
                Action::CallProvider => {
                    let scope = self.provider.throttle_scope(job);
                    if let Some(until) =
                        self.throttles
                            .paused_until(scope, &job.tenant, &job.kind, now)
                    {
                        // Reserved before a 429 this pod saw: hold it back.
                        self.complete_permit(request, false, None).await;
                        action = run.hold_back(&self.policy, until, now);
                        continue;
                    }
                    let attempt = run.attempt();
                    if attempt == 1 {
                        self.metrics.due_lag(tenant, run.due_reference().until(now));
                    }
                    let started = Instant::now();
                    let response = self.provider.call(ProviderCall { job, attempt }).await;
                    let took = started.elapsed();
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
                    self.complete_permit(request, sent, penalty).await;
                    if !sent {
                        info!(decision = outcome.as_str(), response = ?response, "provider did not accept");
                    }
                    run.on_provider(&self.policy, outcome, now, rand::random::<f64>())
                }
                Action::DeadLetter { reason, detail } => {
                    broker
                        .dead_letter(delivery, Some(run.progress()), reason, &detail, now)
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
                    return Ok(Settled::Completed(completion));
                }
            };
        }
    }

    /// Records a sent key (retrying briefly: it is what stops a redelivered
    /// copy from being sent again) and releases the lease.
    async fn complete_permit(
        &self,
        request: PermitRequest<'_>,
        sent: bool,
        penalty: Option<Penalty>,
    ) {
        for attempt in 1..=3u32 {
            match self.permits.complete(request, sent, penalty).await {
                Ok(()) => return,
                Err(e) if attempt < 3 && sent => {
                    warn!(error = %e, attempt, "recording the sent key failed; retrying");
                    tokio::time::sleep(Duration::from_millis(100 * u64::from(attempt))).await;
                }
                Err(e) => {
                    if sent {
                        error!(error = %e, "sent, but the idempotency record could not be written: \
                            a redelivered copy is deduplicated only by the provider's Idempotency-Key");
                    }
                    return;
                }
            }
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
