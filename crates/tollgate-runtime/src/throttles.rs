//! The 429s this pod has seen and not yet waited out. The permit store
//! stops every later permit fleet-wide; this stops the sends this pod had
//! already reserved (up to one permit horizon ahead) before the 429 came.

use std::collections::HashMap;
use std::sync::Mutex;

use tollgate_core::ports::ThrottleScope;
use tollgate_core::{Kind, TenantId, UnixMillis};

/// Who a 429 paused: one tenant, or every tenant of a route.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
enum Paused {
    Tenant(TenantId),
    Route(Kind),
}

impl Paused {
    fn of(scope: ThrottleScope, tenant: &TenantId, route: &Kind) -> Self {
        match scope {
            ThrottleScope::Tenant => Self::Tenant(tenant.clone()),
            ThrottleScope::Route => Self::Route(route.clone()),
        }
    }
}

#[derive(Default)]
pub struct LocalThrottles {
    until: Mutex<HashMap<Paused, UnixMillis>>,
}

impl LocalThrottles {
    /// At `now`, a 429 paused `scope` of this job until `until`.
    pub fn record(
        &self,
        scope: ThrottleScope,
        tenant: &TenantId,
        route: &Kind,
        now: UnixMillis,
        until: UnixMillis,
    ) {
        let mut all = self.until.lock().expect("not poisoned");
        // Bounded: only pauses still running are kept.
        all.retain(|_, &mut t| t > now);
        let entry = all.entry(Paused::of(scope, tenant, route)).or_insert(until);
        *entry = (*entry).max(until);
    }

    /// When a send of this job may go, if a 429 seen here still pauses it.
    pub fn paused_until(
        &self,
        scope: ThrottleScope,
        tenant: &TenantId,
        route: &Kind,
        now: UnixMillis,
    ) -> Option<UnixMillis> {
        let all = self.until.lock().expect("not poisoned");
        all.get(&Paused::of(scope, tenant, route))
            .copied()
            .filter(|&until| until > now)
    }
}
