//! The Redis side of tollgate: one atomic permit decision per job for the whole
//! fleet (idempotency check, in-flight lease and GCRA quota in one Lua call),
//! the completion record after a send, and the live quota store.
//!
//! Every key a script touches is passed in `KEYS` (none is built inside a
//! script), and a tenant's keys share its `{tenant}` hash tag.

/// Scripts of `src/lua/` joined into one, in order, with the shared prelude
/// (`now_us`) prepended.
#[macro_export]
#[doc(hidden)]
macro_rules! lua {
    ($($file:literal),+) => {
        concat!(
            include_str!("lua/prelude.lua"),
            $(include_str!(concat!("lua/", $file))),+
        )
    };
}

mod activity;
mod clock_offset;
mod conn;
mod keys;
mod permit;
mod store;

pub use activity::{
    Activity, CallCount, Calls, NotCounted, ParkedCount, TENANTS_PER_CALL, Tallied, parked_bucket,
};
pub use conn::{Conn, Redis, RedisSettings};
pub use keys::Keys;
pub use permit::{CallKind, CallObserver, PermitSettings, RedisPermits, Reply, SharePlaces};
pub use store::{Actor, AuditEntry, Cancel, Change, QuotaStore, Settings, Target, per_second};

/// Re-exported for tools that talk to the same Redis (bench, tests).
pub use redis::{Script, cmd as redis_cmd};

/// Errors from the Redis adapters. Callers act on one distinction: the
/// store could not be reached (fail closed, retry later) versus it answered
/// something that makes no sense (a bug or a corrupted key).
#[derive(Clone, Debug, thiserror::Error)]
pub enum QuotaError {
    #[error("redis is unreachable: {0}")]
    Unavailable(String),
    #[error("redis answered: {0}")]
    Redis(#[from] redis::RedisError),
    #[error("unexpected reply from the permit script: {0}")]
    BadReply(String),
    #[error("stored quota for {target} is invalid: {reason}")]
    BadQuota { target: String, reason: String },
}
