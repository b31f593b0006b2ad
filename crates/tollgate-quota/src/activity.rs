//! What each tenant is doing, fleet-wide, for the console: its sends, 429s
//! and failures over the last 10 s and 5 minutes (the stats ring that
//! `outcomes.lua` keeps from the pods' tallies), what is in flight, how many jobs wait in its
//! lines for its quota, how many of its jobs are parked in a delay tier and
//! why, and whether a 429's Retry-After holds it. Read only when someone
//! looks: a handful of commands per tenant, in one pipeline.

use std::time::Duration;

use redis::Value;
use tollgate_core::{ParkReason, ProviderOutcome, TenantId};

use crate::store::ACTIVE_FOR_S;
use crate::{QuotaError, QuotaStore, Settings};

pub(crate) static PARKED_LUA: &str = crate::lua!("parked.lua");
pub(crate) static OUTCOMES_LUA: &str = crate::lua!("outcomes.lua");

/// The stats ring's shape; `outcomes.lua` writes it the same way.
const BUCKET_S: i64 = 10;
const SLOTS: i64 = 32;
/// The due-lag ring: one slot a minute, and the bins' upper bounds (ms).
const MINUTES: i64 = 6;
const LAG_BINS_MS: [u64; 9] = [10, 50, 100, 250, 500, 1_000, 2_500, 5_000, 10_000];

/// One tenant's recent traffic and waits, fleet-wide.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Activity {
    /// Sends per second over the last 10 s and the last 5 minutes.
    pub sent_per_s_10s: f64,
    pub sent_per_s_5m: f64,
    /// 429s and other failed calls in the last 5 minutes.
    pub throttled_5m: u64,
    pub failed_5m: u64,
    /// Permits taken and not yet completed (leases still live).
    pub in_flight: u64,
    /// Jobs holding a place in the tenant's lines (about: places handed
    /// out ahead of now), and how far ahead the last place is.
    pub queued: u64,
    pub queued_for_s: f64,
    /// Copies of the tenant's jobs parked in a delay tier right now, by why
    /// they wait (reasons with none left out, in [`ParkReason::ALL`]'s
    /// order); each counted until it is due back, to within a twelfth of
    /// its hop.
    pub parked: Vec<(ParkReason, u64)>,
    /// Seconds a provider's Retry-After still holds the tenant (0 = none).
    pub retry_after_s: f64,
    /// How late 95 % of the first attempts of the last 5 minutes went out
    /// after they were due, at most (the upper bound of its bin: 10 ms,
    /// 50 ms, … 10 s; `f64::INFINITY` beyond); `None` without sends.
    pub due_lag_p95_s: Option<f64>,
}

impl Activity {
    /// Copies parked for `reason` right now.
    pub fn parked_for(&self, reason: ParkReason) -> u64 {
        self.parked
            .iter()
            .find(|(r, _)| *r == reason)
            .map_or(0, |&(_, n)| n)
    }

    /// Why the tenant's jobs are waiting right now, the first that applies:
    /// paused, a provider's Retry-After, its concurrency limit, its quota
    /// (jobs in line), retries backing off, jobs not due yet, or nothing
    /// holds them. Failures the provider answered recently are added, as
    /// they slow a tenant without holding it.
    pub fn why_waiting(&self, settings: &Settings) -> String {
        let retrying =
            self.parked_for(ParkReason::Backoff) + self.parked_for(ParkReason::Throttled);
        let held = if settings.paused {
            "paused".to_owned()
        } else if self.retry_after_s > 0.0 {
            format!("provider's Retry-After, {:.1} s more", self.retry_after_s)
        } else if settings
            .concurrency
            .is_some_and(|limit| self.in_flight >= u64::from(limit))
        {
            format!("at its concurrency limit ({} in flight)", self.in_flight)
        } else if self.queued > 0 {
            format!(
                "quota: {} job(s) in line, the last {:.1} s ahead",
                self.queued, self.queued_for_s
            )
        } else if retrying > 0 {
            format!("retrying: {retrying} job(s) parked, backing off after failures")
        } else if self.parked_for(ParkReason::NotDue) > 0 {
            format!(
                "not due yet: {} scheduled job(s) parked",
                self.parked_for(ParkReason::NotDue)
            )
        } else {
            "not waiting".to_owned()
        };
        match (self.throttled_5m, self.failed_5m) {
            (0, 0) => held,
            (t, f) => {
                format!("{held}; provider answered {t} × 429 and {f} other failure(s) in 5 min")
            }
        }
    }
}

/// The bound 95 % of the due lags counted over the last 5 whole minutes
/// and this one stay within (see [`Activity::due_lag_p95_s`]).
pub(crate) fn lag_p95(fields: &[(String, i64)], now_s: f64) -> Option<f64> {
    let field = |name: String| fields.iter().find(|(f, _)| *f == name).map(|&(_, v)| v);
    let current = (now_s / 60.0).floor() as i64;
    let mut bins = [0i64; LAG_BINS_MS.len() + 1];
    for minute in (current - MINUTES + 1)..=current {
        let slot = minute.rem_euclid(MINUTES);
        if field(format!("m{slot}")) != Some(minute) {
            continue;
        }
        for (i, count) in bins.iter_mut().enumerate() {
            *count += field(format!("L{slot}.{}", i + 1)).unwrap_or(0);
        }
    }
    let total: i64 = bins.iter().sum();
    if total == 0 {
        return None;
    }
    let mut seen = 0;
    for (i, count) in bins.iter().enumerate() {
        seen += count;
        if seen * 100 >= total * 95 {
            return Some(
                LAG_BINS_MS
                    .get(i)
                    .map_or(f64::INFINITY, |&ms| ms as f64 / 1000.0),
            );
        }
    }
    Some(f64::INFINITY)
}

/// Counts of one kind (`s`, `t`, `f`) in the ring `fields`, over the
/// buckets from `now_s - window_s` to now; the oldest bucket counts in
/// proportion to how much of it is inside the window.
pub(crate) fn ring_sum(fields: &[(String, i64)], kind: &str, now_s: f64, window_s: f64) -> f64 {
    let field = |name: String| fields.iter().find(|(f, _)| *f == name).map(|&(_, v)| v);
    let current = (now_s / BUCKET_S as f64).floor() as i64;
    let from = now_s - window_s;
    let mut total = 0.0;
    for bucket in (current - SLOTS + 1)..=current {
        let start = (bucket * BUCKET_S) as f64;
        let end = start + BUCKET_S as f64;
        if end <= from {
            continue;
        }
        let slot = bucket.rem_euclid(SLOTS);
        if field(format!("b{slot}")) != Some(bucket) {
            continue;
        }
        let share = ((end - from) / BUCKET_S as f64).clamp(0.0, 1.0);
        total += field(format!("{kind}{slot}")).unwrap_or(0) as f64 * share;
    }
    total
}

/// Parked copies of one tenant's jobs to count: `copies` parked for
/// `reason`, due back within the bucket starting at `bucket_ms`
/// ([`parked_bucket`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParkedCount {
    pub tenant: TenantId,
    pub reason: ParkReason,
    pub bucket_ms: i64,
    pub copies: u32,
}

/// The bucket (its start, unix ms) a copy parked for `hop` and due back at
/// `back_at_ms` counts in: a twelfth of the hop wide, and at least 100 ms,
/// so a tenant's parked hash keeps a few dozen fields whatever the tiers. A
/// copy counts as parked until its bucket starts: never past its return, so
/// the next hop of the same job is never counted beside it, and short by at
/// most a twelfth of a hop of a second or more (hops under a second mostly
/// go uncounted: they are back before anyone looks).
pub fn parked_bucket(back_at_ms: i64, hop: Duration) -> i64 {
    let width_ms = (hop.as_millis() as i64 / 12).max(100);
    back_at_ms.div_euclid(width_ms) * width_ms
}

/// A pod's count of one tenant's provider calls since it last added its
/// tally to Redis ([`QuotaStore::count_activity`]): the tenant's figures
/// are counted there, not by each job's completion, which writes only what
/// a guarantee needs.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Calls {
    pub sent: u32,
    /// Answered 429.
    pub throttled: u32,
    /// Failed any other way.
    pub failed: u32,
    /// First attempts by how late they went out after they were due: one
    /// count per bin of the due-lag ring, the last past its longest bound.
    pub lags: [u32; LAG_BINS_MS.len() + 1],
}

impl Calls {
    /// One provider call that ended in `outcome`; `due_lag` for a job's
    /// first attempt.
    pub fn count(&mut self, outcome: &ProviderOutcome, due_lag: Option<Duration>) {
        match outcome {
            ProviderOutcome::Sent => self.sent += 1,
            ProviderOutcome::Throttled { .. } => self.throttled += 1,
            _ => self.failed += 1,
        }
        if let Some(lag) = due_lag {
            let ms = u64::try_from(lag.as_millis()).unwrap_or(u64::MAX);
            let bin = LAG_BINS_MS
                .iter()
                .position(|&bound| ms <= bound)
                .unwrap_or(LAG_BINS_MS.len());
            self.lags[bin] += 1;
        }
    }

    /// Adds `other`'s counts to these.
    pub fn add(&mut self, other: &Calls) {
        self.sent += other.sent;
        self.throttled += other.throttled;
        self.failed += other.failed;
        for (mine, theirs) in self.lags.iter_mut().zip(other.lags) {
            *mine += theirs;
        }
    }
}

/// [`Calls`] of one tenant to add to its stats.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CallCount {
    pub tenant: TenantId,
    pub calls: Calls,
}

/// Tenants a call of [`QuotaStore::count_activity`] adds to, at most on
/// one Redis. A call blocks Redis (every pod) while it runs: 64 tenants'
/// counts are about 2.8 million instructions, an eighth of a batch of 64
/// permit decisions.
pub const TENANTS_PER_CALL: usize = 64;

/// A pod's tally of parks and calls, as [`QuotaStore::count_activity`]
/// adds it to Redis.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Tallied {
    pub parked: Vec<ParkedCount>,
    pub calls: Vec<CallCount>,
}

impl Tallied {
    pub fn is_empty(&self) -> bool {
        self.parked.is_empty() && self.calls.is_empty()
    }
}

/// What [`QuotaStore::count_activity`] could not add, and why.
#[derive(Debug, thiserror::Error)]
#[error("{error} ({} parked counts and {} tenants' calls not added)", .untaken.parked.len(), .untaken.calls.len())]
pub struct NotCounted {
    pub untaken: Tallied,
    #[source]
    pub error: QuotaError,
}

/// How long a tenant's parked hash outlives its furthest bucket.
const PARKED_KEEP_S: i64 = 60;

/// Copies parked right now from a tenant's parked hash, by reason.
pub(crate) fn parked_now(fields: &[(String, i64)], now_ms: f64) -> Vec<(ParkReason, u64)> {
    let mut counts = [0u64; ParkReason::ALL.len()];
    for (field, copies) in fields {
        let Some((reason, at)) = field.rsplit_once(':') else {
            continue;
        };
        let (Some(reason), Ok(at)) = (ParkReason::parse(reason), at.parse::<i64>()) else {
            continue;
        };
        if at as f64 > now_ms {
            let i = ParkReason::ALL.iter().position(|r| *r == reason);
            counts[i.expect("a reason of ALL")] += (*copies).max(0) as u64;
        }
    }
    ParkReason::ALL
        .into_iter()
        .zip(counts)
        .filter(|&(_, n)| n > 0)
        .collect()
}

impl QuotaStore {
    /// Adds a pod's tally to the fleet-wide counts, all in flight at once:
    /// its parks to the tenants' parked hashes and its calls to their stats
    /// (a script call for up to [`TENANTS_PER_CALL`] tenants of each kind
    /// on one Redis, one per tenant on a cluster, where a call names one
    /// slot's keys), and keeps
    /// the tenants listed as active (until their furthest parked copy is
    /// back; for 10 minutes after their last call). `now_ms` is the
    /// caller's clock, to keep each parked hash until its furthest bucket
    /// has passed. What a failed call did not add comes back in the error,
    /// to add later; what was added is never added again (a failed listing
    /// is only logged: it is renewed with the next counts).
    pub async fn count_activity(&self, tally: &Tallied, now_ms: i64) -> Result<(), NotCounted> {
        if tally.is_empty() {
            return Ok(());
        }
        let per_call = if self.redis.is_cluster() {
            1
        } else {
            TENANTS_PER_CALL
        };
        let mut marks = Marks::new(&self.keys);

        let mut parked_calls = Vec::new();
        let mut sorted: Vec<&ParkedCount> = tally.parked.iter().collect();
        sorted.sort_by_key(|c| c.tenant.as_str());
        let tenants: Vec<&[&ParkedCount]> = sorted.chunk_by(|a, b| a.tenant == b.tenant).collect();
        for some in tenants.chunks(per_call) {
            let mut invocation = self.parked.prepare_invoke();
            for of_tenant in some {
                let tenant = &of_tenant[0].tenant;
                let furthest = of_tenant.iter().map(|c| c.bucket_ms).max().unwrap_or(0);
                let keep = (furthest - now_ms).max(0) / 1_000 + PARKED_KEEP_S;
                invocation
                    .key(self.keys.parked(tenant))
                    .arg(keep)
                    .arg(of_tenant.len());
                for c in *of_tenant {
                    invocation
                        .arg(format!("{}:{}", c.reason.as_str(), c.bucket_ms))
                        .arg(c.copies);
                }
                // Listed in the console while its copies are out, even
                // before its first send.
                marks.add(tenant, furthest.max(now_ms) / 1_000);
            }
            parked_calls.push((some, invocation));
        }

        let mut outcome_calls = Vec::new();
        for some in tally.calls.chunks(per_call) {
            let mut invocation = self.outcomes.prepare_invoke();
            for c in some {
                invocation
                    .key(self.keys.stats(&c.tenant))
                    .arg(c.calls.sent)
                    .arg(c.calls.throttled)
                    .arg(c.calls.failed);
                let lags = c.calls.lags.iter().enumerate().filter(|&(_, &n)| n > 0);
                invocation.arg(lags.clone().count());
                for (bin, n) in lags {
                    invocation.arg(bin + 1).arg(*n);
                }
            }
            outcome_calls.push((some, invocation));
        }

        // Each script by its hash (loaded only where a server lacks it),
        // all in flight at once on the shared connection.
        let conn = match self.redis.conn().await {
            Ok(conn) => conn,
            Err(error) => {
                return Err(NotCounted {
                    untaken: tally.clone(),
                    error,
                });
            }
        };
        let parked_done = futures::future::join_all(parked_calls.iter().map(|(_, invocation)| {
            let mut conn = conn.clone();
            async move { invocation.invoke_async::<()>(&mut conn).await }
        }));
        let outcomes_done =
            futures::future::join_all(outcome_calls.iter().map(|(_, invocation)| {
                let mut conn = conn.clone();
                async move { invocation.invoke_async::<Vec<usize>>(&mut conn).await }
            }));
        let (parked_done, outcomes_done) = tokio::join!(parked_done, outcomes_done);

        let mut untaken = Tallied::default();
        let mut failed = None;
        for ((tenants, _), done) in parked_calls.iter().zip(parked_done) {
            if let Err(e) = done {
                untaken
                    .parked
                    .extend(tenants.iter().flat_map(|t| t.iter().map(|&c| c.clone())));
                failed = Some(e);
            }
        }
        // A tenant that began a stats bucket (once per 10 s while it
        // sends) is listed as active; the index lives outside its slot.
        let mut began_any = false;
        for ((some, _), done) in outcome_calls.iter().zip(outcomes_done) {
            match done {
                Ok(began) => {
                    for c in began.iter().filter_map(|i| some.get(i.checked_sub(1)?)) {
                        marks.add(&c.tenant, now_ms / 1_000);
                        began_any = true;
                    }
                }
                Err(e) => {
                    untaken.calls.extend_from_slice(some);
                    failed = Some(e);
                }
            }
        }
        if began_any {
            marks.trim(now_ms / 1_000 - ACTIVE_FOR_S);
        }
        if let Err(e) = marks.write(&self.redis).await {
            tracing::debug!(error = %e, "listing tenants as active");
        }
        match failed {
            None => Ok(()),
            Some(e) => Err(NotCounted {
                untaken,
                error: self.redis.classify(e),
            }),
        }
    }

    /// [`Activity`] for each of `tenants`, in order, its calls all in flight
    /// at once.
    pub async fn activity(&self, tenants: &[TenantId]) -> Result<Vec<Activity>, QuotaError> {
        if tenants.is_empty() {
            return Ok(vec![]);
        }
        // Redis's clock, then each tenant's keys (its slot) in a call.
        let mut groups = vec![redis::pipe()];
        groups[0].cmd("TIME");
        for t in tenants {
            let mut pipe = redis::pipe();
            pipe.cmd("HGETALL").arg(self.keys.stats(t));
            pipe.cmd("ZCARD").arg(self.keys.in_flight(t));
            pipe.cmd("GET").arg(self.keys.penalty(t));
            pipe.cmd("HGETALL").arg(self.keys.parked(t));
            for line in [
                self.keys.waiting(t),
                self.keys.waiting_high(t),
                self.keys.waiting_low(t),
            ] {
                pipe.cmd("GET").arg(line);
            }
            groups.push(pipe);
        }
        let replies: Vec<Value> = self
            .redis
            .query_groups(groups)
            .await?
            .into_iter()
            .flatten()
            .collect();
        let got = replies.len();
        let bad = || QuotaError::BadReply(format!("activity: {got} replies"));
        let mut replies = replies.into_iter();
        let (secs, micros): (i64, i64) =
            redis::from_redis_value(replies.next().ok_or_else(bad)?).map_err(|_| bad())?;
        let now_us = secs as f64 * 1e6 + micros as f64;
        let now_s = now_us / 1e6;
        let mut out = Vec::with_capacity(tenants.len());
        for _ in tenants {
            let mut next = || replies.next().ok_or_else(bad);
            let stats: Vec<(String, i64)> = redis::from_redis_value(next()?).unwrap_or_default();
            let in_flight: u64 = redis::from_redis_value(next()?).unwrap_or(0);
            let penalty: Option<f64> = redis::from_redis_value(next()?).unwrap_or(None);
            let parked: Vec<(String, i64)> = redis::from_redis_value(next()?).unwrap_or_default();
            let mut queued = 0.0;
            let mut last = now_us;
            for _ in 0..3 {
                let line: Option<String> = redis::from_redis_value(next()?).unwrap_or(None);
                if let Some((at, iv)) = line.as_deref().and_then(next_place)
                    && at > now_us
                    && iv > 0.0
                {
                    queued += ((at - now_us) / iv).floor();
                    last = last.max(at);
                }
            }
            out.push(Activity {
                sent_per_s_10s: ring_sum(&stats, "s", now_s, 10.0) / 10.0,
                sent_per_s_5m: ring_sum(&stats, "s", now_s, 300.0) / 300.0,
                throttled_5m: ring_sum(&stats, "t", now_s, 300.0).round() as u64,
                failed_5m: ring_sum(&stats, "f", now_s, 300.0).round() as u64,
                in_flight,
                queued: queued as u64,
                queued_for_s: (last - now_us) / 1e6,
                parked: parked_now(&parked, now_us / 1e3),
                retry_after_s: penalty.map_or(0.0, |p| ((p - now_us) / 1e6).max(0.0)),
                due_lag_p95_s: lag_p95(&stats, now_s),
            });
        }
        Ok(out)
    }
}

/// Tenants to list as active (`Keys::active_tenants`), in one pipeline.
struct Marks<'a> {
    keys: &'a crate::Keys,
    pipe: redis::Pipeline,
    any: bool,
}

impl<'a> Marks<'a> {
    fn new(keys: &'a crate::Keys) -> Self {
        Self {
            keys,
            pipe: redis::pipe(),
            any: false,
        }
    }

    /// Listed until `until_s`, unless it already is until later.
    fn add(&mut self, tenant: &TenantId, until_s: i64) {
        self.pipe
            .cmd("ZADD")
            .arg(self.keys.active_tenants())
            .arg("GT")
            .arg(until_s)
            .arg(tenant.as_str())
            .ignore();
        self.any = true;
    }

    /// Drops the tenants listed until before `before_s`.
    fn trim(&mut self, before_s: i64) {
        self.pipe
            .cmd("ZREMRANGEBYSCORE")
            .arg(self.keys.active_tenants())
            .arg("-inf")
            .arg(before_s)
            .ignore();
    }

    async fn write(self, redis: &crate::Redis) -> Result<(), QuotaError> {
        if !self.any {
            return Ok(());
        }
        redis.query_groups(vec![self.pipe]).await.map(drop)
    }
}

/// A line's next free place and the spacing of its places (microseconds),
/// as the permit script writes it: `"<at> <iv>"`.
fn next_place(line: &str) -> Option<(f64, f64)> {
    let (at, iv) = line.split_once(' ')?;
    Some((at.parse().ok()?, iv.parse().ok()?))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ring(entries: &[(i64, i64)]) -> Vec<(String, i64)> {
        entries
            .iter()
            .flat_map(|&(bucket, sent)| {
                let slot = bucket.rem_euclid(SLOTS);
                [(format!("b{slot}"), bucket), (format!("s{slot}"), sent)]
            })
            .collect()
    }

    #[test]
    fn a_window_counts_its_buckets_and_part_of_the_oldest() {
        // Now is 5 s into bucket 100: the last 10 s are all of bucket 100
        // so far and the second half of bucket 99.
        let fields = ring(&[(98, 7), (99, 10), (100, 4)]);
        assert_eq!(ring_sum(&fields, "s", 1005.0, 10.0), 4.0 + 5.0);
        assert_eq!(ring_sum(&fields, "s", 1005.0, 300.0), 21.0);
    }

    #[test]
    fn a_slot_holding_an_older_bucket_counts_nothing() {
        // Slot 100 % 32 = 4 still holds bucket 68 (5 minutes ago and more).
        let fields = ring(&[(68, 50), (99, 3)]);
        assert_eq!(ring_sum(&fields, "s", 1005.0, 300.0), 3.0);
    }

    #[test]
    fn the_first_reason_that_holds_a_tenant_is_the_one_shown() {
        let mut s = Settings {
            concurrency: Some(2),
            ..Settings::default()
        };
        let mut a = Activity {
            in_flight: 2,
            queued: 30,
            queued_for_s: 3.0,
            ..Activity::default()
        };
        assert_eq!(a.why_waiting(&s), "at its concurrency limit (2 in flight)");
        a.retry_after_s = 0.5;
        assert_eq!(a.why_waiting(&s), "provider's Retry-After, 0.5 s more");
        s.paused = true;
        assert_eq!(a.why_waiting(&s), "paused");
        s.paused = false;
        a.retry_after_s = 0.0;
        a.in_flight = 1;
        assert_eq!(
            a.why_waiting(&s),
            "quota: 30 job(s) in line, the last 3.0 s ahead"
        );
        a.queued = 0;
        a.parked = vec![(ParkReason::NotDue, 7), (ParkReason::Backoff, 2)];
        assert_eq!(
            a.why_waiting(&s),
            "retrying: 2 job(s) parked, backing off after failures"
        );
        a.parked = vec![(ParkReason::NotDue, 7)];
        assert_eq!(a.why_waiting(&s), "not due yet: 7 scheduled job(s) parked");
        a.parked = vec![];
        a.failed_5m = 4;
        assert_eq!(
            a.why_waiting(&s),
            "not waiting; provider answered 0 × 429 and 4 other failure(s) in 5 min"
        );
    }

    #[test]
    fn a_parked_copy_counts_until_the_bucket_of_its_return_begins() {
        // At least 100 ms wide; a twelfth of hops over 1.2 s.
        assert_eq!(parked_bucket(10_250, Duration::from_millis(250)), 10_200);
        assert_eq!(parked_bucket(10_250, Duration::from_secs(1)), 10_200);
        assert_eq!(parked_bucket(10_250, Duration::from_secs(30)), 10_000);
        assert_eq!(
            parked_bucket(1_000_000, Duration::from_secs(3_600)),
            900_000
        );
        // The bucket never starts after the return, so a job's next hop
        // (parked when it is back) is never counted beside this one.
        for back in [0, 99, 100, 12_345, 3_599_999] {
            for hop_ms in [100, 1_000, 5_000, 30_000, 3_600_000] {
                assert!(parked_bucket(back, Duration::from_millis(hop_ms)) <= back);
            }
        }
    }

    #[test]
    fn parked_now_counts_the_copies_not_yet_back_by_reason() {
        let fields: Vec<(String, i64)> = [
            ("quota:100000", 5),
            ("quota:101000", 3),
            ("not_due:130000", 2),
            ("backoff:99000", 4),
            ("pruned", 90),
            ("nonsense:abc", 1),
        ]
        .iter()
        .map(|&(f, n)| (f.to_owned(), n))
        .collect();
        assert_eq!(
            parked_now(&fields, 99_500.0),
            [(ParkReason::NotDue, 2), (ParkReason::Quota, 8)]
        );
        assert_eq!(
            parked_now(&fields, 100_000.0),
            [(ParkReason::NotDue, 2), (ParkReason::Quota, 3)]
        );
        assert!(parked_now(&fields, 130_000.0).is_empty());
    }

    #[test]
    fn the_due_lag_p95_is_the_bound_of_the_bin_that_reaches_95_percent() {
        // Minute 20 (now) and 19: 94 jobs within 10 ms, 5 within 250 ms,
        // 1 beyond 10 s; minute 13's slot (13 % 6 = 1 = 19 % 6) is stale.
        let fields: Vec<(String, i64)> = [
            ("m2", 20),
            ("L2.1", 50),
            ("L2.4", 5),
            ("m1", 19),
            ("L1.1", 44),
            ("L1.10", 1),
        ]
        .iter()
        .map(|&(f, v)| (f.to_owned(), v))
        .collect();
        assert_eq!(lag_p95(&fields, 20.0 * 60.0 + 5.0), Some(0.25));
        let stale: Vec<(String, i64)> = [("m1", 13), ("L1.10", 100)]
            .iter()
            .map(|&(f, v)| (f.to_owned(), v))
            .collect();
        assert_eq!(lag_p95(&stale, 20.0 * 60.0 + 5.0), None);
        let late: Vec<(String, i64)> = [("m2", 20), ("L2.10", 3)]
            .iter()
            .map(|&(f, v)| (f.to_owned(), v))
            .collect();
        assert_eq!(lag_p95(&late, 20.0 * 60.0), Some(f64::INFINITY));
    }

    #[test]
    fn an_empty_ring_is_no_traffic() {
        assert_eq!(ring_sum(&[], "s", 1005.0, 10.0), 0.0);
    }

    #[test]
    fn a_line_is_read_as_the_permit_script_writes_it() {
        assert_eq!(
            next_place("1796356847232914 102000.000"),
            Some((1_796_356_847_232_914.0, 102_000.0))
        );
        assert_eq!(next_place("1796356847232914"), None);
        assert_eq!(next_place("soon 100"), None);
    }
}
