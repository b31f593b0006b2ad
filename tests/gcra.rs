//! Property tests of the permit script's GCRA math, run in the real Redis
//! with injected time: whatever the request pattern, a quota of `rate` with
//! `burst` never grants more than rate × t + burst sends in any interval t.

use std::sync::Arc;
use std::time::Duration;

use proptest::prelude::*;
use tollgate_core::ports::{Penalty, PermitRequest, PermitUse, SharePlace, ThrottleScope};
use tollgate_core::{
    Clock, IdempotencyKey, JobId, Kind, ParkReason, PermitDecision, ProviderOutcome, Quota,
    TenantId,
};
use tollgate_quota::{
    CallCount, Calls, Keys, ParkedCount, PermitSettings, QuotaStore, Redis, RedisPermits, Reply,
    Tallied,
};
use tollgate_runtime::system_clock::SystemClock;

const T0: u64 = 1_796_115_600_000_000; // microseconds

fn settings(default: Quota) -> PermitSettings {
    PermitSettings {
        default_quota: default,
        horizon: Duration::from_millis(250),
        lease_ttl: Duration::from_secs(15),
        sent_ttl: Duration::from_secs(60),
        pacing_margin: 0.0,
        pause_recheck: Duration::from_secs(5),
        concurrency_retry: Duration::from_millis(100),
        denial_block: 1,
        denial_cache_ttl: Duration::from_secs(1),
        account_wide: Vec::new(),
    }
}

/// A permit store on a fresh random prefix, and the quota store that
/// purges it.
fn stores(quota: Quota) -> (RedisPermits, QuotaStore) {
    stores_with(settings(quota))
}

fn stores_with(settings: PermitSettings) -> (RedisPermits, QuotaStore) {
    let config = tollgate::Config::load(None).expect("TOLLGATE_* environment is valid");
    let prefix = format!(
        "tgtest-gcra-{}",
        &uuid::Uuid::new_v4().simple().to_string()[..10]
    );
    let redis = Arc::new(Redis::new(&config.redis_settings()).unwrap());
    let permits = RedisPermits::new(Arc::clone(&redis), Keys::new(&prefix), settings);
    (permits, QuotaStore::new(redis, Keys::new(&prefix)))
}

/// `n` pods on one prefix: deciding on one Redis ([`stores`]), or as on a
/// Redis Cluster when `split` ([`split_stores`]).
fn fleet(quota: Quota, n: usize, split: bool) -> (Vec<RedisPermits>, QuotaStore) {
    fleet_with(settings(quota), n, split)
}

/// [`fleet`] with these settings.
fn fleet_with(base: PermitSettings, n: usize, split: bool) -> (Vec<RedisPermits>, QuotaStore) {
    let pod_settings = if split { split_settings(base) } else { base };
    let pod = |permits: RedisPermits| {
        if split {
            permits.splitting_routes()
        } else {
            permits
        }
    };
    let (first, quotas) = stores_with(pod_settings.clone());
    let config = tollgate::Config::load(None).expect("TOLLGATE_* environment is valid");
    let redis = Arc::new(Redis::new(&config.redis_settings()).unwrap());
    let mut pods = vec![pod(first)];
    for _ in 1..n {
        pods.push(pod(RedisPermits::new(
            Arc::clone(&redis),
            quotas.keys().clone(),
            pod_settings.clone(),
        )));
    }
    (pods, quotas)
}

/// Whether `sends` (µs, any order) keep to `rate`/s with `burst`: any k
/// sends span at least k - burst intervals.
fn keeps_to(sends: &[u64], rate: u32, burst: u32) -> Result<(), String> {
    let mut sends = sends.to_vec();
    sends.sort_unstable();
    let interval = 1_000_000.0 / f64::from(rate);
    for i in 0..sends.len() {
        for j in i + usize::try_from(burst).unwrap()..sends.len() {
            let k = (j - i + 1) as f64;
            let span = (sends[j] - sends[i]) as f64;
            // -1e-6: rounding of microsecond TATs.
            if span < (k - f64::from(burst)) * interval - 1e-6 {
                return Err(format!(
                    "{k} sends within {span} µs at {rate}/s burst {burst}"
                ));
            }
        }
    }
    Ok(())
}

/// Whether calls keep to `count` per second as a provider counts them (no
/// more than `count` in any second) when each may begin anywhere from its
/// send to its send plus its leeway: (send µs, leeway µs), any order. Of
/// any `count` + 1 sends, the last begins no earlier than its send and the
/// first no later than its send plus leeway; those must be a second apart.
fn within_window(sends: &[(u64, u64)], count: u32) -> Result<(), String> {
    let mut sends = sends.to_vec();
    sends.sort_unstable();
    let n = usize::try_from(count).unwrap();
    for (i, &(first, leeway)) in sends.iter().enumerate() {
        if let Some(&(last, _)) = sends.get(i + n)
            && last < first + leeway + 1_000_000
        {
            return Err(format!(
                "{} calls at {count}/s may begin within {} µs: the first sent at {first} µs with {leeway} µs of leeway, the last at {last} µs",
                n + 1,
                last.saturating_sub(first + leeway)
            ));
        }
    }
    Ok(())
}

/// [`stores`] deciding as on a Redis Cluster: a route's side of each
/// permit in a call of its own (`route.lua`), the tenant's given the time
/// the route reserved. The route `email`'s 429s are account-wide.
fn split_stores(quota: Quota) -> (RedisPermits, QuotaStore) {
    let (permits, quotas) = stores_with(split_settings(settings(quota)));
    (permits.splitting_routes(), quotas)
}

/// Settings of a pod deciding as on a Redis Cluster: the route `email`'s
/// 429s are account-wide.
fn split_settings(base: PermitSettings) -> PermitSettings {
    PermitSettings {
        account_wide: vec![Kind::parse("email").unwrap()],
        ..base
    }
}

/// Settings as deployed (the defaults of the configuration): sends spaced
/// 2 % wider than the quota, reservations up to 500 ms ahead.
fn deployed_settings(quota: Quota) -> PermitSettings {
    PermitSettings {
        horizon: Duration::from_millis(500),
        pacing_margin: 0.02,
        ..settings(quota)
    }
}

/// A fresh job's request (no place in line, the store's whole horizon).
fn request<'a>(
    tenant: &'a TenantId,
    route: &'a Kind,
    id: &'a JobId,
    key: &'a IdempotencyKey,
) -> PermitRequest<'a> {
    PermitRequest {
        tenant,
        route,
        job_id: id,
        key,
        priority: tollgate_core::Priority::Normal,
        lease_token: "t",
        returning: None,
        reserve_within: None,
    }
}

/// Send times (µs) granted for requests arriving at `arrivals` (µs offsets).
async fn granted_sends(quota: Quota, arrivals: &[u64]) -> Vec<u64> {
    granted_sends_around(quota, arrivals, None)
        .await
        .into_iter()
        .map(|(_, send)| send)
        .collect()
}

/// (arrival, send time) of each granted request, like [`granted_sends`];
/// `throttle` = (offset, Retry-After, scope): at that offset a call answers
/// 429 (a call of this tenant for the tenant scope, of tenant `noisy` on
/// the same route for the route scope), before the requests arriving at or
/// after it are decided.
async fn granted_sends_around(
    quota: Quota,
    arrivals: &[u64],
    throttle: Option<(u64, Duration, ThrottleScope)>,
) -> Vec<(u64, u64)> {
    let (permits, quotas) = stores(quota);
    let tenant = TenantId::parse("prop").unwrap();
    let route = Kind::default_kind();
    let mut sends = Vec::new();
    let mut throttle = throttle;
    for (i, &offset) in arrivals.iter().enumerate() {
        if let Some((at, wait, scope)) = throttle.filter(|&(at, ..)| at <= offset) {
            throttle = None;
            let (noisy, id) = (
                TenantId::parse("noisy").unwrap(),
                JobId::parse("n").unwrap(),
            );
            let key = IdempotencyKey::from(&id);
            let throttled = request(
                if scope == ThrottleScope::Tenant {
                    &tenant
                } else {
                    &noisy
                },
                &route,
                &id,
                &key,
            );
            let penalty = Penalty { wait, scope };
            permits
                .record(
                    throttled,
                    PermitUse::CallFailed { retry_after: None },
                    Some(penalty),
                    Some(T0 + at),
                )
                .await
                .unwrap();
        }
        let id = JobId::parse(format!("j{i}")).unwrap();
        let key = IdempotencyKey::from(&id);
        let req = request(&tenant, &route, &id, &key);
        let now = T0 + offset;
        if let Reply::Decision(PermitDecision::Granted { delay, .. }) =
            permits.decide(req, 1, Some(now)).await.unwrap()
        {
            sends.push((offset, now + delay.as_micros() as u64));
        }
    }
    quotas.purge_prefix().await.unwrap();
    sends
}

/// One job of a simulated run: its tenant, class, and when it first asks
/// (µs after T0).
struct Simulated {
    tenant: TenantId,
    priority: tollgate_core::Priority,
    arrives: u64,
}

/// Runs jobs through the permit script as workers would, with injected
/// time: each asks when it arrives; a denied job waits in hops of the
/// default delay tiers (the largest not longer than what is left, the rest
/// held) and asks again after each (as a returning job, with the time left,
/// the spacing it was given and any place on a share of the route), until
/// it is granted. The
/// earliest ask goes first; at a tie, the lowest `tie(job)`, then the lowest
/// index. Returns (send time µs after T0, job), in the order granted.
async fn simulate(
    permits: &RedisPermits,
    route: &Kind,
    jobs: &[Simulated],
    tie: impl Fn(usize) -> i64,
) -> Vec<(u64, usize)> {
    simulate_pods(std::slice::from_ref(permits), route, jobs, tie, 1, 0).await
}

/// [`simulate`] with several pods (job i asks through pod i mod pods),
/// the next `at_once` asks made together at the latest of their times, so
/// that their calls share batches and interleave; a job asks again `late`
/// µs after the time it was given (a pod's timer and round trip), with as
/// much less time left to its place.
async fn simulate_pods(
    pods: &[RedisPermits],
    route: &Kind,
    jobs: &[Simulated],
    tie: impl Fn(usize) -> i64,
    at_once: usize,
    late: u64,
) -> Vec<(u64, usize)> {
    simulate_leeways(pods, route, jobs, tie, at_once, late, None)
        .await
        .into_iter()
        .map(|(at, i, _)| (at, i))
        .collect()
}

/// Quota changes made while a simulated run goes on: each (µs after T0,
/// target, change) is applied before the first ask at or after its time.
struct Live<'a> {
    quotas: &'a QuotaStore,
    changes: Vec<(u64, tollgate_quota::Target, tollgate_quota::Change)>,
}

/// [`simulate`] with quota changes made as it runs.
async fn simulate_live(
    permits: &RedisPermits,
    route: &Kind,
    jobs: &[Simulated],
    live: Live<'_>,
) -> Vec<(u64, usize)> {
    simulate_leeways(
        std::slice::from_ref(permits),
        route,
        jobs,
        |_| 0,
        1,
        0,
        Some(live),
    )
    .await
    .into_iter()
    .map(|(at, i, _)| (at, i))
    .collect()
}

/// [`simulate_pods`], each send with how late its call may begin (µs).
async fn simulate_leeways(
    pods: &[RedisPermits],
    route: &Kind,
    jobs: &[Simulated],
    tie: impl Fn(usize) -> i64,
    at_once: usize,
    late: u64,
    mut live: Option<Live<'_>>,
) -> Vec<(u64, usize, u64)> {
    use tollgate_core::ports::Returning;
    let ids: Vec<JobId> = (0..jobs.len())
        .map(|i| JobId::parse(format!("j{i}")).unwrap())
        .collect();
    let keys: Vec<IdempotencyKey> = ids.iter().map(IdempotencyKey::from).collect();
    const TIERS_MS: [u64; 6] = [100, 250, 500, 1_000, 5_000, 30_000];
    /// A job's place: time left (µs), the spacing it was given, and its
    /// place on its share of the route if it is one.
    type Place = Option<(u64, Option<Duration>, Option<SharePlace>)>;
    // (when it asks next, job, its place).
    let mut asks: Vec<(u64, usize, Place)> = jobs
        .iter()
        .enumerate()
        .map(|(i, j)| (j.arrives, i, None))
        .collect();
    let mut sends = Vec::new();
    let mut steps = 0;
    while !asks.is_empty() {
        steps += 1;
        assert!(steps < 100 * jobs.len(), "jobs keep asking: {asks:?}");
        asks.sort_by_key(|&(at, i, _)| (at, tie(i), i));
        let now_asking: Vec<_> = asks.drain(..at_once.min(asks.len())).collect();
        let at = now_asking.iter().map(|&(at, ..)| at).max().unwrap();
        if let Some(live) = live.as_mut() {
            while live.changes.first().is_some_and(|&(when, ..)| when <= at) {
                let (_, target, change) = live.changes.remove(0);
                live.quotas
                    .apply(&target, change, &test_actor())
                    .await
                    .unwrap();
            }
        }
        // Each pod's asks go to Redis together (one batch), the pods one
        // after another, first a pod picked by a hash of the step: the
        // interleaving varies from step to step as on a fleet, but the same
        // way in every run (pods racing for Redis made a run's sends differ
        // with the machine's load).
        let first = (steps as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 61;
        let mut decisions: Vec<Option<Result<Reply, _>>> =
            now_asking.iter().map(|_| None).collect();
        for p in 0..pods.len() {
            let pod = (first as usize + p) % pods.len();
            let mine: Vec<usize> = (0..now_asking.len())
                .filter(|&k| now_asking[k].1 % pods.len() == pod)
                .collect();
            let asked = mine.iter().map(|&k| {
                let (_, i, place) = now_asking[k];
                let req = PermitRequest {
                    priority: jobs[i].priority,
                    returning: place.map(|(left, interval, share_place)| Returning {
                        until: until_millis(T0 + at + left),
                        interval,
                        share_place,
                    }),
                    ..request(&jobs[i].tenant, route, &ids[i], &keys[i])
                };
                pods[pod].decide(req, 1, Some(T0 + at))
            });
            for (k, decision) in mine.iter().zip(futures::future::join_all(asked).await) {
                decisions[*k] = Some(decision);
            }
        }
        for (&(_, i, _), decision) in now_asking.iter().zip(decisions) {
            match decision.unwrap().unwrap() {
                Reply::Decision(PermitDecision::Granted { delay, leeway, .. }) => {
                    sends.push((at + delay.as_micros() as u64, i, leeway.as_micros() as u64));
                }
                Reply::Denied {
                    retry_in,
                    interval,
                    share,
                    ..
                } => {
                    let wait = retry_in.as_micros() as u64;
                    let hop = TIERS_MS
                        .iter()
                        .rev()
                        .map(|ms| ms * 1_000)
                        .find(|&t| t <= wait)
                        .unwrap_or(wait);
                    let share_place = share.map(|s| s.first_place());
                    let left = (wait - hop).saturating_sub(late);
                    asks.push((at + hop + late, i, Some((left, interval, share_place))));
                }
                // Paused: parked without its place, back as new.
                Reply::Decision(PermitDecision::Paused { retry_in }) => {
                    asks.push((at + retry_in.as_micros() as u64, i, None));
                }
                other => panic!("{other:?}"),
            }
        }
    }
    sends
}

/// A job's time to come back (µs on a test's clock) as the job carries it:
/// whole milliseconds, rounded down. A simulated job's time is its ask's
/// plus what was left; rounded up, a job asking a few µs late for its
/// place found it a millisecond ahead again on every ask.
fn until_millis(micros: u64) -> tollgate_core::UnixMillis {
    tollgate_core::UnixMillis((micros / 1_000) as i64)
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn never_more_than_rate_times_t_plus_burst(
        count in 1u32..50,
        burst in 1u32..6,
        gaps in proptest::collection::vec(0u64..150_000, 1..120),
    ) {
        let quota = Quota::new(format!("{count}/s").parse().unwrap(), burst).unwrap();
        let arrivals: Vec<u64> = gaps.iter().scan(0, |t, g| { *t += g; Some(*t) }).collect();
        let mut sends = runtime().block_on(granted_sends(quota, &arrivals));
        sends.sort_unstable();
        let interval = 1_000_000.0 / f64::from(count);
        for i in 0..sends.len() {
            for j in i..sends.len() {
                let span = (sends[j] - sends[i]) as f64;
                let allowed = span / interval + f64::from(burst);
                // +1e-6: rounding of microsecond TATs.
                prop_assert!(
                    (j - i + 1) as f64 <= allowed + 1e-6,
                    "{} sends within {} µs at {count}/s burst {burst}", j - i + 1, span
                );
            }
        }
        // And it is not trivially strict: the first request is always granted.
        prop_assert!(!sends.is_empty());
    }
}

#[test]
fn a_burst_of_requests_gets_burst_then_one_per_interval() {
    let quota = Quota::new("10/s".parse().unwrap(), 3).unwrap();
    // 20 requests in the same microsecond.
    let sends = runtime().block_on(granted_sends(quota, &[0; 20]));
    // Three at once (the burst), then one per 100 ms reserved within the
    // 250 ms horizon: at +100 ms and +200 ms.
    let offsets: Vec<u64> = sends.iter().map(|s| s - T0).collect();
    assert_eq!(offsets, [0, 0, 0, 100_000, 200_000]);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    /// After a 429 with Retry-After, no permit is granted for a send before
    /// it has passed, whatever the burst (a bucket with burst b once let
    /// sends through up to (b − 1) intervals early); with the route scope,
    /// a 429 seen by another tenant pauses this one too.
    #[test]
    fn no_send_before_retry_after_whatever_the_burst(
        count in 1u32..50,
        burst in 1u32..8,
        at in 0u64..1_000_000,
        retry_after_ms in 1u64..3_000,
        route_scope in any::<bool>(),
        gaps in proptest::collection::vec(0u64..100_000, 1..80),
    ) {
        let quota = Quota::new(format!("{count}/s").parse().unwrap(), burst).unwrap();
        let arrivals: Vec<u64> = gaps.iter().scan(0, |t, g| { *t += g; Some(*t) }).collect();
        let scope = if route_scope { ThrottleScope::Route } else { ThrottleScope::Tenant };
        let wait = Duration::from_millis(retry_after_ms);
        let sends = runtime().block_on(granted_sends_around(quota, &arrivals, Some((at, wait, scope))));
        let resume = T0 + at + wait.as_micros() as u64;
        // Requests decided before the 429 keep their reservations (the pod
        // that saw the 429 holds its own back; see `LocalThrottles`).
        for (arrival, send) in sends.into_iter().filter(|&(arrival, _)| arrival >= at) {
            prop_assert!(
                send >= resume,
                "asked at +{arrival} µs, granted {} µs before Retry-After ended ({count}/s burst {burst}, {scope:?})",
                resume - send
            );
        }
    }
}

#[test]
fn a_tenant_scoped_429_leaves_other_tenants_of_the_route_alone() {
    let quota = Quota::new("10/s".parse().unwrap(), 1).unwrap();
    // `noisy` was throttled, not `prop`: its requests go on at its pace.
    let runtime = runtime();
    let sends = runtime.block_on(async {
        let (permits, quotas) = stores(quota);
        let (noisy, other, route) = (
            TenantId::parse("noisy").unwrap(),
            TenantId::parse("other").unwrap(),
            Kind::default_kind(),
        );
        let id = JobId::parse("n").unwrap();
        let key = IdempotencyKey::from(&id);
        let req = |tenant| request(tenant, &route, &id, &key);
        let (wait, scope) = (Duration::from_secs(2), ThrottleScope::Tenant);
        permits
            .record(
                req(&noisy),
                PermitUse::CallFailed { retry_after: None },
                Some(Penalty { wait, scope }),
                Some(T0),
            )
            .await
            .unwrap();
        let other_decision = permits.decide(req(&other), 1, Some(T0 + 1)).await.unwrap();
        let noisy_decision = permits.decide(req(&noisy), 1, Some(T0 + 1)).await.unwrap();
        quotas.purge_prefix().await.unwrap();
        (other_decision, noisy_decision)
    });
    assert!(
        matches!(sends.0, Reply::Decision(PermitDecision::Granted { delay, .. }) if delay.is_zero()),
        "another tenant of the route is not paused: {:?}",
        sends.0
    );
    assert!(
        matches!(sends.1, Reply::Denied { retry_in, .. } if retry_in >= Duration::from_micros(1_749_999)),
        "the throttled tenant waits out its Retry-After (less the horizon): {:?}",
        sends.1
    );
}

/// A pod with no hold room for a tenant narrows the reservation window: a
/// slot further out than that is a place in line (and the job is told to
/// come back just before it), never a reservation it would have to hold.
/// Fresh jobs queue behind places already handed out.
#[test]
fn a_narrowed_window_gives_a_place_instead_of_a_reservation() {
    // 10/s burst 1: slots 100 ms apart; the horizon is 250 ms.
    let quota = Quota::new("10/s".parse().unwrap(), 1).unwrap();
    let decisions = runtime().block_on(async {
        let (permits, quotas) = stores(quota);
        let (tenant, route) = (TenantId::parse("prop").unwrap(), Kind::default_kind());
        let mut decisions = Vec::new();
        for (i, window) in [None, None, Some(50), Some(150), Some(10_000)]
            .into_iter()
            .enumerate()
        {
            let id = JobId::parse(format!("j{i}")).unwrap();
            let key = IdempotencyKey::from(&id);
            let req = PermitRequest {
                reserve_within: window.map(Duration::from_millis),
                ..request(&tenant, &route, &id, &key)
            };
            decisions.push(permits.decide(req, 1, Some(T0)).await.unwrap());
        }
        quotas.purge_prefix().await.unwrap();
        decisions
    });
    let granted = |d: &Reply| match d {
        Reply::Decision(PermitDecision::Granted { delay, .. }) => Some(delay.as_millis()),
        _ => None,
    };
    assert_eq!(granted(&decisions[0]), Some(0), "{decisions:?}");
    assert_eq!(
        granted(&decisions[1]),
        Some(100),
        "the full window reserves the next slot: {decisions:?}"
    );
    // The next slot is 200 ms out: beyond a 50 ms window, it is a place
    // (come back 50 ms before it), and nothing is reserved…
    assert!(
        matches!(decisions[2], Reply::Denied { retry_in, .. } if retry_in == Duration::from_millis(150)),
        "{decisions:?}"
    );
    // …and the jobs after it queue behind that place, even when their
    // window reaches the free slot: the 300 ms place, 150 ms before it…
    assert!(
        matches!(decisions[3], Reply::Denied { retry_in, .. } if retry_in == Duration::from_millis(150)),
        "{decisions:?}"
    );
    // …and the 400 ms place, told to come back the store's 250 ms horizon
    // before it (a window wider than the horizon is the horizon).
    assert!(
        matches!(decisions[4], Reply::Denied { retry_in, .. } if retry_in == Duration::from_millis(150)),
        "{decisions:?}"
    );
}

/// One tenant's jobs of the given classes at 10/s burst 1 (slots 100 ms
/// apart; the horizon is 250 ms), job i asking first at `arrives(i, its
/// class)` µs ([`simulate`], `tie` at a tie).
fn simulate_classes(
    classes: &[tollgate_core::Priority],
    arrives: impl Fn(usize, tollgate_core::Priority) -> u64,
    tie: impl Fn(usize) -> i64,
) -> Vec<(u64, usize)> {
    runtime().block_on(async {
        let (permits, quotas) = stores(Quota::new("10/s".parse().unwrap(), 1).unwrap());
        let (tenant, route) = (TenantId::parse("prop").unwrap(), Kind::default_kind());
        let jobs: Vec<Simulated> = classes
            .iter()
            .enumerate()
            .map(|(i, &priority)| Simulated {
                tenant: tenant.clone(),
                priority,
                arrives: arrives(i, priority),
            })
            .collect();
        let sends = simulate(&permits, &route, &jobs, tie).await;
        quotas.purge_prefix().await.unwrap();
        sends
    })
}

/// Priorities within a tenant's line, whatever order the jobs came in and
/// whichever asks first at a tie: with the horizon taken, 5 low, then 5
/// normal, then 5 high jobs are denied; each comes back when told (as a
/// returning job) until granted. They are sent high, normal, low, and never
/// closer than the quota allows. (The 18 sends take 1.7 s: the jobs whose
/// slots went to a class served first take the room made for them.)
#[test]
fn a_tenants_line_is_served_high_then_normal_then_low() {
    use tollgate_core::Priority::{High, Low, Normal};
    for tie_break_low_first in [true, false] {
        let classes: Vec<_> = [Normal; 3]
            .into_iter()
            .chain([Low; 5])
            .chain([Normal; 5])
            .chain([High; 5])
            .collect();
        // The first three take the horizon; the rest come a µs later. At a
        // tie, the lowest (or highest) class first.
        let sends = simulate_classes(
            &classes,
            |i, _| u64::from(i >= 3),
            |i| classes[i] as i64 * if tie_break_low_first { 1 } else { -1 },
        );
        let mut sends = sends;
        sends.sort();
        for w in sends.windows(2) {
            assert!(
                w[1].0 - w[0].0 >= 100_000,
                "two sends closer than 100 ms: {sends:?}"
            );
        }
        assert_eq!(sends.len(), classes.len(), "every job is sent once");
        let order: Vec<_> = sends.iter().skip(3).map(|&(_, i)| classes[i]).collect();
        let expected: Vec<_> = [High; 5]
            .into_iter()
            .chain([Normal; 5])
            .chain([Low; 5])
            .collect();
        assert_eq!(
            order, expected,
            "tie break low first: {tie_break_low_first}: {sends:?}"
        );
    }
}

/// A backlog of low-priority jobs parked for their places, then higher
/// classes arriving: the high and normal jobs go first, and the low jobs
/// whose slots they took get the room made for them at the end of the low
/// line, not places behind it. Sent behind it, they left the room unused:
/// the tenant went 6 s without a send, the drain took 32 s where 24.5 s
/// would do (end to end, 200 low then 20 normal and 20 high at 10/s).
#[test]
fn jobs_displaced_by_a_higher_class_take_the_room_made_for_them() {
    use tollgate_core::Priority::{High, Low, Normal};
    let classes: Vec<_> = [Low; 200]
        .into_iter()
        .chain([Normal; 20])
        .chain([High; 20])
        .collect();
    let sends = simulate_classes(
        &classes,
        |i, class| {
            if class == Low {
                i as u64 * 100
            } else {
                2_000_000 + i as u64 * 100
            }
        },
        |_| 0,
    );
    assert_eq!(sends.len(), classes.len(), "every job is sent once");
    let mut sends = sends;
    sends.sort();
    let of = |class| -> Vec<u64> {
        sends
            .iter()
            .filter(|&&(_, i)| classes[i] == class)
            .map(|&(at, _)| at)
            .collect()
    };
    let (high, normal, low) = (of(High), of(Normal), of(Low));
    let (last_high, first_normal) = (*high.iter().max().unwrap(), *normal.iter().min().unwrap());
    let last_normal = *normal.iter().max().unwrap();
    assert!(
        last_high < first_normal,
        "a normal job before a high one: {sends:?}"
    );
    assert!(
        low.iter()
            .filter(|&&at| at > first_normal)
            .all(|&at| at > last_normal),
        "a low job among the normal ones: {sends:?}"
    );
    let idle = sends.windows(2).map(|w| w[1].0 - w[0].0).max().unwrap();
    // 10/s with the 2 % margin: 102 ms apart; a job back a slot late may
    // leave one.
    assert!(
        idle < 300_000,
        "the tenant went {idle} µs without a send with jobs waiting: {sends:?}"
    );
}

/// A tenant with no quota of its own is paced by the stored default
/// (`quota set --default`), not the config's; a change of the default
/// reaches a running pod by itself (its copy is read again once a second
/// old). Two jobs of a fresh tenant ask at the same instant: at 2/s the
/// second is beyond the 250 ms horizon, at 1000/s it is not.
#[test]
fn a_stored_default_quota_paces_tenants_without_one() {
    runtime().block_on(async {
        let (permits, quotas) = stores(Quota::parse("1000/s", 1).unwrap());
        let set_default = |rate: &str| tollgate_quota::Change::SetQuota {
            quota: Quota::new(rate.parse().unwrap(), 1).unwrap(),
            concurrency: None,
            weight: None,
            adaptive: None,
        };
        let target = tollgate_quota::Target::Default;
        let route = Kind::default_kind();
        // Whether the second of two jobs of a fresh tenant, asking at the
        // same instant, is granted too.
        let both_granted = |round: u64| {
            let permits = &permits;
            let route = &route;
            async move {
                let tenant = TenantId::parse(format!("plain-{round}")).unwrap();
                let mut granted = 0;
                for i in 0..2 {
                    let id = JobId::parse(format!("j{round}-{i}")).unwrap();
                    let key = IdempotencyKey::from(&id);
                    let req = request(&tenant, route, &id, &key);
                    let reply = permits.decide(req, 1, Some(T0 + round * 10_000_000)).await;
                    if let Reply::Decision(PermitDecision::Granted { .. }) = reply.unwrap() {
                        granted += 1;
                    }
                }
                granted == 2
            }
        };
        quotas
            .apply(&target, set_default("2/s"), &test_actor())
            .await
            .unwrap();
        assert!(!both_granted(0).await, "the stored default (2/s) paces it");
        quotas
            .apply(&target, set_default("1000/s"), &test_actor())
            .await
            .unwrap();
        let mut round = 0;
        tollgate_tests::wait_for(
            "the changed default to reach the pod",
            Duration::from_secs(10),
            || {
                round += 1;
                both_granted(round)
            },
        )
        .await;
        quotas.purge_prefix().await.unwrap();
    });
}

fn test_actor() -> tollgate_quota::Actor {
    tollgate_quota::Actor {
        who: "test".into(),
        source: "cli",
    }
}

/// Gives the route `email` a quota of 30/s burst 1 (sends at least 33,333 µs
/// apart) and returns it.
async fn route_of_30_per_second(quotas: &QuotaStore) -> Kind {
    route_of(quotas, "30/s").await
}

/// Gives the route `email` a quota of `rate` burst 1 and returns it.
async fn route_of(quotas: &QuotaStore, rate: &str) -> Kind {
    let route = Kind::parse("email").unwrap();
    let quota = Quota::new(rate.parse().unwrap(), 1).unwrap();
    set_quota(quotas, tollgate_quota::Target::Route(route.clone()), quota).await;
    route
}

/// The send times of tenant `t` of `n`, whose jobs are dealt out in turn
/// (job i is tenant i mod n's).
fn sends_of_tenant(sends: &[(u64, usize)], n: usize, t: usize) -> Vec<u64> {
    sends
        .iter()
        .filter(|&&(_, i)| i % n == t)
        .map(|&(at, _)| at)
        .collect()
}

/// The sends in time order, after checking that every one of `jobs` was
/// sent once and no two sends of the 30/s route are closer than its interval.
fn sorted_within_the_route(mut sends: Vec<(u64, usize)>, jobs: usize) -> Vec<(u64, usize)> {
    sends.sort();
    assert_eq!(sends.len(), jobs, "every job is sent once");
    let interval = 1_000_000 / 30;
    for w in sends.windows(2) {
        assert!(
            w[1].0 - w[0].0 >= interval,
            "two sends of the route closer than {interval} µs: {w:?}"
        );
    }
    sends
}

/// Stores whose tenants' own quotas (1000/s) are far above the route's
/// 30/s, and that route; decided as on a Redis Cluster when `split`
/// ([`split_stores`]).
async fn wide_tenants_on_a_30_per_second_route(split: bool) -> (RedisPermits, QuotaStore, Kind) {
    let quota = Quota::new("1000/s".parse().unwrap(), 1).unwrap();
    let (permits, quotas) = if split {
        split_stores(quota)
    } else {
        stores(quota)
    };
    let route = route_of_30_per_second(&quotas).await;
    (permits, quotas, route)
}

/// Three tenants with backlogs of `per_tenant` jobs share a route of 30/s
/// (their own quotas are far above it) with weights 1, 2 and 3; tenant t's
/// jobs arrive one every 0.1 ms from `starts[t]` µs. Checks that the route's
/// limit holds and every job is sent once; returns each tenant's fraction
/// of the sends made while all three had work: from the first arrival of
/// the last to start to the last send of the first to finish.
/// `split`: decided as on a Redis Cluster ([`split_stores`]).
fn shares_by_weight(per_tenant: usize, starts: [u64; 3], split: bool) -> [f64; 3] {
    let weights = [1u32, 2, 3];
    let (sends, jobs) = runtime().block_on(async {
        let (permits, quotas, route) = wide_tenants_on_a_30_per_second_route(split).await;
        let tenants: Vec<TenantId> = (0..weights.len())
            .map(|t| TenantId::parse(format!("w{t}")).unwrap())
            .collect();
        for (tenant, &w) in tenants.iter().zip(&weights) {
            let target = tollgate_quota::Target::Tenant(tenant.clone());
            let change = tollgate_quota::Change::SetWeight(w);
            quotas.apply(&target, change, &test_actor()).await.unwrap();
        }
        let jobs: Vec<Simulated> = (0..per_tenant * weights.len())
            .map(|i| Simulated {
                tenant: tenants[i % weights.len()].clone(),
                priority: tollgate_core::Priority::Normal,
                arrives: starts[i % weights.len()] + (i / weights.len()) as u64 * 100,
            })
            .collect();
        let sends = simulate(&permits, &route, &jobs, |_| 0).await;
        quotas.purge_prefix().await.unwrap();
        (sends, jobs)
    });
    let sends = sorted_within_the_route(sends, jobs.len());
    let tenant_of = |i: usize| i % weights.len();
    let all_have_work = starts.into_iter().max().unwrap();
    let first_done = (0..weights.len())
        .map(|t| {
            sends
                .iter()
                .rev()
                .find(|&&(_, i)| tenant_of(i) == t)
                .unwrap()
                .0
        })
        .min()
        .unwrap();
    let mut counts = [0usize; 3];
    for &(_, i) in sends
        .iter()
        .filter(|&&(at, _)| at >= all_have_work && at <= first_done)
    {
        counts[tenant_of(i)] += 1;
    }
    let total: usize = counts.iter().sum();
    counts.map(|c| c as f64 / total as f64)
}

/// Asserts that each of the weights 1, 2, 3 got its share, 1/6, 2/6, 3/6,
/// to within 5 % of it.
fn assert_shares_follow_weights(shares: [f64; 3]) {
    for (w, share) in (1..=3).zip(shares) {
        let expected = f64::from(w) / 6.0;
        assert!(
            (share / expected - 1.0).abs() <= 0.05,
            "tenant of weight {w}: {share:.3} of the sends, expected {expected:.3}: {shares:?}"
        );
    }
}

/// Three tenants whose jobs arrive interleaved share a route by weight
/// while all three have work.
#[test]
fn a_shared_route_divides_among_its_tenants_by_weight() {
    assert_shares_follow_weights(shares_by_weight(90, [0, 0, 0], false));
}

/// The same when the tenants start one after another, so the sum of the
/// weights with work changes twice (1, then 3, then 6) while the first
/// tenants' jobs are parked for places on their lines: every change applies
/// to every place alike, and the tenant that started first is not left with
/// a gap in its line.
#[test]
fn shares_follow_the_weights_when_tenants_start_one_after_another() {
    assert_shares_follow_weights(shares_by_weight(150, [0, 1_000_000, 2_000_000], false));
}

/// Both, with the route's side of each permit in the route's slot (as on a
/// Redis Cluster): the shares are kept there the same way.
#[test]
fn with_the_routes_keys_in_a_slot_of_their_own_the_route_divides_by_weight() {
    assert_shares_follow_weights(shares_by_weight(90, [0, 0, 0], true));
    assert_shares_follow_weights(shares_by_weight(150, [0, 1_000_000, 2_000_000], true));
}

/// Two tenants whose own quotas (10/s) hold them far below a route of
/// 1000/s: neither can use its share, so neither is counted for more than
/// it uses, and when one finishes the other's counted weight jumps back to
/// its own. The places it was given on its share line before the jump are
/// re-spaced with it: its backlog goes on at its own quota, not at the
/// spacing of the tiny weight it was counted with (once 140 s for 7 jobs).
#[test]
fn a_tenant_below_its_share_keeps_its_pace_when_the_others_leave() {
    let (big, small) = (30, 10);
    let (sends, jobs) = runtime().block_on(async {
        let (permits, quotas) = stores(Quota::new("10/s".parse().unwrap(), 1).unwrap());
        let route = route_of(&quotas, "1000/s").await;
        let (a, b) = (TenantId::parse("a").unwrap(), TenantId::parse("b").unwrap());
        let job = |tenant: &TenantId, arrives| Simulated {
            tenant: tenant.clone(),
            priority: tollgate_core::Priority::Normal,
            arrives,
        };
        // a's jobs arrive one every 50 ms, twice its quota; b's 10 at once.
        let mut jobs: Vec<Simulated> = (0..big).map(|i| job(&a, i * 50_000)).collect();
        jobs.extend((0..small).map(|i| job(&b, 50 + i * 100)));
        let sends = simulate(&permits, &route, &jobs, |_| 0).await;
        quotas.purge_prefix().await.unwrap();
        (sends, jobs)
    });
    assert_eq!(sends.len(), jobs.len(), "every job is sent once");
    let mut of_a: Vec<u64> = sends
        .iter()
        .filter(|&&(_, i)| i < big as usize)
        .map(|&(at, _)| at)
        .collect();
    of_a.sort_unstable();
    // 10/s with the 2 % pacing margin: 102 ms apart; a job that loses its
    // slot goes to the back of the line, so allow a few lost slots.
    let paced = 102_000;
    for w in of_a.windows(2) {
        assert!(
            w[1] - w[0] >= 100_000,
            "a's sends closer than its quota: {of_a:?}"
        );
    }
    let last = *of_a.last().unwrap();
    assert!(
        last <= (big + 5) * paced,
        "a's {big} jobs took {last} µs at 10/s (sends {of_a:?})"
    );
}

/// A job that comes back for a place given on its share of a route, or with
/// the share's spacing, finds its tenant's own line in the way: its place
/// is never re-spaced with the share's spacing (2 ms when every tenant of a
/// 1000/s route is held far below it by its own quota) as if the tenant's
/// 10/s quota had changed, which once sent such a job 236 s away; and no
/// kept place lies beyond the line's next free place, whatever the job
/// brings back.
#[test]
fn a_place_from_the_share_line_is_not_respaced_as_the_tenants() {
    runtime().block_on(async {
        let (permits, quotas) = stores(Quota::new("1000/s".parse().unwrap(), 1).unwrap());
        let route = route_of(&quotas, "1000/s").await;
        let tenant = TenantId::parse("a").unwrap();
        tenant_quota(&quotas, &tenant, "10/s").await;
        // Decisions 5 s after the quota was stored (Redis time), so a place
        // re-spaced "since the change" would move 5 s × the ratio.
        let stored = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_micros() as u64;
        let now = stored + 5_000_000;
        let (ids, keys) = jobs(0..6);
        // Four fresh jobs: three within the 250 ms horizon (0, 100, 200 ms),
        // the fourth a place at 300 ms; the line's next free place is 400 ms.
        for i in 0..4 {
            permits
                .decide(request(&tenant, &route, &ids[i], &keys[i]), 1, Some(now))
                .await
                .unwrap();
        }
        let share_spacing = Duration::from_micros(2_020);
        // The first goes to the back of the line (400 ms), the second's
        // place is at most the line's next free one (500 ms).
        for (i, share_place, within) in [
            (4, Some(SharePlace { at: 0, step: None }), 400),
            (5, None, 500),
        ] {
            let req = PermitRequest {
                returning: Some(tollgate_core::ports::Returning {
                    until: until_millis(now + 10_000),
                    interval: Some(share_spacing),
                    share_place,
                }),
                ..request(&tenant, &route, &ids[i], &keys[i])
            };
            match permits.decide(req, 1, Some(now)).await.unwrap() {
                Reply::Denied { retry_in, .. } => assert!(
                    retry_in <= Duration::from_millis(within),
                    "back for a place {} the share line: told to wait {retry_in:?}",
                    if share_place.is_some() {
                        "on"
                    } else {
                        "spaced like"
                    }
                ),
                other => panic!("{other:?}"),
            }
        }
        quotas.purge_prefix().await.unwrap();
    });
}

/// A job back from a hop, its place still seconds away, keeps that place
/// even when its tenant's bucket has a slot free now, and even a second
/// after the quota was set: the free slot is another job's place. Only a
/// place given at another spacing than the quota's now (the quota changed
/// since) gives way to the free slot, which is how a parked backlog picks
/// up a raised rate.
#[test]
fn a_job_back_from_a_hop_keeps_its_place_right_after_the_quota_was_set() {
    runtime().block_on(async {
        let (permits, quotas) = stores(Quota::new("1000/s".parse().unwrap(), 1).unwrap());
        let tenant = TenantId::parse("paced").unwrap();
        tenant_quota(&quotas, &tenant, "10/s").await;
        let set_at = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_micros() as u64;
        let now = set_at + 1_000_000;
        let route = Kind::parse("email").unwrap();
        let (ids, keys) = jobs(0..2);
        // 10/s with no pacing margin: places 100 ms apart; one at 200 ms.
        let back = |i: usize, interval_ms: u64| PermitRequest {
            returning: Some(tollgate_core::ports::Returning {
                until: until_millis(now + 3_000_000),
                interval: Some(Duration::from_millis(interval_ms)),
                share_place: None,
            }),
            ..request(&tenant, &route, &ids[i], &keys[i])
        };
        match permits.decide(back(0, 100), 1, Some(now)).await.unwrap() {
            Reply::Denied { retry_in, .. } => assert!(
                retry_in >= Duration::from_millis(2_500),
                "a place 3 s away, given at the quota's spacing: told to come back in {retry_in:?}"
            ),
            other => panic!("a place 3 s away taken now: {other:?}"),
        }
        match permits.decide(back(1, 200), 1, Some(now)).await.unwrap() {
            Reply::Decision(PermitDecision::Granted { delay, .. }) => {
                assert_eq!(delay, Duration::ZERO)
            }
            other => panic!("a place given at another spacing kept: {other:?}"),
        }
        quotas.purge_prefix().await.unwrap();
    });
}

/// A tenant with a few jobs on a route shared with a tenant whose backlog
/// fills it for about ten seconds is not queued behind that backlog: each of
/// its jobs goes out among the next few of the other's sends.
#[test]
fn a_quiet_tenant_is_not_queued_behind_a_backlog_on_a_shared_route() {
    let backlog = 300;
    let (sends, jobs) = runtime().block_on(async {
        let (permits, quotas) = stores(Quota::new("1000/s".parse().unwrap(), 1).unwrap());
        let route = route_of_30_per_second(&quotas).await;
        let (noisy, quiet) = (
            TenantId::parse("noisy").unwrap(),
            TenantId::parse("quiet").unwrap(),
        );
        let job = |tenant: &TenantId, arrives| Simulated {
            tenant: tenant.clone(),
            priority: tollgate_core::Priority::Normal,
            arrives,
        };
        // The backlog arrives in 30 ms; then one quiet job every 0.5 s from 1 s.
        let mut jobs: Vec<Simulated> = (0..backlog).map(|i| job(&noisy, i * 100)).collect();
        jobs.extend((0..16).map(|i| job(&quiet, 1_000_000 + i * 500_000)));
        let sends = simulate(&permits, &route, &jobs, |_| 0).await;
        quotas.purge_prefix().await.unwrap();
        (sends, jobs)
    });
    let sends = sorted_within_the_route(sends, jobs.len());
    for (k, &(sent, i)) in sends.iter().enumerate() {
        if i < backlog as usize {
            continue;
        }
        let ahead = sends[..k]
            .iter()
            .filter(|&&(at, j)| j < backlog as usize && at >= jobs[i].arrives)
            .count();
        assert!(
            ahead <= backlog as usize / 10,
            "quiet job {i} (arrived {} µs) went out at {sent} µs behind {ahead} of the backlog's sends",
            jobs[i].arrives
        );
    }
}

/// Decisions and records asked for at once go to Redis together (one call
/// carries whatever a pod has waiting) and each job gets its own answer:
/// with every other one of 40 jobs recorded as sent (the records sent at
/// once too), the 40 asking at the same instant on a quota of 10/s with
/// burst 5 get: each recorded job, duplicate; of the other 20, exactly 5
/// granted and every other one a place of its own.
#[test]
fn decisions_asked_at_once_each_get_their_own_answer() {
    runtime().block_on(async {
        let (permits, quotas) = stores(Quota::new("10/s".parse().unwrap(), 5).unwrap());
        let (tenant, route) = (TenantId::parse("acme").unwrap(), Kind::default_kind());
        let (ids, keys) = jobs(0..40);
        let fresh = |i: usize| PermitRequest {
            reserve_within: Some(Duration::ZERO),
            ..request(&tenant, &route, &ids[i], &keys[i])
        };
        let recorded = futures::future::join_all(
            (0..ids.len())
                .step_by(2)
                .map(|i| permits.record(fresh(i), PermitUse::Sent, None, Some(T0))),
        )
        .await;
        assert!(recorded.into_iter().all(|r| r.is_ok()));

        let replies = futures::future::join_all(
            (0..ids.len()).map(|i| permits.decide(fresh(i), 1, Some(T0))),
        )
        .await;
        let mut granted = 0;
        let mut places = std::collections::HashSet::new();
        for (i, reply) in replies.into_iter().enumerate() {
            match reply.unwrap() {
                Reply::Decision(PermitDecision::Duplicate) => {
                    assert!(i % 2 == 0, "job {i} was never sent")
                }
                other if i % 2 == 0 => panic!("job {i} was sent, and got {other:?}"),
                Reply::Decision(PermitDecision::Granted { delay, .. }) => {
                    assert_eq!(delay, Duration::ZERO);
                    granted += 1;
                }
                Reply::Denied { retry_in, .. } => {
                    assert!(
                        places.insert(retry_in),
                        "two jobs got the place {retry_in:?}"
                    );
                }
                other => panic!("{other:?}"),
            }
        }
        assert_eq!(granted, 5, "the burst, no more");
        assert_eq!(places.len(), 15);
        quotas.purge_prefix().await.unwrap();
    });
}

/// The tenants' fleet-wide figures are what the pods' tallies add: two
/// pods' calls add up, each tenant's in its own ring, with their due lags,
/// and so do their parked copies; a completion alone counts nothing (each
/// call is counted once, by the pod that made it). A tenant with neither
/// stored settings nor traffic before is listed from then on.
#[test]
fn the_pods_tallies_add_up_in_the_tenants_figures() {
    runtime().block_on(async {
        let (permits, quotas) = stores(Quota::new("10/s".parse().unwrap(), 5).unwrap());
        let (tallied, other, route) = (
            TenantId::parse("tallied").unwrap(),
            TenantId::parse("tallied-too").unwrap(),
            Kind::default_kind(),
        );
        let id = JobId::parse("j1").unwrap();
        let key = IdempotencyKey::from(&id);
        let figures = |tenant: &TenantId| {
            let tenant = tenant.clone();
            let quotas = &quotas;
            async move { quotas.activity(&[tenant]).await.unwrap().remove(0) }
        };
        assert!(quotas.tenant_names("tallied").await.unwrap().is_empty());

        permits
            .record(
                request(&tallied, &route, &id, &key),
                PermitUse::Sent,
                None,
                None,
            )
            .await
            .unwrap();
        let completed = figures(&tallied).await;
        assert_eq!(completed.sent_per_s_5m, 0.0, "{completed:?}");

        let calls = |tenant: &TenantId, outcomes: &[(ProviderOutcome, Option<u64>)]| {
            let mut calls = Calls::default();
            for (outcome, lag_ms) in outcomes {
                calls.count(outcome, lag_ms.map(Duration::from_millis));
            }
            CallCount {
                tenant: tenant.clone(),
                calls,
            }
        };
        let now_ms = SystemClock.now().0;
        let parked = |tenant: &TenantId, copies| ParkedCount {
            tenant: tenant.clone(),
            reason: ParkReason::Quota,
            bucket_ms: now_ms + 60_000,
            copies,
        };
        let throttled = ProviderOutcome::Throttled { retry_after: None };
        let sent = ProviderOutcome::Sent;
        // Two pods, each with calls and parks of both tenants.
        quotas
            .count_activity(
                &Tallied {
                    parked: vec![parked(&tallied, 2), parked(&other, 1)],
                    calls: vec![
                        calls(&tallied, &[(sent.clone(), Some(30)), (throttled, None)]),
                        calls(&other, &[(sent.clone(), Some(3_000))]),
                    ],
                },
                now_ms,
            )
            .await
            .unwrap();
        quotas
            .count_activity(
                &Tallied {
                    parked: vec![parked(&tallied, 1)],
                    calls: vec![
                        calls(
                            &tallied,
                            &[
                                (sent.clone(), Some(5)),
                                (
                                    ProviderOutcome::Failed(tollgate_core::Failure::Timeout),
                                    None,
                                ),
                            ],
                        ),
                        calls(&other, &[(sent, None)]),
                    ],
                },
                now_ms,
            )
            .await
            .unwrap();
        let counted = figures(&tallied).await;
        assert_eq!((counted.sent_per_s_5m * 300.0).round(), 2.0, "{counted:?}");
        assert_eq!(counted.throttled_5m, 1, "{counted:?}");
        assert_eq!(counted.failed_5m, 1, "{counted:?}");
        assert_eq!(counted.due_lag_p95_s, Some(0.05), "{counted:?}");
        assert_eq!(counted.parked, [(ParkReason::Quota, 3)], "{counted:?}");
        let counted = figures(&other).await;
        assert_eq!((counted.sent_per_s_5m * 300.0).round(), 2.0, "{counted:?}");
        assert_eq!(counted.throttled_5m + counted.failed_5m, 0, "{counted:?}");
        assert_eq!(counted.due_lag_p95_s, Some(5.0), "{counted:?}");
        assert_eq!(counted.parked, [(ParkReason::Quota, 1)], "{counted:?}");
        let listed = quotas.tenant_names("tallied").await.unwrap();
        assert_eq!(listed, [tallied.clone(), other.clone()]);
        quotas.purge_prefix().await.unwrap();
    });
}

/// A tally of more tenants than one call adds to goes in several calls,
/// each tenant's counts in its own ring and every tenant listed.
#[test]
fn a_tally_of_many_tenants_reaches_each() {
    runtime().block_on(async {
        let (_, quotas) = stores(Quota::new("10/s".parse().unwrap(), 1).unwrap());
        let n = tollgate_quota::TENANTS_PER_CALL + 6;
        let tenants: Vec<TenantId> = (0..n)
            .map(|i| TenantId::parse(format!("many-{i:03}")).unwrap())
            .collect();
        let calls: Vec<CallCount> = tenants
            .iter()
            .enumerate()
            .map(|(i, tenant)| {
                let mut calls = Calls::default();
                for _ in 0..=i % 3 {
                    calls.count(&ProviderOutcome::Sent, None);
                }
                CallCount {
                    tenant: tenant.clone(),
                    calls,
                }
            })
            .collect();
        quotas
            .count_activity(
                &Tallied {
                    parked: Vec::new(),
                    calls,
                },
                SystemClock.now().0,
            )
            .await
            .unwrap();
        let counted = quotas.activity(&tenants).await.unwrap();
        for (i, (tenant, a)) in tenants.iter().zip(&counted).enumerate() {
            let expected = (i % 3 + 1) as f64;
            assert_eq!(
                (a.sent_per_s_5m * 300.0).round(),
                expected,
                "{tenant}: {a:?}"
            );
        }
        assert_eq!(quotas.tenant_names("many-").await.unwrap(), tenants);
        quotas.purge_prefix().await.unwrap();
    });
}

/// A tally that Redis takes in part: the counts a failed call did not
/// add come back to be added later, those that were added are never added
/// twice, and a listing that fails is no failure of the counts.
#[test]
fn a_tally_taken_in_part_is_added_once() {
    runtime().block_on(async {
        let config = tollgate::Config::load(None).expect("TOLLGATE_* environment is valid");
        let redis = Arc::new(Redis::new(&config.redis_settings()).unwrap());
        let (_, quotas) = stores(Quota::new("10/s".parse().unwrap(), 1).unwrap());
        let keys = quotas.keys().clone();
        let tenant = TenantId::parse("partly").unwrap();
        let mut conn = redis.conn().await.unwrap();
        let set = |key: String| {
            let mut cmd = tollgate_quota::redis_cmd("SET");
            cmd.arg(key).arg("not a hash or a sorted set");
            cmd
        };
        // Its parked hash and the active-tenant index hold the wrong type:
        // those writes fail, the stats ring's does not.
        let _: () = set(keys.parked(&tenant))
            .query_async(&mut conn)
            .await
            .unwrap();
        let _: () = set(keys.active_tenants())
            .query_async(&mut conn)
            .await
            .unwrap();

        let now_ms = SystemClock.now().0;
        let parked = vec![ParkedCount {
            tenant: tenant.clone(),
            reason: ParkReason::Quota,
            bucket_ms: now_ms + 60_000,
            copies: 2,
        }];
        let mut sent = Calls::default();
        sent.count(&ProviderOutcome::Sent, None);
        let calls = vec![CallCount {
            tenant: tenant.clone(),
            calls: sent,
        }];
        let not = quotas
            .count_activity(
                &Tallied {
                    parked: parked.clone(),
                    calls,
                },
                now_ms,
            )
            .await
            .expect_err("the parked hash is a string");
        assert_eq!(not.untaken.parked, parked, "{not}");
        assert!(not.untaken.calls.is_empty(), "the calls were added: {not}");

        // Once the keys are right, what came back is added; the calls are
        // not added again.
        let _: () = tollgate_quota::redis_cmd("DEL")
            .arg(keys.parked(&tenant))
            .arg(keys.active_tenants())
            .query_async(&mut conn)
            .await
            .unwrap();
        quotas.count_activity(&not.untaken, now_ms).await.unwrap();
        let counted = quotas
            .activity(std::slice::from_ref(&tenant))
            .await
            .unwrap()
            .remove(0);
        assert_eq!((counted.sent_per_s_5m * 300.0).round(), 1.0, "{counted:?}");
        assert_eq!(counted.parked, [(ParkReason::Quota, 2)], "{counted:?}");
        quotas.purge_prefix().await.unwrap();
    });
}

/// A tenant paced by its own quota (10/s, a backlog) reserves each of its
/// sends ahead; on a route far from full (1000/s) those reservations never
/// hold another tenant's sends back: each of the quiet tenant's jobs goes
/// out within one route slot of arriving (it waited up to the whole
/// reservation window, 170 ms here, when the route's one "next free" time
/// was pushed past every slot before a reserved send), and the backlog
/// keeps its pace.
#[test]
fn a_reserved_send_never_holds_another_tenant_back_on_a_free_route() {
    let backlog = 40;
    let (sends, jobs) = runtime().block_on(async {
        let (permits, quotas) = stores(Quota::new("10/s".parse().unwrap(), 1).unwrap());
        let route = route_of(&quotas, "1000/s").await;
        let (noisy, quiet) = (
            TenantId::parse("noisy").unwrap(),
            TenantId::parse("quiet").unwrap(),
        );
        let job = |tenant: &TenantId, arrives| Simulated {
            tenant: tenant.clone(),
            priority: tollgate_core::Priority::Normal,
            arrives,
        };
        let mut jobs: Vec<Simulated> = (0..backlog).map(|i| job(&noisy, i * 100)).collect();
        jobs.extend((0..8).map(|i| job(&quiet, 130_000 + i * 500_000)));
        let sends = simulate(&permits, &route, &jobs, |_| 0).await;
        quotas.purge_prefix().await.unwrap();
        (sends, jobs)
    });
    assert_eq!(sends.len(), jobs.len(), "every job is sent once");
    for &(at, i) in sends.iter().filter(|&&(_, i)| i >= backlog as usize) {
        assert!(
            at - jobs[i].arrives <= 1_000,
            "quiet job {i} arrived at {} µs, sent at {at} µs",
            jobs[i].arrives
        );
    }
    let mut of_noisy: Vec<u64> = sends
        .iter()
        .filter(|&&(_, i)| i < backlog as usize)
        .map(|&(at, _)| at)
        .collect();
    of_noisy.sort_unstable();
    for w in of_noisy.windows(2) {
        assert!(
            w[1] - w[0] >= 100_000,
            "noisy sends closer than its quota: {of_noisy:?}"
        );
    }
    let last = *of_noisy.last().unwrap();
    assert!(
        last <= (backlog + 2) * 100_000,
        "the backlog of {backlog} at 10/s took {last} µs: {of_noisy:?}"
    );
}

/// A completion frees its call's place under the tenant's concurrency
/// limit at once (the permit marks the lease with having taken one), and a
/// tenant without a limit never enters the in-flight set.
#[test]
fn a_completion_frees_its_place_under_the_concurrency_limit() {
    runtime().block_on(async {
        let (permits, quotas) = stores(Quota::new("1000/s".parse().unwrap(), 10).unwrap());
        let tenant = TenantId::parse("single").unwrap();
        let set = |concurrency| tollgate_quota::Change::SetQuota {
            quota: Quota::new("1000/s".parse().unwrap(), 10).unwrap(),
            concurrency,
            weight: None,
            adaptive: None,
        };
        let target = tollgate_quota::Target::Tenant(tenant.clone());
        quotas
            .apply(&target, set(Some(1)), &test_actor())
            .await
            .unwrap();
        let route = Kind::default_kind();
        let (ids, keys) = jobs(0..3);
        let req = |i: usize| request(&tenant, &route, &ids[i], &keys[i]);
        let decide = |i: usize| decision_at(&permits, req(i), T0);
        assert!(matches!(decide(0).await, PermitDecision::Granted { .. }));
        assert!(
            matches!(decide(1).await, PermitDecision::AtConcurrency { .. }),
            "one call in flight of one allowed"
        );
        permits
            .record(req(0), PermitUse::Sent, None, Some(T0))
            .await
            .unwrap();
        assert!(
            matches!(decide(1).await, PermitDecision::Granted { .. }),
            "the first call's completion freed its place"
        );
        assert!(matches!(
            decide(2).await,
            PermitDecision::AtConcurrency { .. }
        ));
        permits
            .record(
                req(1),
                PermitUse::CallFailed { retry_after: None },
                None,
                Some(T0),
            )
            .await
            .unwrap();
        assert!(matches!(decide(2).await, PermitDecision::Granted { .. }));
        quotas.purge_prefix().await.unwrap();
    });
}

/// A call that timed out here may still be running at the provider: its
/// lease and its concurrency place stay until the lease expires, so neither
/// the job's own retry (same lease token) nor another copy of its key calls
/// meanwhile. A call that failed outright frees both at once.
#[test]
fn a_call_that_timed_out_keeps_its_key_and_its_place_until_its_lease_ends() {
    runtime().block_on(async {
        let (permits, quotas) = stores(Quota::new("1000/s".parse().unwrap(), 10).unwrap());
        let tenant = TenantId::parse("slow").unwrap();
        let quota = Quota::new("1000/s".parse().unwrap(), 10).unwrap();
        set_quota_at_most(&quotas, &tenant, quota, Some(2)).await;
        let route = Kind::default_kind();
        let (ids, keys) = jobs(0..3);
        // A token per attempt, as workers make them: the in-flight set
        // counts tokens.
        let tokens = ["a0", "a1", "a2"];
        let req = |i: usize| PermitRequest {
            lease_token: tokens[i],
            ..request(&tenant, &route, &ids[i], &keys[i])
        };
        let decide = |req| decision_at(&permits, req, T0);

        assert!(matches!(
            decide(req(0)).await,
            PermitDecision::Granted { .. }
        ));
        permits
            .record(req(0), PermitUse::Unanswered, None, Some(T0))
            .await
            .unwrap();
        assert!(
            matches!(decide(req(0)).await, PermitDecision::InFlight { .. }),
            "the job's own retry waits for the lease"
        );
        let copy = PermitRequest {
            lease_token: "another copy",
            ..req(0)
        };
        assert!(matches!(
            decide(copy).await,
            PermitDecision::InFlight { .. }
        ));
        assert!(matches!(
            decide(req(1)).await,
            PermitDecision::Granted { .. }
        ));
        assert!(
            matches!(decide(req(2)).await, PermitDecision::AtConcurrency { .. }),
            "the unanswered call still counts under the limit of 2"
        );

        // Failed outright: the key and the place are free at once.
        permits
            .record(
                req(1),
                PermitUse::CallFailed { retry_after: None },
                None,
                Some(T0),
            )
            .await
            .unwrap();
        assert!(matches!(
            decide(req(1)).await,
            PermitDecision::Granted { .. }
        ));
        quotas.purge_prefix().await.unwrap();
    });
}

/// The ids `j0`, `j1` … of `range`'s jobs, and their idempotency keys.
fn jobs(range: std::ops::Range<usize>) -> (Vec<JobId>, Vec<IdempotencyKey>) {
    let ids: Vec<JobId> = range
        .map(|i| JobId::parse(format!("j{i}")).unwrap())
        .collect();
    let keys = ids.iter().map(IdempotencyKey::from).collect();
    (ids, keys)
}

/// A decision at `now` (µs).
async fn decision_at(permits: &RedisPermits, req: PermitRequest<'_>, now: u64) -> PermitDecision {
    match permits.decide(req, 1, Some(now)).await.unwrap() {
        Reply::Decision(decision) => decision,
        other => panic!("{other:?}"),
    }
}

/// Sets `tenant`'s quota to `rate`, burst 1.
async fn tenant_quota(quotas: &QuotaStore, tenant: &TenantId, rate: &str) {
    let quota = Quota::new(rate.parse().unwrap(), 1).unwrap();
    set_quota(
        quotas,
        tollgate_quota::Target::Tenant(tenant.clone()),
        quota,
    )
    .await;
}

/// Sets `target`'s quota (no concurrency cap, weight or adaptation).
async fn set_quota(quotas: &QuotaStore, target: tollgate_quota::Target, quota: Quota) {
    apply_quota(quotas, target, quota, None).await;
}

/// Sets `tenant`'s quota with at most `concurrency` calls in flight.
async fn set_quota_at_most(
    quotas: &QuotaStore,
    tenant: &TenantId,
    quota: Quota,
    concurrency: Option<u32>,
) {
    let target = tollgate_quota::Target::Tenant(tenant.clone());
    apply_quota(quotas, target, quota, concurrency).await;
}

async fn apply_quota(
    quotas: &QuotaStore,
    target: tollgate_quota::Target,
    quota: Quota,
    concurrency: Option<u32>,
) {
    let change = tollgate_quota::Change::SetQuota {
        quota,
        concurrency,
        weight: None,
        adaptive: None,
    };
    quotas.apply(&target, change, &test_actor()).await.unwrap();
}

/// The send times of `tenant`'s jobs, in order; checks no two are closer
/// than `interval` µs.
fn spaced(sends: &[(u64, usize)], jobs: &[Simulated], tenant: &str, interval: u64) -> Vec<u64> {
    let mut at: Vec<u64> = sends
        .iter()
        .filter(|&&(_, i)| jobs[i].tenant.as_str() == tenant)
        .map(|&(at, _)| at)
        .collect();
    at.sort_unstable();
    for w in at.windows(2) {
        assert!(
            w[1] - w[0] >= interval,
            "{tenant}: two sends closer than {interval} µs: {w:?}"
        );
    }
    at
}

#[test]
fn with_the_routes_keys_in_a_slot_of_their_own_neither_limit_is_exceeded() {
    // A route of 30/s shared by a tenant that could fill it alone (100/s,
    // a backlog of 150), one at 20/s (60 jobs) and one paced slowly by its
    // own quota (5/s, 20 jobs): the route reserves each send time first,
    // the tenant takes it or refuses it, a refused time goes back.
    let (sends, jobs, after) = runtime().block_on(async {
        let (permits, quotas) = split_stores(Quota::new("1000/s".parse().unwrap(), 1).unwrap());
        let route = route_of_30_per_second(&quotas).await;
        let mut jobs = Vec::new();
        for (name, rate, n) in [
            ("fast", "100/s", 150),
            ("mid", "20/s", 60),
            ("slow", "5/s", 20),
        ] {
            let tenant = TenantId::parse(name).unwrap();
            tenant_quota(&quotas, &tenant, rate).await;
            jobs.extend((0..n).map(|i| Simulated {
                tenant: tenant.clone(),
                priority: tollgate_core::Priority::Normal,
                arrives: i * 100,
            }));
        }
        let sends = simulate(&permits, &route, &jobs, |i| i as i64 % 7).await;
        // Nothing is left reserved: once the last send is past, a new
        // tenant's job goes at once.
        let end = sends.iter().map(|&(at, _)| at).max().unwrap() + 100_000;
        let (late, id) = (TenantId::parse("late").unwrap(), JobId::parse("x").unwrap());
        let key = IdempotencyKey::from(&id);
        let after = decision_at(&permits, request(&late, &route, &id, &key), T0 + end).await;
        quotas.purge_prefix().await.unwrap();
        (sends, jobs, after)
    });
    let sends = sorted_within_the_route(sends, jobs.len());
    spaced(&sends, &jobs, "fast", 10_000);
    spaced(&sends, &jobs, "mid", 50_000);
    let slow = spaced(&sends, &jobs, "slow", 200_000);
    // The slow tenant is not queued behind the others' backlogs (its 20
    // sends would then be the route's last): its last send comes before
    // three quarters of the route's.
    let slow_last = sends
        .iter()
        .position(|&(at, _)| at == *slow.last().unwrap())
        .unwrap();
    assert!(
        slow_last < sends.len() * 3 / 4,
        "slow's last send is the route's {slow_last}th of {}",
        sends.len()
    );
    // The route is never left idle for longer than a job parks (at most a
    // hop of the delay tiers: a parked job learns only when it is back that
    // its place came closer as the others left).
    let idle = sends.windows(2).map(|w| w[1].0 - w[0].0).max().unwrap();
    assert!(idle <= 5_000_000, "the route was idle {idle} µs");
    assert!(
        matches!(after, PermitDecision::Granted { delay, .. } if delay.is_zero()),
        "{after:?}"
    );
}

#[test]
fn with_the_routes_keys_in_a_slot_of_their_own_an_account_wide_429_holds_every_tenant() {
    runtime().block_on(async {
        let (permits, quotas) = split_stores(Quota::new("100/s".parse().unwrap(), 1).unwrap());
        // No quota on the route: its 429s are account-wide, so its jobs
        // still ask its slot, where the penalty is.
        let route = Kind::parse("email").unwrap();
        let (noisy, quiet) = (
            TenantId::parse("noisy").unwrap(),
            TenantId::parse("quiet").unwrap(),
        );
        let ids: Vec<JobId> = (0..3).map(|i| JobId::parse(format!("j{i}")).unwrap()).collect();
        let keys: Vec<IdempotencyKey> = ids.iter().map(IdempotencyKey::from).collect();
        let penalty = Penalty {
            wait: Duration::from_secs(2),
            scope: ThrottleScope::Route,
        };
        permits
            .record(
                request(&noisy, &route, &ids[0], &keys[0]),
                PermitUse::CallFailed { retry_after: None },
                Some(penalty),
                Some(T0),
            )
            .await
            .unwrap();
        let during = permits
            .decide(request(&quiet, &route, &ids[1], &keys[1]), 1, Some(T0 + 500_000))
            .await
            .unwrap();
        assert!(
            matches!(during, Reply::Denied { retry_in, .. } if retry_in == Duration::from_millis(1_500)),
            "{during:?}"
        );
        let after = decision_at(
            &permits,
            request(&quiet, &route, &ids[2], &keys[2]),
            T0 + 2_000_000,
        )
        .await;
        assert!(
            matches!(after, PermitDecision::Granted { delay, .. } if delay.is_zero()),
            "{after:?}"
        );
        quotas.purge_prefix().await.unwrap();
    });
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 192, ..ProptestConfig::default() })]

    /// Several pods whose jobs ask together, on one Redis or as on a Redis
    /// Cluster (`split`: their calls to the route's slot and to the
    /// tenants' interleave in the batches; on one Redis a tenant held below
    /// its share keeps places on a route of burst 1 that the others'
    /// reservations step over or move): whatever the quotas and the
    /// arrivals, no tenant and not the route ever sends beyond its limit,
    /// every job is sent, and once the last send has passed nothing is left
    /// reserved on either side.
    #[test]
    fn neither_limit_is_exceeded_whatever_the_interleaving(
        split in proptest::bool::ANY,
        tenants in proptest::collection::vec((1u32..60, 1u32..4), 1..4),
        route in (1u32..60, 1u32..4),
        arrivals in proptest::collection::vec((0usize..4, 0u64..200_000), 1..50),
        pods in 1usize..4,
        at_once in 1usize..5,
    ) {
        limits_hold(split, &tenants, route, &arrivals, pods, at_once, None)?;
    }

    /// As deployed: sends spaced 2 % wider than the quotas, a 500 ms
    /// horizon, and jobs that ask again up to 4 ms after the time they were
    /// given (a timer and a round trip), so that a tenant held below its
    /// share of the route comes for its kept places after they pass. Each
    /// call, begun anywhere from its send to the leeway it was given, keeps
    /// every quota (burst 1) as a provider counts it: never more than the
    /// quota in any second.
    #[test]
    fn as_deployed_no_second_holds_more_than_a_quota(
        split in proptest::bool::ANY,
        tenants in proptest::collection::vec(1u32..60, 1..4),
        route in 1u32..60,
        arrivals in proptest::collection::vec((0usize..4, 0u64..200_000), 1..50),
        pods in 1usize..4,
        at_once in 1usize..5,
        late in 0u64..30_000,
    ) {
        let tenants: Vec<(u32, u32)> = tenants.into_iter().map(|count| (count, 1)).collect();
        limits_hold(split, &tenants, (route, 1), &arrivals, pods, at_once, Some(late))?;
    }
}

/// The property of `neither_limit_is_exceeded_whatever_the_interleaving`
/// for one case: `tenants` and `route` as (count/s, burst), `arrivals` as
/// (tenant, µs after the previous job). `deployed`: paced and late as in
/// `as_deployed_no_second_holds_more_than_a_quota`, jobs asking again that
/// many µs late, and the limits checked as a provider counts them (else
/// exactly, as the quotas' GCRA).
fn limits_hold(
    split: bool,
    tenants: &[(u32, u32)],
    route: (u32, u32),
    arrivals: &[(usize, u64)],
    pods: usize,
    at_once: usize,
    deployed: Option<u64>,
) -> Result<(), TestCaseError> {
    let rate = |(count, burst): (u32, u32)| {
        Quota::new(format!("{count}/s").parse().unwrap(), burst).unwrap()
    };
    let names: Vec<TenantId> = (0..tenants.len())
        .map(|t| TenantId::parse(format!("t{t}")).unwrap())
        .collect();
    let mut at = 0;
    let jobs: Vec<Simulated> = arrivals
        .iter()
        .map(|&(t, gap)| {
            at += gap;
            Simulated {
                tenant: names[t % names.len()].clone(),
                priority: tollgate_core::Priority::Normal,
                arrives: at,
            }
        })
        .collect();
    let (sends, after) = runtime().block_on(async {
        let (pods, quotas) = match deployed {
            None => fleet(rate((1000, 1)), pods, split),
            Some(_) => fleet_with(deployed_settings(rate((1000, 1))), pods, split),
        };
        let email = Kind::parse("email").unwrap();
        set_quota(
            &quotas,
            tollgate_quota::Target::Route(email.clone()),
            rate(route),
        )
        .await;
        for (name, &quota) in names.iter().zip(tenants) {
            set_quota(
                &quotas,
                tollgate_quota::Target::Tenant(name.clone()),
                rate(quota),
            )
            .await;
        }
        let sends = simulate_leeways(
            &pods,
            &email,
            &jobs,
            |_| 0,
            at_once,
            deployed.unwrap_or(0),
            None,
        )
        .await;
        // Once the last send and every place handed out have passed, a job
        // of each tenant, two seconds apart, goes at once: nothing is left
        // reserved on the route or the tenant. (A job back for its place
        // may go before it, as the tenant's burst allows, and its place
        // then stays in the line, up to the interval × burst after its
        // send: 3 s at most here. A tenant held below its share keeps its
        // next place on the route when it sends, its spacing on: at most
        // 1.02 s here, so the next tenant's job comes 2 s later.)
        let end = sends.iter().map(|&(at, ..)| at).max().unwrap_or(0) + 5_000_000;
        let mut after = Vec::new();
        for (t, name) in names.iter().enumerate() {
            let id = JobId::parse(format!("after-{t}")).unwrap();
            let key = IdempotencyKey::from(&id);
            let at = T0 + end + t as u64 * 2_000_000;
            after.push(
                pods[0]
                    .decide(request(name, &email, &id, &key), 1, Some(at))
                    .await
                    .unwrap(),
            );
        }
        quotas.purge_prefix().await.unwrap();
        (sends, after)
    });
    prop_assert_eq!(sends.len(), jobs.len(), "every job is sent once");
    // The sends of the route (no tenant) or of a tenant keep its quota.
    let keep = |of: Option<&TenantId>, (count, burst): (u32, u32)| {
        let sends: Vec<(u64, u64)> = sends
            .iter()
            .filter(|&&(_, i, _)| of.is_none_or(|name| jobs[i].tenant == *name))
            .map(|&(at, _, leeway)| (at, leeway))
            .collect();
        match deployed {
            Some(_) => within_window(&sends, count),
            None => keeps_to(
                &sends.iter().map(|&(at, _)| at).collect::<Vec<_>>(),
                count,
                burst,
            ),
        }
    };
    prop_assert_eq!(keep(None, route), Ok(()), "the route");
    for (t, name) in names.iter().enumerate() {
        prop_assert_eq!(keep(Some(name), tenants[t]), Ok(()), "tenant {}", t);
    }
    for decision in after {
        prop_assert!(
            matches!(decision, Reply::Decision(PermitDecision::Granted { delay, .. }) if delay.is_zero()),
            "{:?}",
            decision
        );
    }
    Ok(())
}

/// Tenants `t0`, `t1`, … with these quotas (burst 1) and `per_tenant` jobs
/// each, tenant t's arriving from `starts[t]` µs one every ms, on a 30/s
/// route, through two pods (on one Redis, or as on a Redis Cluster when
/// `split`), as many asks at once as there are tenants. Checks that every
/// job is sent once and the route's limit holds; returns the sends in time
/// order and, for each tenant, the longest it went without a send from its
/// first to its last.
fn tenants_on_a_30_per_second_route(
    split: bool,
    quotas: &[&str],
    starts: &[u64],
    per_tenant: usize,
    late: u64,
) -> (Vec<(u64, usize)>, Vec<u64>) {
    let n = quotas.len();
    let sends = runtime().block_on(async {
        let quota = Quota::new("10/s".parse().unwrap(), 1).unwrap();
        let (pods, store) = fleet(quota, 2, split);
        let route = route_of_30_per_second(&store).await;
        for (t, rate) in quotas.iter().enumerate() {
            tenant_quota(&store, &TenantId::parse(format!("t{t}")).unwrap(), rate).await;
        }
        let jobs: Vec<Simulated> = (0..n * per_tenant)
            .map(|i| Simulated {
                tenant: TenantId::parse(format!("t{}", i % n)).unwrap(),
                priority: tollgate_core::Priority::Normal,
                arrives: starts[i % n] + (i / n) as u64 * 1_000,
            })
            .collect();
        let sends = simulate_pods(&pods, &route, &jobs, |_| 0, n, late).await;
        store.purge_prefix().await.unwrap();
        sends
    });
    let sends = sorted_within_the_route(sends, n * per_tenant);
    let longest_gaps = (0..n)
        .map(|t| {
            sends_of_tenant(&sends, n, t)
                .windows(2)
                .map(|w| w[1] - w[0])
                .max()
                .unwrap_or(0)
        })
        .collect();
    (sends, longest_gaps)
}

/// Four tenants at 10/s starting 0.3 s apart on a 30/s route, with 40 jobs
/// each: the route's capacity goes to them in turn, no tenant goes a second
/// without a send, and the backlog drains near the route's pace (160 jobs
/// at 30/s take 5.3 s; each tenant alone 4 s). How the two pods' calls
/// interleave moves the last send by a second (on one Redis 6.1–7.1 s over
/// 62 runs, as on a cluster 6.9–8.0 s over 30; on a later machine 7.9–8.3 s,
/// and 8.1 s since a job back for its place in its tenant's line keeps
/// it), so the bound is 9 s.
fn assert_four_tenants_held_by_their_own_quotas_share_the_route(split: bool) {
    let (sends, gaps) = tenants_on_a_30_per_second_route(
        split,
        &["10/s"; 4],
        &[0, 300_000, 600_000, 900_000],
        40,
        0,
    );
    for (t, gap) in gaps.iter().enumerate() {
        assert!(
            *gap < 1_000_000,
            "tenant t{t} went {gap} µs without a send: {gaps:?}"
        );
    }
    let last = sends.last().unwrap().0;
    assert!(last <= 9_000_000, "160 sends took {last} µs");
}

/// On one Redis. A job back from a hop for a place still ahead on its
/// tenant's line used to be judged by the route's bucket alone: when the
/// route was busier than the tenant's own bucket, every such job was given
/// the route's next moment as a place on the tenant's share of the route,
/// all of them the same one; one of them got it and the rest went to the
/// back of the tenant's line, 5–6 s out, leaving the tenant without a send
/// for 2.8 s and the backlog 9–11 s long.
#[test]
fn tenants_held_by_their_own_quotas_share_the_route_without_stalling() {
    assert_four_tenants_held_by_their_own_quotas_share_the_route(false);
}

/// As on a Redis Cluster. (Counting each tenant for only the part of its
/// share its own quota lets it use made two of them shrink each other's
/// weights to nothing while the others joined; the route's virtual time
/// then stretched a thousandfold when one left, and jobs were given places
/// 400 s ahead: 2,344 s for the 160 jobs.)
#[test]
fn as_on_a_cluster_tenants_held_by_their_own_quotas_share_the_route_without_stalling() {
    assert_four_tenants_held_by_their_own_quotas_share_the_route(true);
}

/// A tenant whose own quota (10/s) is below its half of a 30/s route keeps
/// sending at its pace beside a tenant that could take the whole route:
/// neither goes a second without a send, on either layout. On one Redis
/// the 10/s tenant went 2.5 s without one, and the route sat idle for 2 s
/// of it, when its jobs lost their places as above, or when a job back a
/// few hundred ms early for its place took the free slot of the job due
/// before it, which then went to the back of the line.
#[test]
fn a_tenant_held_by_its_own_quota_keeps_its_pace_beside_one_that_could_take_the_route() {
    for split in [false, true] {
        let (_, gaps) = tenants_on_a_30_per_second_route(split, &["10/s", "100/s"], &[0, 0], 60, 0);
        for (t, gap) in gaps.iter().enumerate() {
            assert!(
                *gap < 1_000_000,
                "split {split}: tenant t{t} went {gap} µs without a send: {gaps:?}"
            );
        }
    }
}

/// Sends per second of tenant `t` of `n` (job i is tenant i mod n) from
/// the start to `until` µs.
fn rate_until(sends: &[(u64, usize)], n: usize, t: usize, until: u64) -> f64 {
    let sent = sends
        .iter()
        .filter(|&&(at, i)| i % n == t && at <= until)
        .count();
    sent as f64 / (until as f64 / 1e6)
}

/// A 10/s tenant and a 100/s one on a 30/s route, 200 jobs each: each one's
/// sends per second while both have work (until the wide tenant's last
/// send; the held one needs twice as long for as many jobs), and the held
/// tenant's longest wait between sends (µs).
fn a_held_tenant_beside_a_wide_one(split: bool, late: u64) -> (f64, f64, u64) {
    let (sends, gaps) =
        tenants_on_a_30_per_second_route(split, &["10/s", "100/s"], &[0, 0], 200, late);
    let until = sends
        .iter()
        .filter(|&&(_, i)| i % 2 == 1)
        .map(|&(at, _)| at)
        .max()
        .unwrap();
    (
        rate_until(&sends, 2, 0, until),
        rate_until(&sends, 2, 1, until),
        gaps[0],
    )
}

/// On one Redis, a tenant whose own quota (10/s) holds it below its half
/// of a 30/s route gets its whole quota beside one that could take the
/// route, and the other gets the rest: the route keeps the held tenant's
/// places, and the other's reservations step over them. Before, each of
/// the held tenant's sends found the route reserved past its place and
/// went out a slot or more later, which its quota of burst 1 cannot make
/// up: 6.4 of its 10/s while both had work. And two of its jobs back early
/// for places on its own line, with the other's reservations past both,
/// were both handed the route's next free time on its share: one took it,
/// the other went to the back of the line, and a slot was lost (9.53/s,
/// 9.46 once in CI; 9.87 since each takes a place on the share line).
#[test]
fn a_tenant_held_by_its_own_quota_gets_its_whole_quota_beside_one_that_takes_the_rest() {
    let (held, wide, _) = a_held_tenant_beside_a_wide_one(false, 0);
    assert!(held >= 9.7, "the held tenant sent {held:.2}/s of its 10/s");
    assert!(
        wide >= 19.0,
        "the other sent {wide:.2}/s of the route's other 20/s"
    );
}

/// As on a Redis Cluster, where the route's slot cannot see the held
/// tenant's own line, the same pair: a job back early (a hop's remainder)
/// for its place in its tenant's line keeps that place and asks again
/// within the window. The route's slot used to hand it the tenant's next
/// place on the route as if it were a fresh job, so it lost its turn: the
/// held tenant sent 7.57–7.77 of its 10/s and went 0.56–0.87 s without a
/// send (8.35–8.51/s and 0.25–0.36 s since). Its places are not kept
/// here, and its whole weight counts in the shares (ARCHITECTURE, "A route
/// quota across two slots"), so it stays below the 9.8/s of one Redis.
#[test]
fn as_on_a_cluster_a_tenant_held_by_its_own_quota_keeps_its_place_beside_one_that_takes_the_rest() {
    let (held, _, gap) = a_held_tenant_beside_a_wide_one(true, 0);
    assert!(held >= 8.1, "the held tenant sent {held:.2}/s of its 10/s");
    assert!(
        gap < 500_000,
        "the held tenant went {gap} µs without a send"
    );
}

/// As deployed, a tenant held below its share (10/s on a 30/s route) by
/// its own quota, beside one whose backlog keeps the route reserved ahead:
/// a job that asks a little after its tenant's kept place has passed (held
/// in its pod until then, it asks a timer and a round trip late) is sent
/// at once on that place, its call allowed only what is left of the leeway;
/// and the next job, as late for the next place, is sent on its own. The
/// place used to be dropped the moment it passed: the first job then took
/// the next place, 100 ms on, and the next job found its place spent and
/// went to the back of the line (at one delivery per queue the tenant sent
/// 0.59-0.95 of its quota in a quarter of the benchmark's runs).
#[test]
fn a_job_a_little_late_for_its_kept_place_still_takes_it() {
    let sends = runtime().block_on(async {
        let (permits, store) = stores_with(deployed_settings(
            Quota::new("10/s".parse().unwrap(), 1).unwrap(),
        ));
        let route = route_of_30_per_second(&store).await;
        let (held, wide) = (
            TenantId::parse("held").unwrap(),
            TenantId::parse("wide").unwrap(),
        );
        tenant_quota(&store, &wide, "100/s").await;
        let ask = |tenant: &TenantId, name: &str, at: u64| {
            let id = JobId::parse(name).unwrap();
            let key = IdempotencyKey::from(&id);
            let tenant = tenant.clone();
            let route = route.clone();
            let permits = &permits;
            async move {
                permits
                    .decide(request(&tenant, &route, &id, &key), 1, Some(T0 + at))
                    .await
                    .unwrap()
            }
        };
        // The held tenant's first send; its next place, a spacing (102 ms)
        // on, is kept. The wide tenant reserves the route's slots around
        // it (34, 68, 136 and 170 ms).
        let first = ask(&held, "h0", 0).await;
        for i in 0..4 {
            ask(&wide, &format!("w{i}"), 0).await;
        }
        let Reply::Decision(PermitDecision::Granted { delay, .. }) = first else {
            panic!("{first:?}")
        };
        let place = delay.as_micros() as u64 + 102_000;
        let mut sends = Vec::new();
        for (i, late) in [(1, 2_000), (2, 1_000)] {
            let at = place + (i - 1) * 102_000 + late;
            sends.push((at, ask(&held, &format!("h{i}"), at).await));
        }
        store.purge_prefix().await.unwrap();
        sends
    });
    for (n, (at, decision)) in sends.into_iter().enumerate() {
        let Reply::Decision(PermitDecision::Granted { delay, leeway, .. }) = decision else {
            panic!("asked at {at} µs: {decision:?}")
        };
        assert!(delay.is_zero(), "asked at {at} µs: sent {delay:?} later");
        // The route was reserved past the first's place: its call has 10 ms
        // of leeway (half of 2 % of the route's second), less how late it
        // is for its place. (The next finds the route free by then.)
        if n == 0 {
            assert!(
                leeway == Duration::from_millis(8),
                "asked at {at} µs: leeway {leeway:?}"
            );
        }
    }
}

/// Several tenants held below their shares by quotas of their own, at
/// paces that do not divide the route's, beside one that could take the
/// route: the places kept for each, stepped over or moved by the others'
/// reservations, never bring two of the route's sends closer than its
/// interval, nor a tenant's closer than its own; every job goes once; and
/// nobody waits long between sends. The harness asks four jobs at once at
/// the latest of their times, which makes a job up to a few hundred ms
/// late for its kept place; about one run in a hundred, two of the 4/s
/// tenant's places then land 20 ms apart, the second job goes to the back
/// of its line, and the tenant waits out one 1 s hop (1.0–1.1 s between
/// sends, its spacing 0.25 s): the bound is 1.5 s, not 1 s.
#[test]
fn kept_places_of_tenants_at_several_paces_keep_every_limit() {
    let quotas = ["4/s", "7/s", "9/s", "100/s"];
    for starts in [[0, 0, 0, 0], [0, 150_000, 400_000, 50_000]] {
        let (sends, gaps) = tenants_on_a_30_per_second_route(false, &quotas, &starts, 40, 0);
        for (t, rate) in [4, 7, 9, 100].into_iter().enumerate() {
            let own = sends_of_tenant(&sends, quotas.len(), t);
            keeps_to(&own, rate, 1).unwrap_or_else(|e| panic!("tenant t{t}: {e}"));
            assert!(
                gaps[t] < 1_500_000,
                "tenant t{t} went {} µs without a send",
                gaps[t]
            );
        }
    }
}

/// Twenty tenants at 1/s, ten jobs each, arriving 20 ms apart, and one at
/// 100/s whose ten jobs arrive at `fast_arrives` µs, on a 30/s route, two
/// pods, `at_once` asks decided together. Checks that every job goes once
/// within the route's limit and every 1/s tenant keeps its own quota;
/// returns each 1/s tenant's sends.
fn slow_tenants_and_a_fast_one(fast_arrives: u64, at_once: usize) -> Vec<Vec<u64>> {
    let n = 21;
    let sends = runtime().block_on(async {
        let quota = Quota::new("10/s".parse().unwrap(), 1).unwrap();
        let (pods, store) = fleet(quota, 2, false);
        let route = route_of_30_per_second(&store).await;
        for t in 0..n {
            let rate = if t == n - 1 { "100/s" } else { "1/s" };
            tenant_quota(&store, &TenantId::parse(format!("t{t}")).unwrap(), rate).await;
        }
        let jobs: Vec<Simulated> = (0..n * 10)
            .map(|i| Simulated {
                tenant: TenantId::parse(format!("t{}", i % n)).unwrap(),
                priority: tollgate_core::Priority::Normal,
                arrives: if i % n == n - 1 {
                    fast_arrives
                } else {
                    (i % n) as u64 * 20_000
                } + (i / n) as u64 * 1_000,
            })
            .collect();
        let sends = simulate_pods(&pods, &route, &jobs, |_| 0, at_once, 0).await;
        store.purge_prefix().await.unwrap();
        sends
    });
    let sends = sorted_within_the_route(sends, n * 10);
    (0..n - 1)
        .map(|t| {
            let own = sends_of_tenant(&sends, n, t);
            keeps_to(&own, 1, 1).unwrap_or_else(|e| panic!("tenant t{t}: {e}"));
            own
        })
        .collect()
}

/// The twenty 1/s tenants arrive just before the 100/s one: each is slower
/// than its share until most have come, so each keeps places on the
/// route, and their places crowd each other. Every 1/s tenant's ten jobs
/// still go out within 13 s (9 s at its pace, from its arrival up to 0.4 s
/// in; 10.9 s measured).
#[test]
fn many_tenants_keeping_places_on_one_route_all_keep_their_pace() {
    for (t, own) in slow_tenants_and_a_fast_one(400_000, 2).iter().enumerate() {
        let last = own.iter().max().unwrap();
        assert!(*last <= 13_000_000, "tenant t{t}'s last send at {last} µs");
    }
}

/// With only tenants held below their shares by their own quotas on a
/// route, each counts for its usable part of the others' weights, at least
/// of one whole weight. Counted of the others' weights alone, those fell to
/// the floor together, the route's virtual time ran 50 times faster than
/// real time, and when the 100/s tenant came 5 s in, every share place
/// already given stretched 50-fold: a 1/s tenant went 23 s without a send
/// with four asks decided together (2.03 s now, at most). The harness
/// decides the asks it groups at the latest of their times, so a 1/s
/// tenant may lose a slot or two to it; while its pods raced for Redis,
/// runs beside the rest of this suite read up to 3.2 s. The bound, 4 s,
/// still catches the 23 s.
#[test]
fn slow_tenants_places_stay_near_when_a_fast_tenant_joins_their_route() {
    for at_once in [2, 4] {
        for (t, own) in slow_tenants_and_a_fast_one(5_000_000, at_once)
            .iter()
            .enumerate()
        {
            let longest = own.windows(2).map(|w| w[1] - w[0]).max().unwrap();
            assert!(
                longest <= 4_000_000,
                "{at_once} at once: tenant t{t} went {longest} µs without a send"
            );
        }
    }
}

/// A call may begin up to its leeway after its slot: 36 s for a per-hour
/// quota at a 2 % margin. The lease and the concurrency place lasted only
/// the provider timeout and 5 s from the slot (15 s here), so a call begun
/// late within its leeway could outlive them, and another job went past the
/// concurrency limit (or a copy with the same key was granted). Both now
/// last past the latest moment the call may begin.
#[test]
fn a_lease_outlasts_the_latest_moment_its_call_may_begin() {
    runtime().block_on(async {
        let hourly = Quota::new("3600/h".parse().unwrap(), 1).unwrap();
        let (permits, quotas) = stores_with(PermitSettings {
            pacing_margin: 0.02,
            ..settings(hourly)
        });
        let tenant = TenantId::parse("hourly").unwrap();
        set_quota_at_most(&quotas, &tenant, hourly, Some(1)).await;
        let route = Kind::default_kind();
        let (ids, keys) = jobs(0..2);
        let req = |i: usize, token| PermitRequest {
            lease_token: token,
            ..request(&tenant, &route, &ids[i], &keys[i])
        };

        let PermitDecision::Granted { leeway, .. } =
            decision_at(&permits, req(0, "first"), T0).await
        else {
            panic!("the first job is granted");
        };
        assert!(leeway > Duration::from_secs(20), "{leeway:?}");
        // 16 s on, the first call may still begin (within its leeway): it
        // still holds the tenant's one place.
        let later = T0 + 16_000_000;
        assert!(matches!(
            decision_at(&permits, req(1, "second"), later).await,
            PermitDecision::AtConcurrency { .. }
        ));
        // Its key stays leased past that latest moment too.
        let lease = Keys::new(quotas.keys().prefix()).lease(&tenant, &keys[0]);
        let pttl = tollgate_tests::pttl(&tollgate::Config::load(None).unwrap(), &lease).await;
        assert!(
            pttl as u128 > (Duration::from_secs(15) + leeway).as_millis() - 1_000,
            "lease PTTL {pttl} ms against a leeway of {leeway:?}"
        );
        quotas.purge_prefix().await.unwrap();
    });
}

/// A shadow quota judges each send as the real one would: only a send it
/// would allow moves its bucket. Moved by the sends it would deny too, it
/// stayed at its cap and said "deny" to nearly everything after the first
/// few sends: a 5/s shadow under 10 sends a second now allows every other
/// one, its rate.
#[test]
fn a_shadow_quota_allows_what_its_rate_would() {
    runtime().block_on(async {
        let (permits, quotas) = stores(Quota::new("100/s".parse().unwrap(), 1).unwrap());
        let tenant = TenantId::parse("trial").unwrap();
        let target = tollgate_quota::Target::Tenant(tenant.clone());
        let shadow =
            tollgate_quota::Change::SetShadow(Quota::new("5/s".parse().unwrap(), 1).unwrap());
        quotas.apply(&target, shadow, &test_actor()).await.unwrap();
        let route = Kind::default_kind();
        let (mut allowed, mut denied) = (0, 0);
        for i in 0..100u64 {
            let id = JobId::parse(format!("s{i}")).unwrap();
            let key = IdempotencyKey::from(&id);
            // 10 a second, for 10 s.
            let at = T0 + i * 100_000;
            match decision_at(&permits, request(&tenant, &route, &id, &key), at).await {
                PermitDecision::Granted {
                    shadow: tollgate_core::run::Shadow::Allow,
                    ..
                } => allowed += 1,
                PermitDecision::Granted {
                    shadow: tollgate_core::run::Shadow::Deny,
                    ..
                } => denied += 1,
                other => panic!("send {i}: {other:?}"),
            }
        }
        assert_eq!((allowed, denied), (50, 50), "5/s of 10 sends a second");
        quotas.purge_prefix().await.unwrap();
    });
}

/// Paused, a tenant's jobs are parked without their places and come back
/// after the resume as new: the places left in its line passed unused ahead
/// of them. A 30-job line at 1/s, paused for 5 s, sent nothing for 23 s
/// after the resume. A pause or a resume now empties the tenant's lines.
#[test]
fn a_resumed_tenant_sends_at_once_not_behind_the_places_its_pause_emptied() {
    runtime().block_on(async {
        let (permits, quotas) = stores(Quota::new("1/s".parse().unwrap(), 1).unwrap());
        let tenant = TenantId::parse("paused").unwrap();
        let target = tollgate_quota::Target::Tenant(tenant.clone());
        let route = Kind::default_kind();
        let (ids, keys) = jobs(0..31);
        let ask = |i: usize, at: u64| {
            decision_at(&permits, request(&tenant, &route, &ids[i], &keys[i]), at)
        };
        assert!(matches!(ask(0, T0).await, PermitDecision::Granted { .. }));
        for i in 1..30 {
            let req = request(&tenant, &route, &ids[i], &keys[i]);
            let reply = permits.decide(req, 1, Some(T0)).await.unwrap();
            assert!(
                !matches!(reply, Reply::Decision(PermitDecision::Granted { .. })),
                "job {i} waits for its place"
            );
        }
        quotas
            .apply(&target, tollgate_quota::Change::Pause, &test_actor())
            .await
            .unwrap();
        quotas
            .apply(&target, tollgate_quota::Change::Resume, &test_actor())
            .await
            .unwrap();
        // 7 s on, the tenant's bucket has room: a job goes at once.
        let decision = ask(30, T0 + 7_000_000).await;
        assert!(
            matches!(decision, PermitDecision::Granted { delay, .. } if delay.is_zero()),
            "{decision:?}"
        );
        quotas.purge_prefix().await.unwrap();
    });
}

/// What a job denied with `reply` at `asked` (µs) brings when it comes
/// back for its place on its tenant's share of the route; `None` when the
/// reply gave it no such place.
fn back_for_its_share_place(asked: u64, reply: &Reply) -> Option<tollgate_core::ports::Returning> {
    match *reply {
        Reply::Denied {
            retry_in,
            interval,
            share: Some(share),
            ..
        } => Some(tollgate_core::ports::Returning {
            until: until_millis(asked + retry_in.as_micros() as u64),
            interval,
            share_place: Some(share.first_place()),
        }),
        _ => None,
    }
}

/// Alone on an idle route, a job back early for its place on its tenant's
/// share goes at once: the place orders it among nobody. While another
/// tenant still has work it waits for its place, idle or not (the route's
/// next slots may be the other's places, their jobs about to come back).
/// A route raised live under two backlogs sent one job, parked before the
/// raise in a long tier, 11-17 s after all the others: it came back to an
/// idle route and was told to wait for a share place still far out.
#[test]
fn a_job_alone_on_an_idle_route_goes_whatever_its_share_place() {
    for split in [false, true] {
        runtime().block_on(async {
            let (permits, quotas, _) = wide_tenants_on_a_30_per_second_route(split).await;
            let route = route_of(&quotas, "10/s").await;
            let (a, b) = (TenantId::parse("a").unwrap(), TenantId::parse("b").unwrap());
            // a's 60 jobs and b's 5 at once: places on their shares of the
            // route, a's last some seconds out.
            let (ids, keys) = jobs(0..65);
            let mut last = None;
            for i in 0..65 {
                let tenant = if i < 60 { &a } else { &b };
                let req = request(tenant, &route, &ids[i], &keys[i]);
                let reply = permits.decide(req, 1, Some(T0 + i as u64)).await.unwrap();
                if i == 59 {
                    last = Some(reply);
                }
            }
            let back = |now: u64, reply: Reply| {
                let returning = back_for_its_share_place(now, &reply).unwrap_or_else(|| {
                    panic!("split {split}: a place on a's share, not {reply:?}")
                });
                assert!(
                    returning.until.0 as u64 * 1_000 > T0 + 3_000_000,
                    "split {split}: a's last place is at {:?}",
                    returning.until
                );
                PermitRequest {
                    returning: Some(returning),
                    ..request(&a, &route, &ids[59], &keys[59])
                }
            };
            // Back early while b has work: it keeps waiting.
            let early = T0 + 300_000;
            let shared = permits
                .decide(back(T0 + 59, last.unwrap()), 1, Some(early))
                .await
                .unwrap();
            assert!(
                matches!(shared, Reply::Denied { .. }),
                "split {split}: went before its place beside b: {shared:?}"
            );
            // Back early again once b is done, the route idle: it goes.
            let alone = permits
                .decide(back(early, shared), 1, Some(T0 + 3_000_000))
                .await
                .unwrap();
            assert!(
                matches!(alone, Reply::Decision(PermitDecision::Granted { .. })),
                "split {split}: alone on an idle route, told {alone:?}"
            );
            quotas.purge_prefix().await.unwrap();
        });
    }
}

/// Two tenants' backlogs of 300 jobs on a route of 15/s, raised to 45/s a
/// second in: the places already given are re-spaced around the raise,
/// and a job parked before it for one of its tenant's last places finds
/// that place gone by once the lines have passed, whenever it comes back,
/// even after its tenant left the route's tenants with work. (Leaving, a
/// tenant forgot when its step changed, and its jobs back after that were
/// told to wait for their places as first given: in the bench, a route
/// raised from 15/s to 45/s under two backlogs sent its last jobs 10 s
/// after the others, one per hop, the route idle.)
#[test]
fn places_re_spaced_by_a_raised_route_stay_re_spaced_after_their_tenant_leaves() {
    use tollgate_core::ports::Returning;
    for split in [false, true] {
        runtime().block_on(async {
            let (permits, quotas, _) = wide_tenants_on_a_30_per_second_route(split).await;
            let route = route_of(&quotas, "15/s").await;
            let (a, b) = (TenantId::parse("a").unwrap(), TenantId::parse("b").unwrap());
            let (ids, keys) = jobs(0..600);
            let ask = |i: usize, at: u64, returning: Option<Returning>| {
                let tenant = if i.is_multiple_of(2) { &a } else { &b };
                let req = PermitRequest {
                    returning,
                    ..request(tenant, &route, &ids[i], &keys[i])
                };
                permits.decide(req, 1, Some(at))
            };
            // A job back for the place it was given at `asked`.
            let back = |i: usize, asked: u64, reply: Reply| {
                back_for_its_share_place(asked, &reply).unwrap_or_else(|| {
                    panic!("split {split}: job {i}: a place on a share, not {reply:?}")
                })
            };
            // Both backlogs at once: b's last two places are 40 s out.
            let mut kept = Vec::new();
            for i in 0..600 {
                let reply = ask(i, T0 + i as u64, None).await.unwrap();
                if [20, 21, 597, 599].contains(&i) {
                    kept.push(back(i, T0 + i as u64, reply));
                }
            }
            route_of(&quotas, "45/s").await;
            // A job of each tenant back a second on, after the raise (its
            // place about now): both lines are re-spaced around it.
            for (k, i) in [20, 21].into_iter().enumerate() {
                ask(i, T0 + 1_000_000, Some(kept[k])).await.unwrap();
            }
            // Both lines have passed (at 45/s, the rest of the 600 places
            // take 13 s); b's last two jobs come back, the second while the
            // first's send is still reserved.
            let now = T0 + 14_500_000;
            for (k, i) in [597, 599].into_iter().enumerate() {
                let returning = kept[2 + k];
                assert!(
                    returning.until.0 as u64 * 1_000 > now + 20_000_000,
                    "split {split}: b's job {i} was given a place at {:?}",
                    returning.until
                );
                let decision = ask(i, now + k as u64, Some(returning)).await.unwrap();
                assert!(
                    matches!(
                        decision,
                        Reply::Decision(PermitDecision::Granted { delay, .. })
                            if delay < Duration::from_millis(100)
                    ),
                    "split {split}: b's job {i}, back after its place moved by, told {decision:?}"
                );
            }
            quotas.purge_prefix().await.unwrap();
        });
    }
}

/// The route's set of tenants with work expired while its weights lived on
/// (each key's TTL is only ever raised, and a set emptied and made again
/// starts shorter): the weights of tenants long gone stayed in the sum,
/// and a tenant alone on a 30/s route got 10/s of it (two gone, one weight
/// each) for as long as the route stayed busy. Now a missing set clears
/// them: the tenant alone sends at the route's pace.
#[test]
fn a_tenant_alone_on_a_route_gets_all_of_it_whoever_was_there_before() {
    let alone = runtime().block_on(async {
        let quota = Quota::new("100/s".parse().unwrap(), 1).unwrap();
        let (pods, store) = fleet(quota, 1, false);
        let route = route_of_30_per_second(&store).await;
        let jobs = |tenant: &str, n: usize, from: u64| -> Vec<Simulated> {
            (0..n)
                .map(|i| Simulated {
                    tenant: TenantId::parse(tenant).unwrap(),
                    priority: tollgate_core::Priority::Normal,
                    arrives: from + i as u64 * 1_000,
                })
                .collect()
        };
        let mut before = jobs("gone-a", 5, 0);
        before.extend(jobs("gone-b", 5, 0));
        simulate_pods(&pods, &route, &before, |_| 0, 2, 0).await;
        // The set expires; the weights hash does not.
        let config = tollgate::Config::load(None).unwrap();
        let deleted = std::process::Command::new("redis-cli")
            .args(["-u", config.redis_url.expose(), "DEL"])
            .arg(store.keys().route_active(&route))
            .output()
            .expect("redis-cli runs");
        assert_eq!(String::from_utf8_lossy(&deleted.stdout).trim(), "1");
        let sends = simulate_pods(&pods, &route, &jobs("alone", 30, 5_000_000), |_| 0, 1, 0).await;
        store.purge_prefix().await.unwrap();
        sends
    });
    let times: Vec<u64> = alone.iter().map(|&(at, _)| at).collect();
    let span = times.iter().max().unwrap() - times.iter().min().unwrap();
    // 29 spacings of the route's 30/s (34 ms with the pacing margin): about
    // 1 s; with the gone tenants' weights counted, three times that.
    assert!(
        span < 1_500_000,
        "30 sends alone on a 30/s route took {span} µs"
    );
}

/// Two tenants' backlogs of `each` jobs, interleaved, one every 0.1 ms:
/// job i is tenant i mod 2's.
fn two_backlogs(names: [&str; 2], each: usize) -> ([TenantId; 2], Vec<Simulated>) {
    let tenants = names.map(|n| TenantId::parse(n).unwrap());
    let jobs = (0..2 * each)
        .map(|i| Simulated {
            tenant: tenants[i % 2].clone(),
            priority: tollgate_core::Priority::Normal,
            arrives: (i / 2) as u64 * 100,
        })
        .collect();
    (tenants, jobs)
}

/// Sends of each of [`two_backlogs`]' tenants within `span` (µs).
fn sends_of_each(sends: &[(u64, usize)], span: std::ops::RangeInclusive<u64>) -> [usize; 2] {
    sends
        .iter()
        .filter(|(at, _)| span.contains(at))
        .fold([0; 2], |mut c, &(_, i)| {
            c[i % 2] += 1;
            c
        })
}

/// Two tenants of weight 1 with backlogs share a 30/s route; one's weight
/// is raised to 5 while most of both backlogs are parked for places on
/// their share lines. The places already given are re-spaced with the new
/// weights: the route stays full, and from then on the raised tenant gets
/// five sends in six. (Kept at the old step, they held both tenants to the
/// old share of a sum that had tripled: the route sent 10/s of its 30.)
/// When the raised tenant is done, the other's parked jobs come back in
/// time for their places. The same when the route's keys live in a slot of
/// their own.
#[test]
fn a_weight_changed_live_re_spaces_the_places_already_given() {
    for split in [false, true] {
        let (sends, jobs) = runtime().block_on(async {
            let (permits, quotas, route) = wide_tenants_on_a_30_per_second_route(split).await;
            let (tenants, jobs) = two_backlogs(["wa", "wb"], 300);
            let raise = (
                4_000_000,
                tollgate_quota::Target::Tenant(tenants[0].clone()),
                tollgate_quota::Change::SetWeight(5),
            );
            let live = Live {
                quotas: &quotas,
                changes: vec![raise],
            };
            let sends = simulate_live(&permits, &route, &jobs, live).await;
            quotas.purge_prefix().await.unwrap();
            (sends, jobs)
        });
        assert_eq!(sends.len(), jobs.len(), "every job is sent once");
        // From a second after the raise (time for every parked job to have
        // come back once) until the raised tenant's last send.
        let raised_done = sends
            .iter()
            .filter(|&&(_, i)| i % 2 == 0)
            .map(|&(at, _)| at)
            .max()
            .unwrap();
        let (from, until) = (5_000_000, raised_done);
        let counts = sends_of_each(&sends, from..=until);
        let sent = (counts[0] + counts[1]) as f64;
        let seconds = (until - from) as f64 / 1e6;
        // 30/s less the 2 % pacing margin.
        assert!(
            sent / seconds >= 0.9 * 30.0 / 1.02,
            "split {split}: the route sent {sent} in {seconds:.2} s after the raise: {counts:?}"
        );
        // And once the raised tenant is done, the other's backlog, parked
        // for places a sum of 6 spaced, comes back as the sum falls to 1:
        // the route never idles while jobs wait (judged at the sum of
        // today, they came back 16 s after their places).
        let mut times: Vec<u64> = sends.iter().map(|&(at, _)| at).collect();
        times.sort_unstable();
        let idle = times.windows(2).map(|w| w[1] - w[0]).max().unwrap();
        assert!(
            idle < 1_000_000,
            "split {split}: the route went {idle} µs without a send with jobs waiting"
        );
        let share = counts[0] as f64 / sent;
        assert!(
            (share / (5.0 / 6.0) - 1.0).abs() <= 0.05,
            "split {split}: the raised tenant got {share:.3} of the sends, not 5/6: {counts:?}"
        );
    }
}

/// Two tenants of weight 1 with backlogs share a 30/s route; one is paused
/// for 5 s, then resumed. While it is paused the other has the whole
/// route (from a second after the pause), and once resumed it gets its
/// half again. (It stayed counted and
/// kept its share line: the route ran at half its rate while it was paused,
/// and after the resume its jobs, back as new, queued behind its stale line:
/// 2 sends in 30 s with 540 waiting, end to end.)
#[test]
fn a_paused_tenant_leaves_the_route_to_the_others_and_comes_back_to_its_share() {
    a_paused_tenant_leaves_the_route(false);
}

/// The same as on a Redis Cluster, where the tenant's slot that knows of
/// the pause cannot reach the route's keys: the route's send time given
/// back for the paused tenant's job takes it off the route. (Counted on, it
/// held the other to 15 of the route's 30/s for the whole pause.)
#[test]
fn as_on_a_cluster_a_paused_tenant_leaves_the_route_to_the_others() {
    a_paused_tenant_leaves_the_route(true);
}

fn a_paused_tenant_leaves_the_route(split: bool) {
    let (sends, jobs) = runtime().block_on(async {
        let (permits, quotas, route) = wide_tenants_on_a_30_per_second_route(split).await;
        let (tenants, jobs) = two_backlogs(["pa", "pb"], 600);
        let paused = tollgate_quota::Target::Tenant(tenants[1].clone());
        let live = Live {
            quotas: &quotas,
            changes: vec![
                (3_000_000, paused.clone(), tollgate_quota::Change::Pause),
                (8_000_000, paused, tollgate_quota::Change::Resume),
            ],
        };
        let sends = simulate_live(&permits, &route, &jobs, live).await;
        quotas.purge_prefix().await.unwrap();
        (sends, jobs)
    });
    assert_eq!(sends.len(), jobs.len(), "every job is sent once");
    let count = |from: u64, until: u64| sends_of_each(&sends, from..=until - 1);
    // Paused at 3 s: its last reservations go out within the horizon, and
    // the other's jobs, parked for places spaced for two, take about a
    // second to come back for the sooner ones.
    let paused = count(4_000_000, 8_000_000);
    assert_eq!(
        paused[1], 0,
        "split {split}: the paused tenant sent: {paused:?}"
    );
    let alone = count(5_000_000, 8_000_000);
    assert!(
        alone[0] as f64 >= 0.9 * 3.0 * 30.0 / 1.02,
        "split {split}: the other tenant had the route to itself and sent {alone:?} in 3 s"
    );
    // Resumed at 8 s: its jobs come back within the pause's recheck.
    let resumed = count(11_000_000, 16_000_000);
    let share = resumed[1] as f64 / (resumed[0] + resumed[1]) as f64;
    assert!(
        (share - 0.5).abs() <= 0.05,
        "split {split}: the resumed tenant got {share:.3} of the route: {resumed:?}"
    );
}

/// `GET key` through `redis-cli`, blocking the thread (and with it a
/// current-thread runtime) while it runs.
fn get_blocking(key: &str) -> String {
    let config = tollgate::Config::load(None).expect("TOLLGATE_* environment is valid");
    let out = std::process::Command::new("redis-cli")
        .args(["-u", config.redis_url.expose(), "--raw", "GET", key])
        .output()
        .expect("redis-cli runs");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A denial's time to ask again counts from when Redis made it, as a
/// grant's send time does, not from when the pod read the reply. Counted
/// from the read, a job held in its pod for its place came back as much
/// after it as the reply had waited (in Redis's socket, the batch, a busy
/// runtime); on a busy route its tenant's kept place had passed by then,
/// and the slot went unused.
#[tokio::test(flavor = "current_thread")]
async fn a_denial_counts_from_when_redis_made_it_however_late_the_pod_reads_it() {
    a_denial_read_late(false).await;
}

/// [`a_denial_counts_from_when_redis_made_it_however_late_the_pod_reads_it`]
/// for a denial by a route's slot (a Redis Cluster: `route.lua`).
#[tokio::test(flavor = "current_thread")]
async fn a_route_slots_denial_counts_from_when_redis_made_it_however_late_the_pod_reads_it() {
    a_denial_read_late(true).await;
}

/// A job back from a hop brings its time to come back, and keeps it
/// exactly, however many hops it makes. It used to bring the time left,
/// which the script counted from its own clock: each hop added the
/// request's way to Redis (the batch, the socket), and a backlog's later
/// jobs, several hops in, came back tens of ms past their places, which
/// the route had kept for them only a few ms.
#[tokio::test(flavor = "current_thread")]
async fn a_job_back_from_hops_keeps_its_time_to_the_millisecond() {
    a_place_kept_over_hops(false).await;
}

/// [`a_job_back_from_hops_keeps_its_time_to_the_millisecond`] for a place
/// kept by a route's slot (a Redis Cluster: `route.lua`).
#[tokio::test(flavor = "current_thread")]
async fn a_job_back_from_hops_keeps_its_time_on_a_route_slot_too() {
    a_place_kept_over_hops(true).await;
}

/// A 10/s tenant (with `split`, on a 100/s route whose keys live in
/// another slot, which the job asks first): one job granted, five denied
/// places in the tenant's line; the fifth comes back ten times, each time
/// well before its place.
async fn a_place_kept_over_hops(split: bool) {
    use tollgate_core::ports::{PermitStore, Returning};
    let ten_per_second = Quota::new("10/s".parse().unwrap(), 1).unwrap();
    let tenant = TenantId::parse("hopper").unwrap();
    let (permits, quotas, route) = if split {
        let (permits, quotas) = split_stores(ten_per_second);
        let route = Kind::parse("email").unwrap();
        set_quota(
            &quotas,
            tollgate_quota::Target::Route(route.clone()),
            Quota::new("100/s".parse().unwrap(), 1).unwrap(),
        )
        .await;
        (permits, quotas, route)
    } else {
        let (permits, quotas) = stores(ten_per_second);
        (permits, quotas, Kind::default_kind())
    };
    let (ids, keys) = jobs(0..6);
    let mut last = None;
    for i in 0..6 {
        last = Some(
            permits
                .acquire(request(&tenant, &route, &ids[i], &keys[i]))
                .await
                .unwrap(),
        );
    }
    let told = |d: tollgate_core::ports::Decided| match d.decision {
        PermitDecision::Denied {
            retry_in,
            interval,
            share_place,
            ..
        } => (d.made_at.saturating_add(retry_in), interval, share_place),
        other => panic!("split {split}: denied, not {other:?}"),
    };
    let (until, interval, share_place) = told(last.unwrap());
    for hop in 1..=10 {
        let back = PermitRequest {
            returning: Some(Returning {
                until,
                interval,
                share_place,
            }),
            ..request(&tenant, &route, &ids[5], &keys[5])
        };
        let (again, ..) = told(permits.acquire(back).await.unwrap());
        assert_eq!(
            again,
            until,
            "split {split}: back from hop {hop}, told to come back {} ms later than it was",
            again.0 - until.0
        );
    }
    quotas.purge_prefix().await.unwrap();
}

/// Three jobs of a 1/s tenant (or, `split`, of a tenant on a 1/s route
/// whose keys live in another slot): the first granted, the second denied
/// and read at once, the third denied and read 100 ms after Redis decided.
/// They must ask again a spacing apart, as their places are.
async fn a_denial_read_late(split: bool) {
    use tollgate_core::ports::PermitStore;
    let one_per_second = Quota::new("1/s".parse().unwrap(), 1).unwrap();
    let tenant = TenantId::parse("late-reader").unwrap();
    let (permits, quotas, route, line) = if split {
        let (permits, quotas) = split_stores(Quota::new("1000/s".parse().unwrap(), 1000).unwrap());
        let route = Kind::parse("email").unwrap();
        set_quota(
            &quotas,
            tollgate_quota::Target::Route(route.clone()),
            one_per_second,
        )
        .await;
        let line = quotas.keys().route_line(&route, &tenant);
        (permits, quotas, route, line)
    } else {
        let (permits, quotas) = stores(one_per_second);
        let line = quotas.keys().waiting(&tenant);
        (permits, quotas, Kind::default_kind(), line)
    };
    let ids: Vec<JobId> = (0..3)
        .map(|i| JobId::parse(format!("job-{i}")).unwrap())
        .collect();
    let keys: Vec<IdempotencyKey> = (0..3)
        .map(|i| IdempotencyKey::parse(format!("key-{i}")).unwrap())
        .collect();
    let ask = |i: usize| permits.acquire(request(&tenant, &route, &ids[i], &keys[i]));

    // Asks again at: when it was made, plus its retry (the pod's clock).
    let again = |d: tollgate_core::ports::Decided| match d.decision {
        PermitDecision::Denied { retry_in, .. } => d.made_at.saturating_add(retry_in).0,
        other => panic!("split {split}: denied, not {other:?}"),
    };
    assert!(matches!(
        ask(0).await.unwrap().decision,
        PermitDecision::Granted { .. }
    ));
    // The second job is read at once...
    let second = again(ask(1).await.unwrap());
    // ...the third 100 ms after Redis decided: the tenant's line moves
    // when it does, and the runtime is then blocked.
    let before = get_blocking(&line);
    let late_read = async {
        let since = std::time::Instant::now();
        loop {
            tokio::task::yield_now().await;
            assert!(
                since.elapsed() < Duration::from_secs(30),
                "split {split}: the third job's decision never moved its tenant's line"
            );
            if get_blocking(&line) != before {
                std::thread::sleep(Duration::from_millis(100));
                return;
            }
        }
    };
    let (third, ()) = tokio::join!(ask(2), late_read);
    let third = again(third.unwrap());
    // One spacing (1 s) apart, as their places are: read 100 ms late, the
    // third asked again 1.1 s after the second. (2 ms: the pod's clock
    // counts whole milliseconds, and rounds each up.)
    assert!(
        (third - second - 1_000).abs() <= 2,
        "split {split}: asks again {} ms after the job before it, whose place is 1 s before its own",
        third - second
    );
    quotas.purge_prefix().await.unwrap();
}
