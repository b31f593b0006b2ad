//! Redis key layout. All keys of one tenant share the `{tenant}` hash tag.
//! Tenants are validated to `[A-Za-z0-9._:-]`, so a tenant can never close
//! the tag or reach another tenant's keys.

use tollgate_core::{IdempotencyKey, TenantId};

#[derive(Clone, Debug)]
pub struct Keys {
    prefix: String,
}

impl Keys {
    pub fn new(prefix: impl Into<String>) -> Self {
        Self {
            prefix: prefix.into(),
        }
    }

    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// Hash: `count`, `period_ms`, `burst` (+ who/when of the last change).
    pub fn quota(&self, tenant: &TenantId) -> String {
        format!("{}:quota:{{{tenant}}}", self.prefix)
    }

    /// The GCRA theoretical arrival time, in microseconds of Redis time.
    pub fn tat(&self, tenant: &TenantId) -> String {
        format!("{}:tat:{{{tenant}}}", self.prefix)
    }

    /// The tenant's virtual queue of denied jobs (next free virtual slot).
    pub fn waiting(&self, tenant: &TenantId) -> String {
        format!("{}:waiting:{{{tenant}}}", self.prefix)
    }

    /// Present once the key was sent; holds the job id.
    pub fn sent(&self, tenant: &TenantId, key: &IdempotencyKey) -> String {
        format!("{}:sent:{{{tenant}}}:{key}", self.prefix)
    }

    /// The in-flight lease of one idempotency key.
    pub fn lease(&self, tenant: &TenantId, key: &IdempotencyKey) -> String {
        format!("{}:lease:{{{tenant}}}:{key}", self.prefix)
    }

    /// Set of tenants with a stored quota (for `quota list`).
    pub fn tenants(&self) -> String {
        format!("{}:tenants", self.prefix)
    }

    /// Pattern matching every key of this prefix (cleanup in tests and demo).
    pub fn all_pattern(&self) -> String {
        format!("{}:*", self.prefix)
    }
}
