//! Provider failures: retries with backoff end as `exhausted`, other 4xx
//! as `rejected` at once, and a 429 parks the job until Retry-After.

use std::time::{Duration, Instant};

use std::sync::Arc;
use tollgate_tests::{FakeProvider, Reply, TestEnv, wait_for};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failures_retry_then_exhaust_rejections_stop_and_429s_wait() {
    let provider = FakeProvider::start(Arc::new(
        |req: &tollgate_tests::Received, earlier: usize| match req.tenant.as_str() {
            "flaky" => Reply::status(500),
            // Answers too late for the worker's 300 ms timeout (and not 2xx,
            // so it never counts as a send here either).
            "timeout" => Reply::status(503).after(Duration::from_secs(3)),
            "gone" => Reply::status(408),
            "bad" => Reply::status(422),
            "busy" if earlier == 0 => Reply::throttled("1"),
            // Down for maintenance, and says for how long.
            "down" if earlier == 0 => Reply {
                retry_after: Some("3".into()),
                ..Reply::status(503)
            },
            _ => Reply::ok(),
        },
    ))
    .await
    .unwrap();
    let env = TestEnv::new(&provider.url()).await;
    let worker = env.spawn_worker_with(|c| c.provider_timeout_ms = 300).await;
    for tenant in ["flaky", "timeout", "gone", "bad", "busy", "down"] {
        env.publish(tenant, 1, |_| {}).await;
    }

    wait_for("four dead letters", Duration::from_secs(30), || async {
        env.dead_letters().await.len() >= 4
    })
    .await;
    for tenant in ["busy", "down"] {
        wait_for(
            "the throttled and the unavailable job to be sent",
            Duration::from_secs(30),
            || async {
                provider
                    .received()
                    .iter()
                    .any(|r| r.tenant == tenant && r.status == 200)
            },
        )
        .await;
    }

    let received = provider.received();
    let calls =
        |tenant: &str| -> Vec<_> { received.iter().filter(|r| r.tenant == tenant).collect() };
    for tenant in ["flaky", "timeout", "gone"] {
        let attempts: Vec<u32> = calls(tenant).iter().map(|r| r.attempt).collect();
        assert_eq!(
            attempts,
            [1, 2, 3],
            "{tenant}: max_attempts = 3, numbered in the header"
        );
    }
    assert_eq!(calls("bad").len(), 1, "a 422 is not retried");

    let busy = calls("busy");
    assert_eq!(busy.len(), 2, "429 once, then sent");
    assert_eq!(busy[0].status, 429);
    assert_eq!(busy[1].status, 200);
    assert_eq!(busy[1].attempt, 1, "a 429 does not burn an attempt");
    let waited = busy[1].instant.duration_since(busy[0].instant);
    assert!(
        waited >= Duration::from_secs(1),
        "Retry-After: 1 honoured, waited {waited:?}"
    );

    // A 503's Retry-After is a floor for the next attempt (the backoff
    // alone retried it within a second, and a maintenance window used up
    // every attempt).
    let down = calls("down");
    assert_eq!(down.len(), 2);
    assert_eq!((down[0].status, down[1].attempt), (503, 2));
    let waited = down[1].instant.duration_since(down[0].instant);
    assert!(
        waited >= Duration::from_secs(3),
        "Retry-After: 3 on a 503 honoured, waited {waited:?}"
    );

    let letters = env.dead_letters().await;
    // The dead letter says what the last attempt met: whether the provider
    // may have done the job decides whether a replay is safe.
    let detail_of = |tenant: &str| {
        letters
            .iter()
            .find(|l| l.tenant == tenant)
            .map(|l| l.detail.clone())
            .unwrap_or_default()
    };
    assert_eq!(
        detail_of("flaky"),
        "gave up after 3 failed attempts; the last: provider answered 500"
    );
    assert!(
        detail_of("timeout")
            .ends_with("no answer within the provider timeout (it may have done it)"),
        "{}",
        detail_of("timeout")
    );
    let reason_of = |tenant: &str| {
        letters
            .iter()
            .find(|l| l.tenant == tenant)
            .map(|l| l.reason.clone())
            .unwrap_or_default()
    };
    assert_eq!(reason_of("flaky"), "exhausted");
    assert_eq!(reason_of("timeout"), "exhausted");
    assert_eq!(reason_of("gone"), "exhausted");
    assert_eq!(reason_of("bad"), "rejected");
    assert_eq!(letters.len(), 4);

    let m = &worker.metrics;
    assert_eq!(
        m.counter_sum(
            "tollgate_provider_requests_total",
            &[("outcome", "throttled")]
        ),
        1.0
    );
    assert_eq!(
        m.counter_sum("tollgate_provider_requests_total", &[("outcome", "failed")]),
        10.0
    );
    assert_eq!(
        m.counter_sum(
            "tollgate_provider_requests_total",
            &[("outcome", "rejected")]
        ),
        1.0
    );
    wait_for("queues to drain", Duration::from_secs(10), || async {
        env.pending().await == 0
    })
    .await;
    worker.stop().await.unwrap();
    env.cleanup().await;
}

/// A redirect is an answer, not an instruction: following a 302 would turn
/// the POST into a GET and lose the payload; following a 307/308 would
/// re-post the payload and its `Idempotency-Key` to whatever host the
/// provider names. Both are dead-lettered as `rejected`, with the status
/// and the `Location` in the detail.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redirect_is_rejected_and_never_followed() {
    let elsewhere = FakeProvider::start(tollgate_tests::fake_provider::always_ok())
        .await
        .unwrap();
    let other_host = elsewhere.url();
    let provider =
        FakeProvider::start(Arc::new(move |req: &tollgate_tests::Received, _| match req
            .tenant
            .as_str()
        {
            "moved" => Reply::redirect(302, "/elsewhere"),
            "moved-away" => Reply::redirect(307, &other_host),
            _ => Reply::redirect(308, &other_host),
        }))
        .await
        .unwrap();
    let env = TestEnv::new(&provider.url()).await;
    let worker = env.spawn_worker().await;
    for tenant in ["moved", "moved-away", "moved-for-good"] {
        env.publish(tenant, 3, |a| a.payload = r#"{"to":"x"}"#.into())
            .await;
    }

    wait_for("nine dead letters", Duration::from_secs(30), || async {
        env.dead_letters().await.len() >= 9
    })
    .await;
    let letters = env.dead_letters().await;
    assert_eq!(letters.len(), 9);
    for letter in &letters {
        assert_eq!(letter.reason, "rejected", "{letter:?}");
        let (status, location) = match letter.tenant.as_str() {
            "moved" => ("302", "/elsewhere".to_owned()),
            "moved-away" => ("307", elsewhere.url()),
            _ => ("308", elsewhere.url()),
        };
        assert!(
            letter.detail.contains(status)
                && letter.detail.contains(&format!("Location: {location}")),
            "the detail names the status and Location: {letter:?}"
        );
    }
    let received = provider.received();
    assert_eq!(received.len(), 9, "each job called the provider once");
    assert!(
        received
            .iter()
            .all(|r| r.method == "POST" && r.path == "/send"),
        "no redirect followed on the provider's host: {:?}",
        received
            .iter()
            .map(|r| format!("{} {}", r.method, r.path))
            .collect::<Vec<_>>()
    );
    assert!(
        elsewhere.received().is_empty(),
        "nothing (no payload, no Idempotency-Key) reached the host a redirect named"
    );
    let m = &worker.metrics;
    assert_eq!(
        m.counter_sum("tollgate_jobs_completed_total", &[("outcome", "sent")]),
        0.0,
        "a redirect is never a send"
    );
    worker.stop().await.unwrap();
    env.cleanup().await;
}

/// A 429's Retry-After is a floor for every later send of the tenant,
/// whatever its burst (a bucket with burst 5 once let sends through four
/// intervals early), including sends this pod had already reserved; and
/// `Retry-After: 0` or a date in the past pauses `min_retry_after_ms`, never
/// retrying at once without using an attempt.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_send_before_retry_after_whatever_the_burst_or_the_header() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let bursty_calls = Arc::new(AtomicUsize::new(0));
    let calls = Arc::clone(&bursty_calls);
    let past = tollgate_core::outcome::http_date(tollgate_core::UnixMillis(0));
    let provider = FakeProvider::start(Arc::new(
        move |req: &tollgate_tests::Received, earlier: usize| match req.tenant.as_str() {
            // The sixth call, once the burst of five is spent and sends are
            // spaced 100 ms apart, so none is in flight beside it.
            "bursty" if calls.fetch_add(1, Ordering::SeqCst) == 5 => Reply::throttled("2"),
            "zero" if earlier < 3 => Reply::throttled("0"),
            "past" if earlier < 3 => Reply::throttled(&past),
            _ => Reply::ok(),
        },
    ))
    .await
    .unwrap();
    let env = TestEnv::new(&provider.url()).await;
    env.set_quota("bursty", "10/s", 5).await;
    let worker = env.spawn_worker().await;
    env.publish("bursty", 20, |_| {}).await;
    env.publish("zero", 1, |_| {}).await;
    env.publish("past", 1, |_| {}).await;

    wait_for("every job sent", Duration::from_secs(60), || async {
        provider.accepted() >= 22
    })
    .await;
    let received = provider.received();
    let of = |tenant: &str| -> Vec<&tollgate_tests::Received> {
        received.iter().filter(|r| r.tenant == tenant).collect()
    };
    let bursty = of("bursty");
    let throttled = bursty
        .iter()
        .find(|r| r.status == 429)
        .expect("the sixth call was throttled");
    let resume = throttled.instant + Duration::from_secs(2);
    let early: Vec<Duration> = bursty
        .iter()
        .filter(|r| r.instant > throttled.instant && r.instant < resume)
        .map(|r| resume - r.instant)
        .collect();
    assert!(
        early.is_empty(),
        "sends before Retry-After ended, by {early:?} (burst 5)"
    );
    assert_eq!(bursty.iter().filter(|r| r.status == 200).count(), 20);

    let min = Duration::from_millis(env.config.min_retry_after_ms);
    for tenant in ["zero", "past"] {
        let calls = of(tenant);
        assert_eq!(calls.len(), 4, "{tenant}: three 429s, then sent");
        for pair in calls.windows(2) {
            let gap = pair[1].instant - pair[0].instant;
            assert!(
                gap >= min,
                "{tenant}: retried {gap:?} after a 429, under the {min:?} floor"
            );
        }
        assert!(
            calls.iter().all(|r| r.attempt == 1),
            "{tenant}: a 429 uses no attempt"
        );
    }
    worker.stop().await.unwrap();
    env.cleanup().await;
}

/// A provider that reads each request whole and, the first time, closes the
/// connection without answering, as one that crashed (or whose proxy cut the
/// line) while it worked on the request; it answers 200 to every request
/// after. Returns its URL and, per request, when it came and its attempt.
async fn provider_cutting_the_first_call() -> (String, Arc<std::sync::Mutex<Vec<(Instant, String)>>>)
{
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/send", listener.local_addr().unwrap());
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let log = Arc::clone(&seen);
    tokio::spawn(async move {
        while let Ok((mut socket, _)) = listener.accept().await {
            let log = Arc::clone(&log);
            tokio::spawn(async move {
                let mut request = Vec::new();
                let mut buf = [0u8; 4096];
                // Headers, then the body its Content-Length announces.
                let (head, length) = loop {
                    let Ok(n) = socket.read(&mut buf).await else {
                        return;
                    };
                    if n == 0 {
                        return;
                    }
                    request.extend_from_slice(&buf[..n]);
                    if let Some(end) = request.windows(4).position(|w| w == b"\r\n\r\n") {
                        let head = String::from_utf8_lossy(&request[..end]).to_lowercase();
                        let length = head
                            .lines()
                            .find_map(|l| l.strip_prefix("content-length:"))
                            .and_then(|v| v.trim().parse::<usize>().ok())
                            .unwrap_or(0);
                        break (end + 4, length);
                    }
                };
                while request.len() < head + length {
                    let Ok(n) = socket.read(&mut buf).await else {
                        return;
                    };
                    if n == 0 {
                        return;
                    }
                    request.extend_from_slice(&buf[..n]);
                }
                let text = String::from_utf8_lossy(&request[..head]).to_lowercase();
                let attempt = text
                    .lines()
                    .find_map(|l| l.strip_prefix("x-tollgate-attempt:"))
                    .map(|v| v.trim().to_owned())
                    .unwrap_or_default();
                let first = {
                    let mut log = log.lock().unwrap();
                    log.push((Instant::now(), attempt));
                    log.len() == 1
                };
                if !first {
                    let _ = socket
                        .write_all(
                            b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\nconnection: close\r\n\r\n",
                        )
                        .await;
                }
                // The first: dropped here, unanswered.
            });
        }
    });
    (url, seen)
}

/// A connection that breaks after the request went out may have reached a
/// provider that is still working on it: like a timeout, its lease is kept
/// until it expires, so no copy with the same key calls meanwhile. Retried
/// at once (0.1–0.8 s later, found in review), a provider that answers
/// "key in use" (409) to an overlap had the job dead-lettered as
/// `rejected` while it finished it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_cut_after_the_request_went_out_is_retried_after_its_lease() {
    let (url, seen) = provider_cutting_the_first_call().await;
    let env = TestEnv::new(&url).await;
    let worker = env.spawn_worker_with(|c| c.provider_timeout_ms = 300).await;
    env.publish("cut", 1, |_| {}).await;
    wait_for("the retried call", Duration::from_secs(30), || async {
        seen.lock().unwrap().len() >= 2
    })
    .await;
    wait_for("the job to settle", Duration::from_secs(10), || async {
        env.pending().await == 0
    })
    .await;
    let seen = seen.lock().unwrap().clone();
    assert_eq!(seen.len(), 2, "cut once, then sent");
    assert_eq!((seen[0].1.as_str(), seen[1].1.as_str()), ("1", "2"));
    let waited = seen[1].0.duration_since(seen[0].0);
    // The lease: the provider timeout (300 ms) and 5 s.
    assert!(
        waited >= Duration::from_millis(5_000),
        "retried {waited:?} after the cut call"
    );
    assert!(env.dead_letters().await.is_empty());
    worker.stop().await.unwrap();
    env.cleanup().await;
}

/// A 503 that says when to call again holds the job's key that long, not
/// only its parked copy: another copy of the job (here published again
/// once the 503 is recorded, as when the park's confirm is lost with the
/// connection and the original is redelivered) waits for it too. It was
/// called 2 s after a `Retry-After: 4`, the moment the lease was released.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_503s_retry_after_holds_every_copy_of_the_job() {
    let provider = FakeProvider::start(Arc::new(|_: &tollgate_tests::Received, earlier: usize| {
        if earlier == 0 {
            Reply {
                retry_after: Some("3".into()),
                ..Reply::status(503)
            }
        } else {
            Reply::ok()
        }
    }))
    .await
    .unwrap();
    let env = TestEnv::new(&provider.url()).await;
    let worker = env.spawn_worker().await;
    let same_job = |args: &mut tollgate::cli::PublishArgs| {
        args.id = Some("maintenance-1".into());
    };
    env.publish("maint", 1, same_job).await;
    wait_for("the 503", Duration::from_secs(10), || async {
        !provider.received().is_empty()
    })
    .await;
    // The 503's completion is recorded a round trip after the answer.
    tokio::time::sleep(Duration::from_millis(500)).await;
    env.publish("maint", 1, same_job).await;
    wait_for("the job to be sent", Duration::from_secs(30), || async {
        provider.received().iter().any(|r| r.status == 200)
    })
    .await;
    wait_for("both copies to settle", Duration::from_secs(10), || async {
        env.pending().await == 0
    })
    .await;
    let received = provider.received();
    assert_eq!(
        received.iter().filter(|r| r.status == 200).count(),
        1,
        "sent once: {received:?}"
    );
    assert_eq!(received[0].status, 503);
    for later in &received[1..] {
        let waited = later.instant.duration_since(received[0].instant);
        assert!(
            waited >= Duration::from_secs(3),
            "a copy called {waited:?} after a 503 with Retry-After: 3"
        );
    }
    worker.stop().await.unwrap();
    env.cleanup().await;
}
