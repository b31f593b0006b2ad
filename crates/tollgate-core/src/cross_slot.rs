//! A permit across two hash slots: the specification.
//!
//! On a Redis Cluster an installation's keys can spread over the masters:
//! a tenant's keys share the tenant's slot, a route's (one provider account
//! that tenants share) the route's. No script may touch two slots, so a
//! job on a route with a quota takes its permit in calls to each, one at a
//! time, with other pods' calls in between:
//!
//! 1. the route's slot reserves the route's next send time `at`, not before
//!    the tenant's own next send as the pod last heard it (`not_before`),
//!    and no further than `lead` past the route's next free time (a send
//!    reserved further would leave the route's slots before it to nobody);
//!    else it says when to come back;
//! 2. the tenant's slot takes `at` if the tenant's pace allows a send then
//!    (any time at or after its own next free one); else it says when;
//! 3. when the tenant refuses, the route's slot takes `at` back: a *hole*
//!    that the route's next reservation, for any tenant, fills while it is
//!    still ahead.
//!
//! The route goes first because it is the contended side: it hands out its
//! slots in order to whoever asks, while a tenant's own bucket only ever
//! sees that tenant's jobs. Asked the other way round, a tenant must find
//! its own exact time free on the route, and a tenant paced slowly by its
//! own quota never does while another keeps the route full (the tests
//! below). Each bucket is exact on its own, so the fleet never exceeds
//! either limit whatever the interleaving; a send time is sent, given back,
//! or lost with a pod that died between the calls (capacity unused, never a
//! send beyond a limit). A hole is only ever a time still ahead, so a job
//! sent in it is as punctual as any other (the worker's leeway for a late
//! start is counted from it).
//!
//! This module is pure (injected time, microseconds); its property tests
//! drive many pods' calls interleaved at random.

use std::collections::BTreeSet;

/// One quota's bucket as a slot keeps it: GCRA in whole microseconds, with
/// the send times given back by permits that could not use them.
#[derive(Clone, Debug, PartialEq)]
pub struct Bucket {
    interval: u64,
    burst: u64,
    /// The theoretical arrival time: where the quota's pace has reached.
    tat: u64,
    /// Send times reserved and given back, still ahead.
    holes: BTreeSet<u64>,
}

impl Bucket {
    /// A bucket sending one per `interval` microseconds, `burst` at once.
    pub fn new(interval: u64, burst: u32) -> Self {
        Self {
            interval: interval.max(1),
            burst: u64::from(burst.max(1)),
            tat: 0,
            holes: BTreeSet::new(),
        }
    }

    /// The earliest send the bucket's pace allows, at `now` or later.
    pub fn next_free(&self, now: u64) -> u64 {
        self.tat
            .saturating_sub(self.interval * (self.burst - 1))
            .max(now)
    }

    /// Reserves the earliest send time from `not_before` (at the earliest
    /// `now`) within `window` of `now`: a hole given back, or a time the
    /// bucket's pace allows, no further than `lead` past its next free time.
    /// `Err` says when to ask again.
    pub fn reserve(
        &mut self,
        now: u64,
        not_before: u64,
        window: u64,
        lead: u64,
    ) -> Result<u64, u64> {
        self.forget_holes_before(now);
        let start = not_before.max(now);
        let free = self.next_free(now);
        let hole = self.holes.range(start..).next().copied();
        // Reserving `start` far past the next free time leaves the slots
        // between to nobody: come back `lead` before it instead.
        let paced = (start <= free.saturating_add(lead)).then_some(start.max(free));
        let earliest = match (hole, paced) {
            (Some(h), Some(p)) => h.min(p),
            (Some(h), None) => h,
            (None, Some(p)) => p,
            (None, None) => return Err(start - lead),
        };
        if earliest > now.saturating_add(window) {
            return Err(earliest);
        }
        if hole == Some(earliest) {
            self.holes.remove(&earliest);
        } else {
            self.advance(earliest);
        }
        Ok(earliest)
    }

    /// Takes exactly `at` (not before `now`) if the bucket's pace allows a
    /// send then. `Err` says when it would.
    pub fn take(&mut self, now: u64, at: u64) -> Result<(), u64> {
        let free = self.next_free(now);
        if at < free {
            return Err(free);
        }
        self.advance(at);
        Ok(())
    }

    /// Gives back a send time reserved and not used. One already past is
    /// dropped: a send in it now would be late, and a late send can crowd
    /// the next one.
    pub fn give_back(&mut self, now: u64, at: u64) {
        if at >= now {
            self.holes.insert(at);
        }
    }

    /// The quota changed: the holes were spaced at the old pace, so they go.
    pub fn set_pace(&mut self, interval: u64, burst: u32) {
        self.interval = interval.max(1);
        self.burst = u64::from(burst.max(1));
        self.holes.clear();
    }

    /// Send times given back and still ahead.
    pub fn holes(&self) -> usize {
        self.holes.len()
    }

    fn advance(&mut self, at: u64) {
        self.tat = self.tat.max(at) + self.interval;
    }

    fn forget_holes_before(&mut self, now: u64) {
        self.holes = self.holes.split_off(&now);
    }
}

/// Which slot a job's next call goes to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Slot {
    Tenant,
    Route,
}

/// One job's way through the calls; each step is one atomic call to one
/// slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Permit {
    /// Asks the route's slot for a send time from `not_before`.
    Ask { not_before: u64 },
    /// Holds the route's send time `at`; asks the tenant's slot for it.
    Held { at: u64 },
    /// The tenant refused `at`: gives it back to the route's slot, then
    /// asks again for a time from `not_before`.
    GiveBack { at: u64, not_before: u64 },
    /// Asks again at `until`, holding nothing.
    Wait { until: u64, not_before: u64 },
    /// Both slots took `at`: the call goes out then.
    Granted { at: u64 },
}

impl Permit {
    /// A job that has not asked yet.
    pub const FRESH: Permit = Permit::Ask { not_before: 0 };

    /// The slot the next call goes to, if any.
    pub fn next_call(&self) -> Option<Slot> {
        match self {
            Permit::Ask { .. } | Permit::GiveBack { .. } => Some(Slot::Route),
            Permit::Held { .. } => Some(Slot::Tenant),
            Permit::Wait { .. } | Permit::Granted { .. } => None,
        }
    }

    /// One call: to the route's bucket for [`Slot::Route`], the tenant's for
    /// [`Slot::Tenant`]. `window` is how far ahead the pod would hold the
    /// job; `lead` how far past the route's next free time it may reserve.
    pub fn step(self, now: u64, bucket: &mut Bucket, window: u64, lead: u64) -> Permit {
        match self {
            Permit::Ask { not_before } => match bucket.reserve(now, not_before, window, lead) {
                Ok(at) => Permit::Held { at },
                Err(next) => Permit::Wait {
                    until: next.saturating_sub(window),
                    not_before,
                },
            },
            Permit::Held { at } => match bucket.take(now, at) {
                Ok(()) => Permit::Granted { at },
                Err(free) => Permit::GiveBack {
                    at,
                    not_before: free,
                },
            },
            Permit::GiveBack { at, not_before } => {
                bucket.give_back(now, at);
                Permit::Wait {
                    until: not_before.saturating_sub(window),
                    not_before,
                }
            }
            done @ (Permit::Wait { .. } | Permit::Granted { .. }) => done,
        }
    }

    /// Back from waiting: asks again.
    pub fn resume(self, now: u64) -> Permit {
        match self {
            Permit::Wait { until, not_before } if until <= now => Permit::Ask { not_before },
            other => other,
        }
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    const MS: u64 = 1_000;

    /// Whether sends (sorted) keep to a bucket of `interval` and `burst`:
    /// any k + burst sends span at least k intervals.
    fn within(sends: &[u64], interval: u64, burst: u64) -> Result<(), String> {
        for (i, a) in sends.iter().enumerate() {
            for (j, b) in sends.iter().enumerate().skip(i + 1) {
                let k = (j - i) as u64 + 1;
                if k > burst && b - a < (k - burst) * interval {
                    return Err(format!(
                        "{k} sends from {a} to {b}: {} µs, less than {} intervals of {interval}",
                        b - a,
                        k - burst
                    ));
                }
            }
        }
        Ok(())
    }

    #[test]
    fn a_send_time_given_back_goes_to_the_next_reservation() {
        let mut route = Bucket::new(100 * MS, 1);
        assert_eq!(route.reserve(0, 0, 500 * MS, 100 * MS), Ok(0));
        assert_eq!(route.reserve(0, 0, 500 * MS, 100 * MS), Ok(100 * MS));
        route.give_back(10 * MS, 100 * MS);
        assert_eq!(route.holes(), 1);
        // The hole comes before the bucket's next free time (200 ms).
        assert_eq!(route.reserve(20 * MS, 0, 500 * MS, 100 * MS), Ok(100 * MS));
        assert_eq!(route.reserve(20 * MS, 0, 500 * MS, 100 * MS), Ok(200 * MS));
        assert_eq!(route.holes(), 0);
    }

    #[test]
    fn a_send_time_given_back_too_late_is_not_reused() {
        let mut route = Bucket::new(100 * MS, 1);
        assert_eq!(route.reserve(0, 0, 500 * MS, 100 * MS), Ok(0));
        assert_eq!(route.reserve(0, 0, 500 * MS, 100 * MS), Ok(100 * MS));
        route.give_back(150 * MS, 100 * MS);
        assert_eq!(route.holes(), 0);
        // Given back in time, but asked for after it passed.
        assert_eq!(route.reserve(150 * MS, 0, 500 * MS, 100 * MS), Ok(200 * MS));
        route.give_back(150 * MS, 200 * MS);
        assert_eq!(route.reserve(210 * MS, 0, 500 * MS, 100 * MS), Ok(300 * MS));
        assert_eq!(route.holes(), 0);
    }

    #[test]
    fn a_hole_before_not_before_is_left_for_others() {
        let mut route = Bucket::new(10 * MS, 1);
        for at in [0, 10, 20] {
            assert_eq!(route.reserve(0, 0, 500 * MS, 25 * MS), Ok(at * MS));
        }
        route.give_back(0, 10 * MS);
        // A tenant whose own next send is at 25 ms cannot use it…
        assert_eq!(route.reserve(0, 25 * MS, 500 * MS, 25 * MS), Ok(30 * MS));
        // …another can.
        assert_eq!(route.reserve(0, 0, 500 * MS, 25 * MS), Ok(10 * MS));
    }

    #[test]
    fn the_route_reserves_no_send_beyond_its_lead() {
        let mut route = Bucket::new(10 * MS, 1);
        assert_eq!(route.reserve(0, 0, 500 * MS, 25 * MS), Ok(0));
        // A tenant whose next send is 400 ms ahead would leave every slot
        // before it to nobody: it comes back 25 ms before.
        assert_eq!(route.reserve(0, 400 * MS, 500 * MS, 25 * MS), Err(375 * MS));
        assert_eq!(
            route.reserve(375 * MS, 400 * MS, 500 * MS, 25 * MS),
            Ok(400 * MS)
        );
        // Within the lead, the route may wait for it.
        assert_eq!(
            route.reserve(375 * MS, 430 * MS, 500 * MS, 25 * MS),
            Ok(430 * MS)
        );
    }

    #[test]
    fn a_tenant_takes_any_time_its_pace_allows() {
        let mut tenant = Bucket::new(100 * MS, 1);
        assert_eq!(tenant.take(0, 30 * MS), Ok(()));
        assert_eq!(tenant.take(0, 60 * MS), Err(130 * MS));
        assert_eq!(tenant.take(0, 300 * MS), Ok(()));
        assert_eq!(tenant.take(0, 350 * MS), Err(400 * MS));
    }

    #[test]
    fn a_quota_change_drops_the_holes_spaced_at_the_old_pace() {
        let mut route = Bucket::new(10 * MS, 1);
        for at in [0, 10, 20] {
            assert_eq!(route.reserve(0, 0, 500 * MS, 25 * MS), Ok(at * MS));
        }
        route.give_back(0, 10 * MS);
        route.give_back(0, 20 * MS);
        route.set_pace(100 * MS, 1);
        assert_eq!(route.holes(), 0);
        assert_eq!(route.reserve(0, 0, 500 * MS, 100 * MS), Ok(30 * MS));
        assert_eq!(route.reserve(0, 0, 500 * MS, 100 * MS), Ok(130 * MS));
    }

    /// A fleet of pods, each with jobs of several tenants on one route, run
    /// one call at a time in a random order, with time moving on.
    struct Fleet {
        tenants: Vec<Bucket>,
        route: Bucket,
        window: u64,
        lead: u64,
        /// Per pod: its jobs (tenant, where it stands).
        pods: Vec<Vec<(usize, Permit)>>,
        /// Send times of each tenant, and of the route.
        sent: Vec<Vec<u64>>,
        route_sent: Vec<u64>,
    }

    #[derive(Clone, Debug)]
    enum Event {
        /// Time moves on by this many microseconds.
        Tick(u64),
        /// Pod `pod` (modulo the pods) makes the next call of its job `job`
        /// (modulo its jobs).
        Call { pod: usize, job: usize },
        /// Pod `pod` (modulo the pods) dies and starts again with its jobs
        /// asking afresh.
        Crash { pod: usize },
    }

    fn event(pods: usize) -> impl Strategy<Value = Event> {
        prop_oneof![
            3 => (0u64..30 * MS).prop_map(Event::Tick),
            12 => (0..pods, 0usize..64).prop_map(|(pod, job)| Event::Call { pod, job }),
            1 => (0..pods).prop_map(|pod| Event::Crash { pod }),
        ]
    }

    impl Fleet {
        fn new(tenants: &[(u64, u32)], route: (u64, u32), pods: usize, jobs: usize) -> Self {
            let n = tenants.len();
            Fleet {
                tenants: tenants.iter().map(|&(i, b)| Bucket::new(i, b)).collect(),
                route: Bucket::new(route.0, route.1),
                window: 500 * MS,
                lead: route.0.max(25 * MS),
                pods: (0..pods)
                    .map(|p| (0..jobs).map(|j| ((p + j) % n, Permit::FRESH)).collect())
                    .collect(),
                sent: vec![vec![]; n],
                route_sent: vec![],
            }
        }

        /// Runs the events; returns the time they end at.
        fn run(&mut self, events: &[Event]) -> u64 {
            let mut now = 0;
            for e in events {
                match *e {
                    Event::Tick(d) => now += d,
                    Event::Call { pod, job } => self.call(now, pod % self.pods.len(), job),
                    Event::Crash { pod } => {
                        let pod = pod % self.pods.len();
                        // What its jobs held (route send times, some
                        // granted by the tenant) is lost with it.
                        for (_, permit) in &mut self.pods[pod] {
                            *permit = Permit::FRESH;
                        }
                    }
                }
            }
            now
        }

        fn call(&mut self, now: u64, pod: usize, job: usize) {
            let jobs = &mut self.pods[pod];
            let job = job % jobs.len();
            let (tenant, permit) = jobs[job];
            let permit = permit.resume(now);
            let next = match permit.next_call() {
                None => permit,
                Some(Slot::Route) => permit.step(now, &mut self.route, self.window, self.lead),
                Some(Slot::Tenant) => {
                    permit.step(now, &mut self.tenants[tenant], self.window, self.lead)
                }
            };
            if let Permit::Granted { at } = next {
                assert!(at >= now, "a send granted in the past: {at} at {now}");
                self.sent[tenant].push(at);
                self.route_sent.push(at);
                // The job is done; the pod's next job of this tenant asks.
                jobs[job] = (tenant, Permit::FRESH);
            } else {
                jobs[job] = (tenant, next);
            }
        }
    }

    fn pace() -> impl Strategy<Value = (u64, u32)> {
        (1u64..200, 1u32..4).prop_map(|(ms, burst)| (ms * MS, burst))
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

        #[test]
        fn the_fleet_never_exceeds_the_tenants_nor_the_routes_limit(
            tenants in prop::collection::vec(pace(), 1..4),
            route in pace(),
            pods in 1usize..5,
            jobs in 1usize..6,
            events in prop::collection::vec(event(4), 1..600),
        ) {
            let mut fleet = Fleet::new(&tenants, route, pods, jobs);
            let end = fleet.run(&events);
            for (t, &(interval, burst)) in tenants.iter().enumerate() {
                let mut sends = fleet.sent[t].clone();
                sends.sort_unstable();
                prop_assert_eq!(within(&sends, interval, u64::from(burst)), Ok(()), "tenant {}", t);
            }
            let mut sends = fleet.route_sent.clone();
            sends.sort_unstable();
            prop_assert_eq!(within(&sends, route.0, u64::from(route.1)), Ok(()), "the route");
            // Nothing leaks: once the window has passed with no more calls,
            // what was reserved, given back or lost with a pod is behind
            // both buckets, and each is free again.
            let later = end + fleet.window + 200 * MS + 1;
            prop_assert_eq!(fleet.route.next_free(later), later);
            prop_assert_eq!(fleet.route.reserve(later, 0, 0, 0), Ok(later));
            for tenant in &fleet.tenants {
                prop_assert_eq!(tenant.next_free(later), later);
            }
        }
    }

    /// Runs `pods` pods, each with two jobs per tenant that ask as soon as
    /// they may, for `seconds`: every millisecond each job makes its next
    /// call, starting from a different job each time (no job is always
    /// first when a route slot frees).
    fn busy_fleet(tenants: &[(u64, u32)], route: (u64, u32), pods: usize, seconds: u64) -> Fleet {
        let per_pod = tenants.len() * 2;
        let mut fleet = Fleet::new(tenants, route, pods, per_pod);
        let calls = pods * per_pod;
        for tick in 0..seconds * 1_000 {
            for i in 0..calls {
                let k = (i + tick as usize * 7) % calls;
                fleet.call(tick * MS, k / per_pod, k % per_pod);
            }
        }
        fleet
    }

    #[test]
    fn tenants_that_could_each_fill_the_route_share_it_and_fill_it() {
        // Two tenants of 20/s each on a 20/s route, three pods: the tenants
        // refuse the route's times that come too soon after their own last
        // send, and those go to the other tenant.
        let fleet = busy_fleet(&[(50 * MS, 1), (50 * MS, 1)], (50 * MS, 1), 3, 10);
        let route_sends = fleet.route_sent.len();
        assert!(
            route_sends >= 195,
            "the route sent {route_sends} of 200 in 10 s"
        );
        for (t, sends) in fleet.sent.iter().enumerate() {
            assert!(
                sends.len() >= 60,
                "tenant {t} sent {} of its 100",
                sends.len()
            );
        }
    }

    #[test]
    fn a_tenant_paced_by_its_own_quota_leaves_the_route_to_the_others() {
        // One tenant at 5/s, one at 100/s, on a 50/s route: the slow one
        // gets its 5/s, the fast one what is left of the route.
        let fleet = busy_fleet(&[(200 * MS, 1), (10 * MS, 1)], (20 * MS, 1), 2, 10);
        assert!(fleet.sent[0].len() >= 48, "slow: {}", fleet.sent[0].len());
        assert!(fleet.sent[1].len() >= 440, "fast: {}", fleet.sent[1].len());
    }
}
