//! The stretch of a delivery that must run to its end once begun.
//!
//! A provider call cannot be taken back. Once it starts, the call, the
//! sent record and the settling of the delivery (ack, park or dead letter)
//! run to the end: a per-delivery timeout does not hand the delivery back
//! meanwhile, and shutdown waits for them instead of aborting them (else the
//! copy is redelivered and, once its lease expires, sent a second time).
//! Retrying a publish the broker refused is shielded the same way: it is
//! the broker's fault, not the job's, so it must not count toward `poison`.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

use tokio::sync::{OwnedRwLockReadGuard, RwLock};

/// Counts the reasons a delivery must not be interrupted right now.
#[derive(Clone, Default)]
pub struct Shield(Arc<AtomicU32>);

impl Shield {
    pub fn raised(&self) -> bool {
        self.0.load(Ordering::Acquire) > 0
    }

    /// Raised until the returned guard is dropped.
    pub fn raise(&self) -> ShieldGuard {
        self.0.fetch_add(1, Ordering::AcqRel);
        ShieldGuard(Arc::clone(&self.0))
    }
}

pub struct ShieldGuard(Arc<AtomicU32>);

impl Drop for ShieldGuard {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Lets provider calls begin until it is closed; closing waits for every
/// call already begun to be settled.
#[derive(Clone, Default)]
pub struct CommitGate(Arc<RwLock<bool>>);

impl CommitGate {
    /// No provider call may begin from now on; returns once every one
    /// begun before is settled.
    pub async fn close(&self) {
        *self.0.write().await = true;
    }
}

/// One delivery's hold on the gate, from its provider call until it is
/// settled or goes back to waiting.
pub struct Commitment {
    shield: Shield,
    held: Option<(OwnedRwLockReadGuard<bool>, ShieldGuard)>,
}

impl Commitment {
    pub fn new(shield: Shield) -> Self {
        Self { shield, held: None }
    }

    pub fn shield(&self) -> &Shield {
        &self.shield
    }

    /// Before a provider call. False when the gate is closed: the call must
    /// not start.
    pub async fn begin(&mut self, gate: &CommitGate) -> bool {
        if self.held.is_some() {
            // Re-acquiring a read lock while a writer waits would deadlock.
            return true;
        }
        let guard = Arc::clone(&gate.0).read_owned().await;
        if *guard {
            return false;
        }
        self.held = Some((guard, self.shield.raise()));
        true
    }

    /// The delivery goes back to waiting (a retry's backoff): nothing is
    /// left that cannot be interrupted.
    pub fn end(&mut self) {
        self.held = None;
    }
}
