//! Adaptive quotas in the real Redis, with injected time: the completion
//! script learns exactly as the specification in `tollgate_core::adaptive`
//! says, permits follow the learned rate, routes learn from account-wide
//! 429s, and what is learned is audited without flooding the stream.

use std::sync::Arc;
use std::time::Duration;

use proptest::prelude::*;
use tollgate_core::adaptive::AUDIT_EVERY_MICROS;
use tollgate_core::ports::{Learned, Penalty, PermitRequest, PermitUse, ThrottleScope};
use tollgate_core::{
    Adaptive, IdempotencyKey, JobId, Kind, Learning, PermitDecision, Quota, TenantId,
};
use tollgate_quota::{
    Actor, Change, Keys, PermitSettings, QuotaStore, Redis, RedisPermits, Reply, Target,
};

const T0: u64 = 1_796_115_600_000_000; // microseconds

fn stores() -> (RedisPermits, QuotaStore) {
    let config = tollgate::Config::load(None).expect("TOLLGATE_* environment is valid");
    let prefix = format!(
        "tgtest-adapt-{}",
        &uuid::Uuid::new_v4().simple().to_string()[..10]
    );
    let redis = Arc::new(Redis::new(&config.redis_settings()).unwrap());
    let settings = PermitSettings {
        default_quota: Quota::parse("10/s", 1).unwrap(),
        horizon: Duration::from_millis(500),
        lease_ttl: Duration::from_secs(15),
        sent_ttl: Duration::from_secs(60),
        pacing_margin: 0.0,
        pause_recheck: Duration::from_secs(5),
        concurrency_retry: Duration::from_millis(100),
        denial_block: 1,
        denial_cache_ttl: Duration::from_secs(1),
        account_wide: Vec::new(),
    };
    let permits = RedisPermits::new(Arc::clone(&redis), Keys::new(&prefix), settings);
    (permits, QuotaStore::new(redis, Keys::new(&prefix)))
}

fn actor() -> Actor {
    Actor {
        who: "test".into(),
        source: "cli",
    }
}

async fn set_adaptive(store: &QuotaStore, target: &Target, rate: &str, adaptive: Adaptive) {
    let change = Change::SetQuota {
        quota: Quota::parse(rate, 1).unwrap(),
        concurrency: None,
        weight: None,
        adaptive: Some(adaptive),
    };
    store.apply(target, change, &actor()).await.unwrap();
}

/// One job of `tenant` on `route`: its ids, and the request built from them.
struct Job {
    tenant: TenantId,
    route: Kind,
    id: JobId,
    key: IdempotencyKey,
}

impl Job {
    fn new(tenant: &str, route: &Kind, n: usize) -> Self {
        let id = JobId::parse(format!("j{n}")).unwrap();
        Self {
            tenant: TenantId::parse(tenant).unwrap(),
            route: route.clone(),
            key: IdempotencyKey::from(&id),
            id,
        }
    }

    fn request(&self) -> PermitRequest<'_> {
        PermitRequest {
            tenant: &self.tenant,
            route: &self.route,
            job_id: &self.id,
            key: &self.key,
            priority: tollgate_core::Priority::Normal,
            lease_token: "t",
            returning: None,
            reserve_within: None,
        }
    }
}

fn throttled(scope: ThrottleScope) -> Option<Penalty> {
    Some(Penalty {
        wait: Duration::from_secs(1),
        scope,
    })
}

/// A 429 (Retry-After 1 s) on `job`'s call at `now`: what was learned.
async fn throttle(permits: &RedisPermits, job: &Job, scope: ThrottleScope, now: u64) -> Learned {
    permits
        .record(
            job.request(),
            PermitUse::CallFailed { retry_after: None },
            throttled(scope),
            Some(now),
        )
        .await
        .unwrap()
}

/// `job`'s call accepted at `now`: what was learned.
async fn sent(permits: &RedisPermits, job: &Job, now: u64) -> Learned {
    permits
        .record(job.request(), PermitUse::Sent, None, Some(now))
        .await
        .unwrap()
}

/// Events: (a 429?, µs since the previous one). Long enough runs to reach
/// a settled rate's next probe and its trial's windows, and a climb resumed
/// after a failed later step; now and then a gap of seconds, as a long
/// Retry-After or a slow quota leaves between outcomes.
fn events() -> impl Strategy<Value = Vec<(bool, u64)>> {
    let gap = prop_oneof![20 => 1u64..300_000, 1 => 1_000_000u64..15_000_000];
    prop::collection::vec((prop::bool::weighted(0.08), gap), 1..240)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    /// The script and the specification, given the same outcomes at the
    /// same times, hold the same state after every one, to the bit.
    #[test]
    fn the_script_learns_exactly_as_the_specification(
        ceiling in prop::sample::select(vec!["20/s", "7/s", "300/m", "1000/s"]),
        decrease in 0.1f64..0.95,
        increase in prop_oneof![0.01f64..1.0, Just(1.0)],
        probe_s in 1u64..30,
        events in events(),
    ) {
        let rt = tokio::runtime::Runtime::new().unwrap();
        rt.block_on(async {
            let (permits, store) = stores();
            let job = Job::new("learner", &Kind::default_kind(), 0);
            let target = Target::Tenant(job.tenant.clone());
            let quota = Quota::parse(ceiling, 1).unwrap();
            let adaptive = Adaptive::new(quota.rate, None, Some(decrease), Some(increase),
                Some(Duration::from_secs(probe_s))).unwrap();
            set_adaptive(&store, &target, ceiling, adaptive).await;
            let tuning = adaptive.tuning(quota.rate);
            let mut spec = Learning::new(&tuning);
            let mut now = T0;
            for (is_429, gap) in events {
                now += gap;
                let penalty = if is_429 { throttled(ThrottleScope::Tenant) } else { None };
                let used = if is_429 { PermitUse::CallFailed { retry_after: None } } else { PermitUse::Sent };
                let learned = permits.record(job.request(), used, penalty, Some(now)).await.unwrap();
                if is_429 { spec.throttled(&tuning, now); } else { spec.sent(&tuning, now); }
                spec.audit(&tuning, now);
                let stored = store.learning(&target, &tuning).await.unwrap();
                assert_eq!(stored, spec);
                let effective = (spec.effective(&tuning) * 1e6).round() / 1e6;
                assert_eq!(learned, Learned { tenant: Some(effective), route: None });
            }
            store.purge_prefix().await.unwrap();
        });
    }
}

/// The script and the specification against a provider that allows 8 in
/// any sliding second, then 12: sends paced at the learned rate (a 429
/// pauses 1 s, its Retry-After). The same state after every outcome, through
/// the paths random events seldom reach: a settled rate's probes, a climb
/// after the raise, its later step failing, and the resumed climb stopping
/// short of the rate that failed.
#[tokio::test]
async fn the_script_follows_a_raised_limit_as_the_specification() {
    let (permits, store) = stores();
    let job = Job::new("learner", &Kind::default_kind(), 0);
    let target = Target::Tenant(job.tenant.clone());
    let quota = Quota::parse("20/s", 1).unwrap();
    let adaptive = Adaptive::new(quota.rate, None, None, None, None).unwrap();
    set_adaptive(&store, &target, "20/s", adaptive).await;
    let tuning = adaptive.tuning(quota.rate);
    let mut spec = Learning::new(&tuning);
    let mut accepted = std::collections::VecDeque::new();
    let (mut now, mut stopped_short) = (T0, 0);
    while now < T0 + 100_000_000 {
        let limit = if now < T0 + 50_000_000 { 8 } else { 12 };
        while accepted.front().is_some_and(|&t| now - t >= 1_000_000) {
            accepted.pop_front();
        }
        let ok = accepted.len() < limit;
        let failed_before = spec.failed;
        let learned = if ok {
            accepted.push_back(now);
            spec.sent(&tuning, now);
            sent(&permits, &job, now).await
        } else {
            spec.throttled(&tuning, now);
            throttle(&permits, &job, ThrottleScope::Tenant, now).await
        };
        spec.audit(&tuning, now);
        if ok && failed_before.is_some() && spec.failed.is_none() && spec.step == 0.0 {
            stopped_short += 1;
        }
        assert_eq!(store.learning(&target, &tuning).await.unwrap(), spec);
        let effective = (spec.effective(&tuning) * 1e6).round() / 1e6;
        assert_eq!(learned.tenant, Some(effective));
        now += if ok {
            (1e6 / spec.effective(&tuning) * 1.02).ceil() as u64
        } else {
            1_000_000
        };
    }
    assert!(stopped_short > 0, "no climb stopped short of a failed rate");
    // What held last: above the old limit, and paced (2 %) within the new.
    let held = spec.good.unwrap();
    assert!(
        held > 8.0 && held <= 12.0 * 1.02,
        "held {held}/s under a 12/s limit"
    );
    store.purge_prefix().await.unwrap();
}

/// Granted send times (µs) for `n` fresh jobs asking at `now`.
async fn sends(permits: &RedisPermits, tenant: &str, route: &Kind, n: usize, now: u64) -> Vec<u64> {
    let mut out = Vec::new();
    for i in 0..n {
        let job = Job::new(tenant, route, 1000 + i);
        if let Reply::Decision(PermitDecision::Granted { delay, .. }) =
            permits.decide(job.request(), 1, Some(now)).await.unwrap()
        {
            out.push(now + delay.as_micros() as u64);
        }
    }
    out
}

#[tokio::test]
async fn permits_follow_the_learned_rate_and_a_plain_quota_forgets_it() {
    let (permits, store) = stores();
    let route = Kind::default_kind();
    let job = Job::new("acme", &route, 0);
    let target = Target::Tenant(job.tenant.clone());
    let quota = Quota::parse("20/s", 1).unwrap();
    set_adaptive(
        &store,
        &target,
        "20/s",
        Adaptive::new(quota.rate, None, None, None, None).unwrap(),
    )
    .await;

    // Nothing learned: the ceiling.
    let at_ceiling = sends(&permits, "acme", &route, 3, T0).await;
    assert_eq!(at_ceiling.len(), 3);
    assert!(
        at_ceiling.windows(2).all(|w| w[1] - w[0] == 50_000),
        "{at_ceiling:?}"
    );

    // Two 429 bursts: 20 → 14 → 9.8 per second.
    let now = T0 + 2_000_000;
    let learned = throttle(&permits, &job, ThrottleScope::Tenant, now).await;
    assert_eq!(learned.tenant, Some(14.0));
    let same_burst = throttle(&permits, &job, ThrottleScope::Tenant, now + 100_000).await;
    assert_eq!(
        same_burst.tenant,
        Some(14.0),
        "the rest of a burst changes nothing"
    );
    let later = now + 2_500_000;
    let learned = throttle(&permits, &job, ThrottleScope::Tenant, later).await;
    assert_eq!(learned.tenant, Some(9.8));
    let settings = store.get(&target).await.unwrap().unwrap();
    assert!(
        (settings.effective.unwrap() - 9.8).abs() < 1e-9,
        "{settings:?}"
    );
    assert_eq!(
        settings.quota,
        Some(quota),
        "the configured rate stays the ceiling"
    );

    let spaced = sends(&permits, "acme", &route, 3, later + 5_000_000).await;
    let interval = (1e6_f64 / 9.8).ceil() as u64;
    assert_eq!(spaced.len(), 3);
    assert!(
        spaced.windows(2).all(|w| w[1] - w[0] == interval),
        "{spaced:?}, want {interval} µs apart"
    );

    // Accepted sends at the learned rate, window after window: it rises
    // again, and never above the ceiling.
    let mut t = later + 10_000_000;
    let mut rates = vec![];
    for _ in 0..400 {
        t += interval;
        let learned = permits
            .record(job.request(), PermitUse::Sent, None, Some(t))
            .await
            .unwrap();
        rates.push(learned.tenant.unwrap());
    }
    assert!(rates.windows(2).all(|w| w[1] >= w[0]), "{rates:?}");
    assert!(*rates.last().unwrap() > 9.8, "{rates:?}");
    assert!(rates.iter().all(|&r| r <= 20.0));

    // The same quota without --adaptive: the learning is gone.
    store
        .apply(
            &target,
            Change::SetQuota {
                quota,
                concurrency: None,
                weight: None,
                adaptive: None,
            },
            &actor(),
        )
        .await
        .unwrap();
    let settings = store.get(&target).await.unwrap().unwrap();
    assert_eq!((settings.adaptive, settings.effective), (None, None));
    let learned = throttle(&permits, &job, ThrottleScope::Tenant, t + 5_000_000).await;
    assert_eq!(learned, Learned::default());
    store.purge_prefix().await.unwrap();
}

#[tokio::test]
async fn a_route_learns_from_the_429s_blamed_on_it() {
    let (permits, store) = stores();
    a_route_learns(permits, store).await;
}

/// As on a Redis Cluster: the route's side of each permit and completion
/// is a call of its own, in the route's slot.
#[tokio::test]
async fn a_route_in_a_slot_of_its_own_learns_from_the_429s_blamed_on_it() {
    let (permits, store) = stores();
    a_route_learns(permits.splitting_routes(), store).await;
}

async fn a_route_learns(permits: RedisPermits, store: QuotaStore) {
    let route = Kind::parse("email").unwrap();
    let route_target = Target::Route(route.clone());
    let rate = Quota::parse("30/s", 1).unwrap().rate;
    set_adaptive(
        &store,
        &route_target,
        "30/s",
        Adaptive::new(rate, None, None, None, None).unwrap(),
    )
    .await;
    let acme = Job::new("acme", &route, 0);
    let globex = Job::new("globex", &route, 1);
    let globex_target = Target::Tenant(globex.tenant.clone());
    set_adaptive(
        &store,
        &globex_target,
        "10/s",
        Adaptive::new(
            Quota::parse("10/s", 1).unwrap().rate,
            None,
            None,
            None,
            None,
        )
        .unwrap(),
    )
    .await;

    // An account-wide 429 lowers the route, whoever saw it.
    let learned = throttle(&permits, &globex, ThrottleScope::Route, T0).await;
    assert_eq!(
        learned,
        Learned {
            tenant: None,
            route: Some(21.0)
        }
    );
    // A tenant's own 429: its own quota when it adapts...
    let learned = throttle(&permits, &globex, ThrottleScope::Tenant, T0 + 3_000_000).await;
    assert_eq!(
        learned,
        Learned {
            tenant: Some(7.0),
            route: None
        }
    );
    // ...else the route's, the only limit that adapts.
    let learned = throttle(&permits, &acme, ThrottleScope::Tenant, T0 + 3_000_000).await;
    assert_eq!(learned.route, Some(14.7));
    let effective = store
        .get(&route_target)
        .await
        .unwrap()
        .unwrap()
        .effective
        .unwrap();
    assert!((effective - 14.7).abs() < 1e-9, "{effective}");

    // Sends on the route are spaced at its learned rate (acme's own quota
    // is wider).
    let plain = Change::SetQuota {
        quota: Quota::parse("100/s", 1).unwrap(),
        concurrency: None,
        weight: None,
        adaptive: None,
    };
    store
        .apply(&Target::Tenant(acme.tenant.clone()), plain, &actor())
        .await
        .unwrap();
    let spaced = sends(&permits, "acme", &route, 2, T0 + 6_000_000).await;
    assert_eq!(spaced[1] - spaced[0], (1e6_f64 / 14.7).ceil() as u64);
    store.purge_prefix().await.unwrap();
}

#[tokio::test]
async fn adjustments_are_audited_at_most_every_ten_seconds() {
    let (permits, store) = stores();
    let job = Job::new("stormy", &Kind::default_kind(), 0);
    let target = Target::Tenant(job.tenant.clone());
    let rate = Quota::parse("100/s", 1).unwrap().rate;
    set_adaptive(
        &store,
        &target,
        "100/s",
        Adaptive::new(rate, None, None, None, None).unwrap(),
    )
    .await;
    // A storm: a 429 every 2.1 s for 30 s, each a new burst.
    let mut now = T0;
    let mut rates = vec![];
    for _ in 0..15 {
        now += 2_100_000;
        let learned = throttle(&permits, &job, ThrottleScope::Tenant, now).await;
        rates.push(learned.tenant.unwrap());
    }
    assert!(
        rates.windows(2).all(|w| w[1] < w[0] || w[1] == 5.0),
        "{rates:?}"
    );
    let entries: Vec<_> = store
        .history(Some(&target), 100)
        .await
        .unwrap()
        .into_iter()
        .filter(|e| e.action == "adapt")
        .collect();
    let span_s = (now - T0) as f64 / 1e6;
    assert!(!entries.is_empty());
    assert!(
        entries.len() as f64 <= span_s / (AUDIT_EVERY_MICROS as f64 / 1e6) + 1.0,
        "{} entries in {span_s} s",
        entries.len()
    );
    for e in &entries {
        assert_eq!(
            (e.who.as_str(), e.source.as_str()),
            ("tollgate", "adaptive")
        );
        assert!(e.new.effective.unwrap() < e.old.effective.unwrap());
    }
    store.purge_prefix().await.unwrap();
}

/// A completion learns for the quota its permit found adaptive: the permit
/// marks the lease with what the completion must do, so a completion
/// skips the reads for a quota that does not adapt. A quota made adaptive
/// between the two is learned from the next job on; one made fixed
/// between them is read and found fixed.
#[tokio::test]
async fn a_completion_learns_for_the_quota_its_permit_found_adaptive() {
    let (permits, store) = stores();
    let route = Kind::default_kind();
    let target = Target::Tenant(TenantId::parse("acme").unwrap());
    let quota = Quota::parse("20/s", 1).unwrap();
    let fixed = || Change::SetQuota {
        quota,
        concurrency: None,
        weight: None,
        adaptive: None,
    };
    let adaptive = || Adaptive::new(quota.rate, None, None, None, None).unwrap();
    let granted = |reply: Reply| matches!(reply, Reply::Decision(PermitDecision::Granted { .. }));

    store.apply(&target, fixed(), &actor()).await.unwrap();
    let before = Job::new("acme", &route, 1);
    assert!(granted(
        permits.decide(before.request(), 1, Some(T0)).await.unwrap()
    ));
    set_adaptive(&store, &target, "20/s", adaptive()).await;
    let learned = sent(&permits, &before, T0 + 1_000).await;
    assert_eq!(
        learned,
        Learned {
            tenant: None,
            route: None
        },
        "permitted while fixed"
    );

    let after = Job::new("acme", &route, 2);
    assert!(granted(
        permits
            .decide(after.request(), 1, Some(T0 + 100_000))
            .await
            .unwrap()
    ));
    let learned = sent(&permits, &after, T0 + 101_000).await;
    assert_eq!(learned.tenant, Some(20.0), "permitted while adaptive");

    let last = Job::new("acme", &route, 3);
    assert!(granted(
        permits
            .decide(last.request(), 1, Some(T0 + 200_000))
            .await
            .unwrap()
    ));
    store.apply(&target, fixed(), &actor()).await.unwrap();
    let learned = sent(&permits, &last, T0 + 201_000).await;
    assert_eq!(
        learned.tenant, None,
        "permitted while adaptive, made fixed since"
    );
    store.purge_prefix().await.unwrap();
}
