//! The ports the runtime drives: small traits the adapters implement
//! (`tollgate-quota` for [`PermitStore`], `tollgate-provider` for
//! [`Provider`]). The AMQP side is driven directly by the runtime, because a
//! delivery's ack is tied to its channel.

use std::future::Future;

use crate::clock::UnixMillis;
use crate::ids::{IdempotencyKey, JobId, Kind, TenantId};
use crate::job::Job;
use crate::outcome::ProviderResponse;
use crate::run::{Eligibility, PermitDecision};

/// Identifies one permit request: the tenant's bucket, the route's shared
/// bucket, the job's idempotency key, and a token naming this attempt as the
/// holder of the in-flight lease.
#[derive(Clone, Copy, Debug)]
pub struct PermitRequest<'a> {
    pub tenant: &'a TenantId,
    /// The provider route (the job's kind).
    pub route: &'a Kind,
    /// Stored in the sent record, so "who sent this key" has an answer.
    pub job_id: &'a JobId,
    pub key: &'a IdempotencyKey,
    /// The job's class within its tenant's line.
    pub priority: crate::Priority,
    pub lease_token: &'a str,
    /// The job is back from a quota wait: decided by the fleet, never from
    /// a pod's local cache, and it keeps its place if still denied.
    pub returning: Option<Returning>,
    /// How far ahead a permit may be reserved for this job: `None` is the
    /// store's horizon. A pod that would not hold the job that long (its
    /// tenant has no hold room left) narrows it, so the job is denied with a
    /// place instead, parks, and comes back just before that place.
    pub reserve_within: Option<std::time::Duration>,
}

/// A job back from (a hop of) a quota wait.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Returning {
    /// When it was told to come back for its place in line, on the job's
    /// clock. A time, not the time left: the store reads the time left from
    /// its own clock, so a time left grew by the request's way there (the
    /// batch, the socket) on every hop, and a backlog's last jobs came back
    /// tens of ms past their places.
    pub until: UnixMillis,
    /// Spacing its place was computed with.
    pub interval: Option<std::time::Duration>,
    /// Its place on its tenant's share of a route, as the store gave it.
    pub share_place: Option<SharePlace>,
}

/// A place on a tenant's share of a route, in the route's virtual time,
/// with the tenant's step there when it was given (so the store can
/// re-space it after the tenant's weight or the route's quota changed).
/// Opaque outside the store: given back as it came.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SharePlace {
    pub at: u64,
    /// `None`: not known (a copy from before steps were kept).
    pub step: Option<u64>,
}

/// Whom a provider's 429 pauses, per route.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Deserialize, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ThrottleScope {
    /// The provider limits each customer: only the tenant that was
    /// throttled waits.
    #[default]
    Tenant,
    /// One provider account shared by every tenant: every tenant of the
    /// route waits.
    Route,
}

/// What became of a permit, as its completion records it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PermitUse {
    /// The provider accepted the call: the idempotency key is recorded.
    Sent,
    /// The provider was called and did not accept (a 429, an error).
    /// `retry_after`: a failure's `Retry-After` (a 503's "down for this
    /// long"): the key's lease is kept that long, so no copy of the job
    /// calls before it, even one whose parked copy's wait was lost (its
    /// confirm lost with the connection, the original redelivered).
    CallFailed {
        retry_after: Option<std::time::Duration>,
    },
    /// The call timed out here: the provider may still be working on it.
    /// Its lease is kept until it expires, so no copy with the same key
    /// (this job's own retry included) calls meanwhile, and a provider that
    /// answers "key in use" (409) to an overlap never sees one.
    Unanswered,
    /// Released without a call (shutting down, or held back by a 429 this
    /// pod saw after the permit was reserved): nothing to count.
    Unused,
}

/// A 429's pause, pushed into the permit store so every pod obeys it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Penalty {
    pub wait: std::time::Duration,
    pub scope: ThrottleScope,
}

/// The effective rates (per second) of the adaptive quotas a completion
/// taught, as they stand after it; `None` where the quota does not adapt.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Learned {
    pub tenant: Option<f64>,
    pub route: Option<f64>,
}

/// A permit decision and when it was made, on the pod's clock: its
/// `delay` and `retry_in` count from then. A decision may be read well
/// after it was made (on a busy pod, a reply waits its turn behind other
/// jobs' replies), and a wait counted from when it was read would send the
/// job, or bring it back for its place, late by as much.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Decided {
    pub decision: PermitDecision,
    pub made_at: UnixMillis,
}

/// The fleet-wide permit decision (one atomic call) and its bookkeeping.
pub trait PermitStore: Send + Sync + 'static {
    type Error: std::error::Error + Send + Sync + 'static;

    /// Idempotency check, in-flight lease and quota decision, atomically.
    fn acquire(
        &self,
        req: PermitRequest<'_>,
    ) -> impl Future<Output = Result<Decided, Self::Error>> + Send;

    /// A round trip, for readiness probes.
    fn ping(&self) -> impl Future<Output = Result<(), Self::Error>> + Send;

    /// After a provider call, or instead of one: record the key when
    /// [`PermitUse::Sent`], release the lease and concurrency slot, and on
    /// a 429 push the tenant's (or, by the route's scope, the route's)
    /// bucket past `penalty` so every pod backs off. Adaptive quotas learn
    /// from the same outcome.
    fn complete(
        &self,
        req: PermitRequest<'_>,
        used: PermitUse,
        penalty: Option<Penalty>,
    ) -> impl Future<Output = Result<Learned, Self::Error>> + Send;
}

/// One provider call for one job.
#[derive(Clone, Copy, Debug)]
pub struct ProviderCall<'a> {
    pub job: &'a Job,
    /// 1-based, sent as `X-Tollgate-Attempt`.
    pub attempt: u32,
}

pub trait Provider: Send + Sync + 'static {
    /// The route a job goes to, or `None` when its kind has no route.
    fn route(&self, job: &Job) -> Option<&str>;

    /// Whom a 429 from the job's route pauses.
    fn throttle_scope(&self, job: &Job) -> ThrottleScope;

    /// Asks the route's eligibility webhook; `Eligible` when it has none.
    fn eligibility(&self, job: &Job) -> impl Future<Output = Eligibility> + Send;

    fn call(&self, call: ProviderCall<'_>) -> impl Future<Output = ProviderResponse> + Send;
}
