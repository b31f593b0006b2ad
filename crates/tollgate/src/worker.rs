//! The worker runtime: consumes deliveries from every work queue and drives
//! each one through the core's state machine ([`JobRun`]), carrying out its
//! actions against RabbitMQ, Redis and the provider.
//!
//! [`Worker::process_one`] is one whole step (one delivery to its settled
//! outcome); [`Worker::run`] is the thin loop around it.

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use futures::StreamExt;
use governor::{DefaultDirectRateLimiter, RateLimiter};
use tokio::task::JoinSet;
use tollgate_amqp::Broker;
use tollgate_amqp::headers;
use tollgate_amqp::lapin::message::Delivery;
use tollgate_amqp::lapin::options::{BasicAckOptions, BasicNackOptions};
use tollgate_core::job::{Limits, decode};
use tollgate_core::outcome::classify;
use tollgate_core::ports::{PermitRequest, PermitStore, Provider, ProviderCall};
use tollgate_core::{
    Action, Clock, Completion, DeadReason, Job, JobRun, Malformed, ParkReason, PermitDecision,
    Policy, Progress, ProviderOutcome, TenantId, UnixMillis,
};
use tollgate_provider::HttpProvider;
use tollgate_quota::{Keys, Redis, RedisPermits};
use tracing::{Instrument, debug, error, info, info_span, warn};

use crate::config::Config;
use crate::metrics::{Metrics, UNKNOWN_TENANT};
use crate::system_clock::SystemClock;

/// How one delivery was settled.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Settled {
    Completed(Completion),
    Parked(ParkReason),
    DeadLettered(DeadReason),
    /// Publishing its successor failed: handed back to the queue unharmed.
    Requeued,
}

pub struct Worker<P, V> {
    broker: Arc<Broker>,
    permits: P,
    provider: V,
    metrics: Metrics,
    policy: Policy,
    limits: Limits,
    clock: Arc<dyn Clock>,
    name: String,
    concurrency: u16,
    shutdown_grace: Duration,
    consuming: AtomicBool,
    holds: HoldGate,
    /// Optional per-pod ceiling on provider calls (governor, local only).
    ceiling: Option<DefaultDirectRateLimiter>,
}

/// Counts the deliveries of each tenant this pod holds in-process (waiting
/// to be due, for a permit, or for a reserved slot), and refuses optional
/// holds beyond `cap`.
struct HoldGate {
    cap: usize,
    held: Arc<Mutex<HashMap<TenantId, usize>>>,
}

/// Releases its hold when dropped.
struct HoldSlot {
    tenant: TenantId,
    held: Arc<Mutex<HashMap<TenantId, usize>>>,
}

impl HoldGate {
    fn new(cap: usize) -> Self {
        Self {
            cap,
            held: Arc::default(),
        }
    }

    /// A slot for one more held delivery of `tenant`; `forced` slots are
    /// counted but never refused.
    fn hold(&self, tenant: &TenantId, forced: bool) -> Option<HoldSlot> {
        let mut held = self.held.lock().expect("not poisoned");
        let count = held.entry(tenant.clone()).or_insert(0);
        if *count >= self.cap && !forced {
            return None;
        }
        *count += 1;
        Some(HoldSlot {
            tenant: tenant.clone(),
            held: Arc::clone(&self.held),
        })
    }
}

impl Drop for HoldSlot {
    fn drop(&mut self) {
        let mut held = self.held.lock().expect("not poisoned");
        if let Some(count) = held.get_mut(&self.tenant) {
            *count -= 1;
            if *count == 0 {
                held.remove(&self.tenant);
            }
        }
    }
}

/// The worker wired to the real adapters.
pub type LiveWorker = Worker<RedisPermits, HttpProvider>;

impl LiveWorker {
    /// Connects to RabbitMQ and Redis and builds the provider client.
    pub async fn connect(config: &Config, metrics: Metrics) -> anyhow::Result<Self> {
        let name = config.name();
        let broker = Broker::connect(
            config.amqp_url.expose(),
            &config.amqp_url.redacted(),
            &name,
            config.topology()?,
        )
        .await?;
        let redis = Arc::new(Redis::new(&config.redis_settings())?);
        let permits =
            RedisPermits::new(redis, Keys::new(&config.prefix), config.permit_settings()?);
        let provider = HttpProvider::new(
            config.routes()?,
            Duration::from_millis(config.provider_timeout_ms),
        )?;
        Ok(Self {
            broker: Arc::new(broker),
            permits,
            provider,
            metrics,
            policy: config.policy()?,
            limits: config.limits(),
            clock: Arc::new(SystemClock),
            name,
            concurrency: config.concurrency,
            shutdown_grace: Duration::from_millis(config.shutdown_grace_ms),
            consuming: AtomicBool::new(false),
            holds: HoldGate::new(config.tenant_hold_max),
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

impl<P: PermitStore, V: Provider> Worker<P, V> {
    pub fn broker(&self) -> &Arc<Broker> {
        &self.broker
    }

    pub async fn readiness(&self) -> Readiness {
        let redis = tokio::time::timeout(Duration::from_secs(1), self.permits.ping())
            .await
            .is_ok_and(|r| r.is_ok());
        Readiness {
            amqp: self.broker.is_connected(),
            redis,
            consuming: self.consuming.load(Ordering::Relaxed),
        }
    }

    /// Declares the topology, then consumes until `shutdown` resolves or the
    /// consumer ends. On shutdown: cancel the consumers (no new deliveries),
    /// let in-flight deliveries settle within the grace period, close.
    pub async fn run(self: Arc<Self>, shutdown: impl Future<Output = ()>) -> anyhow::Result<()> {
        self.broker.declare_topology().await?;
        let mut consumption = self
            .broker
            .consume(&self.name, self.concurrency)
            .await
            .context("starting consumers")?;
        self.consuming.store(true, Ordering::Relaxed);
        info!(name = %self.name, concurrency = self.concurrency, "worker consuming");

        let mut tasks = JoinSet::new();
        tokio::pin!(shutdown);
        let ended = loop {
            tokio::select! {
                () = &mut shutdown => break Ok(()),
                next = consumption.deliveries.next() => match next {
                    Some(Ok(delivery)) => {
                        let worker = Arc::clone(&self);
                        tasks.spawn(async move { worker.process_one(delivery).await });
                    }
                    Some(Err(e)) => break Err(anyhow::Error::new(e).context("consuming")),
                    None => break Err(anyhow::anyhow!("the broker cancelled the consumer")),
                },
                Some(_) = tasks.join_next(), if !tasks.is_empty() => {}
            }
        };
        self.consuming.store(false, Ordering::Relaxed);
        if let Err(e) = consumption.control.cancel().await {
            warn!(error = %e, "cancelling consumers");
        }
        let in_flight = tasks.len();
        info!(in_flight, "draining in-flight deliveries");
        let drained = tokio::time::timeout(self.shutdown_grace, async {
            while tasks.join_next().await.is_some() {}
        })
        .await;
        if drained.is_err() {
            warn!(
                left = tasks.len(),
                "grace period over: unsettled deliveries return to their queue"
            );
            tasks.abort_all();
        }
        consumption.control.close().await;
        self.broker.close().await;
        ended
    }

    /// Carries one delivery to a settled outcome and acks it (or hands it
    /// back when its successor could not be published).
    pub async fn process_one(&self, delivery: Delivery) -> Settled {
        self.metrics.in_flight().inc();
        let settled = match self.handle(&delivery).await {
            Ok(settled) => {
                if let Err(e) = delivery.acker.ack(BasicAckOptions::default()).await {
                    warn!(error = %e, "ack failed: the broker will redeliver, idempotency stops a double send");
                }
                settled
            }
            Err(e) => {
                error!(error = %e, "could not publish a parked or dead-lettered copy; requeueing");
                let requeue = BasicNackOptions {
                    requeue: true,
                    ..Default::default()
                };
                let _ = delivery.acker.nack(requeue).await;
                Settled::Requeued
            }
        };
        self.metrics.in_flight().dec();
        settled
    }

    async fn handle(&self, delivery: &Delivery) -> Result<Settled, tollgate_amqp::AmqpError> {
        let now = self.clock.now();
        let progress = headers::read_progress(delivery.properties.headers().as_ref());
        let job = progress
            .and_then(|p| Ok((decode(&delivery.data, &self.limits)?, p)))
            .and_then(|(job, p)| self.check_envelope(delivery, &job).map(|()| (job, p)));
        let (job, progress) = match job {
            Ok(ok) => ok,
            Err(malformed) => return self.reject_malformed(delivery, &malformed, now).await,
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
        self.drive(delivery, &job, &tenant, JobRun::new(&job, progress, now))
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
        delivery: &Delivery,
        malformed: &Malformed,
        now: UnixMillis,
    ) -> Result<Settled, tollgate_amqp::AmqpError> {
        let detail = malformed.to_string();
        self.broker
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
                    tokio::time::sleep(now.until(until)).await;
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
                    self.broker
                        .park(delivery, &job.tenant, &progress, tier)
                        .await?;
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
                    let attempt = run.attempt();
                    if attempt == 1 {
                        self.metrics.due_lag(tenant, run.due_reference().until(now));
                    }
                    let started = Instant::now();
                    let response = self.provider.call(ProviderCall { job, attempt }).await;
                    let took = started.elapsed();
                    now = self.clock.now();
                    let outcome = classify(&response, now);
                    self.metrics.provider(tenant, route, outcome, took);
                    let sent = matches!(outcome, ProviderOutcome::Sent);
                    let penalty = match outcome {
                        ProviderOutcome::Throttled { retry_after } => {
                            Some(retry_after.unwrap_or(self.policy.default_retry_after))
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
                    self.broker
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
        penalty: Option<Duration>,
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
