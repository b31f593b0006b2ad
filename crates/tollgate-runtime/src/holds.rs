//! Per-tenant bookkeeping of the deliveries one pod holds in-process, so one
//! tenant's waits cannot fill the prefetch and block the tenants behind it.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use tollgate_core::TenantId;

/// Counts the deliveries of each tenant this pod holds in-process (waiting
/// to be due, for a permit, or for a reserved slot), and refuses optional
/// holds beyond `cap` (which may be 0: then only the forced ones, waits
/// shorter than the smallest tier and reserved slots, are held).
pub struct HoldGate {
    cap: usize,
    held: Arc<Mutex<HashMap<TenantId, usize>>>,
}

/// Releases its hold when dropped.
pub struct HoldSlot {
    tenant: TenantId,
    held: Arc<Mutex<HashMap<TenantId, usize>>>,
}

impl HoldGate {
    pub fn new(cap: usize) -> Self {
        Self {
            cap,
            held: Arc::default(),
        }
    }

    /// Whether `tenant` may have one more delivery held beyond the forced
    /// ones.
    pub fn has_room(&self, tenant: &TenantId) -> bool {
        let held = self.held.lock().expect("not poisoned");
        held.get(tenant).copied().unwrap_or(0) < self.cap
    }

    /// A slot for one more held delivery of `tenant`; `forced` slots are
    /// counted but never refused.
    pub fn hold(&self, tenant: &TenantId, forced: bool) -> Option<HoldSlot> {
        let mut held = self.held.lock().expect("not poisoned");
        let count = held.entry(tenant.clone()).or_insert(0);
        if *count >= self.cap && !forced {
            return None;
        }
        *count += 1;
        Some(HoldSlot {
            tenant: tenant.clone(),
            held: Arc::clone(&self.held),
        })
    }
}

impl Drop for HoldSlot {
    fn drop(&mut self) {
        let mut held = self.held.lock().expect("not poisoned");
        if let Some(count) = held.get_mut(&self.tenant) {
            *count -= 1;
            if *count == 0 {
                held.remove(&self.tenant);
            }
        }
    }
}
