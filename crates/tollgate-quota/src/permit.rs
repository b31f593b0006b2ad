//! [`PermitStore`] on Redis: one `EVALSHA` per decision (falling back to
//! `EVAL` on `NOSCRIPT` after a restart or failover), time from Redis `TIME`
//! so the whole fleet shares one clock.

use std::sync::Arc;
use std::time::Duration;

use redis::Script;
use tollgate_core::ports::{PermitRequest, PermitStore};
use tollgate_core::{PermitDecision, Quota};

use crate::{Keys, QuotaError, Redis};

static PERMIT_LUA: &str = include_str!("lua/permit.lua");
static COMPLETE_LUA: &str = include_str!("lua/complete.lua");

#[derive(Clone, Debug)]
pub struct PermitSettings {
    /// Applies to tenants without a stored quota. Conservative by design:
    /// never unlimited.
    pub default_quota: Quota,
    /// How far ahead a permit may be reserved. A reserved job is held
    /// in-process until its slot, so this must not exceed the hold limit,
    /// and it bounds how long a quota change takes to apply.
    pub horizon: Duration,
    /// How long a granted job may stay in flight before another copy may
    /// try (provider timeout plus margin). Expires if a pod dies.
    pub lease_ttl: Duration,
    /// How long a sent idempotency key is remembered.
    pub sent_ttl: Duration,
    /// Fraction by which sends are spaced wider than the quota (0.02 = 2 %).
    /// Permits are exact, but sends arrive with a few milliseconds of jitter;
    /// without a margin, a provider counting per sliding second would see
    /// rate + 1 requests in some windows.
    pub pacing_margin: f64,
}

pub struct RedisPermits {
    redis: Arc<Redis>,
    keys: Keys,
    settings: PermitSettings,
    permit: Script,
    complete: Script,
}

impl RedisPermits {
    pub fn new(redis: Arc<Redis>, keys: Keys, settings: PermitSettings) -> Self {
        Self {
            redis,
            keys,
            settings,
            permit: Script::new(PERMIT_LUA),
            complete: Script::new(COMPLETE_LUA),
        }
    }

    pub fn redis(&self) -> &Arc<Redis> {
        &self.redis
    }
}

fn micros(d: Duration) -> u64 {
    d.as_micros() as u64
}

impl PermitStore for RedisPermits {
    type Error = QuotaError;

    async fn acquire(&self, req: PermitRequest<'_>) -> Result<PermitDecision, QuotaError> {
        let default = &self.settings.default_quota;
        let mut conn = self.redis.conn().await?;
        let (code, value): (i64, i64) = self
            .permit
            .key(self.keys.quota(req.tenant))
            .key(self.keys.tat(req.tenant))
            .key(self.keys.sent(req.tenant, req.key))
            .key(self.keys.lease(req.tenant, req.key))
            .key(self.keys.waiting(req.tenant))
            .arg(default.rate.count)
            .arg(default.rate.period.as_millis() as u64)
            .arg(default.burst)
            .arg(req.lease_token)
            .arg(micros(self.settings.horizon))
            .arg(self.settings.lease_ttl.as_millis() as u64)
            .arg(1.0 + self.settings.pacing_margin)
            .invoke_async(&mut conn)
            .await
            .map_err(|e| self.redis.classify(e))?;
        let wait = Duration::from_micros(value.max(0) as u64);
        match code {
            0 => Ok(PermitDecision::Granted { delay: wait }),
            1 => Ok(PermitDecision::Denied { retry_in: wait }),
            2 => Ok(PermitDecision::Duplicate),
            3 => Ok(PermitDecision::InFlight { retry_in: wait }),
            other => Err(QuotaError::BadReply(format!("code {other}"))),
        }
    }

    async fn ping(&self) -> Result<(), QuotaError> {
        self.redis.ping().await
    }

    async fn complete(&self, req: PermitRequest<'_>, sent: bool) -> Result<(), QuotaError> {
        let mut conn = self.redis.conn().await?;
        self.complete
            .key(self.keys.sent(req.tenant, req.key))
            .key(self.keys.lease(req.tenant, req.key))
            .arg(req.lease_token)
            .arg(if sent { "1" } else { "0" })
            .arg(self.settings.sent_ttl.as_millis() as u64)
            .arg(req.job_id.as_str())
            .invoke_async::<i64>(&mut conn)
            .await
            .map(drop)
            .map_err(|e| self.redis.classify(e))
    }
}
