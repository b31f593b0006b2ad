//! The metrics operators watch (README, "Metrics and health"). Label values come from
//! closed enums or from the bounded tenant label; no job id, key or payload is
//! ever a label.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use prometheus::{
    Encoder, GaugeVec, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge,
    IntGaugeVec, Opts, Registry, TextEncoder,
};
use tollgate_amqp::ShardQueue;
use tollgate_core::ports::Learned;
use tollgate_core::{
    Completion, DeadReason, DelayTiers, ParkReason, PermitDecision, ProviderOutcome, Shadow,
};
use tollgate_quota::CallKind;

/// Milliseconds to a day, with the SLO thresholds 0.1 s, 1 s and 60 s on
/// bucket boundaries (due lag can be hours when a queue backs up).
pub const WAIT_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0,
    1800.0, 3600.0, 7200.0, 21600.0, 86400.0,
];

/// Provider latency: a few milliseconds to the longest sensible timeout.
pub const LATENCY_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];

/// A pod's calls to Redis: a tenth of a millisecond (a round trip on one
/// host) to the seconds of a Redis that is failing over.
pub const REDIS_BUCKETS: &[f64] = &[
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
];

/// Label value for a message whose tenant could not be read.
pub const UNKNOWN_TENANT: &str = "unknown";
/// Label value for tenants beyond the allowlist / first-N.
pub const OTHER_TENANT: &str = "other";

/// Bounds the tenant label: allowlisted tenants and the first `limit`
/// distinct tenants seen are reported by name, the rest as `other`.
struct TenantLabels {
    allow: HashSet<String>,
    limit: usize,
    seen: Mutex<HashSet<String>>,
    overflow: IntCounter,
}

impl TenantLabels {
    fn label(&self, tenant: &str) -> String {
        if self.allow.contains(tenant) {
            return tenant.to_owned();
        }
        let mut seen = self.seen.lock().expect("not poisoned");
        if seen.contains(tenant) {
            return tenant.to_owned();
        }
        if seen.len() < self.limit {
            seen.insert(tenant.to_owned());
            return tenant.to_owned();
        }
        self.overflow.inc();
        OTHER_TENANT.to_owned()
    }
}

pub fn permit_label(decision: &PermitDecision) -> &'static str {
    match decision {
        PermitDecision::Granted { .. } => "allowed",
        PermitDecision::Denied { .. } => "denied",
        PermitDecision::Duplicate => "duplicate",
        PermitDecision::InFlight { .. } => "in_flight",
        PermitDecision::Paused { .. } => "paused",
        PermitDecision::Cancelled => "cancelled",
        PermitDecision::AtConcurrency { .. } => "concurrency",
        PermitDecision::Unavailable => "unavailable",
    }
}

struct Inner {
    registry: Registry,
    tenants: TenantLabels,
    queue_age: HistogramVec,
    due_lag: HistogramVec,
    quota_wait: HistogramVec,
    permit_decisions: IntCounterVec,
    late_permits: IntCounterVec,
    shadow_decisions: IntCounterVec,
    provider_requests: IntCounterVec,
    provider_duration: HistogramVec,
    /// `tollgate_redis_call_duration_seconds` by call, resolved once: each
    /// series exists from the start, and a call's observation looks up no
    /// label.
    redis_permit: Histogram,
    redis_backlog_permit: Histogram,
    redis_complete: Histogram,
    jobs_completed: IntCounterVec,
    parked: IntCounterVec,
    dead_letters: IntCounterVec,
    tier_publishes: IntCounterVec,
    look_aheads: IntCounterVec,
    redelivered: IntCounterVec,
    effective_rate: LearnedRates,
    route_effective_rate: LearnedRates,
    in_flight: IntGauge,
    consuming: IntGauge,
}

/// The rates adaptive quotas learned, by tenant or route. A label goes once
/// its quota is seen not to adapt any more: a dashboard would otherwise show
/// a learned rate above the plain quota now enforced, as long as the pod runs.
struct LearnedRates {
    gauge: GaugeVec,
    /// The labels this pod shows.
    shown: Mutex<HashSet<String>>,
    /// Whether it shows any: a sent job of an installation with no adaptive
    /// quota checks this flag, not the lock.
    any: AtomicBool,
}

impl LearnedRates {
    fn new(gauge: GaugeVec) -> Self {
        Self {
            gauge,
            shown: Default::default(),
            any: Default::default(),
        }
    }

    /// `rate`: what a completion learned; `None` after a sent job, whose
    /// permit found the quota not adaptive.
    fn record(&self, label: &str, rate: Option<f64>) {
        let mut shown = self.shown.lock().expect("never poisoned");
        match rate {
            Some(rate) => {
                self.gauge.with_label_values(&[label]).set(rate);
                if !shown.contains(label) {
                    shown.insert(label.to_owned());
                }
            }
            None => {
                if shown.remove(label) {
                    let _ = self.gauge.remove_label_values(&[label]);
                }
            }
        }
        self.any.store(!shown.is_empty(), Ordering::Relaxed);
    }

    fn shows_any(&self) -> bool {
        self.any.load(Ordering::Relaxed)
    }
}

/// Cheap to clone; every worker task records through the same handle.
#[derive(Clone)]
pub struct Metrics(Arc<Inner>);

fn histogram(
    registry: &Registry,
    name: &str,
    help: &str,
    labels: &[&str],
    buckets: &[f64],
) -> HistogramVec {
    let h = HistogramVec::new(
        HistogramOpts::new(name, help).buckets(buckets.to_vec()),
        labels,
    )
    .expect("valid histogram");
    registry
        .register(Box::new(h.clone()))
        .expect("registered once");
    h
}

fn gauge(registry: &Registry, name: &str, help: &str, labels: &[&str]) -> GaugeVec {
    let g = GaugeVec::new(Opts::new(name, help), labels).expect("valid gauge");
    registry
        .register(Box::new(g.clone()))
        .expect("registered once");
    g
}

fn counter(registry: &Registry, name: &str, help: &str, labels: &[&str]) -> IntCounterVec {
    let c = IntCounterVec::new(Opts::new(name, help), labels).expect("valid counter");
    registry
        .register(Box::new(c.clone()))
        .expect("registered once");
    c
}

impl Metrics {
    pub fn new(tenant_limit: usize, allowlist: &[String]) -> Self {
        let registry = Registry::new();
        let overflow = IntCounter::new(
            "tollgate_tenant_label_overflow_total",
            "Times a tenant beyond the label allowlist and first-N limit was reported as `other`.",
        )
        .expect("valid counter");
        registry
            .register(Box::new(overflow.clone()))
            .expect("registered once");
        let in_flight = IntGauge::new(
            "tollgate_jobs_in_flight",
            "Deliveries this pod holds right now (being processed or held until due).",
        )
        .expect("valid gauge");
        registry
            .register(Box::new(in_flight.clone()))
            .expect("registered once");
        let consuming = IntGauge::new(
            "tollgate_consuming",
            "1 while this pod's consumers are running on RabbitMQ, 0 while it connects or reconnects.",
        )
        .expect("valid gauge");
        registry
            .register(Box::new(consuming.clone()))
            .expect("registered once");
        let build_info = IntGaugeVec::new(
            Opts::new(
                "tollgate_build_info",
                "Always 1; the labels say which build is running.",
            ),
            &["version"],
        )
        .expect("valid gauge");
        registry
            .register(Box::new(build_info.clone()))
            .expect("registered once");
        build_info
            .with_label_values(&[env!("CARGO_PKG_VERSION")])
            .set(1);

        let r = &registry;
        let redis_calls = histogram(
            r,
            "tollgate_redis_call_duration_seconds",
            "How long this pod's calls to Redis took, from a job asking to its answer (the wait for the pod's next batched call included): permit decisions (call=\"permit\"; \"backlog_permit\" for a tenant the pod already holds a backlog of, which gives way to the others by design) and records of a permit's use (call=\"complete\"; a sent job's ack waits for its record). Every pod calls the one Redis: a rise on every pod at once is Redis.",
            &["call"],
            REDIS_BUCKETS,
        );
        let inner = Inner {
            tenants: TenantLabels {
                allow: allowlist.iter().cloned().collect(),
                limit: tenant_limit,
                seen: Mutex::new(HashSet::new()),
                overflow,
            },
            queue_age: histogram(
                r,
                "tollgate_queue_age_seconds",
                "How long a delivery waited in its work queue before this pod received it.",
                &["tenant"],
                WAIT_BUCKETS,
            ),
            due_lag: histogram(
                r,
                "tollgate_due_lag_seconds",
                "How late after its due time (due_at, or when first seen) a job's first provider call started.",
                &["tenant"],
                WAIT_BUCKETS,
            ),
            quota_wait: histogram(
                r,
                "tollgate_quota_wait_seconds",
                "Intentional throttling a job went through (quota denials, reservations, 429 waits), recorded at its final outcome.",
                &["tenant"],
                WAIT_BUCKETS,
            ),
            permit_decisions: counter(
                r,
                "tollgate_permit_decisions_total",
                "Permit decisions made in Redis, by tenant and decision.",
                &["tenant", "decision"],
            ),
            late_permits: counter(
                r,
                "tollgate_late_permits_total",
                "Permits let go unused because their call could not begin within the leeway after their slot (the pod was busy); the job asked again.",
                &["tenant"],
            ),
            shadow_decisions: counter(
                r,
                "tollgate_shadow_decisions_total",
                "What a tenant's shadow quota would have decided for each granted permit (allow, deny); never enforced.",
                &["tenant", "decision"],
            ),
            provider_requests: counter(
                r,
                "tollgate_provider_requests_total",
                "Provider calls by tenant, route and classified outcome (sent, throttled, failed, rejected).",
                &["tenant", "route", "outcome"],
            ),
            provider_duration: histogram(
                r,
                "tollgate_provider_request_duration_seconds",
                "Provider call latency by route and outcome.",
                &["route", "outcome"],
                LATENCY_BUCKETS,
            ),
            redis_permit: redis_calls.with_label_values(&["permit"]),
            redis_backlog_permit: redis_calls.with_label_values(&["backlog_permit"]),
            redis_complete: redis_calls.with_label_values(&["complete"]),
            jobs_completed: counter(
                r,
                "tollgate_jobs_completed_total",
                "Jobs that reached a final outcome (sent, duplicate, skipped, dead_lettered), by tenant.",
                &["tenant", "outcome"],
            ),
            parked: counter(
                r,
                "tollgate_parked_total",
                "Waits that parked a job in the delay tiers (once per wait, not per tier hop), by tenant and reason.",
                &["tenant", "reason"],
            ),
            dead_letters: counter(
                r,
                "tollgate_dead_letters_total",
                "Jobs published to the dead-letter queue, by tenant and reason.",
                &["tenant", "reason"],
            ),
            tier_publishes: counter(
                r,
                "tollgate_tier_publishes_total",
                "Copies published to a delay tier, by tier; a long wait takes several hops through the tiers.",
                &["tier"],
            ),
            look_aheads: counter(
                r,
                "tollgate_look_aheads_total",
                "Look-ahead consumers opened beyond a queue's share of the prefetch, by lane (work, return, recheck): the queue delivered only jobs to park or to hold for later slots. A pod holding far more unacked deliveries than its prefetch is looking ahead.",
                &["lane"],
            ),
            redelivered: counter(
                r,
                "tollgate_redelivered_total",
                "Deliveries the broker handed out again, by lane (work, return, recheck): a worker died or lost its channel holding them, a delivery was handed back, or a look-ahead consumer was cancelled while the broker was still sending to it. Each counts toward the delivery limit (poison).",
                &["lane"],
            ),
            effective_rate: LearnedRates::new(gauge(
                r,
                "tollgate_quota_effective_rate",
                "The rate (per second) a tenant's adaptive quota enforces now, as learned from the provider's 429s; the configured rate is its ceiling. Set at each of the tenant's completions on this pod; gone at its first sent job after its quota stops adapting.",
                &["tenant"],
            )),
            route_effective_rate: LearnedRates::new(gauge(
                r,
                "tollgate_route_effective_rate",
                "The rate (per second) a route's adaptive quota (one provider account) enforces now; gone at the route's first sent job after its quota stops adapting.",
                &["route"],
            )),
            in_flight,
            consuming,
            registry,
        };
        // Every lane at 0 from the start: a bounded set, and a rate over a
        // series that is not there yet is no data rather than none opened.
        for lane in ShardQueue::ALL {
            inner.look_aheads.with_label_values(&[lane.lane()]);
            inner.redelivered.with_label_values(&[lane.lane()]);
        }
        Self(Arc::new(inner))
    }

    /// The Prometheus text exposition of every metric.
    pub fn render(&self) -> String {
        let mut out = Vec::new();
        TextEncoder::new()
            .encode(&self.0.registry.gather(), &mut out)
            .expect("encoding to a Vec cannot fail");
        String::from_utf8(out).expect("the text format is UTF-8")
    }

    pub fn tenant(&self, tenant: &str) -> String {
        self.0.tenants.label(tenant)
    }

    pub fn queue_age(&self, tenant: &str, age: Duration) {
        self.0
            .queue_age
            .with_label_values(&[tenant])
            .observe(age.as_secs_f64());
    }

    pub fn due_lag(&self, tenant: &str, lag: Duration) {
        self.0
            .due_lag
            .with_label_values(&[tenant])
            .observe(lag.as_secs_f64());
    }

    pub fn permit(&self, tenant: &str, decision: &PermitDecision) {
        self.0
            .permit_decisions
            .with_label_values(&[tenant, permit_label(decision)])
            .inc();
        if let PermitDecision::Granted { shadow, .. } = decision {
            let verdict = match shadow {
                Shadow::None => return,
                Shadow::Allow => "allow",
                Shadow::Deny => "deny",
            };
            self.0
                .shadow_decisions
                .with_label_values(&[tenant, verdict])
                .inc();
        }
    }

    /// Whether this pod shows any learned rate (one a sent job of a
    /// quota that stopped adapting may have to take away).
    pub fn shows_learned_rates(&self) -> bool {
        self.0.effective_rate.shows_any() || self.0.route_effective_rate.shows_any()
    }

    pub fn late_permit(&self, tenant: &str) {
        self.0.late_permits.with_label_values(&[tenant]).inc();
    }

    /// What adaptive quotas learned from a completion. After a sent job
    /// (`sent`), a quota that learned nothing does not adapt (its permit
    /// found it plain), and its gauge goes; after a 429, nothing learned
    /// says only that the other quota was blamed.
    pub fn learned(&self, tenant: &str, route: &str, learned: Learned, sent: bool) {
        for (rates, label, rate) in [
            (&self.0.effective_rate, tenant, learned.tenant),
            (&self.0.route_effective_rate, route, learned.route),
        ] {
            if rate.is_some() || sent {
                rates.record(label, rate);
            }
        }
    }

    pub fn provider(&self, tenant: &str, route: &str, outcome: &ProviderOutcome, took: Duration) {
        let outcome = outcome.as_str();
        self.0
            .provider_requests
            .with_label_values(&[tenant, route, outcome])
            .inc();
        self.0
            .provider_duration
            .with_label_values(&[route, outcome])
            .observe(took.as_secs_f64());
    }

    fn redis_histogram(&self, call: CallKind) -> &Histogram {
        match call {
            CallKind::Permit => &self.0.redis_permit,
            CallKind::BacklogPermit => &self.0.redis_backlog_permit,
            CallKind::Complete => &self.0.redis_complete,
        }
    }

    /// A call to Redis took `took`, whatever its answer.
    pub fn redis_call(&self, call: CallKind, took: Duration) {
        self.redis_histogram(call).observe(took.as_secs_f64());
    }

    pub fn tier_publish(&self, tier: Duration) {
        self.0
            .tier_publishes
            .with_label_values(&[&DelayTiers::name(tier)])
            .inc();
    }

    /// A look-ahead consumer opened on a queue of `lane`.
    pub fn look_ahead_opened(&self, lane: &str) {
        self.0.look_aheads.with_label_values(&[lane]).inc();
    }

    /// A delivery from a queue of `lane` came marked redelivered.
    pub fn redelivered(&self, lane: &str) {
        self.0.redelivered.with_label_values(&[lane]).inc();
    }

    pub fn parked(&self, tenant: &str, reason: ParkReason) {
        self.0
            .parked
            .with_label_values(&[tenant, reason.as_str()])
            .inc();
    }

    /// A final outcome: counts it and records the job's quota wait.
    pub fn completed(&self, tenant: &str, completion: Completion, quota_wait: Duration) {
        self.0
            .jobs_completed
            .with_label_values(&[tenant, completion.as_str()])
            .inc();
        self.0
            .quota_wait
            .with_label_values(&[tenant])
            .observe(quota_wait.as_secs_f64());
    }

    pub fn dead_lettered(&self, tenant: &str, reason: DeadReason, quota_wait: Duration) {
        self.0
            .dead_letters
            .with_label_values(&[tenant, reason.as_str()])
            .inc();
        self.0
            .jobs_completed
            .with_label_values(&[tenant, "dead_lettered"])
            .inc();
        self.0
            .quota_wait
            .with_label_values(&[tenant])
            .observe(quota_wait.as_secs_f64());
    }

    pub fn in_flight(&self) -> &IntGauge {
        &self.0.in_flight
    }

    pub fn set_consuming(&self, consuming: bool) {
        self.0.consuming.set(i64::from(consuming));
    }

    /// The mean time of this pod's calls of `call` so far (demo); `None`
    /// before the first.
    pub fn redis_call_mean(&self, call: CallKind) -> Option<Duration> {
        let histogram = self.redis_histogram(call);
        let count = histogram.get_sample_count();
        (count > 0).then(|| Duration::from_secs_f64(histogram.get_sample_sum() / count as f64))
    }

    /// Sum of a counter over every label set matching `labels` (demo, tests).
    pub fn counter_sum(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        self.0
            .registry
            .gather()
            .iter()
            .filter(|family| family.name() == name)
            .flat_map(|family| family.get_metric())
            .filter(|m| {
                labels.iter().all(|(k, v)| {
                    m.get_label()
                        .iter()
                        .any(|l| l.name() == *k && l.value() == *v)
                })
            })
            .map(|m| m.get_counter().get_value())
            // fold from +0.0: `sum()` of nothing is -0.0, which prints as "-0".
            .fold(0.0, |total, v| total + v)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tenant_labels_are_bounded() {
        let metrics = Metrics::new(2, &["vip".to_owned()]);
        assert_eq!(metrics.tenant("a"), "a");
        assert_eq!(metrics.tenant("b"), "b");
        assert_eq!(metrics.tenant("c"), OTHER_TENANT);
        assert_eq!(metrics.tenant("a"), "a", "seen tenants keep their label");
        assert_eq!(
            metrics.tenant("vip"),
            "vip",
            "allowlisted tenants do not use a slot"
        );
        assert!(
            metrics
                .render()
                .contains("tollgate_tenant_label_overflow_total 1")
        );
    }

    #[test]
    fn a_learned_rate_goes_once_its_quota_stops_adapting() {
        let metrics = Metrics::new(50, &[]);
        assert!(!metrics.shows_learned_rates());
        let learned = Learned {
            tenant: Some(7.92),
            route: Some(0.000278),
        };
        metrics.learned("acme", "email", learned, true);
        let text = metrics.render();
        assert!(text.contains("tollgate_quota_effective_rate{tenant=\"acme\"} 7.92"));
        assert!(text.contains("tollgate_route_effective_rate{route=\"email\"} 0.000278"));
        // A 429 blamed on the route teaches the tenant nothing: it stays.
        let route_only = Learned {
            tenant: None,
            route: Some(5.0),
        };
        metrics.learned("acme", "email", route_only, false);
        assert!(metrics.render().contains("{tenant=\"acme\"} 7.92"));
        // A sent job whose permit found the tenant's quota plain.
        metrics.learned("acme", "email", route_only, true);
        let text = metrics.render();
        assert!(!text.contains("{tenant=\"acme\"}"), "{text}");
        assert!(text.contains("{route=\"email\"} 5"));
        metrics.learned("acme", "email", Learned::default(), true);
        assert!(!metrics.render().contains("{route=\"email\"}"));
        assert!(!metrics.shows_learned_rates(), "nothing left to take away");
    }

    #[test]
    fn renders_every_family_with_help() {
        let metrics = Metrics::new(50, &[]);
        metrics.queue_age("acme", Duration::from_millis(20));
        metrics.due_lag("acme", Duration::from_millis(20));
        metrics.permit("acme", &PermitDecision::Duplicate);
        metrics.permit(
            "acme",
            &PermitDecision::Granted {
                delay: Duration::ZERO,
                shadow: Shadow::Deny,
                leeway: Duration::ZERO,
            },
        );
        metrics.provider(
            "acme",
            "default",
            &ProviderOutcome::Sent,
            Duration::from_millis(3),
        );
        metrics.parked("acme", ParkReason::Quota);
        metrics.late_permit("acme");
        metrics.tier_publish(Duration::from_secs(5));
        metrics.redis_call(CallKind::Permit, Duration::from_micros(300));
        metrics.redis_call(CallKind::Complete, Duration::from_millis(2));
        assert_eq!(
            metrics.redis_call_mean(CallKind::Permit),
            Some(Duration::from_micros(300))
        );
        metrics.look_ahead_opened("return");
        metrics.redelivered("return");
        metrics.completed("acme", Completion::Sent, Duration::ZERO);
        metrics.dead_lettered("acme", DeadReason::Rejected, Duration::ZERO);
        let text = metrics.render();
        for name in [
            "tollgate_queue_age_seconds",
            "tollgate_due_lag_seconds",
            "tollgate_quota_wait_seconds",
            "tollgate_permit_decisions_total",
            "tollgate_late_permits_total",
            "tollgate_shadow_decisions_total",
            "tollgate_provider_requests_total",
            "tollgate_provider_request_duration_seconds",
            "tollgate_redis_call_duration_seconds",
            "tollgate_jobs_completed_total",
            "tollgate_parked_total",
            "tollgate_dead_letters_total",
            "tollgate_tier_publishes_total",
            "tollgate_look_aheads_total",
            "tollgate_redelivered_total",
            "tollgate_jobs_in_flight",
            "tollgate_consuming",
            "tollgate_build_info",
        ] {
            assert!(text.contains(&format!("# HELP {name} ")), "{name} missing");
        }
        // Each call in its own series, in the bucket its time falls in.
        assert!(text.contains(
            r#"tollgate_redis_call_duration_seconds_bucket{call="permit",le="0.0005"} 1"#
        ));
        assert!(text.contains(
            r#"tollgate_redis_call_duration_seconds_bucket{call="complete",le="0.001"} 0"#
        ));
        assert!(text.contains(
            r#"tollgate_redis_call_duration_seconds_bucket{call="complete",le="0.0025"} 1"#
        ));
        // A series that observed nothing yet is there, at 0.
        assert!(
            text.contains(r#"tollgate_redis_call_duration_seconds_count{call="backlog_permit"} 0"#)
        );
        assert!(text.contains(r#"tollgate_due_lag_seconds_bucket{tenant="acme",le="0.1"} 1"#));
        assert_eq!(
            metrics.counter_sum("tollgate_jobs_completed_total", &[("tenant", "acme")]),
            2.0
        );
    }
}
