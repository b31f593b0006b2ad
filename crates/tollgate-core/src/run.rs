//! The per-job decision state machine.
//!
//! The runtime drives one [`JobRun`] per delivery: it calls [`JobRun::next`],
//! carries out the returned [`Action`] (sleep, publish, ask Redis, call the
//! provider) and feeds the result back through [`JobRun::on_permit`] or
//! [`JobRun::on_provider`]. Every method takes `now`, so tests drive the whole
//! lifecycle with an injected clock and no sleeps.

use std::time::Duration;

use crate::backoff::Backoff;
use crate::clock::UnixMillis;
use crate::job::{Job, Progress};
use crate::outcome::{DeadReason, ParkReason, ProviderOutcome};
use crate::tiers::DelayTiers;

/// The knobs of the decision logic, built once from config.
#[derive(Clone, Debug)]
pub struct Policy {
    /// Waits up to this long are held in-process (delivery kept unacked);
    /// longer ones go through the delay tiers.
    pub hold_max: Duration,
    /// Failed provider attempts (408/5xx/timeout) before `exhausted`.
    pub max_attempts: u32,
    /// Unsettled deliveries (crashes, hangs) before `poison`.
    pub max_redeliveries: u32,
    pub backoff: Backoff,
    pub tiers: DelayTiers,
    /// First wait before asking again when the permit store (or an
    /// eligibility webhook) cannot be reached; it doubles at each further
    /// failure of the same job, up to `unavailable_retry_max`, with jitter.
    /// Longer than `hold_max`, such waits are parked: an outage never keeps
    /// a delivery looping in-process (where `delivery_timeout_ms` would hand
    /// it back and count it toward `poison`).
    pub unavailable_retry: Duration,
    pub unavailable_retry_max: Duration,
    /// Shortest hop of a quota wait. A quota wait hops through the tiers at
    /// most half its remaining time at once (never less than this, never
    /// more than [`QUOTA_HOP_MAX`]), and at
    /// each hop the job asks the permit store again: it keeps its place,
    /// re-spaced if the quota changed, or is sent at once when a raised
    /// quota has room. Halving keeps the churn of a backlog proportional to
    /// the tenant's rate (about 2 × rate × ln(wait / this) hops per second,
    /// more for waits past twice the cap), not to its size, while a job near
    /// the front sees a raise within this.
    pub quota_recheck: Duration,
    /// Wait after a 429 that carried no usable `Retry-After`.
    pub default_retry_after: Duration,
    /// Shortest wait after a 429: `Retry-After: 0` or a date in the past
    /// would otherwise retry at once, forever, without using an attempt.
    pub min_retry_after: Duration,
}

/// Longest hop of a quota wait. Halving alone sent a wait of minutes into
/// the 1 and 2 min tiers, where a raised quota, or the capacity a tenant
/// leaving a route frees, could not reach it: a backlog of a tenant whose
/// quota went from 2/s back to 20/s sent nothing for 18.8 s with 144 jobs
/// waiting, and one alone on a route went 53 s without a send. Capped, a
/// change reaches every parked job within this; the price is a few more
/// hops for the jobs of a backlog more than a minute deep (about rate ×
/// (wait − 60 s) / 30 s more parks a second, a third more for a 200 s one).
pub const QUOTA_HOP_MAX: Duration = Duration::from_secs(30);

impl Policy {
    /// How long a 429 pauses: its `Retry-After`, else the default, never
    /// less than `min_retry_after`.
    pub fn throttle_wait(&self, retry_after: Option<Duration>) -> Duration {
        retry_after
            .unwrap_or(self.default_retry_after)
            .max(self.min_retry_after)
    }

    /// Whether a wait is too short to park without coming back late. It
    /// occupies a delivery slot for less than the smallest tier, so
    /// [`JobRun::held_whatever_the_cap`] holds it (unless it is a place in
    /// line just given).
    fn imminent(&self, wait: Duration) -> bool {
        wait < self.tiers.shortest()
    }
}

/// What a tenant's shadow quota would have decided for a granted send.
/// Computed and counted, never enforced.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Shadow {
    /// No shadow quota is set.
    None,
    Allow,
    Deny,
}

/// The permit store's answer for one job.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PermitDecision {
    /// A permit is reserved for `now + delay` (zero: send now). The delay is
    /// bounded by the store's reservation horizon.
    Granted {
        delay: Duration,
        shadow: Shadow,
        /// How late after its slot the call may still begin. Sends are
        /// spaced a little wider than the quota; a send later than this,
        /// with the one a period of sends after it on time, could put one
        /// more than the quota in the provider's window. Past it the permit
        /// is let go unused and the job asks again.
        leeway: Duration,
    },
    /// Over quota; come back in `retry_in` (the job's place in line).
    Denied {
        retry_in: Duration,
        /// Spacing of the line the place is in (carried with the job, so a
        /// quota change can re-space its place).
        interval: Option<Duration>,
        /// The job kept the place it already had (a hop, not a new wait).
        kept: bool,
        /// A place on the tenant's share of a route, in the route's virtual
        /// time (carried with the job and given back as it came, so the
        /// store can place it however the shares have moved since).
        share_place: Option<crate::ports::SharePlace>,
    },
    /// The idempotency key is already recorded as sent.
    Duplicate,
    /// Another copy of this job holds the in-flight lease.
    InFlight { retry_in: Duration },
    /// The tenant is paused: park, consume nothing, look again later.
    Paused { retry_in: Duration },
    /// The job (or its idempotency key) was cancelled: skip it.
    Cancelled,
    /// The tenant has its maximum of provider calls in flight.
    AtConcurrency { retry_in: Duration },
    /// The store could not be reached: fail closed, no call without a permit.
    Unavailable,
}

/// How a job finished without a dead letter.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Completion {
    /// The provider accepted it: record the idempotency key, then ack.
    Sent,
    /// Already sent earlier: ack without a call.
    Duplicate,
    /// Cancelled, or the eligibility webhook said 410: ack without a call.
    Skipped,
}

impl Completion {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Sent => "sent",
            Self::Duplicate => "duplicate",
            Self::Skipped => "skipped",
        }
    }
}

/// The answer of a route's eligibility webhook ("is this still true?").
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Eligibility {
    /// 200, or the route has no webhook.
    Eligible,
    /// 410: skip the job, consuming no quota.
    Skip,
    /// Anything else: ask again later; never send without an answer.
    Unavailable,
}

/// What the runtime must do next.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    /// Keep the delivery and call [`JobRun::next`] again at `until`. May be
    /// turned into a park with [`JobRun::park_instead`] when the pod will
    /// not hold more of this tenant's jobs.
    Hold {
        until: UnixMillis,
        reason: ParkReason,
    },
    /// A permit is reserved for `until`: keep the delivery until then (never
    /// park it: the permit is already taken), then call [`JobRun::next`],
    /// which calls the provider.
    AwaitSlot {
        until: UnixMillis,
    },
    /// Publish a copy carrying [`JobRun::progress`] to the delay tier `tier`
    /// (confirmed), then ack the delivery.
    Park {
        until: UnixMillis,
        reason: ParkReason,
        tier: Duration,
        /// This copy was already parked for the same wait: a further hop
        /// through the tiers, not a new park.
        hop: bool,
    },
    /// Ask the route's eligibility webhook, then [`JobRun::on_eligibility`].
    CheckEligibility,
    /// Ask the permit store, then call [`JobRun::on_permit`].
    AskPermit,
    /// Call the provider, then [`JobRun::on_provider`].
    CallProvider,
    /// Publish to the dead-letter exchange (confirmed), then ack.
    DeadLetter {
        reason: DeadReason,
        detail: String,
    },
    Complete(Completion),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Stage {
    /// Waiting to be due, then to get a permit.
    Due,
    /// Holds a permit: the next step is the provider call.
    Granted,
}

/// One job's way through the pipeline, for one delivery.
///
/// ```text
/// Due ──(due, not expired)──▶ CheckEligibility ──Eligible──▶ AskPermit ──Granted──▶ CallProvider
///  ▲                               │ Skip → Complete(Skipped)    │ Denied/Paused/… → wait
///  └───────── waits (hold or park) ┴─────────────────────────────┘
/// ```
#[derive(Clone, Debug)]
pub struct JobRun {
    due_at: Option<UnixMillis>,
    expires_at: Option<UnixMillis>,
    progress: Progress,
    stage: Stage,
    /// The wait this copy was parked for, if any: parking it again for the
    /// same wait is a hop, not a new park.
    arrived_waiting: Option<(UnixMillis, ParkReason)>,
    /// This delivery already re-asked the permit store on its way back.
    rechecked: bool,
    /// The granted permit's slot and how late the call may begin after it.
    slot: Option<(UnixMillis, Duration)>,
    /// 429s this delivery met. From the second, the wait is parked however
    /// short: a provider that answers 429 for as long as it likes (a daily
    /// cap without `Retry-After`) would otherwise keep the job looping
    /// in-process, a second at a time, until `delivery_timeout_ms` handed
    /// it back and counted it toward `poison`.
    throttles_here: u32,
}

impl JobRun {
    pub fn new(job: &Job, mut progress: Progress, now: UnixMillis) -> Self {
        progress.first_seen.get_or_insert(now);
        Self {
            due_at: job.due_at,
            expires_at: job.expires_at,
            arrived_waiting: progress.not_before.zip(progress.park_reason),
            rechecked: false,
            slot: None,
            throttles_here: 0,
            progress,
            stage: Stage::Due,
        }
    }

    /// The headers a parked copy must carry.
    pub fn progress(&self) -> &Progress {
        &self.progress
    }

    /// The instant the job was meant to go out: `due_at`, or when tollgate
    /// first saw it. Due lag is measured from here.
    pub fn due_reference(&self) -> UnixMillis {
        self.due_at
            .or(self.progress.first_seen)
            .expect("first_seen is set in new")
    }

    /// When the job comes back from a quota wait (to its place in line, or
    /// from a hop of it): when it was told to come back, and the spacing
    /// its place was computed with. The permit store must decide such a job
    /// itself, never from a pod's local cache.
    pub fn returning(&self) -> Option<crate::ports::Returning> {
        if self.progress.park_reason != Some(ParkReason::Quota) {
            return None;
        }
        Some(crate::ports::Returning {
            until: self.progress.not_before?,
            interval: self.progress.slot_interval,
            share_place: self.progress.share_place,
        })
    }

    /// The attempt number of the next provider call (1-based), as sent in
    /// `X-Tollgate-Attempt`.
    pub fn attempt(&self) -> u32 {
        self.progress.attempt.saturating_add(1)
    }

    /// Whether the call about to be made is the job's first: neither a
    /// failure nor a 429 came before it. Only that call measures due lag.
    pub fn first_call(&self) -> bool {
        self.progress.attempt == 0 && self.progress.throttled == 0
    }

    /// The first step, and the step after every [`Action::Hold`] and
    /// [`Action::AwaitSlot`].
    pub fn next(&mut self, policy: &Policy, now: UnixMillis) -> Action {
        if self.progress.redeliveries >= policy.max_redeliveries {
            return Action::DeadLetter {
                reason: DeadReason::Poison,
                detail: format!(
                    "delivered {} times without settling: it crashed, hung or panicked workers",
                    self.progress.redeliveries
                ),
            };
        }
        if let Some(expired) = self.expired(now) {
            return expired;
        }
        match self.stage {
            Stage::Granted => Action::CallProvider,
            Stage::Due => {
                let not_before = self.progress.not_before.filter(|&t| t > now);
                let due = self.due_at.filter(|&t| t > now);
                match (due, not_before) {
                    (None, None) => Action::CheckEligibility,
                    (Some(due), nb) if nb.is_none_or(|nb| due >= nb) => {
                        self.progress.not_before = Some(due);
                        self.progress.park_reason = Some(ParkReason::NotDue);
                        self.wait_action(policy, now, due, ParkReason::NotDue)
                    }
                    (_, Some(nb)) => {
                        let reason = self.progress.park_reason.unwrap_or(ParkReason::Backoff);
                        let back_from_hop = self.arrived_waiting == Some((nb, reason));
                        if reason == ParkReason::Quota
                            && back_from_hop
                            && !self.rechecked
                            && now.until(nb) > policy.hold_max
                        {
                            // Back from a hop of a long quota wait: ask
                            // again (keep the place, or go if there is room).
                            self.rechecked = true;
                            return Action::AskPermit;
                        }
                        self.wait_action(policy, now, nb, reason)
                    }
                    (Some(_), None) => unreachable!("covered by the guard above"),
                }
            }
        }
    }

    /// `jitter` is uniform in [0, 1), drawn by the runtime.
    pub fn on_eligibility(
        &mut self,
        policy: &Policy,
        eligibility: Eligibility,
        now: UnixMillis,
        jitter: f64,
    ) -> Action {
        match eligibility {
            Eligibility::Eligible => Action::AskPermit,
            Eligibility::Skip => Action::Complete(Completion::Skipped),
            Eligibility::Unavailable => self.unavailable(policy, now, jitter),
        }
    }

    /// A dependency (permit store, eligibility webhook) did not answer:
    /// wait, longer at each failure in a row, jittered so a fleet does not
    /// come back in step.
    fn unavailable(&mut self, policy: &Policy, now: UnixMillis, jitter: f64) -> Action {
        let failures = self.progress.unavailable.min(16);
        self.progress.unavailable = self.progress.unavailable.saturating_add(1);
        let ceiling = policy
            .unavailable_retry
            .saturating_mul(1 << failures)
            .min(policy.unavailable_retry_max.max(policy.unavailable_retry));
        let wait = ceiling.mul_f64(0.5 + 0.5 * jitter.clamp(0.0, 1.0));
        self.begin_wait(policy, now, wait, ParkReason::Backoff)
    }

    /// The permit store's decision, made at `made_at` and read at `now`.
    /// Its waits count from when it was made: a decision read late (its
    /// reply queued behind others on a busy pod) sends the job at the slot
    /// the store chose, or not at all (past the permit's leeway the job asks
    /// again), and brings a job back for its place on time; counted from
    /// `now`, both were late by as much (a send 33 ms late put three sends
    /// of a 2/s tenant in one second).
    /// `jitter` is uniform in [0, 1), drawn by the runtime.
    pub fn on_permit(
        &mut self,
        policy: &Policy,
        decision: PermitDecision,
        made_at: UnixMillis,
        now: UnixMillis,
        jitter: f64,
    ) -> Action {
        debug_assert_eq!(
            self.stage,
            Stage::Due,
            "a permit is asked for once per call"
        );
        if decision != PermitDecision::Unavailable {
            self.progress.unavailable = 0;
        }
        // What is left of a wait the decision gave.
        let left = |wait: Duration| now.until(made_at.saturating_add(wait));
        match decision {
            PermitDecision::Granted { delay, leeway, .. } => {
                self.stage = Stage::Granted;
                let slot = made_at.saturating_add(delay);
                self.slot = Some((slot, leeway));
                self.progress.quota_wait += delay;
                if slot <= now {
                    // Due already (or late: `too_late` decides).
                    Action::CallProvider
                } else {
                    Action::AwaitSlot { until: slot }
                }
            }
            PermitDecision::Denied {
                retry_in,
                interval,
                kept,
                share_place,
            } => {
                self.progress.slot_interval = interval.or(self.progress.slot_interval);
                self.progress.share_place = share_place;
                if kept {
                    // Same wait, maybe re-spaced: a hop, not a new park.
                    self.arrived_waiting =
                        Some((made_at.saturating_add(retry_in), ParkReason::Quota));
                }
                self.begin_wait(policy, now, left(retry_in), ParkReason::Quota)
            }
            PermitDecision::Duplicate => Action::Complete(Completion::Duplicate),
            PermitDecision::InFlight { retry_in } => {
                self.begin_wait(policy, now, left(retry_in), ParkReason::Backoff)
            }
            PermitDecision::Paused { retry_in } => {
                self.begin_wait(policy, now, left(retry_in), ParkReason::Paused)
            }
            PermitDecision::Cancelled => Action::Complete(Completion::Skipped),
            PermitDecision::AtConcurrency { retry_in } => {
                self.begin_wait(policy, now, left(retry_in), ParkReason::Quota)
            }
            PermitDecision::Unavailable => self.unavailable(policy, now, jitter),
        }
    }

    /// `jitter` is uniform in [0, 1), drawn by the runtime.
    pub fn on_provider(
        &mut self,
        policy: &Policy,
        outcome: ProviderOutcome,
        now: UnixMillis,
        jitter: f64,
    ) -> Action {
        debug_assert_eq!(
            self.stage,
            Stage::Granted,
            "the provider is called with a permit"
        );
        self.stage = Stage::Due;
        match outcome {
            ProviderOutcome::Sent => Action::Complete(Completion::Sent),
            ProviderOutcome::Throttled { retry_after } => {
                self.throttles_here = self.throttles_here.saturating_add(1);
                self.progress.throttled = self.progress.throttled.saturating_add(1);
                self.begin_wait(
                    policy,
                    now,
                    policy.throttle_wait(retry_after),
                    ParkReason::Throttled,
                )
            }
            ProviderOutcome::Failed(failure) => {
                self.progress.attempt = self.progress.attempt.saturating_add(1);
                let failures = self.progress.attempt;
                if failures >= policy.max_attempts {
                    return Action::DeadLetter {
                        reason: DeadReason::Exhausted,
                        detail: format!(
                            "gave up after {failures} failed attempts; the last: {failure}"
                        ),
                    };
                }
                // At least as long as the provider asked (a 503 "down for
                // two minutes"): retried sooner, a maintenance window used
                // up every attempt in a minute.
                let wait = policy
                    .backoff
                    .delay(failures, jitter)
                    .max(failure.retry_after().unwrap_or_default());
                self.begin_wait(policy, now, wait, ParkReason::Backoff)
            }
            ProviderOutcome::Rejected { status, location } => Action::DeadLetter {
                reason: DeadReason::Rejected,
                detail: match location {
                    Some(location) => format!(
                        "provider answered {status} with Location: {location} (redirects are never followed)"
                    ),
                    None => format!("provider answered {status}"),
                },
            },
        }
    }

    /// A permit is held but the tenant (or its route) was throttled since
    /// it was granted: do not call, wait until `until` instead. The permit's
    /// slot is spent; no attempt is used.
    pub fn hold_back(&mut self, policy: &Policy, until: UnixMillis, now: UnixMillis) -> Action {
        debug_assert_eq!(
            self.stage,
            Stage::Granted,
            "only a granted job is held back"
        );
        self.stage = Stage::Due;
        self.begin_wait(policy, now, now.until(until), ParkReason::Throttled)
    }

    /// Just before the call: a permit whose slot passed more than its
    /// leeway ago (the pod was busy: no call slot free, a late timer) is
    /// not used. The permit store must be asked again; the slot is spent.
    /// The send time of the permit this job holds, once granted.
    pub fn slot(&self) -> Option<UnixMillis> {
        self.slot.map(|(slot, _)| slot)
    }

    pub fn too_late(&mut self, now: UnixMillis) -> Option<Action> {
        debug_assert_eq!(self.stage, Stage::Granted, "only a granted job can be late");
        let (slot, leeway) = self.slot?;
        if slot.until(now) <= leeway {
            return None;
        }
        self.stage = Stage::Due;
        self.slot = None;
        Some(Action::AskPermit)
    }

    fn expired(&self, now: UnixMillis) -> Option<Action> {
        let expires_at = self.expires_at.filter(|&t| t <= now)?;
        Some(Action::DeadLetter {
            reason: DeadReason::Expired,
            detail: format!("expired at {expires_at}"),
        })
    }

    /// Starts a new wait: remembers why, and counts it as quota wait when it
    /// is intentional throttling.
    fn begin_wait(
        &mut self,
        policy: &Policy,
        now: UnixMillis,
        wait: Duration,
        reason: ParkReason,
    ) -> Action {
        let until = now.saturating_add(wait);
        if reason.is_quota_wait() {
            // Count only what this wait adds beyond one still running (a kept
            // place re-spaced by a quota change adds the difference).
            let running_until = self.progress.not_before.filter(|&t| t > now).unwrap_or(now);
            self.progress.quota_wait += running_until.until(until);
        }
        self.progress.not_before = Some(until);
        self.progress.park_reason = Some(reason);
        if wait.is_zero() {
            return self.next(policy, now);
        }
        self.wait_action(policy, now, until, reason)
    }

    /// Hold short waits in-process, park long ones in the largest tier that
    /// does not overshoot.
    fn wait_action(
        &self,
        policy: &Policy,
        now: UnixMillis,
        until: UnixMillis,
        reason: ParkReason,
    ) -> Action {
        if reason == ParkReason::Paused
            || (reason == ParkReason::Throttled && self.throttles_here > 1)
        {
            // Parked however short the recheck: a pause may last hours,
            // and nothing of it should sit in a pod; nor should a provider's
            // throttling, once it has answered this delivery twice.
            return self.park_instead(policy, now, until, reason);
        }
        let remaining = now.until(until);
        let hop = match reason {
            // A quota wait's last hop leaves at least half of `hold_max` to
            // be held: a job late for its place loses it (the slot passes
            // with nobody to take it), and returning copies of a backlog
            // come back in herds that queue ahead of it for a few hundred
            // ms.
            ParkReason::Quota => remaining
                .min((remaining / 2).max(policy.quota_recheck))
                .min(QUOTA_HOP_MAX)
                .min(remaining.saturating_sub(policy.hold_max / 2)),
            _ => remaining,
        };
        match policy.tiers.pick(hop) {
            Some(tier) if remaining > policy.hold_max => Action::Park {
                until,
                reason,
                tier,
                hop: self.is_hop(until, reason),
            },
            _ => Action::Hold { until, reason },
        }
    }

    /// Parks a wait that [`JobRun::next`] offered to hold, because the pod
    /// holds enough of this tenant's jobs already. A wait shorter than every
    /// tier goes to the smallest one: the job comes back late, never early.
    pub fn park_instead(
        &self,
        policy: &Policy,
        now: UnixMillis,
        until: UnixMillis,
        reason: ParkReason,
    ) -> Action {
        let remaining = now.until(until);
        let tier = policy
            .tiers
            .pick(remaining)
            .unwrap_or_else(|| policy.tiers.shortest());
        Action::Park {
            until,
            reason,
            tier,
            hop: self.is_hop(until, reason),
        }
    }

    /// Whether a pod holds this wait whatever its hold cap. A quota wait
    /// for the place this job came back for (from a hop) is held: parked
    /// again, it came back later and later for that place (at one delivery
    /// per queue, 2–3 more hops in its last second, each a permit decision
    /// and a confirmed publish), and a queue behind it is looked past while
    /// it waits. A place in line just given never is, however short, so a
    /// backlog's first pass moves on; any other wait only when it is too
    /// short to park without coming back late.
    pub fn held_whatever_the_cap(
        &self,
        policy: &Policy,
        now: UnixMillis,
        until: UnixMillis,
        reason: ParkReason,
    ) -> bool {
        match reason {
            ParkReason::Quota => self.is_hop(until, reason),
            _ => policy.imminent(now.until(until)),
        }
    }

    fn is_hop(&self, until: UnixMillis, reason: ParkReason) -> bool {
        self.arrived_waiting == Some((until, reason))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::job::{Limits, decode};
    use crate::outcome::Failure;
    use proptest::prelude::*;

    const GRANTED: PermitDecision = PermitDecision::Granted {
        delay: Duration::ZERO,
        shadow: Shadow::None,
        leeway: Duration::from_millis(10),
    };

    /// A permit reserved 80 ms ahead, usable up to 10 ms late.
    const RESERVED_80MS: PermitDecision = PermitDecision::Granted {
        delay: Duration::from_millis(80),
        shadow: Shadow::None,
        leeway: Duration::from_millis(10),
    };

    /// A fresh place in line, `retry_in` away, given at `interval`.
    fn place(retry_in: Duration, interval: Option<Duration>) -> PermitDecision {
        PermitDecision::Denied {
            retry_in,
            interval,
            kept: false,
            share_place: None,
        }
    }

    fn policy() -> Policy {
        Policy {
            hold_max: Duration::from_secs(1),
            max_attempts: 3,
            max_redeliveries: 5,
            backoff: Backoff {
                base: Duration::from_millis(500),
                max: Duration::from_secs(60),
            },
            tiers: DelayTiers::new(
                [1, 5, 30, 120, 600, 3600].map(Duration::from_secs).to_vec(),
                Duration::from_secs(1),
            )
            .unwrap(),
            unavailable_retry: Duration::from_secs(1),
            unavailable_retry_max: Duration::from_secs(5),
            quota_recheck: Duration::from_secs(5),
            default_retry_after: Duration::from_secs(1),
            min_retry_after: Duration::from_secs(1),
        }
    }

    fn job(extra: &str) -> Job {
        let body = format!(r#"{{"id":"j1","tenant":"acme"{extra}}}"#);
        decode(body.as_bytes(), &Limits::default()).unwrap()
    }

    const T0: UnixMillis = UnixMillis(1_796_115_600_000); // 2026-12-01T09:00:00Z

    fn at(ms: i64) -> UnixMillis {
        UnixMillis(T0.0 + ms)
    }

    fn due_in(ms: i64) -> String {
        format!(r#","due_at":"{}""#, at(ms).to_rfc3339())
    }

    #[test]
    fn a_due_job_asks_for_a_permit_and_is_sent() {
        let p = policy();
        let mut run = JobRun::new(&job(""), Progress::default(), T0);
        assert_eq!(run.next(&p, T0), Action::CheckEligibility);
        assert_eq!(
            run.on_eligibility(&p, Eligibility::Eligible, T0, 0.5),
            Action::AskPermit
        );
        let a = run.on_permit(&p, GRANTED, T0, T0, 0.5);
        assert_eq!(a, Action::CallProvider);
        assert_eq!(run.attempt(), 1);
        let a = run.on_provider(&p, ProviderOutcome::Sent, T0, 0.5);
        assert_eq!(a, Action::Complete(Completion::Sent));
        assert_eq!(
            run.due_reference(),
            T0,
            "undated jobs are due when first seen"
        );
    }

    #[test]
    fn a_future_job_is_parked_then_held_then_sent() {
        let p = policy();
        let mut run = JobRun::new(&job(&due_in(3_400)), Progress::default(), T0);
        assert_eq!(
            run.next(&p, T0),
            Action::Park {
                until: at(3_400),
                reason: ParkReason::NotDue,
                tier: Duration::from_secs(1),
                hop: false,
            }
        );
        // Back from the 1 s tier a little late: still 2.39 s to go; the copy
        // carries its wait, so parking it again is a hop.
        let mut run = JobRun::new(&job(&due_in(3_400)), run.progress().clone(), at(1_010));
        let a = run.next(&p, at(1_010));
        assert!(
            matches!(a, Action::Park { tier, hop: true, .. } if tier == Duration::from_secs(1))
        );
        // Under the hold limit: held in-process until exactly due.
        assert_eq!(
            run.next(&p, at(2_900)),
            Action::Hold {
                until: at(3_400),
                reason: ParkReason::NotDue
            }
        );
        // A pod that will not hold more of this tenant parks it instead.
        assert_eq!(
            run.park_instead(&p, at(2_900), at(3_400), ParkReason::NotDue),
            Action::Park {
                until: at(3_400),
                reason: ParkReason::NotDue,
                tier: Duration::from_secs(1),
                hop: true,
            }
        );
        assert_eq!(run.next(&p, at(3_400)), Action::CheckEligibility);
        assert_eq!(
            run.progress().quota_wait,
            Duration::ZERO,
            "waiting to be due is not throttling"
        );
    }

    #[test]
    fn a_reservation_is_held_then_sent_without_asking_again() {
        let p = policy();
        let mut run = JobRun::new(&job(""), Progress::default(), T0);
        run.next(&p, T0);
        let a = run.on_permit(&p, RESERVED_80MS, T0, T0, 0.5);
        assert_eq!(
            a,
            Action::AwaitSlot { until: at(80) },
            "a reservation must be held, never parked"
        );
        assert_eq!(
            run.next(&p, at(80)),
            Action::CallProvider,
            "no second permit, no second eligibility check"
        );
        assert_eq!(run.progress().quota_wait, Duration::from_millis(80));
    }

    #[test]
    fn a_permit_past_its_leeway_is_not_used_and_the_job_asks_again() {
        let p = policy();
        let mut run = JobRun::new(&job(""), Progress::default(), T0);
        run.next(&p, T0);
        let reserved = RESERVED_80MS;
        assert_eq!(
            run.on_permit(&p, reserved, T0, T0, 0.5),
            Action::AwaitSlot { until: at(80) }
        );
        assert_eq!(run.next(&p, at(80)), Action::CallProvider);
        assert_eq!(run.too_late(at(90)), None, "within its leeway");
        assert_eq!(run.too_late(at(91)), Some(Action::AskPermit));
        // Asked again and granted for now: used at once.
        assert_eq!(
            run.on_permit(&p, GRANTED, at(91), at(91), 0.5),
            Action::CallProvider
        );
        assert_eq!(run.too_late(at(91)), None);
        assert_eq!(run.attempt(), 1, "no attempt used");
    }

    #[test]
    fn a_permit_read_late_keeps_the_slot_the_store_chose() {
        let p = policy();
        let reserved = RESERVED_80MS;
        // Made at T0, read 30 ms later: the slot is still T0 + 80 ms.
        let mut run = JobRun::new(&job(""), Progress::default(), T0);
        run.next(&p, T0);
        assert_eq!(
            run.on_permit(&p, reserved, T0, at(30), 0.5),
            Action::AwaitSlot { until: at(80) }
        );
        // Read past its slot and leeway: the call is due at once, and the
        // check just before it finds it too late, so the job asks again.
        let mut late = JobRun::new(&job(""), Progress::default(), T0);
        late.next(&p, T0);
        assert_eq!(
            late.on_permit(&p, reserved, T0, at(95), 0.5),
            Action::CallProvider
        );
        assert_eq!(late.too_late(at(95)), Some(Action::AskPermit));
    }

    #[test]
    fn a_denial_read_late_brings_the_job_back_for_its_place_on_time() {
        let p = policy();
        let mut run = JobRun::new(&job(""), Progress::default(), T0);
        run.next(&p, T0);
        let denied = place(Duration::from_millis(400), None);
        assert_eq!(
            run.on_permit(&p, denied, T0, at(30), 0.5),
            Action::Hold {
                until: at(400),
                reason: ParkReason::Quota
            }
        );
        assert_eq!(run.progress().not_before, Some(at(400)));
    }

    #[test]
    fn a_denied_job_waits_for_the_returned_time_and_counts_it_as_quota_wait() {
        let p = policy();
        let mut run = JobRun::new(&job(""), Progress::default(), T0);
        run.next(&p, T0);
        let a = run.on_permit(&p, place(Duration::from_millis(7_500), None), T0, T0, 0.5);
        assert_eq!(
            a,
            Action::Park {
                until: at(7_500),
                reason: ParkReason::Quota,
                tier: Duration::from_secs(5),
                hop: false,
            }
        );
        assert_eq!(run.progress().quota_wait, Duration::from_millis(7_500));
        assert_eq!(run.progress().not_before, Some(at(7_500)));
        // The copy comes back from its hop: it asks again, keeps its place,
        // and the wait goes on as a hop, not counted twice.
        let mut back = JobRun::new(&job(""), run.progress().clone(), at(5_004));
        assert_eq!(back.next(&p, at(5_004)), Action::AskPermit);
        let place = crate::ports::SharePlace {
            at: 1_234_567,
            step: Some(33_334),
        };
        let kept = PermitDecision::Denied {
            retry_in: Duration::from_millis(2_496),
            interval: Some(Duration::from_millis(100)),
            kept: true,
            share_place: Some(place),
        };
        assert_eq!(
            back.on_permit(&p, kept, at(5_004), at(5_004), 0.5),
            Action::Park {
                until: at(7_500),
                reason: ParkReason::Quota,
                tier: Duration::from_secs(1),
                hop: true,
            }
        );
        assert_eq!(back.progress().quota_wait, Duration::from_millis(7_500));
        assert_eq!(
            back.progress().slot_interval,
            Some(Duration::from_millis(100))
        );
        // A place on a share of a route goes with the job, as it came.
        assert_eq!(back.returning().and_then(|r| r.share_place), Some(place));
        assert_eq!(
            back.next(&p, at(6_600)),
            Action::Hold {
                until: at(7_500),
                reason: ParkReason::Quota
            }
        );
        assert_eq!(back.next(&p, at(7_500)), Action::CheckEligibility);
    }

    #[test]
    fn a_copy_back_for_its_kept_place_is_held_whatever_the_cap_a_new_place_is_not() {
        // The default tiers: the smallest is 100 ms.
        let p = Policy {
            tiers: DelayTiers::new(
                [100, 250, 500, 1_000, 5_000]
                    .map(Duration::from_millis)
                    .to_vec(),
                Duration::from_secs(1),
            )
            .unwrap(),
            ..policy()
        };
        // A place in line just given, 600 ms or 50 ms out: parked by a pod
        // with no room for the tenant, so a backlog's first pass moves on.
        for ms in [600, 50] {
            let mut run = JobRun::new(&job(""), Progress::default(), T0);
            run.next(&p, T0);
            let until = at(ms);
            assert_eq!(
                run.on_permit(
                    &p,
                    place(Duration::from_millis(ms as u64), None),
                    T0,
                    T0,
                    0.5
                ),
                Action::Hold {
                    until,
                    reason: ParkReason::Quota
                }
            );
            assert!(!run.held_whatever_the_cap(&p, T0, until, ParkReason::Quota));
        }
        // Its copy back from a hop for that place, 600 ms out: held.
        let waiting = Progress {
            not_before: Some(at(1_600)),
            park_reason: Some(ParkReason::Quota),
            ..Progress::default()
        };
        let mut back = JobRun::new(&job(""), waiting, at(1_000));
        let held = back.next(&p, at(1_000));
        assert_eq!(
            held,
            Action::Hold {
                until: at(1_600),
                reason: ParkReason::Quota
            }
        );
        assert!(back.held_whatever_the_cap(&p, at(1_000), at(1_600), ParkReason::Quota));
        // Any other wait only when too short to park.
        let run = JobRun::new(&job(""), Progress::default(), T0);
        assert!(!run.held_whatever_the_cap(&p, T0, at(600), ParkReason::Backoff));
        assert!(run.held_whatever_the_cap(&p, T0, at(50), ParkReason::Backoff));
    }

    #[test]
    fn a_quota_waits_last_hop_leaves_half_of_hold_max_to_hold() {
        let p = policy();
        let denied = |retry_in_ms| {
            place(
                Duration::from_millis(retry_in_ms),
                Some(Duration::from_millis(125)),
            )
        };
        let first = |retry_in_ms| {
            let mut run = JobRun::new(&job(""), Progress::default(), T0);
            run.next(&p, T0);
            run.on_permit(&p, denied(retry_in_ms), T0, T0, 0.5)
        };
        // 5.2 s to its place: not the 5 s tier (back 0.2 s before it, late
        // behind any herd of returning copies) but the 1 s tier.
        assert!(matches!(
            first(5_200),
            Action::Park { tier, .. } if tier == Duration::from_secs(1)
        ));
        // 1.4 s: no tier leaves 0.5 s (of `hold_max` 1 s), so it is held.
        assert_eq!(
            first(1_400),
            Action::Hold {
                until: at(1_400),
                reason: ParkReason::Quota
            }
        );
        // 2.2 s: the 1 s tier, back with 1.2 s to go (then held or hops).
        assert!(matches!(
            first(2_200),
            Action::Park { tier, .. } if tier == Duration::from_secs(1)
        ));
    }

    #[test]
    fn long_quota_waits_hop_and_recheck_so_a_raised_quota_reaches_them() {
        let p = policy();
        let mut run = JobRun::new(&job(""), Progress::default(), T0);
        run.next(&p, T0);
        let denied = place(Duration::from_secs(40), Some(Duration::from_millis(200)));
        // 40 s to wait: the first hop is at most half of it (the 5 s tier
        // of 1, 5, 30, 120 s …).
        assert!(matches!(
            run.on_permit(&p, denied, T0, T0, 0.5),
            Action::Park { tier, hop: false, .. } if tier == Duration::from_secs(5)
        ));
        let mut back = JobRun::new(&job(""), run.progress().clone(), at(5_003));
        assert_eq!(
            back.returning(),
            Some(crate::ports::Returning {
                until: at(40_000),
                interval: Some(Duration::from_millis(200)),
                share_place: None,
            })
        );
        assert_eq!(back.next(&p, at(5_003)), Action::AskPermit);
        // The quota was raised 4x meanwhile: the store re-spaces the place.
        let respaced = PermitDecision::Denied {
            retry_in: Duration::from_millis(8_749),
            interval: Some(Duration::from_millis(50)),
            kept: true,
            share_place: None,
        };
        assert!(matches!(
            back.on_permit(&p, respaced, at(5_003), at(5_003), 0.5),
            Action::Park { hop: true, .. }
        ));
        assert_eq!(
            back.progress().quota_wait,
            Duration::from_secs(40),
            "a shorter place adds no wait"
        );
        // Or the raised quota has room right away.
        let mut lucky = JobRun::new(&job(""), run.progress().clone(), at(5_003));
        lucky.next(&p, at(5_003));
        assert_eq!(
            lucky.on_permit(&p, GRANTED, at(5_003), at(5_003), 0.5),
            Action::CallProvider
        );
    }

    /// However long the wait, a quota hop is at most [`QUOTA_HOP_MAX`], so a
    /// raised quota or capacity freed on a route reaches the job within it.
    #[test]
    fn no_quota_hop_is_longer_than_the_cap() {
        let p = policy();
        for wait_s in [61, 300, 3_600] {
            let mut run = JobRun::new(&job(""), Progress::default(), T0);
            run.next(&p, T0);
            let denied = place(
                Duration::from_secs(wait_s),
                Some(Duration::from_millis(500)),
            );
            match run.on_permit(&p, denied, T0, T0, 0.5) {
                Action::Park { tier, .. } => {
                    assert!(tier <= QUOTA_HOP_MAX, "a {wait_s} s wait hops {tier:?}")
                }
                other => panic!("a {wait_s} s wait is parked: {other:?}"),
            }
        }
    }

    #[test]
    fn failures_back_off_then_exhaust() {
        let p = policy();
        let mut run = JobRun::new(&job(""), Progress::default(), T0);
        for attempt in 1..=3 {
            assert_eq!(
                run.next(&p, at(i64::from(attempt) * 100_000)),
                Action::CheckEligibility
            );
            let now = at(i64::from(attempt) * 100_000);
            run.on_permit(&p, GRANTED, now, now, 0.5);
            assert_eq!(run.attempt(), attempt);
            let a = run.on_provider(&p, ProviderOutcome::Failed(Failure::Timeout), now, 0.99);
            if attempt < 3 {
                let ceiling = p.backoff.ceiling(attempt);
                match a {
                    Action::Hold { until, .. } | Action::Park { until, .. } => {
                        assert!(now.until(until) <= ceiling);
                    }
                    other => panic!("attempt {attempt}: expected a wait, got {other:?}"),
                }
            } else {
                assert_eq!(
                    a,
                    Action::DeadLetter {
                        reason: DeadReason::Exhausted,
                        detail: "gave up after 3 failed attempts; the last: no answer within the \
                                 provider timeout (it may have done it)"
                            .into(),
                    }
                );
            }
        }
    }

    #[test]
    fn a_failure_with_retry_after_waits_at_least_that_long() {
        // A 503 "down for two minutes": the backoff (at most 1 s here) would
        // use up every attempt within the window.
        let p = policy();
        let mut run = JobRun::new(&job(""), Progress::default(), T0);
        let now = at(100_000);
        assert_eq!(run.next(&p, now), Action::CheckEligibility);
        run.on_permit(&p, GRANTED, now, now, 0.5);
        let unavailable = Failure::Status {
            status: 503,
            retry_after: Some(Duration::from_secs(120)),
        };
        match run.on_provider(&p, ProviderOutcome::Failed(unavailable), now, 0.5) {
            Action::Park { until, reason, .. } => {
                assert_eq!(now.until(until), Duration::from_secs(120));
                assert_eq!(reason, ParkReason::Backoff);
            }
            other => panic!("expected a park, got {other:?}"),
        }
        assert_eq!(run.attempt(), 2, "the failure used an attempt");
    }

    #[test]
    fn a_429_waits_for_retry_after_and_burns_no_attempt() {
        let p = policy();
        let mut run = JobRun::new(&job(""), Progress::default(), T0);
        run.next(&p, T0);
        run.on_permit(&p, GRANTED, T0, T0, 0.5);
        let a = run.on_provider(
            &p,
            ProviderOutcome::Throttled {
                retry_after: Some(Duration::from_secs(2)),
            },
            T0,
            0.5,
        );
        assert!(matches!(
            a,
            Action::Park { until, reason: ParkReason::Throttled, .. } if until == at(2_000)
        ));
        assert_eq!(run.attempt(), 1, "a 429 is not a failed attempt");
        assert_eq!(run.progress().quota_wait, Duration::from_secs(2));
    }

    /// A provider that keeps answering 429 (a daily cap, without
    /// `Retry-After`): the first wait is held, the next ones parked, so the
    /// delivery ends instead of looping in-process until
    /// `delivery_timeout_ms` hands it back as hung (toward `poison`).
    #[test]
    fn a_second_429_in_one_delivery_is_parked_however_short() {
        let p = policy();
        let mut run = JobRun::new(&job(""), Progress::default(), T0);
        let throttled = ProviderOutcome::Throttled { retry_after: None };
        let mut now = T0;
        run.next(&p, now);
        run.on_permit(&p, GRANTED, now, now, 0.5);
        let until = match run.on_provider(&p, throttled.clone(), now, 0.5) {
            Action::Hold { until, reason } => {
                assert_eq!(reason, ParkReason::Throttled);
                until
            }
            other => panic!("the first 429's second is held: {other:?}"),
        };
        now = until;
        assert_eq!(run.next(&p, now), Action::CheckEligibility);
        run.on_permit(&p, GRANTED, now, now, 0.5);
        match run.on_provider(&p, throttled, now, 0.5) {
            Action::Park { until, reason, .. } => {
                assert_eq!(reason, ParkReason::Throttled);
                assert_eq!(now.until(until), p.min_retry_after, "never early");
            }
            other => panic!("the second 429's wait is parked: {other:?}"),
        }
        assert_eq!(run.attempt(), 1, "429s use no attempt");
    }

    /// Due lag is how late a job's first call began: a call after a 429
    /// (which uses no attempt) or after a failure is not its first, in this
    /// delivery or a parked copy's. Every call after a 429 used to count as
    /// attempt 1, and a throttled tenant's lag was measured once per 429.
    #[test]
    fn only_a_jobs_first_call_measures_its_due_lag() {
        let p = policy();
        let mut run = JobRun::new(&job(""), Progress::default(), T0);
        run.next(&p, T0);
        run.on_permit(&p, GRANTED, T0, T0, 0.5);
        assert!(run.first_call());
        let throttled = ProviderOutcome::Throttled { retry_after: None };
        run.on_provider(&p, throttled, T0, 0.5);
        assert_eq!(run.attempt(), 1, "429s use no attempt");
        assert!(!run.first_call(), "after a 429");
        let parked = run.progress().clone();
        assert_eq!(parked.throttled, 1);
        let copy = JobRun::new(&job(""), parked, T0);
        assert!(!copy.first_call(), "nor in the copy parked after it");
    }

    #[test]
    fn a_429_with_retry_after_zero_or_past_still_pauses() {
        let p = policy();
        for retry_after in [Some(Duration::ZERO), Some(Duration::from_millis(20)), None] {
            let mut run = JobRun::new(&job(""), Progress::default(), T0);
            run.next(&p, T0);
            run.on_permit(&p, GRANTED, T0, T0, 0.5);
            let a = run.on_provider(&p, ProviderOutcome::Throttled { retry_after }, T0, 0.5);
            match a {
                Action::Hold { until, .. } | Action::Park { until, .. } => assert!(
                    T0.until(until) >= p.min_retry_after,
                    "{retry_after:?}: waits {:?}",
                    T0.until(until)
                ),
                other => panic!("expected a wait, got {other:?}"),
            }
            assert_eq!(run.attempt(), 1);
        }
    }

    #[test]
    fn a_held_back_permit_waits_and_uses_no_attempt() {
        let p = policy();
        let mut run = JobRun::new(&job(""), Progress::default(), T0);
        run.next(&p, T0);
        run.on_permit(
            &p,
            PermitDecision::Granted {
                delay: Duration::from_millis(300),
                shadow: Shadow::None,
                leeway: Duration::from_millis(10),
            },
            T0,
            T0,
            0.5,
        );
        assert_eq!(run.next(&p, at(300)), Action::CallProvider);
        let a = run.hold_back(&p, at(1_800), at(300));
        assert_eq!(
            a,
            Action::Park {
                until: at(1_800),
                reason: ParkReason::Throttled,
                tier: Duration::from_secs(1),
                hop: false,
            }
        );
        assert_eq!(run.attempt(), 1);
        let mut back = JobRun::new(&job(""), run.progress().clone(), at(1_310));
        assert!(
            matches!(back.next(&p, at(1_310)), Action::Hold { until, .. } if until == at(1_800))
        );
        assert_eq!(back.next(&p, at(1_800)), Action::CheckEligibility);
    }

    #[test]
    fn rejections_and_duplicates_end_at_once() {
        let p = policy();
        let mut run = JobRun::new(&job(""), Progress::default(), T0);
        run.next(&p, T0);
        assert_eq!(
            run.on_permit(&p, PermitDecision::Duplicate, T0, T0, 0.5),
            Action::Complete(Completion::Duplicate)
        );
        let mut run = JobRun::new(&job(""), Progress::default(), T0);
        run.next(&p, T0);
        run.on_permit(&p, GRANTED, T0, T0, 0.5);
        assert_eq!(
            run.on_provider(
                &p,
                ProviderOutcome::Rejected {
                    status: 422,
                    location: None
                },
                T0,
                0.0
            ),
            Action::DeadLetter {
                reason: DeadReason::Rejected,
                detail: "provider answered 422".into(),
            }
        );
    }

    #[test]
    fn paused_cancelled_and_ineligible_jobs_consume_nothing() {
        let p = policy();
        let mut run = JobRun::new(&job(""), Progress::default(), T0);
        run.next(&p, T0);
        let a = run.on_permit(
            &p,
            PermitDecision::Paused {
                retry_in: Duration::from_secs(5),
            },
            T0,
            T0,
            0.5,
        );
        assert!(matches!(
            a,
            Action::Park {
                reason: ParkReason::Paused,
                ..
            }
        ));
        assert_eq!(run.attempt(), 1);
        // However short the recheck: a pause is never held in a pod.
        let mut run = JobRun::new(&job(""), Progress::default(), T0);
        run.next(&p, T0);
        let short = PermitDecision::Paused {
            retry_in: Duration::from_millis(500),
        };
        assert!(matches!(
            run.on_permit(&p, short, T0, T0, 0.5),
            Action::Park {
                reason: ParkReason::Paused,
                ..
            }
        ));
        let mut run = JobRun::new(&job(""), Progress::default(), T0);
        run.next(&p, T0);
        assert_eq!(
            run.on_permit(&p, PermitDecision::Cancelled, T0, T0, 0.5),
            Action::Complete(Completion::Skipped)
        );
        let mut run = JobRun::new(&job(""), Progress::default(), T0);
        run.next(&p, T0);
        assert_eq!(
            run.on_eligibility(&p, Eligibility::Skip, T0, 0.5),
            Action::Complete(Completion::Skipped)
        );
        let mut run = JobRun::new(&job(""), Progress::default(), T0);
        run.next(&p, T0);
        assert!(matches!(
            run.on_eligibility(&p, Eligibility::Unavailable, T0, 0.5),
            Action::Hold {
                reason: ParkReason::Backoff,
                ..
            }
        ));
    }

    #[test]
    fn a_job_that_keeps_crashing_workers_is_poison() {
        let p = policy();
        let crashed = Progress {
            redeliveries: 4,
            ..Progress::default()
        };
        let mut run = JobRun::new(&job(""), crashed.clone(), T0);
        assert_eq!(run.next(&p, T0), Action::CheckEligibility);
        let mut run = JobRun::new(
            &job(""),
            Progress {
                redeliveries: 5,
                ..crashed
            },
            T0,
        );
        assert!(matches!(
            run.next(&p, T0),
            Action::DeadLetter {
                reason: DeadReason::Poison,
                ..
            }
        ));
    }

    #[test]
    fn an_unreachable_permit_store_fails_closed() {
        let p = policy();
        let mut run = JobRun::new(&job(""), Progress::default(), T0);
        run.next(&p, T0);
        let a = run.on_permit(&p, PermitDecision::Unavailable, T0, T0, 0.999);
        assert_eq!(
            a,
            Action::Hold {
                until: at(999),
                reason: ParkReason::Backoff
            }
        );
        assert_eq!(
            run.next(&p, at(999)),
            Action::CheckEligibility,
            "asks again, never calls"
        );
    }

    #[test]
    fn an_outage_backs_off_with_jitter_and_parks_instead_of_looping() {
        let p = policy();
        let mut run = JobRun::new(&job(""), Progress::default(), T0);
        let mut now = T0;
        let mut waits = Vec::new();
        for i in 0..6 {
            assert_eq!(run.next(&p, now), Action::CheckEligibility);
            let jitter = [0.0, 0.999][i % 2];
            let a = run.on_permit(&p, PermitDecision::Unavailable, now, now, jitter);
            let until = match a {
                Action::Hold { until, .. } => {
                    assert!(i == 0, "only the first wait is short enough to hold");
                    until
                }
                Action::Park { until, .. } => until,
                other => panic!("expected a wait, got {other:?}"),
            };
            waits.push(now.until(until));
            // A parked copy comes back as a new delivery carrying the count.
            run = JobRun::new(&job(""), run.progress().clone(), until);
            now = until;
        }
        let ms: Vec<u128> = waits.iter().map(Duration::as_millis).collect();
        assert_eq!(
            ms,
            [500, 1_999, 2_000, 4_997, 2_500, 4_997],
            "doubling to 5 s, jittered 50-100 %"
        );
        // The store answers again: the count starts over.
        assert_eq!(run.next(&p, now), Action::CheckEligibility);
        run.on_permit(&p, GRANTED, now, now, 0.5);
        assert_eq!(run.progress().unavailable, 0);
        assert_eq!(run.attempt(), 1, "an outage uses no attempt");
    }

    #[test]
    fn expired_jobs_are_dead_lettered_before_anything_else() {
        let p = policy();
        let extra = format!(r#","expires_at":"{}""#, at(500).to_rfc3339());
        let mut run = JobRun::new(&job(&extra), Progress::default(), T0);
        assert_eq!(run.next(&p, T0), Action::CheckEligibility);
        run.on_permit(&p, place(Duration::from_millis(800), None), T0, T0, 0.5);
        assert!(matches!(
            run.next(&p, at(800)),
            Action::DeadLetter {
                reason: DeadReason::Expired,
                ..
            }
        ));
    }

    proptest! {
        /// Whatever the due time and however late the tiers hand jobs back,
        /// the provider is never called before `due_at`, and the job is
        /// called within one tier-lateness of it.
        #[test]
        fn never_sent_before_due(due_ms in 0i64..7_200_000, lateness_ms in 0i64..50) {
            let p = policy();
            let mut run = JobRun::new(&job(&due_in(due_ms)), Progress::default(), T0);
            let mut now = T0;
            let mut steps = 0;
            loop {
                steps += 1;
                prop_assert!(steps < 200, "no progress");
                match run.next(&p, now) {
                    Action::Park { until, tier, .. } => {
                        prop_assert!(now.saturating_add(tier) <= until, "a tier overshoots");
                        now = now.saturating_add(tier + Duration::from_millis(lateness_ms as u64));
                    }
                    Action::Hold { until, .. } => {
                        prop_assert!(now.until(until) <= p.hold_max);
                        now = until;
                    }
                    Action::CheckEligibility => break,
                    other => prop_assert!(false, "unexpected {other:?}"),
                }
            }
            prop_assert!(now >= at(due_ms));
            prop_assert!(now.0 - at(due_ms).0 <= lateness_ms.max(1));
        }

        /// A job that always fails makes exactly `max_attempts` calls, and
        /// throttling in between does not change that.
        #[test]
        fn attempts_are_bounded(throttles in proptest::collection::vec(any::<bool>(), 0..20)) {
            let p = policy();
            let mut run = JobRun::new(&job(""), Progress::default(), T0);
            let (mut now, mut failed_calls, mut throttles) = (T0, 0, throttles.into_iter());
            loop {
                match run.next(&p, now) {
                    Action::Hold { until, .. } | Action::Park { until, .. } => { now = until; continue; }
                    Action::CheckEligibility => {}
                    other => prop_assert!(false, "unexpected {other:?}"),
                }
                prop_assert_eq!(
                    run.on_permit(&p, GRANTED, now, now, 0.5),
                    Action::CallProvider
                );
                let outcome = if throttles.next().unwrap_or(false) {
                    ProviderOutcome::Throttled { retry_after: None }
                } else {
                    failed_calls += 1;
                    ProviderOutcome::Failed(Failure::Unreachable)
                };
                if let Action::DeadLetter { reason, .. } = run.on_provider(&p, outcome, now, 0.5) {
                    prop_assert_eq!(reason, DeadReason::Exhausted);
                    break;
                }
            }
            prop_assert_eq!(failed_calls, p.max_attempts);
        }
    }
}
