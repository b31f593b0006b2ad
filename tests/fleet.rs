//! Eight `tollgate worker` processes share one tenant quota.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use tollgate_tests::{
    FakeProvider, TestEnv, WorkerProcess, fake_provider, max_in_window, wait_for,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eight_worker_processes_share_one_quota_of_twenty_per_second() {
    // A strict provider: more than 20 accepted in any second gets 429.
    let provider = FakeProvider::start_punctual(fake_provider::strict_limits(HashMap::from([(
        "fleet".to_owned(),
        20,
    )])))
    .await
    .unwrap();
    let env = TestEnv::new(&provider.url()).await;
    env.set_quota("fleet", "20/s", 1).await;
    let workers: Vec<WorkerProcess> = (0..8)
        .map(|_| WorkerProcess::spawn(&env, &provider.url(), &[]))
        .collect();
    for w in &workers {
        w.ready().await;
    }
    let jobs = env.publish("fleet", 400, |_| {}).await;
    let started = Instant::now();

    wait_for("400 sends", Duration::from_secs(90), || async {
        provider.accepted() >= 400
    })
    .await;
    let took = started.elapsed();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let received = provider.received();
    let times: Vec<Instant> = received.iter().map(|r| r.instant).collect();
    let worst = max_in_window(&times, Duration::from_secs(1));
    let throttled = received.iter().filter(|r| r.status == 429).count();
    eprintln!(
        "8 processes, 400 jobs at 20/s: {:.1} s, {:.1}/s, max {worst} in any 1 s, {throttled} × 429",
        took.as_secs_f64(),
        400.0 / took.as_secs_f64()
    );
    assert!(
        worst <= 21,
        "{worst} requests in one second at a 20/s quota"
    );
    let mut accepted: Vec<&str> = received
        .iter()
        .filter(|r| r.status == 200)
        .map(|r| r.idempotency_key.as_str())
        .collect();
    accepted.sort();
    let before = accepted.len();
    accepted.dedup();
    assert_eq!(before, accepted.len(), "a job was sent twice");
    assert_eq!(accepted.len(), jobs.len(), "every job sent");
    wait_for("queues to drain", Duration::from_secs(10), || async {
        env.pending().await == 0
    })
    .await;
    drop(workers);
    env.cleanup().await;
}
