//! Fleet-wide quota: several workers, one Redis decision per job.

use std::time::Duration;

use tollgate_tests::{FakeProvider, TestEnv, fake_provider, max_in_window, wait_for};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_workers_sharing_ten_per_second_never_exceed_it() {
    let provider = FakeProvider::start(fake_provider::always_ok())
        .await
        .unwrap();
    let env = TestEnv::new(&provider.url()).await;
    env.set_quota("shared", "10/s", 1).await;
    let workers = [
        env.spawn_worker().await,
        env.spawn_worker().await,
        env.spawn_worker().await,
    ];
    env.publish("shared", 45, |_| {}).await;

    wait_for("45 sends", Duration::from_secs(60), || async {
        provider.accepted() >= 45
    })
    .await;
    let received = provider.received();
    assert_eq!(received.len(), 45, "each job sent once");
    let times: Vec<_> = received.iter().map(|r| r.instant).collect();
    let worst = max_in_window(&times, Duration::from_secs(1));
    assert!(
        worst <= 11,
        "{worst} requests in one 1 s window; the quota allows 10 (+1 at the edge)"
    );
    // Every worker took part: the limit held across processes, not inside one.
    for (i, w) in workers.iter().enumerate() {
        let sent = w
            .metrics
            .counter_sum("tollgate_jobs_completed_total", &[("outcome", "sent")]);
        assert!(sent > 0.0, "worker {i} sent nothing");
    }
    let denied: f64 = workers
        .iter()
        .map(|w| {
            w.metrics
                .counter_sum("tollgate_permit_decisions_total", &[("decision", "denied")])
        })
        .sum();
    assert!(denied > 0.0, "a 45-job backlog at 10/s must meet denials");
    for w in workers {
        w.stop().await.unwrap();
    }
    env.cleanup().await;
}

#[test]
fn window_counting_is_right() {
    let t0 = std::time::Instant::now();
    let at = |ms| t0 + Duration::from_millis(ms);
    let times = [at(0), at(500), at(999), at(1000), at(1001)];
    assert_eq!(max_in_window(&times, Duration::from_secs(1)), 4);
    assert_eq!(max_in_window(&[], Duration::from_secs(1)), 0);
}
