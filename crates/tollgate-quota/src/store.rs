//! The live quota store: what `tollgate quota set|get|list` read and write.
//! The permit script reads the same hash on every decision, so a change
//! applies to the next decision of every pod.

use std::sync::Arc;
use std::time::Duration;

use redis::AsyncCommands;
use tollgate_core::{Quota, Rate, TenantId};

use crate::{Keys, QuotaError, Redis};

/// A stored quota and who last changed it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct QuotaEntry {
    pub quota: Quota,
    pub updated_at_ms: Option<i64>,
    pub updated_by: Option<String>,
}

pub struct QuotaStore {
    redis: Arc<Redis>,
    keys: Keys,
}

impl QuotaStore {
    pub fn new(redis: Arc<Redis>, keys: Keys) -> Self {
        Self { redis, keys }
    }

    pub async fn set(&self, tenant: &TenantId, quota: Quota, who: &str) -> Result<(), QuotaError> {
        let mut conn = self.redis.conn().await?;
        // Stamp the change with Redis time, the clock every decision uses.
        let (secs, micros): (i64, i64) = redis::cmd("TIME")
            .query_async(&mut conn)
            .await
            .map_err(|e| self.redis.classify(e))?;
        let fields = [
            ("count", quota.rate.count.to_string()),
            ("period_ms", quota.rate.period.as_millis().to_string()),
            ("burst", quota.burst.to_string()),
            ("updated_by", who.to_owned()),
            ("updated_at_ms", (secs * 1000 + micros / 1000).to_string()),
        ];
        redis::pipe()
            .atomic()
            .hset_multiple(self.keys.quota(tenant), &fields)
            .ignore()
            .sadd(self.keys.tenants(), tenant.as_str())
            .ignore()
            .query_async::<()>(&mut conn)
            .await
            .map_err(|e| self.redis.classify(e))
    }

    pub async fn get(&self, tenant: &TenantId) -> Result<Option<QuotaEntry>, QuotaError> {
        let mut conn = self.redis.conn().await?;
        let fields: std::collections::HashMap<String, String> = conn
            .hgetall(self.keys.quota(tenant))
            .await
            .map_err(|e| self.redis.classify(e))?;
        if fields.is_empty() {
            return Ok(None);
        }
        let bad = |reason: &str| QuotaError::BadQuota {
            tenant: tenant.to_string(),
            reason: reason.to_owned(),
        };
        let num = |name: &str| -> Result<u64, QuotaError> {
            fields
                .get(name)
                .and_then(|v| v.parse().ok())
                .ok_or_else(|| bad(&format!("field {name} is missing or not a number")))
        };
        let rate = Rate {
            count: u32::try_from(num("count")?).map_err(|_| bad("count is too large"))?,
            period: Duration::from_millis(num("period_ms")?),
        };
        let burst = u32::try_from(num("burst")?).map_err(|_| bad("burst is too large"))?;
        let quota = Quota::new(rate, burst).map_err(|e| bad(&e.to_string()))?;
        Ok(Some(QuotaEntry {
            quota,
            updated_at_ms: fields.get("updated_at_ms").and_then(|v| v.parse().ok()),
            updated_by: fields.get("updated_by").cloned(),
        }))
    }

    /// Every tenant with a stored quota, sorted by tenant.
    pub async fn list(&self) -> Result<Vec<(TenantId, QuotaEntry)>, QuotaError> {
        let mut conn = self.redis.conn().await?;
        let mut tenants: Vec<String> = conn
            .smembers(self.keys.tenants())
            .await
            .map_err(|e| self.redis.classify(e))?;
        tenants.sort();
        let mut out = Vec::with_capacity(tenants.len());
        for name in tenants {
            // The set is written only with validated tenants; anything else
            // was put there by hand and is skipped rather than trusted.
            let Ok(tenant) = TenantId::parse(name) else {
                continue;
            };
            if let Some(entry) = self.get(&tenant).await? {
                out.push((tenant, entry));
            }
        }
        Ok(out)
    }

    /// Deletes every key under this prefix (tests, demo, `bench` cleanup).
    pub async fn purge_prefix(&self) -> Result<u64, QuotaError> {
        let mut conn = self.redis.conn().await?;
        let pattern = self.keys.all_pattern();
        let mut cursor: u64 = 0;
        let mut deleted = 0;
        loop {
            let (next, batch): (u64, Vec<String>) = redis::cmd("SCAN")
                .arg(cursor)
                .arg("MATCH")
                .arg(&pattern)
                .arg("COUNT")
                .arg(1000)
                .query_async(&mut conn)
                .await
                .map_err(|e| self.redis.classify(e))?;
            if !batch.is_empty() {
                deleted += redis::cmd("UNLINK")
                    .arg(&batch)
                    .query_async::<u64>(&mut conn)
                    .await
                    .map_err(|e| self.redis.classify(e))?;
            }
            if next == 0 {
                return Ok(deleted);
            }
            cursor = next;
        }
    }
}
