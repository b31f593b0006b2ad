//! The Redis side of tollgate: one atomic permit decision per job for the whole
//! fleet (idempotency check, in-flight lease and GCRA quota in one Lua call),
//! the completion record after a send, and the live quota store.
//!
//! Every key carries the tenant as a `{tenant}` hash tag and is passed in
//! `KEYS`, so each script touches one Redis Cluster slot.

mod conn;
mod keys;
mod permit;
mod store;

pub use conn::{Redis, RedisSettings};
pub use keys::Keys;
pub use permit::{PermitSettings, RedisPermits, Reply};
pub use store::{Actor, AuditEntry, Cancel, Change, QuotaStore, Settings, Target};

/// Re-exported for tools that talk to the same Redis (bench, tests).
pub use redis::{Script, cmd as redis_cmd};

/// Errors from the Redis adapters. Callers act on one distinction: the
/// store could not be reached (fail closed, retry later) versus it answered
/// something that makes no sense (a bug or a corrupted key).
#[derive(Debug, thiserror::Error)]
pub enum QuotaError {
    #[error("redis is unreachable: {0}")]
    Unavailable(String),
    #[error("redis answered: {0}")]
    Redis(#[from] redis::RedisError),
    #[error("unexpected reply from the permit script: {0}")]
    BadReply(String),
    #[error("stored quota for {tenant} is invalid: {reason}")]
    BadQuota { tenant: String, reason: String },
}
