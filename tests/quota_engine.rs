//! The quota engine against the real Redis and RabbitMQ: route buckets,
//! live changes, pause and cancel, 429 feedback, concurrency, shadow quotas,
//! eligibility, and the admin API.

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use tollgate_core::{JobId, Kind, TenantId};
use tollgate_dev::fake_provider::Received;
use tollgate_quota::{Change, Target};
use tollgate_tests::{FakeProvider, Reply, TestEnv, fake_provider, max_in_window, wait_for};

fn quota(rate: &str, burst: u32) -> tollgate_core::Quota {
    tollgate_core::Quota::new(rate.parse().unwrap(), burst).unwrap()
}

fn tenant(name: &str) -> Target {
    Target::Tenant(TenantId::parse(name).unwrap())
}

fn sent_keys(received: &[Received]) -> HashSet<String> {
    received
        .iter()
        .filter(|r| r.status == 200)
        .map(|r| r.idempotency_key.clone())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_route_bucket_caps_two_tenants_together() {
    let provider = FakeProvider::start(fake_provider::always_ok())
        .await
        .unwrap();
    let env = TestEnv::new(&provider.url()).await;
    env.set_quota("left", "100/s", 5).await;
    env.set_quota("right", "100/s", 5).await;
    let route = Target::Route(Kind::default_kind());
    env.change(
        route,
        Change::SetQuota {
            quota: quota("10/s", 1),
            concurrency: None,
            weight: None,
            adaptive: None,
        },
    )
    .await;
    let worker = env.spawn_worker().await;
    env.publish("left", 30, |_| {}).await;
    env.publish("right", 30, |_| {}).await;

    wait_for("60 sends", Duration::from_secs(60), || async {
        provider.accepted() >= 60
    })
    .await;
    let received = provider.received();
    assert_eq!(sent_keys(&received).len(), 60);
    assert_eq!(received.len(), 60, "nothing sent twice");
    let times: Vec<Instant> = received.iter().map(|r| r.instant).collect();
    let worst = max_in_window(&times, Duration::from_secs(1));
    assert!(worst <= 11, "{worst} calls in one second on a 10/s route");
    for t in ["left", "right"] {
        assert!(received.iter().any(|r| r.tenant == t), "{t} was served");
    }
    worker.stop().await.unwrap();
    env.cleanup().await;
}

/// Requests per second over `[from, to)`.
fn rate_between(received: &[Received], from: Instant, to: Instant) -> f64 {
    let n = received
        .iter()
        .filter(|r| r.instant >= from && r.instant < to)
        .count();
    n as f64 / to.duration_since(from).as_secs_f64()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lowering_and_raising_a_quota_apply_at_once() {
    let provider = FakeProvider::start(fake_provider::always_ok())
        .await
        .unwrap();
    let env = TestEnv::new(&provider.url()).await;
    env.set_quota("live", "20/s", 1).await;
    let worker = env.spawn_worker().await;
    env.publish("live", 400, |_| {}).await;

    wait_for("the backlog to flow", Duration::from_secs(20), || async {
        provider.accepted() >= 40
    })
    .await;
    let lowered = Instant::now();
    env.set_quota("live", "5/s", 1).await;
    tokio::time::sleep(Duration::from_secs(5)).await;
    let raised = Instant::now();
    env.set_quota("live", "20/s", 1).await;
    tokio::time::sleep(Duration::from_secs(9)).await;

    let received = provider.received();
    // Once the change is visible (sends already reserved go out within the
    // permit horizon), no second holds more than the new rate + 1.
    let settled = lowered + env.horizon() + Duration::from_millis(50);
    let after_lowering: Vec<Instant> = received
        .iter()
        .map(|r| r.instant)
        .filter(|&t| t >= settled && t < raised)
        .collect();
    let worst = max_in_window(&after_lowering, Duration::from_secs(1));
    assert!(
        worst <= 6,
        "{worst} sends in one second after lowering to 5/s"
    );
    // Raising: the parked backlog comes back faster than the old 5/s
    // schedule would allow (every parked job re-asks within one 5 s hop).
    // Counted over 4 s: over 2 s, a few copies coming back together moved
    // the rate by a quarter.
    let old_schedule = rate_between(&received, lowered + Duration::from_secs(1), raised);
    let after_raise = rate_between(
        &received,
        raised + Duration::from_secs(5),
        raised + Duration::from_secs(9),
    );
    eprintln!("rate while lowered: {old_schedule:.1}/s; 5-9 s after the raise: {after_raise:.1}/s");
    assert!(old_schedule <= 5.5, "{old_schedule:.1}/s while lowered");
    assert!(
        after_raise > 2.0 * old_schedule,
        "after the raise the rate went from {old_schedule:.1}/s to only {after_raise:.1}/s"
    );
    assert_eq!(
        sent_keys(&received).len(),
        received.len(),
        "nothing sent twice"
    );
    worker.stop().await.unwrap();
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn paused_jobs_wait_resumed_jobs_go_and_cancelled_jobs_never_do() {
    let provider = FakeProvider::start(fake_provider::always_ok())
        .await
        .unwrap();
    let env = TestEnv::new(&provider.url()).await;
    env.set_quota("sleepy", "50/s", 5).await;
    env.change(tenant("sleepy"), Change::Pause).await;
    let worker = env
        .spawn_worker_with(|c| {
            c.pause_recheck_ms = 1_000;
        })
        .await;
    let jobs = env.publish("sleepy", 20, |_| {}).await;
    // Cancel two: one by id, one by idempotency key.
    let store = &env.quotas;
    let actor = tollgate_quota::Actor {
        who: "test".into(),
        source: "cli",
    };
    let sleepy = TenantId::parse("sleepy").unwrap();
    let ttl = Duration::from_secs(60);
    store
        .cancel(
            &sleepy,
            &tollgate_quota::Cancel::JobId(jobs[0].id.clone()),
            ttl,
            &actor,
        )
        .await
        .unwrap();
    store
        .cancel(
            &sleepy,
            &tollgate_quota::Cancel::Key(jobs[1].idempotency_key.clone()),
            ttl,
            &actor,
        )
        .await
        .unwrap();

    wait_for(
        "every job to be parked as paused",
        Duration::from_secs(10),
        || async {
            worker
                .metrics
                .counter_sum("tollgate_parked_total", &[("reason", "paused")])
                >= 20.0
        },
    )
    .await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(
        provider.received().is_empty(),
        "nothing is sent while paused"
    );
    assert_eq!(
        worker
            .metrics
            .counter_sum("tollgate_dead_letters_total", &[]),
        0.0
    );

    env.change(tenant("sleepy"), Change::Resume).await;
    wait_for("the 18 live jobs", Duration::from_secs(20), || async {
        provider.accepted() >= 18
    })
    .await;
    wait_for(
        "the 2 cancelled jobs to be skipped",
        Duration::from_secs(10),
        || async {
            worker
                .metrics
                .counter_sum("tollgate_jobs_completed_total", &[("outcome", "skipped")])
                == 2.0
        },
    )
    .await;
    let received = provider.received();
    assert_eq!(received.len(), 18, "each live job sent once");
    for cancelled in &jobs[..2] {
        assert!(
            received.iter().all(|r| r.job_id != cancelled.id.as_str()),
            "{} was cancelled",
            cancelled.id
        );
    }
    wait_for("queues to drain", Duration::from_secs(10), || async {
        env.pending().await == 0
    })
    .await;
    // The changes were audited.
    let history = store.history(Some(&tenant("sleepy")), 10).await.unwrap();
    let actions: Vec<&str> = history.iter().map(|e| e.action.as_str()).collect();
    assert_eq!(actions, ["resume", "cancel", "cancel", "pause", "set"]);
    assert!(history[3].new.paused && !history[3].old.paused);
    worker.stop().await.unwrap();
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_429_slows_every_worker_and_loses_nothing() {
    // The provider throttles the tenant once, 2 s long, on its 10th request.
    let storm_at = Arc::new(std::sync::Mutex::new(None::<Instant>));
    let seen = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let (storm, count) = (Arc::clone(&storm_at), Arc::clone(&seen));
    let provider = FakeProvider::start(Arc::new(move |r: &Received, _| {
        if count.fetch_add(1, std::sync::atomic::Ordering::SeqCst) == 9 {
            *storm.lock().unwrap() = Some(r.instant);
            return Reply::throttled("2");
        }
        Reply::ok()
    }))
    .await
    .unwrap();
    let env = TestEnv::new(&provider.url()).await;
    env.set_quota("stormy", "20/s", 1).await;
    let workers = [
        env.spawn_worker().await,
        env.spawn_worker().await,
        env.spawn_worker().await,
    ];
    env.publish("stormy", 60, |_| {}).await;

    wait_for("all 60 sent", Duration::from_secs(60), || async {
        provider.accepted() >= 60
    })
    .await;
    let storm = storm_at
        .lock()
        .unwrap()
        .expect("the provider throttled once");
    let received = provider.received();
    // Permits already granted when the 429 came may still go out (they were
    // reserved at most one permit horizon ahead, plus scheduling lateness on
    // a loaded machine); after that, no worker sends until Retry-After has
    // passed.
    let settled = storm + env.horizon() + Duration::from_millis(250);
    let during: Vec<&Received> = received
        .iter()
        .filter(|r| r.instant > settled && r.instant < storm + Duration::from_millis(1_900))
        .collect();
    assert!(
        during.is_empty(),
        "{} sends while the provider asked everyone to wait",
        during.len()
    );
    assert_eq!(sent_keys(&received).len(), 60, "every job sent");
    let throttled: f64 = workers
        .iter()
        .map(|w| {
            w.metrics.counter_sum(
                "tollgate_provider_requests_total",
                &[("outcome", "throttled")],
            )
        })
        .sum();
    assert_eq!(throttled, 1.0, "counted as throttled, not failed");
    let dead: f64 = workers
        .iter()
        .map(|w| w.metrics.counter_sum("tollgate_dead_letters_total", &[]))
        .sum();
    assert_eq!(dead, 0.0);
    for w in workers {
        w.stop().await.unwrap();
    }
    env.cleanup().await;
}

/// A quota set above what the provider allows learns the provider's limit:
/// the effective rate falls below the ceiling, every pod enforces it (the
/// later sends meet fewer 429s than the first), and nothing is lost or
/// sent twice on the way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_adaptive_quota_learns_the_providers_limit_and_loses_nothing() {
    let provider = FakeProvider::start(fake_provider::strict_limits(
        [("learner".to_owned(), 5)].into(),
    ))
    .await
    .unwrap();
    let env = TestEnv::new(&provider.url()).await;
    let ceiling = quota("20/s", 1);
    let adaptive = tollgate_core::Adaptive::new(ceiling.rate, None, None, None, None).unwrap();
    env.change(
        tenant("learner"),
        Change::SetQuota {
            quota: ceiling,
            concurrency: None,
            weight: None,
            adaptive: Some(adaptive),
        },
    )
    .await;
    let workers = [env.spawn_worker().await, env.spawn_worker().await];
    env.publish("learner", 100, |_| {}).await;
    wait_for("all 100 sent", Duration::from_secs(90), || async {
        provider.accepted() >= 100
    })
    .await;
    let received = provider.received();
    assert_eq!(sent_keys(&received).len(), 100, "every job sent");
    let accepted: Vec<&Received> = received.iter().filter(|r| r.status == 200).collect();
    assert_eq!(accepted.len(), 100, "none sent twice");
    let halfway = accepted[49].instant;
    let throttled = |early: bool| {
        received
            .iter()
            .filter(|r| r.status == 429 && (r.instant < halfway) == early)
            .count()
    };
    assert!(
        throttled(true) > 0,
        "the ceiling is above the provider's limit"
    );
    assert!(
        throttled(false) < throttled(true),
        "{} × 429 in the last 50 sends, {} in the first",
        throttled(false),
        throttled(true)
    );
    let learned = env.quotas.get(&tenant("learner")).await.unwrap().unwrap();
    let effective = learned.effective.unwrap();
    assert!(
        effective < 20.0 && effective >= adaptive.min.per_second(),
        "{learned:?}"
    );
    let reported = workers
        .iter()
        .filter_map(|w| {
            w.metrics
                .render()
                .lines()
                .find(|l| l.starts_with("tollgate_quota_effective_rate{tenant=\"learner\"}"))
                .and_then(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        })
        .collect::<Vec<_>>();
    assert!(
        !reported.is_empty() && reported.iter().all(|&r| r < 20.0),
        "{reported:?}"
    );
    for w in workers {
        let dead = w.metrics.counter_sum("tollgate_dead_letters_total", &[]);
        assert_eq!(dead, 0.0);
        w.stop().await.unwrap();
    }
    env.cleanup().await;
}

/// A pod whose one call slot is taken by a slow call must not send the
/// permits that came due meanwhile in a burst once it frees: each would
/// leave late and, with the sends after it on time, the provider's sliding
/// second would see more than the quota (before: 12 sends within 12 ms
/// after the slow call, then on time, and a 429). A permit past its leeway
/// is let go and the job asks again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn permits_that_came_due_while_the_pod_was_busy_are_not_sent_late() {
    const RATE: u32 = 20;
    const JOBS: u32 = 80;
    let strict = fake_provider::strict_limits([("busy".to_owned(), RATE)].into());
    let calls = AtomicUsize::new(0);
    let provider = FakeProvider::start(Arc::new(move |req: &Received, n: usize| {
        let reply = strict(req, n);
        // The 20th call takes 600 ms: the pod's only call slot is busy.
        if calls.fetch_add(1, Ordering::Relaxed) == 19 {
            reply.after(Duration::from_millis(600))
        } else {
            reply
        }
    }))
    .await
    .unwrap();
    let env = TestEnv::new(&provider.url()).await;
    env.set_quota("busy", &format!("{RATE}/s"), 1).await;
    let worker = env.spawn_worker_with(|c| c.concurrency = 1).await;
    env.publish("busy", JOBS, |_| {}).await;
    wait_for("every job sent", Duration::from_secs(60), || async {
        sent_keys(&provider.received()).len() >= JOBS as usize
    })
    .await;
    let received = provider.received();
    // Every call the provider saw, 429s included: what the quota bounds.
    let times: Vec<Instant> = received.iter().map(|r| r.instant).collect();
    let throttled = received.iter().filter(|r| r.status == 429).count();
    let late = worker
        .metrics
        .counter_sum("tollgate_late_permits_total", &[("tenant", "busy")]);
    eprintln!(
        "busy pod: {late} permit(s) let go late, {throttled} 429(s), most in 1 s {}",
        max_in_window(&times, Duration::from_secs(1))
    );
    assert!(late > 0.0, "the slow calls made permits late");
    assert_eq!(throttled, 0, "the provider never saw more than the quota");
    assert_eq!(sent_keys(&received).len(), JOBS as usize, "every job sent");
    assert_eq!(times.len(), JOBS as usize, "and each once");
    assert!(max_in_window(&times, Duration::from_secs(1)) <= RATE as usize);
    worker.stop().await.unwrap();
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrency_limits_in_flight_calls_across_the_fleet() {
    let provider = FakeProvider::start(fake_provider::slow_ok(Duration::from_millis(300)))
        .await
        .unwrap();
    let env = TestEnv::new(&provider.url()).await;
    env.change(
        tenant("narrow"),
        Change::SetQuota {
            quota: quota("100/s", 10),
            concurrency: Some(2),
            weight: None,
            adaptive: None,
        },
    )
    .await;
    let workers = [env.spawn_worker().await, env.spawn_worker().await];
    env.publish("narrow", 12, |_| {}).await;

    wait_for("12 sends", Duration::from_secs(30), || async {
        provider.accepted() >= 12
    })
    .await;
    tokio::time::sleep(Duration::from_millis(400)).await;
    let starts: Vec<Instant> = provider.received().iter().map(|r| r.instant).collect();
    // Each call lasts 300 ms: at most 2 may start within any 300 ms.
    let worst = max_in_window(&starts, Duration::from_millis(290));
    assert!(
        worst <= 2,
        "{worst} calls in flight at once with concurrency 2"
    );
    let limited: f64 = workers
        .iter()
        .map(|w| {
            w.metrics.counter_sum(
                "tollgate_permit_decisions_total",
                &[("decision", "concurrency")],
            )
        })
        .sum();
    assert!(limited > 0.0, "the limit was met");
    for w in workers {
        w.stop().await.unwrap();
    }
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shadow_quota_is_counted_but_not_enforced() {
    let provider = FakeProvider::start(fake_provider::always_ok())
        .await
        .unwrap();
    let env = TestEnv::new(&provider.url()).await;
    env.set_quota("trial", "200/s", 50).await;
    env.change(tenant("trial"), Change::SetShadow(quota("2/s", 1)))
        .await;
    let worker = env.spawn_worker().await;
    env.publish("trial", 30, |_| {}).await;
    wait_for("30 sends", Duration::from_secs(20), || async {
        provider.accepted() >= 30
    })
    .await;
    let m = &worker.metrics;
    let allow = m.counter_sum("tollgate_shadow_decisions_total", &[("decision", "allow")]);
    let deny = m.counter_sum("tollgate_shadow_decisions_total", &[("decision", "deny")]);
    // A permit whose slot passed before its call could start is asked for
    // again (a busy machine does this), and the shadow quota, like the
    // real one, judges each grant: so grants, not sends, are what it counts.
    let granted = m.counter_sum(
        "tollgate_permit_decisions_total",
        &[("decision", "allowed")],
    );
    assert_eq!(
        granted,
        30.0 + m.counter_sum("tollgate_late_permits_total", &[]),
        "one grant per send, and one more per grant let go late"
    );
    assert_eq!(
        allow + deny,
        granted,
        "every granted permit was judged by the shadow quota"
    );
    assert!(
        deny >= 25.0,
        "2/s would have denied most of a 30-job burst (denied {deny})"
    );
    assert_eq!(
        m.counter_sum("tollgate_permit_decisions_total", &[("decision", "denied")]),
        0.0
    );
    worker.stop().await.unwrap();
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_eligibility_webhook_skips_jobs_without_using_quota() {
    let provider = FakeProvider::start(fake_provider::always_ok())
        .await
        .unwrap();
    // The webhook says "no longer true" (410) for odd job numbers.
    let webhook = FakeProvider::start(Arc::new(|r: &Received, _| {
        let n: u32 = r
            .job_id
            .rsplit('-')
            .next()
            .and_then(|n| n.parse().ok())
            .unwrap_or(0);
        Reply::status(if n % 2 == 1 { 410 } else { 200 })
    }))
    .await
    .unwrap();
    let env = TestEnv::new(&provider.url()).await;
    env.set_quota("crm", "100/s", 10).await;
    let worker = env
        .spawn_worker_with(|c| {
            c.eligibility_url = Some(tollgate_core::SecretUrl::new(webhook.url()))
        })
        .await;
    for n in 0..10 {
        env.publish("crm", 1, |a| a.id = Some(format!("crm-job-{n}")))
            .await;
    }
    wait_for("5 skipped", Duration::from_secs(20), || async {
        worker
            .metrics
            .counter_sum("tollgate_jobs_completed_total", &[("outcome", "skipped")])
            == 5.0
    })
    .await;
    wait_for("5 sent", Duration::from_secs(20), || async {
        provider.accepted() >= 5
    })
    .await;
    let sent: Vec<String> = provider
        .received()
        .iter()
        .map(|r| r.job_id.clone())
        .collect();
    assert_eq!(sent.len(), 5);
    assert!(
        sent.iter()
            .all(|id| id.ends_with(['0', '2', '4', '6', '8'])),
        "{sent:?}"
    );
    assert_eq!(webhook.received().len(), 10, "asked once per job");
    // Skipped jobs took no permit. (A grant the pod was too busy to use
    // within its leeway is asked for again: it counts twice, once late.)
    let m = &worker.metrics;
    assert_eq!(
        m.counter_sum(
            "tollgate_permit_decisions_total",
            &[("decision", "allowed")]
        ),
        5.0 + m.counter_sum("tollgate_late_permits_total", &[])
    );
    worker.stop().await.unwrap();
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_admin_api_needs_the_right_token() {
    let env = TestEnv::new("http://127.0.0.1:9/unused").await;
    let addr = env.serve_admin("right-token-0123456789").await;
    let http = reqwest::Client::new();
    let url = |path: &str| format!("http://{addr}{path}");

    let none = http.get(url("/v1/quotas")).send().await.unwrap();
    assert_eq!(none.status(), 401);
    let wrong = http
        .get(url("/v1/quotas"))
        .bearer_auth("wrong-token")
        .send()
        .await
        .unwrap();
    assert_eq!(wrong.status(), 401);
    let put_wrong = http
        .put(url("/v1/tenants/acme/quota"))
        .bearer_auth("right-token-0123456789X")
        .json(&serde_json::json!({"rate": "1/s"}))
        .send()
        .await
        .unwrap();
    assert_eq!(put_wrong.status(), 401);
    assert!(
        env.quotas.get(&tenant("acme")).await.unwrap().is_none(),
        "nothing changed"
    );

    let ok = http
        .get(url("/v1/quotas"))
        .bearer_auth("right-token-0123456789")
        .send()
        .await
        .unwrap();
    assert_eq!(ok.status(), 200);
    for scheme in ["bearer", "BEARER"] {
        let any_case = http
            .get(url("/v1/quotas"))
            .header("authorization", format!("{scheme} right-token-0123456789"))
            .send()
            .await
            .unwrap();
        assert_eq!(
            any_case.status(),
            200,
            "the scheme is case-insensitive: {scheme}"
        );
    }
    let put = http
        .put(url("/v1/tenants/acme/quota"))
        .bearer_auth("right-token-0123456789")
        .header("x-tollgate-actor", "alice")
        .json(&serde_json::json!({"rate": "20/s", "burst": 2, "concurrency": 4}))
        .send()
        .await
        .unwrap();
    assert_eq!(put.status(), 200);
    let body: serde_json::Value = put.json().await.unwrap();
    assert_eq!(body["new"]["quota"]["rate"], "20/s");
    let stored = env.quotas.get(&tenant("acme")).await.unwrap().unwrap();
    assert_eq!(stored.quota, Some(quota("20/s", 2)));
    assert_eq!(stored.concurrency, Some(4));
    let history: serde_json::Value = http
        .get(url("/v1/history?target=tenant:acme"))
        .bearer_auth("right-token-0123456789")
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(history[0]["who"], "api:alice");
    assert_eq!(history[0]["source"], "api");
    let bad = http
        .put(url("/v1/tenants/acme/quota"))
        .bearer_auth("right-token-0123456789")
        .json(&serde_json::json!({"rate": "lots"}))
        .send()
        .await
        .unwrap();
    assert_eq!(bad.status(), 400);

    // A body or query axum cannot read, and an actor that cannot be
    // recorded as sent, get the same 400 with {"error"} as any bad input
    // (they were a plain-text 415 / 422, and a 200 recorded as `unknown`).
    let body_of = |body: &'static str, content_type: &'static str| {
        http.put(url("/v1/tenants/acme/quota"))
            .bearer_auth("right-token-0123456789")
            .header("content-type", content_type)
            .body(body)
            .send()
    };
    let as_actor = |name: &str| {
        http.put(url("/v1/tenants/acme/quota"))
            .bearer_auth("right-token-0123456789")
            .header("x-tollgate-actor", name)
            .json(&serde_json::json!({"rate": "1/s"}))
            .send()
    };
    let long_name = "n".repeat(65);
    let refusals = [
        (
            "unfinished JSON",
            body_of(r#"{"rate":"#, "application/json").await,
        ),
        (
            "no content type",
            body_of(r#"{"rate":"1/s"}"#, "text/plain").await,
        ),
        (
            "unknown field",
            body_of(r#"{"rat":"1/s"}"#, "application/json").await,
        ),
        (
            "bad query",
            http.get(url("/v1/history?limit=lots"))
                .bearer_auth("right-token-0123456789")
                .send()
                .await,
        ),
        ("blank actor", as_actor("   ").await),
        ("long actor", as_actor(&long_name).await),
        ("actor with a tab", as_actor("a\tb").await),
    ];
    for (what, refused) in refusals {
        let refused = refused.unwrap();
        assert_eq!(refused.status(), 400, "{what}");
        let body: serde_json::Value = refused.json().await.expect("a JSON error");
        assert!(
            body["error"].as_str().is_some_and(|e| !e.is_empty()),
            "{what}: {body}"
        );
    }
    let stored = env.quotas.get(&tenant("acme")).await.unwrap().unwrap();
    assert_eq!(stored.quota, Some(quota("20/s", 2)), "nothing changed");
    // A path or method the API does not have: 404 / 405, JSON too, and
    // only behind the token.
    let ask = |method: reqwest::Method, path: &str, token: &str| {
        http.request(method, url(path)).bearer_auth(token).send()
    };
    let token = "right-token-0123456789";
    for (method, path, status, says) in [
        (
            reqwest::Method::GET,
            "/v1/nope",
            404,
            "no endpoint GET /v1/nope",
        ),
        (
            reqwest::Method::DELETE,
            "/v1/history",
            405,
            "/v1/history does not take DELETE",
        ),
    ] {
        let answer = ask(method.clone(), path, token).await.unwrap();
        assert_eq!(answer.status(), status, "{method} {path}");
        let body: serde_json::Value = answer.json().await.expect("a JSON error");
        assert_eq!(body["error"], says);
        let stranger = ask(method.clone(), path, "wrong-token").await.unwrap();
        assert_eq!(stranger.status(), 401, "{method} {path} without the token");
    }

    // A weight: alone (the quota stays), audited; out of range or on a
    // route, a clear 400 and nothing changes.
    let put_weight = |path: &'static str, body: serde_json::Value| {
        http.put(url(path))
            .bearer_auth("right-token-0123456789")
            .header("x-tollgate-actor", "alice")
            .json(&body)
            .send()
    };
    let weighted = put_weight("/v1/tenants/acme/weight", serde_json::json!({"weight": 3}))
        .await
        .unwrap();
    assert_eq!(weighted.status(), 200);
    let body: serde_json::Value = weighted.json().await.unwrap();
    assert_eq!(body["old"]["weight"], 1);
    assert_eq!(body["new"]["weight"], 3);
    let stored = env.quotas.get(&tenant("acme")).await.unwrap().unwrap();
    assert_eq!(stored.weight, Some(3));
    assert_eq!(stored.quota, Some(quota("20/s", 2)), "the quota stays");
    for (path, body) in [
        ("/v1/tenants/acme/weight", serde_json::json!({"weight": 0})),
        (
            "/v1/tenants/acme/weight",
            serde_json::json!({"weight": 1001}),
        ),
        (
            "/v1/routes/email/quota",
            serde_json::json!({"rate": "9/s", "weight": 2}),
        ),
    ] {
        let refused = put_weight(path, body).await.unwrap();
        assert_eq!(refused.status(), 400, "{path}");
        let message = refused.text().await.unwrap();
        assert!(message.contains("weight"), "{message}");
    }
    // A concurrency of 0 reads as no limit in Redis: refused, not stored.
    let refused = put_weight(
        "/v1/tenants/acme/quota",
        serde_json::json!({"rate": "20/s", "concurrency": 0}),
    )
    .await
    .unwrap();
    assert_eq!(refused.status(), 400);
    let message = refused.text().await.unwrap();
    assert!(
        message.contains("concurrency must be at least 1"),
        "{message}"
    );
    assert_eq!(
        env.quotas
            .get(&tenant("acme"))
            .await
            .unwrap()
            .unwrap()
            .weight,
        Some(3)
    );
    let history = env.quotas.history(Some(&tenant("acme")), 1).await.unwrap();
    assert_eq!(history[0].action, "weight");
    assert_eq!(history[0].who, "api:alice");

    // An adaptive quota: the rate is the ceiling, and both come back.
    let adaptive = put_weight(
        "/v1/tenants/globex/quota",
        serde_json::json!({"rate": "20/s", "adaptive": {"min": "2/s"}}),
    )
    .await
    .unwrap();
    assert_eq!(adaptive.status(), 200);
    let body: serde_json::Value = adaptive.json().await.unwrap();
    assert_eq!(body["new"]["quota"]["rate"], "20/s");
    assert_eq!(body["new"]["adaptive"]["min"], "2/s");
    assert_eq!(body["new"]["adaptive"]["decrease"], 0.7);
    let shown: serde_json::Value = http
        .get(url("/v1/tenants/globex/quota"))
        .bearer_auth("right-token-0123456789")
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(
        shown["effective_rate_per_s"], 20.0,
        "nothing learned yet: the ceiling"
    );
    for (path, body, says) in [
        (
            "/v1/tenants/globex/quota",
            serde_json::json!({"rate": "20/s", "adaptive": {"min": "30/s"}}),
            "above the rate",
        ),
        (
            "/v1/tenants/globex/quota",
            serde_json::json!({"rate": "20/s", "adaptive": {"decrease": 1.5}}),
            "not between 0.1 and 0.95",
        ),
        (
            "/v1/tenants/globex/quota",
            serde_json::json!({"rate": "20/s", "adaptive": {"slow": true}}),
            "unknown field",
        ),
        (
            "/v1/default-quota",
            serde_json::json!({"rate": "20/s", "adaptive": {}}),
            "the default is shared",
        ),
    ] {
        let refused = put_weight(path, body).await.unwrap();
        assert!(refused.status().is_client_error(), "{path}");
        let message = refused.text().await.unwrap();
        assert!(message.contains(says), "{message}");
    }
    let stored = env.quotas.get(&tenant("globex")).await.unwrap().unwrap();
    assert_eq!(
        stored.adaptive.unwrap().min.to_string(),
        "2/s",
        "nothing changed"
    );
    // `quota export` writes it in the baseline's format, which reads back.
    let exported = tollgate_runtime::baseline::Baseline::export(&env.quotas)
        .await
        .unwrap();
    let entry = &exported.tenants["globex"];
    assert_eq!(entry.rate, "20/s");
    assert_eq!(entry.adaptive.as_ref().unwrap().min.as_deref(), Some("2/s"));
    assert!(
        exported
            .changes()
            .unwrap()
            .iter()
            .any(|(_, change, _)| matches!(
                change,
                Change::SetQuota { adaptive: Some(a), .. } if a.min.to_string() == "2/s"
            ))
    );
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_quota_baseline_survives_losing_redis_and_never_overrides_a_live_change() {
    let mut redis = tollgate_tests::PrivateRedis::start().await;
    let dir =
        std::env::temp_dir().join(format!("tgtest-baseline-{}", uuid::Uuid::new_v4().simple()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("quotas.toml");
    std::fs::write(
        &file,
        "[default]\nrate = \"3/s\"\n\n[tenants.acme]\nrate = \"7/s\"\nconcurrency = 2\n\n[routes.default]\nrate = \"50/s\"\n",
    )
    .unwrap();
    let (url, path) = (redis.url(), file.display().to_string());
    let env = TestEnv::new_with("http://127.0.0.1:9/unused", |c| {
        c.redis_url = tollgate_core::SecretUrl::new(url);
        c.quotas_file = Some(path);
        c.quota_seed_interval_ms = 200;
    })
    .await;
    let acme = tenant("acme");
    let stored = |target: Target| {
        let store = &env.quotas;
        async move {
            store
                .get(&target)
                .await
                .ok()
                .flatten()
                .and_then(|s| s.quota)
        }
    };
    let worker = env.spawn_worker().await;
    wait_for("the baseline seeded", Duration::from_secs(10), || async {
        stored(acme.clone()).await == Some(quota("7/s", 1))
    })
    .await;
    assert_eq!(
        stored(Target::Route(Kind::default_kind())).await,
        Some(quota("50/s", 1))
    );
    assert_eq!(stored(Target::Default).await, Some(quota("3/s", 1)));

    // A live change wins over the baseline…
    env.set_quota("acme", "9/s", 1).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(
        stored(acme.clone()).await,
        Some(quota("9/s", 1)),
        "seeding overwrote a live change"
    );

    // …until Redis loses everything: the baseline comes back by itself.
    redis.stop();
    redis.start_again().await;
    wait_for(
        "the baseline re-seeded",
        Duration::from_secs(15),
        || async { stored(acme.clone()).await == Some(quota("7/s", 1)) },
    )
    .await;
    let history = env.quotas.history(Some(&acme), 5).await.unwrap();
    assert_eq!(history[0].who, "baseline");
    assert_eq!(
        env.quotas.get(&acme).await.unwrap().unwrap().concurrency,
        Some(2)
    );

    // export writes the live state in the baseline's format.
    env.set_quota("acme", "11/s", 2).await;
    let exported = tollgate_runtime::baseline::Baseline::export(&env.quotas)
        .await
        .unwrap();
    assert_eq!(exported.tenants["acme"].rate, "11/s");
    assert_eq!(exported.tenants["acme"].burst, 2);
    assert_eq!(exported.routes["default"].rate, "50/s");
    // and seed --overwrite is the deliberate reset.
    let baseline = tollgate_runtime::baseline::Baseline::load(&file.display().to_string()).unwrap();
    baseline.seed(&env.quotas, true).await.unwrap();
    assert_eq!(stored(acme.clone()).await, Some(quota("7/s", 1)));

    // A deliberate delete sticks: the seeder (every 200 ms) does not bring
    // the quota back, and the delete says why…
    env.change(acme.clone(), Change::Delete).await;
    assert!(env.quotas.in_baseline(&acme).await.unwrap());
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    assert_eq!(
        stored(acme.clone()).await,
        None,
        "a deleted quota came back"
    );
    // …until the baseline's entry for it changes (the file is re-read).
    std::fs::write(
        &file,
        "[default]\nrate = \"3/s\"\n\n[tenants.acme]\nrate = \"8/s\"\n\n[routes.default]\nrate = \"50/s\"\n",
    )
    .unwrap();
    wait_for(
        "the changed entry seeded",
        Duration::from_secs(10),
        || async { stored(acme.clone()).await == Some(quota("8/s", 1)) },
    )
    .await;
    worker.stop().await.unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_ceiling_caps_one_pod_below_generous_quotas() {
    let provider = FakeProvider::start(fake_provider::always_ok())
        .await
        .unwrap();
    let env = TestEnv::new(&provider.url()).await;
    for t in ["one", "two"] {
        env.set_quota(t, "200/s", 20).await;
    }
    // The fleet would allow 400/s; this pod allows itself 5/s.
    let worker = env
        .spawn_worker_with(|c| c.pod_max_rate = Some("5/s".into()))
        .await;
    env.publish("one", 10, |_| {}).await;
    env.publish("two", 10, |_| {}).await;
    wait_for("20 sends", Duration::from_secs(30), || async {
        provider.accepted() >= 20
    })
    .await;
    let times: Vec<Instant> = provider.received().iter().map(|r| r.instant).collect();
    let worst = max_in_window(&times, Duration::from_secs(1));
    assert!(
        worst <= 6,
        "{worst} calls in one second from a pod capped at 5/s"
    );
    assert_eq!(sent_keys(&provider.received()).len(), 20);
    worker.stop().await.unwrap();
    env.cleanup().await;
}

/// A cancellation once expired after 7 days, so a job due in 30 days was
/// sent anyway. Now it waits for its job (`cancel_ttl_s`, 400 days), and
/// once the job is seen and skipped it is kept as long as a sent record, so
/// another copy of the job is skipped too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancel_outlives_its_job_and_every_copy_of_it() {
    let provider = FakeProvider::start(fake_provider::always_ok())
        .await
        .unwrap();
    let env = TestEnv::new(&provider.url()).await;
    let keys = env.quotas.keys().clone();
    let acme = TenantId::parse("acme").unwrap();
    let cancel = |id: &str| {
        let args = tollgate::cli::CancelArgs {
            tenant: "acme".into(),
            job_id: Some(id.into()),
            idempotency_key: None,
        };
        let config = env.config.clone();
        async move {
            let actor = tollgate::cli::cli_actor(Some("test")).unwrap();
            tollgate::cli::cancel(&config, &args, &actor).await
        }
    };

    let later = env
        .publish("acme", 1, |a| {
            a.due_in = Some(Duration::from_secs(30 * 86_400))
        })
        .await;
    cancel(later[0].id.as_str()).await.unwrap();
    let kept = tollgate_tests::pttl(&env.config, &keys.cancelled_id(&acme, &later[0].id)).await;
    let due_in_ms = 30 * 86_400 * 1000;
    assert!(
        kept > due_in_ms + 86_400 * 1000,
        "the cancel of a job due in 30 days must outlive it by a margin; kept {kept} ms"
    );

    let worker = env.spawn_worker().await;
    // Cancelled before it is even published: the cancel waits for it.
    cancel("due-now").await.unwrap();
    env.publish("acme", 1, |a| a.id = Some("due-now".into()))
        .await;
    wait_for("the job to be skipped", Duration::from_secs(20), || async {
        worker
            .metrics
            .counter_sum("tollgate_jobs_completed_total", &[("outcome", "skipped")])
            >= 1.0
    })
    .await;
    let key = keys.cancelled_id(&acme, &JobId::parse("due-now").unwrap());
    let kept = tollgate_tests::pttl(&env.config, &key).await;
    let sent_ttl_ms = (env.config.sent_ttl_s * 1000) as i64;
    assert!(
        kept > 0 && kept <= sent_ttl_ms,
        "seen: kept as long as a sent record ({sent_ttl_ms} ms), got {kept}"
    );
    // Another copy of the same job (a producer retry) is skipped too.
    env.publish("acme", 1, |a| a.id = Some("due-now".into()))
        .await;
    wait_for(
        "the copy to be skipped",
        Duration::from_secs(20),
        || async {
            worker
                .metrics
                .counter_sum("tollgate_jobs_completed_total", &[("outcome", "skipped")])
                >= 2.0
        },
    )
    .await;
    assert!(provider.received().is_empty(), "nothing cancelled was sent");
    worker.stop().await.unwrap();
    env.cleanup().await;
}

/// An installation from before each target kept its own baseline mark kept
/// them all in one hash. Such a mark still counts (a quota deleted then is
/// not seeded back), and the first seed of the target carries it over.
#[tokio::test]
async fn a_baseline_mark_kept_in_the_older_hash_still_counts() {
    let env = TestEnv::new("http://127.0.0.1:9/unused").await;
    let acme = tenant("acme");
    let actor = tollgate_quota::Actor {
        who: "baseline".into(),
        source: "baseline",
    };
    let seven = || Change::SetQuota {
        quota: quota("7/s", 1),
        concurrency: None,
        weight: None,
        adaptive: None,
    };
    let legacy = tollgate_quota::Keys::new(&env.config.prefix).legacy_baseline_marks();
    let redis = tollgate_quota::Redis::new(&env.config.redis_settings()).unwrap();
    let mut conn = redis.conn().await.unwrap();
    tollgate_quota::redis_cmd("HSET")
        .arg(&legacy)
        .arg(acme.label())
        .arg("entry-1")
        .query_async::<()>(&mut conn)
        .await
        .unwrap();
    assert!(env.quotas.in_baseline(&acme).await.unwrap());

    let seeded = |fingerprint: &'static str| {
        let (quotas, acme, actor) = (&env.quotas, &acme, &actor);
        async move {
            quotas
                .seed(acme, seven(), fingerprint, false, actor)
                .await
                .unwrap()
        }
    };
    assert!(!seeded("entry-1").await, "a deleted quota was seeded back");
    assert_eq!(env.quotas.get(&acme).await.unwrap(), None);
    // Carried over: gone from the old hash, and it still counts.
    let still_there: bool = tollgate_quota::redis_cmd("HEXISTS")
        .arg(&legacy)
        .arg(acme.label())
        .query_async(&mut conn)
        .await
        .unwrap();
    assert!(!still_there);
    assert!(env.quotas.in_baseline(&acme).await.unwrap());
    assert!(!seeded("entry-1").await, "a deleted quota was seeded back");
    // A changed entry is seeded, audited and listed.
    assert!(seeded("entry-2").await);
    assert_eq!(
        env.quotas.get(&acme).await.unwrap().and_then(|s| s.quota),
        Some(quota("7/s", 1))
    );
    let history = env.quotas.history(Some(&acme), 5).await.unwrap();
    assert_eq!(history.len(), 1);
    assert_eq!(
        (history[0].who.as_str(), history[0].source.as_str()),
        ("baseline", "baseline")
    );
    let listed: Vec<String> = env
        .quotas
        .tenants()
        .await
        .unwrap()
        .into_iter()
        .map(|(t, _)| t.to_string())
        .collect();
    assert_eq!(listed, vec!["acme".to_string()]);
    env.cleanup().await;
}

/// The history is read a page at a time from the newest entry: a target's
/// entries are found however many others came after them, in order, and
/// the answer stops at the limit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_targets_history_is_found_under_thousands_of_newer_entries() {
    let set_rate = |rate: u32| Change::SetQuota {
        quota: quota(&format!("{rate}/s"), 1),
        concurrency: None,
        weight: None,
        adaptive: None,
    };
    let env = TestEnv::new("http://127.0.0.1:9/unused").await;
    for rate in 1..=3 {
        env.change(tenant("quiet"), set_rate(rate)).await;
    }
    for rate in 1..=2500 {
        env.change(tenant("busy"), set_rate(rate)).await;
    }

    let rates = |entries: Vec<tollgate_quota::AuditEntry>| -> Vec<String> {
        entries
            .iter()
            .map(|e| e.new.quota.unwrap().rate.to_string())
            .collect()
    };
    let quiet = env
        .quotas
        .history(Some(&tenant("quiet")), 10)
        .await
        .unwrap();
    assert_eq!(
        rates(quiet),
        ["3/s", "2/s", "1/s"],
        "newest first, all of them"
    );
    let busy = env.quotas.history(Some(&tenant("busy")), 2).await.unwrap();
    assert_eq!(rates(busy), ["2500/s", "2499/s"]);
    assert_eq!(env.quotas.history(None, 5).await.unwrap().len(), 5);
    let everything = env.quotas.history(None, 10_000).await.unwrap();
    assert_eq!(everything.len(), 2503, "the whole stream, once");
    env.cleanup().await;
}
