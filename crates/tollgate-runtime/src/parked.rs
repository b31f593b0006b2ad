//! How many of each tenant's jobs are parked in a delay tier, and why, for
//! the console: each park is tallied here (in memory, by tenant, reason and
//! when the copy comes back) and a background task adds the tally to Redis
//! in one pipelined call twice a second. A job's path never waits on it.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use tollgate_core::{ParkReason, TenantId, UnixMillis};
use tollgate_quota::{ParkedCount, parked_bucket};

/// How often a pod adds its tally to Redis.
pub const FLUSH_EVERY: Duration = Duration::from_millis(500);

/// Parks not yet added to Redis.
#[derive(Debug, Default)]
pub struct ParkTally {
    counts: Mutex<HashMap<(TenantId, ParkReason, i64), u32>>,
}

impl ParkTally {
    /// A copy of a `tenant` job parked for `reason` in the tier `hop`,
    /// due back at `back_at`.
    pub fn add(&self, tenant: &TenantId, reason: ParkReason, back_at: UnixMillis, hop: Duration) {
        let bucket = parked_bucket(back_at.0, hop);
        *self
            .counts
            .lock()
            .expect("not poisoned")
            .entry((tenant.clone(), reason, bucket))
            .or_default() += 1;
    }

    /// Everything tallied since the last take that still counts at `now`
    /// (the rest would count nowhere).
    pub fn take(&self, now: UnixMillis) -> Vec<ParkedCount> {
        let counts = std::mem::take(&mut *self.counts.lock().expect("not poisoned"));
        counts
            .into_iter()
            .filter(|((_, _, bucket_ms), _)| *bucket_ms > now.0)
            .map(|((tenant, reason, bucket_ms), copies)| ParkedCount {
                tenant,
                reason,
                bucket_ms,
                copies,
            })
            .collect()
    }

    /// Puts back counts Redis did not take, to try again at the next flush.
    pub fn restore(&self, counts: Vec<ParkedCount>) {
        let mut tally = self.counts.lock().expect("not poisoned");
        for c in counts {
            *tally.entry((c.tenant, c.reason, c.bucket_ms)).or_default() += c.copies;
        }
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
        let tally = ParkTally::default();
        let hop = Duration::from_secs(5);
        // 5 s hops count in 416 ms buckets.
        tally.add(&tenant("acme"), ParkReason::Quota, UnixMillis(10_000), hop);
        tally.add(&tenant("acme"), ParkReason::Quota, UnixMillis(10_300), hop);
        tally.add(&tenant("acme"), ParkReason::NotDue, UnixMillis(10_300), hop);
        tally.add(
            &tenant("globex"),
            ParkReason::Quota,
            UnixMillis(12_000),
            hop,
        );
        let mut counts = tally.take(UnixMillis(9_000));
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
        let tally = ParkTally::default();
        let hop = Duration::from_secs(1);
        tally.add(&tenant("acme"), ParkReason::Quota, UnixMillis(1_100), hop);
        tally.add(&tenant("acme"), ParkReason::Quota, UnixMillis(3_150), hop);
        let counts = tally.take(UnixMillis(2_500));
        assert_eq!(
            counts.len(),
            1,
            "the copy back at 1.1 s is gone: {counts:?}"
        );
        assert_eq!(counts[0].bucket_ms, 3_100);
        tally.restore(counts.clone());
        assert_eq!(tally.take(UnixMillis(2_500)), counts);
    }
}
