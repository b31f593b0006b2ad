//! Property tests of the permit script's GCRA math, run in the real Redis
//! with injected time: whatever the request pattern, a quota of `rate` with
//! `burst` never grants more than rate × t + burst sends in any interval t.

use std::sync::Arc;
use std::time::Duration;

use proptest::prelude::*;
use tollgate_core::ports::PermitRequest;
use tollgate_core::{IdempotencyKey, JobId, Kind, PermitDecision, Quota, TenantId};
use tollgate_quota::{Keys, PermitSettings, QuotaStore, Redis, RedisPermits, Reply};

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
    }
}

/// Send times (µs) granted for requests arriving at `arrivals` (µs offsets).
async fn granted_sends(quota: Quota, arrivals: &[u64]) -> Vec<u64> {
    let config = tollgate::Config::load(None).expect("TOLLGATE_* environment is valid");
    let prefix = format!(
        "tgtest-gcra-{}",
        &uuid::Uuid::new_v4().simple().to_string()[..10]
    );
    let redis = Arc::new(Redis::new(&config.redis_settings()).unwrap());
    let permits = RedisPermits::new(Arc::clone(&redis), Keys::new(&prefix), settings(quota));
    let tenant = TenantId::parse("prop").unwrap();
    let route = Kind::default_kind();
    let mut sends = Vec::new();
    for (i, &offset) in arrivals.iter().enumerate() {
        let id = JobId::parse(format!("j{i}")).unwrap();
        let key = IdempotencyKey::from(&id);
        let req = PermitRequest {
            tenant: &tenant,
            route: &route,
            job_id: &id,
            key: &key,
            lease_token: "t",
            returning: None,
        };
        let now = T0 + offset;
        if let Reply::Decision(PermitDecision::Granted { delay, .. }) =
            permits.decide(req, 1, Some(now)).await.unwrap()
        {
            sends.push(now + delay.as_micros() as u64);
        }
    }
    QuotaStore::new(redis, Keys::new(&prefix))
        .purge_prefix()
        .await
        .unwrap();
    sends
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
