//! The ports the runtime drives: small traits the adapters implement
//! (`tollgate-quota` for [`PermitStore`], `tollgate-provider` for
//! [`Provider`]). The AMQP side is driven directly by the runtime, because a
//! delivery's ack is tied to its channel.

use std::future::Future;

use crate::ids::{IdempotencyKey, JobId, TenantId};
use crate::job::Job;
use crate::outcome::ProviderResponse;
use crate::run::PermitDecision;

/// Identifies one permit request: the tenant's bucket, the job's idempotency
/// key, and a token naming this attempt as the holder of the in-flight lease.
#[derive(Clone, Copy, Debug)]
pub struct PermitRequest<'a> {
    pub tenant: &'a TenantId,
    /// Stored in the sent record, so "who sent this key" has an answer.
    pub job_id: &'a JobId,
    pub key: &'a IdempotencyKey,
    pub lease_token: &'a str,
}

/// The fleet-wide permit decision (one atomic call) and its bookkeeping.
pub trait PermitStore: Send + Sync + 'static {
    type Error: std::error::Error + Send + Sync + 'static;

    /// Idempotency check, in-flight lease and quota decision, atomically.
    fn acquire(
        &self,
        req: PermitRequest<'_>,
    ) -> impl Future<Output = Result<PermitDecision, Self::Error>> + Send;

    /// A round trip, for readiness probes.
    fn ping(&self) -> impl Future<Output = Result<(), Self::Error>> + Send;

    /// After a provider call: record the key when `sent`, release the lease.
    fn complete(
        &self,
        req: PermitRequest<'_>,
        sent: bool,
    ) -> impl Future<Output = Result<(), Self::Error>> + Send;
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

    fn call(&self, call: ProviderCall<'_>) -> impl Future<Output = ProviderResponse> + Send;
}
