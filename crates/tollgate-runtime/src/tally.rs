//! What a pod counts for the console, between two additions to Redis: each
//! park (by tenant, reason and when the copy comes back: how many of a
//! tenant's jobs are parked in a delay tier, and why) and each provider
//! call (by tenant: sent, 429, failed, and how late first attempts went out
//! after they were due). A background task adds the tally to Redis in one
//! pipelined round trip twice a second. A job's path never waits on it, and
//! its completion writes only what a guarantee needs.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use tollgate_core::{ParkReason, ProviderOutcome, TenantId, UnixMillis};
use tollgate_quota::{CallCount, Calls, ParkedCount, Tallied, parked_bucket};

/// How often a pod adds its tally to Redis.
pub const FLUSH_EVERY: Duration = Duration::from_millis(500);

/// Parks and calls not yet added to Redis.
#[derive(Debug, Default)]
pub struct Tally {
    counts: Mutex<Counts>,
}

#[derive(Debug, Default)]
struct Counts {
    parks: HashMap<(TenantId, ParkReason, i64), u32>,
    calls: HashMap<TenantId, Calls>,
}

impl Tally {
    /// A copy of a `tenant` job parked for `reason` in the tier `hop`,
    /// due back at `back_at`.
    pub fn park(&self, tenant: &TenantId, reason: ParkReason, back_at: UnixMillis, hop: Duration) {
        let bucket = parked_bucket(back_at.0, hop);
        *self
            .lock()
            .parks
            .entry((tenant.clone(), reason, bucket))
            .or_default() += 1;
    }

    /// A provider call for a `tenant` job that ended in `outcome`;
    /// `due_lag` for the job's first attempt.
    pub fn call(&self, tenant: &TenantId, outcome: &ProviderOutcome, due_lag: Option<Duration>) {
        let mut counts = self.lock();
        match counts.calls.get_mut(tenant) {
            Some(calls) => calls.count(outcome, due_lag),
            None => {
                let mut calls = Calls::default();
                calls.count(outcome, due_lag);
                counts.calls.insert(tenant.clone(), calls);
            }
        }
    }

    /// Everything tallied since the last take, but parks that no longer
    /// count at `now` (they would count nowhere).
    pub fn take(&self, now: UnixMillis) -> Tallied {
        let counts = std::mem::take(&mut *self.lock());
        Tallied {
            parked: counts
                .parks
                .into_iter()
                .filter(|((_, _, bucket_ms), _)| *bucket_ms > now.0)
                .map(|((tenant, reason, bucket_ms), copies)| ParkedCount {
                    tenant,
                    reason,
                    bucket_ms,
                    copies,
                })
                .collect(),
            calls: counts
                .calls
                .into_iter()
                .map(|(tenant, calls)| CallCount { tenant, calls })
                .collect(),
        }
    }

    /// Puts back what Redis did not take, to try again at the next flush.
    pub fn restore(&self, taken: Tallied) {
        let mut counts = self.lock();
        for c in taken.parked {
            *counts
                .parks
                .entry((c.tenant, c.reason, c.bucket_ms))
                .or_default() += c.copies;
        }
        for c in taken.calls {
            counts.calls.entry(c.tenant).or_default().add(&c.calls);
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Counts> {
        self.counts.lock().expect("not poisoned")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tenant(name: &str) -> TenantId {
        TenantId::parse(name).unwrap()
    }

    #[test]
    fn parks_of_one_tenant_reason_and_second_add_up() {
        let tally = Tally::default();
        let hop = Duration::from_secs(5);
        // 5 s hops count in 416 ms buckets.
        tally.park(&tenant("acme"), ParkReason::Quota, UnixMillis(10_000), hop);
        tally.park(&tenant("acme"), ParkReason::Quota, UnixMillis(10_300), hop);
        tally.park(&tenant("acme"), ParkReason::NotDue, UnixMillis(10_300), hop);
        tally.park(
            &tenant("globex"),
            ParkReason::Quota,
            UnixMillis(12_000),
            hop,
        );
        let mut counts = tally.take(UnixMillis(9_000)).parked;
        counts.sort_by_key(|c| (c.tenant.to_string(), c.reason.as_str(), c.bucket_ms));
        let seen: Vec<_> = counts
            .iter()
            .map(|c| (c.tenant.to_string(), c.reason, c.bucket_ms, c.copies))
            .collect();
        assert_eq!(
            seen,
            [
                ("acme".to_owned(), ParkReason::NotDue, 9_984, 1),
                ("acme".to_owned(), ParkReason::Quota, 9_984, 2),
                ("globex".to_owned(), ParkReason::Quota, 11_648, 1),
            ]
        );
        assert!(tally.take(UnixMillis(9_000)).is_empty(), "taken once");
    }

    #[test]
    fn copies_already_back_are_not_written_and_failed_writes_come_back() {
        let tally = Tally::default();
        let hop = Duration::from_secs(1);
        tally.park(&tenant("acme"), ParkReason::Quota, UnixMillis(1_100), hop);
        tally.park(&tenant("acme"), ParkReason::Quota, UnixMillis(3_150), hop);
        let taken = tally.take(UnixMillis(2_500));
        let counts = &taken.parked;
        assert_eq!(
            counts.len(),
            1,
            "the copy back at 1.1 s is gone: {counts:?}"
        );
        assert_eq!(counts[0].bucket_ms, 3_100);
        tally.restore(taken.clone());
        assert_eq!(tally.take(UnixMillis(2_500)), taken);
    }

    /// A call counts by how it ended; a first attempt's due lag in the bin
    /// whose bound it is within (10 ms, 50 ms, … 10 s, then longer), and
    /// calls Redis did not take add to those counted since.
    #[test]
    fn calls_count_by_outcome_and_due_lag_and_failed_writes_come_back() {
        let tally = Tally::default();
        let acme = tenant("acme");
        let ms = |n| Some(Duration::from_millis(n));
        tally.call(&acme, &ProviderOutcome::Sent, ms(10));
        tally.call(&acme, &ProviderOutcome::Sent, ms(11));
        tally.call(&acme, &ProviderOutcome::Sent, ms(60_000));
        tally.call(&acme, &ProviderOutcome::Sent, None);
        let throttled = ProviderOutcome::Throttled { retry_after: None };
        tally.call(&acme, &throttled, None);
        tally.call(
            &acme,
            &ProviderOutcome::Failed(tollgate_core::Failure::Timeout),
            ms(0),
        );
        tally.call(&tenant("globex"), &ProviderOutcome::Sent, None);

        let mut taken = tally.take(UnixMillis(0));
        taken.calls.sort_by_key(|c| c.tenant.to_string());
        let mut lags = [0; 10];
        (lags[0], lags[1], lags[9]) = (2, 1, 1);
        let acme_calls = Calls {
            sent: 4,
            throttled: 1,
            failed: 1,
            lags,
        };
        assert_eq!(taken.calls[0].tenant, acme);
        assert_eq!(taken.calls[0].calls, acme_calls);
        assert_eq!(taken.calls[1].calls.sent, 1);
        assert!(tally.take(UnixMillis(0)).is_empty(), "taken once");

        tally.call(&acme, &ProviderOutcome::Sent, ms(10));
        tally.restore(taken);
        let again = tally.take(UnixMillis(0));
        let acme_again = again.calls.iter().find(|c| c.tenant == acme).unwrap();
        assert_eq!(acme_again.calls.sent, 5);
        assert_eq!(acme_again.calls.lags[0], 3);
    }
}
