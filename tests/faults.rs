//! Faults injected by the tests themselves, on this machine only: whatever
//! dies, no job is lost, none is sent twice, and the fleet recovers by
//! itself. Every test states its accounting:
//! published = sent + dead-lettered + skipped, repeated effects = 0.
//!
//! The RabbitMQ restart stops the shared broker, so it is `#[ignore]`d here
//! and run alone in the serial phase of `make test`
//! (`cargo test --test faults -- --ignored --test-threads=1`).

use std::collections::HashSet;
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::time::{Duration, Instant};

use tollgate_tests::{
    FakeProvider, PrivateRedis, Received, Reply, TestEnv, WorkerProcess, effects, fake_provider,
    tollgate_bin, wait_for,
};

fn ids(jobs: &[tollgate_core::Job]) -> HashSet<String> {
    jobs.iter().map(|j| j.idempotency_key.to_string()).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_of_one_worker_mid_run_loses_nothing() {
    let provider = FakeProvider::start(fake_provider::always_ok())
        .await
        .unwrap();
    let env = TestEnv::new(&provider.url()).await;
    env.set_quota("crashy", "200/s", 20).await;
    let timeout = [("TOLLGATE_PROVIDER_TIMEOUT_MS", "2000")];
    let mut workers: Vec<WorkerProcess> = (0..3)
        .map(|_| WorkerProcess::spawn(&env, &provider.url(), &timeout))
        .collect();
    for w in &workers {
        w.ready().await;
    }
    let jobs = env.publish("crashy", 1000, |_| {}).await;

    wait_for("a third of the run", Duration::from_secs(60), || async {
        provider.accepted() >= 330
    })
    .await;
    let victim = workers.remove(0);
    assert!(
        Command::new("kill")
            .args(["-9", &victim.child.id().to_string()])
            .status()
            .unwrap()
            .success()
    );
    drop(victim);
    let replacement = WorkerProcess::spawn(&env, &provider.url(), &timeout);
    replacement.ready().await;

    wait_for("every job's effect", Duration::from_secs(90), || async {
        effects(&provider.received()).0.len() >= 1000
    })
    .await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let (sent, repeats) = effects(&provider.received());
    let dead = env.dead_letters().await.len();
    eprintln!(
        "kill -9: published 1000 = sent {} + dead-lettered {dead}; repeated requests {repeats}",
        sent.len()
    );
    assert_eq!(sent, ids(&jobs), "published = sent");
    assert_eq!(dead, 0);
    // A job the killed worker had sent but not yet recorded is sent again
    // with the same Idempotency-Key (the provider performs it once); only
    // calls in flight at the kill can be in that window.
    assert!(repeats <= 64, "{repeats} repeated requests");
    // What the killed worker held came back to the others, each counted as
    // a delivery handed out again (toward the delivery limit).
    let mut redelivered = 0.0;
    for w in workers.iter().chain([&replacement]) {
        redelivered += w.metric_sum("tollgate_redelivered_total{").await;
    }
    assert!(redelivered >= 1.0, "{redelivered} redelivered counted");
    wait_for("queues to drain", Duration::from_secs(10), || async {
        env.pending().await == 0
    })
    .await;
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_down_means_no_call_then_everything_once_it_returns() {
    let mut redis = PrivateRedis::start().await;
    let provider = FakeProvider::start(fake_provider::always_ok())
        .await
        .unwrap();
    let url = redis.url();
    // The quota comes from config: a restarted Redis has lost what was stored.
    let env = TestEnv::new_with(&provider.url(), |c| {
        c.redis_url = tollgate_core::SecretUrl::new(url);
        c.default_rate = "100/s".into();
        c.default_burst = 10;
    })
    .await;
    let worker = env.spawn_worker().await;
    let jobs = env.publish("fragile", 300, |_| {}).await;

    wait_for("the run to start", Duration::from_secs(30), || async {
        provider.accepted() >= 80
    })
    .await;
    redis.stop();
    let down = Instant::now();
    wait_for(
        "/readyz to see Redis gone",
        Duration::from_secs(10),
        || async { !worker.worker.readiness().await.redis },
    )
    .await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let up = Instant::now();
    redis.start_again().await;

    wait_for("every job's effect", Duration::from_secs(60), || async {
        effects(&provider.received()).0.len() >= 300
    })
    .await;
    let received = provider.received();
    // Calls already permitted when Redis died (reserved at most one permit
    // horizon ahead, answered at once) may finish; after that, none until it
    // is back.
    let settled = down + env.horizon() + Duration::from_millis(250);
    let while_down: Vec<&Received> = received
        .iter()
        .filter(|r| r.instant > settled && r.instant < up)
        .collect();
    assert!(
        while_down.is_empty(),
        "{} provider calls while Redis was down",
        while_down.len()
    );
    let (sent, repeats) = effects(&received);
    eprintln!(
        "redis restart: published 300 = sent {} + dead-lettered 0; repeats {repeats}",
        sent.len()
    );
    assert_eq!(sent, ids(&jobs));
    assert_eq!(repeats, 0);
    assert!(env.dead_letters().await.is_empty());
    assert!(worker.worker.readiness().await.ready(), "ready again");
    worker.stop().await.unwrap();
    env.cleanup().await;
}

/// Deterministic per (key, attempt): about 30 % answer 500 and 5 % time out.
fn chaos(r: &Received, _: usize) -> Reply {
    let mut h: u64 = 1469598103934665603;
    for b in r.idempotency_key.bytes().chain([r.attempt as u8]) {
        h = (h ^ u64::from(b)).wrapping_mul(1099511628211);
    }
    match h % 100 {
        0..30 => Reply::status(500),
        30..35 => Reply::status(503).after(Duration::from_secs(2)),
        _ => Reply::ok(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flaky_provider_ends_every_job_sent_or_exhausted() {
    let provider = FakeProvider::start(Arc::new(chaos)).await.unwrap();
    let env = TestEnv::new(&provider.url()).await;
    env.set_quota("flaky", "500/s", 50).await;
    let worker = env
        .spawn_worker_with(|c| {
            c.provider_timeout_ms = 300;
            c.max_attempts = 3;
        })
        .await;
    let jobs = env.publish("flaky", 200, |_| {}).await;

    let m = &worker.metrics;
    wait_for("every job to end", Duration::from_secs(60), || async {
        m.counter_sum("tollgate_jobs_completed_total", &[]) >= 200.0
    })
    .await;
    let (sent, repeats) = effects(&provider.received());
    let letters = env.dead_letters().await;
    let dead: HashSet<String> = letters.iter().map(|l| l.job_id.clone()).collect();
    eprintln!(
        "flaky provider: published 200 = sent {} + dead-lettered {} (all exhausted); repeats {repeats}",
        sent.len(),
        dead.len()
    );
    assert!(
        letters.iter().all(|l| l.reason == "exhausted"),
        "only exhausted"
    );
    assert!(sent.is_disjoint(&dead));
    assert_eq!(
        sent.union(&dead).cloned().collect::<HashSet<_>>(),
        ids(&jobs),
        "nothing lost"
    );
    assert_eq!(repeats, 0);
    assert_eq!(
        m.counter_sum("tollgate_jobs_completed_total", &[("outcome", "sent")]),
        sent.len() as f64
    );
    assert_eq!(
        m.counter_sum("tollgate_dead_letters_total", &[("reason", "exhausted")]),
        dead.len() as f64
    );
    assert!(
        !dead.is_empty() && sent.len() > 150,
        "the mix is as designed"
    );
    worker.stop().await.unwrap();
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_drains_within_the_grace_period_and_loses_nothing() {
    let provider = FakeProvider::start(fake_provider::always_ok())
        .await
        .unwrap();
    let env = TestEnv::new(&provider.url()).await;
    env.set_quota("steady", "20/s", 1).await;
    let grace = Duration::from_secs(8);
    let settings = [("TOLLGATE_SHUTDOWN_GRACE_MS", "8000")];
    let mut first = WorkerProcess::spawn(&env, &provider.url(), &settings);
    first.ready().await;
    let jobs = env.publish("steady", 150, |_| {}).await;

    wait_for("the run to start", Duration::from_secs(30), || async {
        provider.accepted() >= 40
    })
    .await;
    let asked = Instant::now();
    assert!(
        Command::new("kill")
            .args(["-TERM", &first.child.id().to_string()])
            .status()
            .unwrap()
            .success()
    );
    let status = tokio::task::spawn_blocking(move || first.child.wait().unwrap())
        .await
        .unwrap();
    let took = asked.elapsed();
    eprintln!(
        "SIGTERM: exited {status} after {} ms (grace {} ms)",
        took.as_millis(),
        grace.as_millis()
    );
    assert!(status.success(), "a drained shutdown exits 0");
    assert!(took < grace, "exited after {took:?}");

    let second = WorkerProcess::spawn(&env, &provider.url(), &[]);
    second.ready().await;
    wait_for("every job's effect", Duration::from_secs(60), || async {
        effects(&provider.received()).0.len() >= 150
    })
    .await;
    let (sent, repeats) = effects(&provider.received());
    eprintln!(
        "SIGTERM: published 150 = sent {} + dead-lettered 0; repeats {repeats}",
        sent.len()
    );
    assert_eq!(sent, ids(&jobs));
    assert_eq!(repeats, 0);
    assert!(env.dead_letters().await.is_empty());
    drop(second);
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_that_kills_its_worker_ends_as_poison_and_the_rest_flow() {
    // The provider kills the worker process calling it about job "poison".
    let victim = Arc::new(AtomicU32::new(0));
    let pid = Arc::clone(&victim);
    let provider = FakeProvider::start(Arc::new(move |r: &Received, _| {
        if r.job_id == "poison" {
            let target = pid.load(Ordering::SeqCst);
            let _ = Command::new("kill")
                .args(["-9", &target.to_string()])
                .status();
            return Reply::status(500);
        }
        Reply::ok()
    }))
    .await
    .unwrap();
    let env = TestEnv::new_with(&provider.url(), |c| c.delivery_limit = 3).await;
    env.set_quota("mixed", "100/s", 10).await;
    let settings = [
        ("TOLLGATE_DELIVERY_LIMIT", "3"),
        ("TOLLGATE_PROVIDER_TIMEOUT_MS", "1000"),
    ];
    env.publish("mixed", 1, |a| a.id = Some("poison".into()))
        .await;

    // Like a Deployment: whenever the worker dies, start another.
    let mut crashes = 0;
    let started = Instant::now();
    let mut worker = WorkerProcess::spawn(&env, &provider.url(), &settings);
    victim.store(worker.child.id(), Ordering::SeqCst);
    while env.dead_letters().await.is_empty() {
        assert!(
            started.elapsed() < Duration::from_secs(90),
            "the poison never reached the DLQ"
        );
        if worker.child.try_wait().unwrap().is_some() {
            crashes += 1;
            worker = WorkerProcess::spawn(&env, &provider.url(), &settings);
            victim.store(worker.child.id(), Ordering::SeqCst);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let letters = env.dead_letters().await;
    assert_eq!(letters.len(), 1);
    assert_eq!(letters[0].job_id, "poison");
    assert_eq!(letters[0].reason, "poison");
    eprintln!(
        "poison: dead-lettered after {crashes} crashed workers ({})",
        letters[0].detail
    );

    worker.ready().await;
    let jobs = env.publish("mixed", 30, |_| {}).await;
    wait_for("the other jobs", Duration::from_secs(30), || async {
        provider.accepted() >= 30
    })
    .await;
    let (sent, repeats) = effects(&provider.received());
    eprintln!(
        "poison: published 31 = sent {} + dead-lettered 1; repeats {repeats}",
        sent.len()
    );
    assert_eq!(sent, ids(&jobs));
    assert_eq!(repeats, 0);
    assert!(
        worker.child.try_wait().unwrap().is_none(),
        "the worker keeps serving"
    );
    drop(worker);
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dlq_replay_sends_replayed_jobs_once_and_purge_empties_it() {
    let healthy = Arc::new(AtomicBool::new(false));
    let ok = Arc::clone(&healthy);
    let provider = FakeProvider::start(Arc::new(move |_: &Received, _| {
        Reply::status(if ok.load(Ordering::SeqCst) { 200 } else { 422 })
    }))
    .await
    .unwrap();
    let env = TestEnv::new(&provider.url()).await;
    env.set_quota("fixme", "100/s", 10).await;
    let worker = env.spawn_worker().await;
    let jobs = env.publish("fixme", 10, |_| {}).await;
    wait_for("10 rejected", Duration::from_secs(20), || async {
        env.dead_letters().await.len() >= 10
    })
    .await;

    healthy.store(true, Ordering::SeqCst);
    let cli = |args: &[&str]| {
        let out = Command::new(tollgate_bin())
            .args(args)
            .env("TOLLGATE_PREFIX", &env.config.prefix)
            .env("TOLLGATE_SHARDS", env.config.shards.to_string())
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    };
    let out = cli(&["dlq", "replay", "--reason", "exhausted"]);
    assert!(
        out.starts_with("replayed 0 dead letter(s); 10 left"),
        "{out}"
    );
    // A limit stops the sweep at its last letter; the rest stay.
    let out = cli(&["dlq", "replay", "--reason", "rejected", "--limit", "4"]);
    assert!(
        out.starts_with("replayed 4 dead letter(s); 6 left"),
        "{out}"
    );
    let out = cli(&[
        "dlq", "replay", "--reason", "rejected", "--tenant", "fixme", "--actor", "dana",
    ]);
    assert!(
        out.starts_with("replayed 6 dead letter(s); 0 left"),
        "{out}"
    );
    wait_for("10 sent", Duration::from_secs(20), || async {
        provider.accepted() >= 10
    })
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let (sent, repeats) = effects(&provider.received());
    assert_eq!(
        sent,
        ids(&jobs),
        "published 10 = sent 10 (after replay) + dead-lettered 0"
    );
    assert_eq!(repeats, 0);
    let replayed: Vec<u32> = provider
        .received()
        .iter()
        .filter(|r| r.status == 200)
        .map(|r| r.attempt)
        .collect();
    assert!(
        replayed.iter().all(|&a| a == 1),
        "attempts start over: {replayed:?}"
    );
    assert!(env.dead_letters().await.is_empty());

    // Purge: refuses without --yes when nobody can confirm, empties with it.
    env.publish_raw("fixme", b"not a job").await;
    wait_for("a dead letter", Duration::from_secs(10), || async {
        env.dead_letters().await.len() == 1
    })
    .await;
    let refused = Command::new(tollgate_bin())
        .args(["dlq", "purge"])
        .env("TOLLGATE_PREFIX", &env.config.prefix)
        .env("TOLLGATE_SHARDS", env.config.shards.to_string())
        .stdin(std::process::Stdio::null())
        .output()
        .unwrap();
    assert!(!refused.status.success());
    assert!(String::from_utf8_lossy(&refused.stderr).contains("pass --yes"));
    assert_eq!(env.dead_letters().await.len(), 1);
    let out = cli(&["dlq", "purge", "--yes", "--actor", "dana"]);
    assert!(out.starts_with("purged 1 dead letter(s)"), "{out}");
    assert!(env.dead_letters().await.is_empty());

    // Each replay and the purge is in the audit stream, as the API's are.
    let audit = env.quotas.history(None, 10).await.unwrap();
    let dlq: Vec<_> = audit
        .iter()
        .filter(|e| e.target == "dlq")
        .map(|e| {
            (
                e.action.as_str(),
                e.who.as_str(),
                e.detail.as_deref().unwrap_or(""),
            )
        })
        .collect();
    assert_eq!(dlq.len(), 4, "{dlq:?}");
    assert_eq!(dlq[0], ("purge", "cli:dana", "purged 1"));
    assert_eq!(
        dlq[1],
        (
            "replay",
            "cli:dana",
            "replayed 6 (reason rejected, tenant fixme); 0 left"
        )
    );
    assert_eq!(dlq[2].2, "replayed 4 (reason rejected, tenant any); 6 left");
    assert_eq!(
        dlq[3].2,
        "replayed 0 (reason exhausted, tenant any); 10 left"
    );
    assert!(
        dlq.iter().all(|(_, who, _)| who.starts_with("cli:")),
        "{dlq:?}"
    );
    worker.stop().await.unwrap();
    env.cleanup().await;
}

/// Leaves the shared broker running whatever happens in the test.
struct RestartGuard;

impl Drop for RestartGuard {
    fn drop(&mut self) {
        let _ = Command::new("rabbitmqctl")
            .args(["-q", "start_app"])
            .status();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "stops the shared RabbitMQ: run alone (make test runs it in its serial phase)"]
async fn a_rabbitmq_restart_is_survived_without_restarting_workers() {
    let provider = FakeProvider::start(fake_provider::always_ok())
        .await
        .unwrap();
    let mut env = TestEnv::new(&provider.url()).await;
    env.set_quota("restart", "100/s", 10).await;
    let workers = [env.spawn_worker().await, env.spawn_worker().await];
    let jobs = env.publish("restart", 400, |_| {}).await;

    wait_for("the run to start", Duration::from_secs(30), || async {
        provider.accepted() >= 80
    })
    .await;
    let _guard = RestartGuard;
    assert!(
        Command::new("rabbitmqctl")
            .args(["-q", "stop_app"])
            .status()
            .unwrap()
            .success()
    );
    for w in &workers {
        let worker = &w.worker;
        wait_for(
            "/readyz to see RabbitMQ gone",
            Duration::from_secs(15),
            || async { !worker.readiness().await.ready() },
        )
        .await;
    }
    // A producer publishing while the broker is down retries until it is back.
    let producer = Command::new(tollgate_bin())
        .args(["publish", "--tenant", "restart", "--count", "100"])
        .env("TOLLGATE_PREFIX", &env.config.prefix)
        .env("TOLLGATE_SHARDS", env.config.shards.to_string())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // Long enough for the workers' reconnect backoff to reach its ceiling.
    tokio::time::sleep(Duration::from_secs(10)).await;
    assert!(
        Command::new("rabbitmqctl")
            .args(["-q", "start_app"])
            .status()
            .unwrap()
            .success()
    );
    let back = Instant::now();
    let back_to_work = futures::future::join_all(workers.iter().map(|w| async move {
        wait_for(
            "the worker to consume again",
            Duration::from_secs(60),
            || async { w.worker.readiness().await.consuming },
        )
        .await;
        back.elapsed()
    }))
    .await;
    eprintln!(
        "rabbitmq restart: workers consuming again {back_to_work:?} after the broker was back"
    );
    let published = tokio::task::spawn_blocking(move || producer.wait_with_output().unwrap())
        .await
        .unwrap();
    let stderr = String::from_utf8_lossy(&published.stderr).into_owned();
    let retries = stderr.matches("retrying").count();
    assert!(published.status.success(), "{stderr}");
    assert!(retries > 0, "the producer met the outage");

    wait_for("every job's effect", Duration::from_secs(120), || async {
        effects(&provider.received()).0.len() >= 500
    })
    .await;
    for w in &workers {
        let worker = &w.worker;
        wait_for(
            "the worker to consume again",
            Duration::from_secs(30),
            || async { worker.readiness().await.ready() },
        )
        .await;
    }
    let (sent, repeats) = effects(&provider.received());
    env.reconnect().await;
    let dead = env.dead_letters().await.len();
    eprintln!(
        "rabbitmq restart: published 500 = sent {} + dead-lettered {dead}; repeats {repeats}; producer retried {retries}x",
        sent.len()
    );
    assert_eq!(sent.len(), 500);
    assert!(ids(&jobs).is_subset(&sent));
    assert_eq!(dead, 0);
    assert_eq!(repeats, 0);
    env.stop_when_drained(workers).await;
}

/// `dlq list` used to peek by fetch-and-requeue, which raises a quorum
/// queue's delivery count: a dead queue with a delivery limit (RabbitMQ 4.x
/// gives every quorum queue 20) dropped a dead letter listed 20 times. The
/// dead queue is declared here as 4.x would, then listed 30 times and
/// swept by 5 replays that select nothing: every letter is still there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn listing_dead_letters_never_wears_them_out() {
    use tollgate_amqp::lapin::options::{
        QueueBindOptions, QueueDeclareOptions, QueueDeleteOptions,
    };
    use tollgate_amqp::lapin::types::{AMQPValue, FieldTable, LongString};

    let env = TestEnv::new("http://127.0.0.1:9/unused").await;
    let topology = env.broker.topology().clone();
    let (conn, channel) = env.raw_channel().await;
    let dead = topology.dead_queue();
    channel
        .queue_delete(dead.as_str().into(), QueueDeleteOptions::default())
        .await
        .unwrap();
    let mut args = FieldTable::default();
    args.insert(
        "x-queue-type".into(),
        AMQPValue::LongString(LongString::from("quorum")),
    );
    args.insert("x-delivery-limit".into(), AMQPValue::LongLongInt(20));
    let durable = QueueDeclareOptions {
        durable: true,
        ..Default::default()
    };
    channel
        .queue_declare(dead.as_str().into(), durable, args)
        .await
        .unwrap();
    channel
        .queue_bind(
            dead.as_str().into(),
            topology.dead_letter_exchange().as_str().into(),
            "".into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    conn.close(200, "declared".into()).await.unwrap();

    let mut ids = Vec::new();
    for i in 0..6 {
        let id = format!("dead-{i}");
        let mut headers = FieldTable::default();
        tollgate_amqp::headers::set_text(&mut headers, tollgate_amqp::headers::REASON, "rejected");
        let body = format!(r#"{{"id":"{id}","tenant":"acme"}}"#);
        let props = tollgate_amqp::job_properties().with_headers(headers);
        env.broker
            .publish(
                &topology.dead_letter_exchange(),
                "acme",
                body.as_bytes(),
                props,
            )
            .await
            .unwrap();
        ids.push(id);
    }

    let cli = |args: &[&str]| {
        let out = Command::new(tollgate_bin())
            .args(args)
            .env("TOLLGATE_PREFIX", &env.config.prefix)
            .env("TOLLGATE_SHARDS", env.config.shards.to_string())
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    };
    for _ in 0..30 {
        let out = cli(&["dlq", "list"]);
        assert!(out.contains(": 6 dead letter(s)"), "{out}");
    }
    for _ in 0..5 {
        let out = cli(&["dlq", "replay", "--tenant", "nobody"]);
        assert!(
            out.starts_with("replayed 0 dead letter(s); 6 left"),
            "{out}"
        );
    }
    let left: Vec<String> = env
        .dead_letters()
        .await
        .into_iter()
        .map(|l| l.job_id)
        .collect();
    assert_eq!(left, ids, "every dead letter kept, in order");
    assert_eq!(env.broker.queue_depth(&dead).await.unwrap(), 6);
    env.cleanup().await;
}

/// Long enough for an in-flight lease (provider timeout 2 s + 5 s in the
/// tests) to expire: a copy handed back before its send was recorded would
/// be sent again by now.
const PAST_THE_LEASE: Duration = Duration::from_secs(8);

/// A provider call cannot be taken back. The per-delivery timeout used to
/// hand a delivery back in the middle of its call (the provider answering
/// 2xx after it), so the copy was sent again once its lease expired. Now the
/// call, the record and the ack run to the end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_timeout_never_interrupts_a_send_it_began() {
    let provider = FakeProvider::start(fake_provider::slow_ok(Duration::from_millis(1_500)))
        .await
        .unwrap();
    let env = TestEnv::new(&provider.url()).await;
    let worker = env.spawn_worker_with(|c| c.delivery_timeout_ms = 500).await;
    let jobs = env.publish("slow", 3, |_| {}).await;
    wait_for("three sends", Duration::from_secs(30), || async {
        provider.accepted() >= 3
    })
    .await;
    tokio::time::sleep(PAST_THE_LEASE).await;
    let (sent, repeats) = effects(&provider.received());
    eprintln!(
        "timeout during a send: published 3 = sent {} + dead-lettered 0; repeats {repeats}",
        sent.len()
    );
    assert_eq!(sent, ids(&jobs));
    assert_eq!(
        repeats, 0,
        "a send interrupted by its timeout was sent again"
    );
    assert_eq!(env.pending().await, 0);
    assert!(env.dead_letters().await.is_empty());
    worker.stop().await.unwrap();
    env.cleanup().await;
}

/// Shutdown used to abort deliveries still running at the end of the grace
/// period, provider calls included: the copy went back to the queue and
/// another worker sent it again once its lease expired. Now shutdown stops
/// beginning calls late in the grace period and waits for those begun.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_never_abandons_a_send_it_began() {
    let provider = FakeProvider::start(fake_provider::slow_ok(Duration::from_millis(1_500)))
        .await
        .unwrap();
    let env = TestEnv::new(&provider.url()).await;
    let first = env.spawn_worker_with(|c| c.shutdown_grace_ms = 300).await;
    let jobs = env.publish("slow", 3, |_| {}).await;
    wait_for("calls in flight", Duration::from_secs(20), || async {
        provider.received().len() >= 3
    })
    .await;
    first
        .stop()
        .await
        .expect("calls begun are settled, nothing left unsettled");
    let (sent, _) = effects(&provider.received());
    assert_eq!(
        sent,
        ids(&jobs),
        "the calls begun were answered and recorded"
    );
    let second = env.spawn_worker().await;
    tokio::time::sleep(PAST_THE_LEASE).await;
    let (sent, repeats) = effects(&provider.received());
    eprintln!(
        "shutdown during a send: published 3 = sent {} + dead-lettered 0; repeats {repeats}",
        sent.len()
    );
    assert_eq!(repeats, 0, "a send abandoned by shutdown was sent again");
    assert_eq!(env.pending().await, 0);
    second.stop().await.unwrap();
    env.cleanup().await;
}

/// An outage is not the job's fault. While Redis was down a held job asked
/// again every second in the same delivery until `delivery_timeout_ms`
/// handed it back, which counted toward its delivery limit: an outage of a
/// few timeouts turned healthy jobs into `poison`. Now the waits grow (with
/// jitter) and are parked, so a delivery never loops.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_redis_outage_turns_no_job_into_poison() {
    let mut redis = PrivateRedis::start().await;
    let provider = FakeProvider::start(fake_provider::always_ok())
        .await
        .unwrap();
    let url = redis.url();
    let env = TestEnv::new_with(&provider.url(), |c| {
        c.redis_url = tollgate_core::SecretUrl::new(url);
        c.default_rate = "100/s".into();
        c.default_burst = 10;
        c.delivery_limit = 2;
        c.delivery_timeout_ms = 2_000;
    })
    .await;
    let worker = env.spawn_worker().await;
    redis.stop();
    let jobs = env.publish("patient", 20, |_| {}).await;
    // Five delivery timeouts: enough, before, for every held job to be
    // handed back past its delivery limit of 2.
    tokio::time::sleep(Duration::from_secs(10)).await;
    assert!(provider.received().is_empty(), "no call without a permit");
    redis.start_again().await;
    wait_for("every job's effect", Duration::from_secs(60), || async {
        effects(&provider.received()).0.len() >= 20
    })
    .await;
    let (sent, repeats) = effects(&provider.received());
    let dead = env.dead_letters().await;
    eprintln!(
        "10 s Redis outage: published 20 = sent {} + dead-lettered {}; repeats {repeats}",
        sent.len(),
        dead.len()
    );
    assert!(dead.is_empty(), "an outage made poison: {dead:?}");
    assert_eq!(sent, ids(&jobs));
    assert_eq!(repeats, 0);
    worker.stop().await.unwrap();
    env.cleanup().await;
}

/// What someone deletes under a running worker in [`delete_delay_tiers`].
enum Deleted {
    Exchanges,
    Queues,
}

/// Someone deletes every delay tier's exchange, or its queue (the two share
/// the tier's name), under the running workers.
async fn delete_delay_tiers(env: &TestEnv, what: Deleted) {
    use tollgate_amqp::lapin::options::{ExchangeDeleteOptions, QueueDeleteOptions};

    let (conn, channel) = env.raw_channel().await;
    let topology = env.broker.topology().clone();
    for tier in env.config.tiers().unwrap().all() {
        let name = topology.tier(*tier);
        match what {
            Deleted::Exchanges => {
                channel
                    .exchange_delete(name.as_str().into(), ExchangeDeleteOptions::default())
                    .await
            }
            Deleted::Queues => channel
                .queue_delete(name.as_str().into(), QueueDeleteOptions::default())
                .await
                .map(drop),
        }
        .unwrap();
    }
    conn.close(200, "deleted".into()).await.unwrap();
}

/// A publish to an exchange that is gone makes the broker close the
/// publisher channel. The worker used to keep the dead channel: every park
/// failed, the delivery was requeued at once, again and again, and ended as
/// `poison`. Now the channel is reopened, the topology declared again, and
/// the refused publish retried with backoff while the delivery is kept.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_closed_publisher_channel_is_reopened_and_nothing_is_lost() {
    let provider = FakeProvider::start(fake_provider::always_ok())
        .await
        .unwrap();
    let env = TestEnv::new_with(&provider.url(), |c| c.delivery_limit = 2).await;
    env.set_quota("paced", "10/s", 1).await;
    let worker = env.spawn_worker().await;
    let jobs = env.publish("paced", 40, |_| {}).await;
    wait_for("the run to start", Duration::from_secs(20), || async {
        provider.accepted() >= 5
    })
    .await;
    delete_delay_tiers(&env, Deleted::Exchanges).await;

    wait_for("every job's effect", Duration::from_secs(60), || async {
        effects(&provider.received()).0.len() >= 40
    })
    .await;
    let (sent, repeats) = effects(&provider.received());
    let dead = env.dead_letters().await;
    eprintln!(
        "publisher channel closed: published 40 = sent {} + dead-lettered {}; repeats {repeats}",
        sent.len(),
        dead.len()
    );
    assert!(dead.is_empty(), "{dead:?}");
    assert_eq!(sent, ids(&jobs));
    assert_eq!(repeats, 0);
    assert!(
        worker.worker.readiness().await.amqp,
        "the publisher is open again"
    );
    worker.stop().await.unwrap();
    env.cleanup().await;
}

/// Connecting used to ignore shutdown: a worker stopped while its broker
/// did not answer waited out the whole connect timeout (10 s). Now every
/// setup step hears shutdown.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_stopped_while_connecting_exits_at_once() {
    // A broker that accepts connections and never answers.
    let blackhole = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = blackhole.local_addr().unwrap().port();
    let held = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((socket, _)) = blackhole.accept().await {
            held.push(socket);
        }
    });
    let env = TestEnv::new("http://127.0.0.1:9/unused").await;
    let mut config = env.config.clone();
    config.amqp_url =
        tollgate_core::SecretUrl::new(format!("amqp://guest:guest@127.0.0.1:{port}/%2f"));
    config.shutdown_grace_ms = 2_000;
    let worker = Arc::new(
        tollgate_runtime::LiveWorker::new(
            &config.worker_settings().unwrap(),
            tollgate_runtime::Metrics::new(50, &[]),
        )
        .unwrap(),
    );
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let run = tokio::spawn(Arc::clone(&worker).run(async move {
        let _ = stopped.await;
    }));
    tokio::time::sleep(Duration::from_millis(500)).await;
    let asked = Instant::now();
    stop.send(()).unwrap();
    let result = tokio::time::timeout(Duration::from_secs(8), run)
        .await
        .expect("stopped well before the 10 s connect bound")
        .unwrap();
    eprintln!(
        "stopped while connecting: exited after {:?}",
        asked.elapsed()
    );
    assert!(result.is_ok(), "{result:?}");
    held.abort();
    env.cleanup().await;
}

/// Redis going away used to be silent (only `/readyz` said so) while a
/// RabbitMQ outage logged a clear WARN. Both now log each change of state:
/// down with its cause and address (password redacted), back up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_logs_redis_going_away_and_coming_back() {
    use std::io::BufRead;
    let provider = FakeProvider::start(fake_provider::always_ok())
        .await
        .unwrap();
    let env = TestEnv::new(&provider.url()).await;
    let port = tollgate_tests::free_port();
    let mut child = WorkerProcess::command(&env, &provider.url(), tollgate_tests::free_port())
        .env(
            "TOLLGATE_REDIS_URL",
            format!("redis://:s3cret-pw@127.0.0.1:{port}"),
        )
        .env("TOLLGATE_LOG_FORMAT", "json")
        .env("RUST_LOG", "info")
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let lines = Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    let reader = std::io::BufReader::new(child.stderr.take().unwrap());
    let sink = Arc::clone(&lines);
    std::thread::spawn(move || {
        for line in reader.lines().map_while(Result::ok) {
            sink.lock().unwrap().push(line);
        }
    });
    let logged = |needle: &'static str| {
        let lines = Arc::clone(&lines);
        move || {
            let found = lines.lock().unwrap().iter().any(|l| l.contains(needle));
            async move { found }
        }
    };
    wait_for(
        "Redis reported down",
        Duration::from_secs(20),
        logged("Redis is unreachable"),
    )
    .await;
    let down = lines
        .lock()
        .unwrap()
        .iter()
        .find(|l| l.contains("Redis is unreachable"))
        .cloned()
        .unwrap();
    let down: serde_json::Value = serde_json::from_str(&down).unwrap();
    assert_eq!(down["level"], "WARN");
    assert_eq!(
        down["address"],
        format!("redis://:REDACTED@127.0.0.1:{port}")
    );
    assert!(
        down["cause"].as_str().is_some_and(|c| !c.is_empty()),
        "{down}"
    );

    let _redis = PrivateRedis::start_on(port, &["--requirepass", "s3cret-pw"]).await;
    wait_for(
        "Redis reported back",
        Duration::from_secs(20),
        logged("Redis is reachable again"),
    )
    .await;
    let _ = child.kill();
    let _ = child.wait();
    let all = lines.lock().unwrap().join("\n");
    assert!(
        !all.contains("s3cret-pw"),
        "the password reached a log line"
    );
    let reminders = all.matches("Redis is unreachable").count();
    assert_eq!(
        reminders, 1,
        "one line per change of state, not one per failure"
    );
    env.cleanup().await;
}

/// A dead-letter read takes each letter and puts a copy back, so two reads
/// at once (two operators, or the console and the CLI) used to see part of
/// the queue each, and a purge during a read missed the letters the read
/// held. They now run one at a time across the installation.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_letter_reads_and_purges_at_once_each_see_the_whole_queue() {
    const LETTERS: usize = 150;
    let provider = FakeProvider::start(Arc::new(|_: &Received, _| Reply::status(422)))
        .await
        .unwrap();
    let env = TestEnv::new(&provider.url()).await;
    env.set_quota("acme", "1000/s", 100).await;
    let worker = env.spawn_worker().await;
    let jobs = env.publish("acme", LETTERS as u32, |_| {}).await;
    wait_for("every job dead", Duration::from_secs(30), || async {
        env.dead_letters().await.len() == LETTERS
    })
    .await;
    worker.stop().await.unwrap();

    let published: HashSet<String> = jobs.iter().map(|j| j.id.to_string()).collect();
    let (a, b) = tokio::join!(
        tollgate::cli::dlq_summary(&env.config, 10_000),
        tollgate::cli::dlq_summary(&env.config, 10_000),
    );
    for summary in [a.unwrap(), b.unwrap()] {
        let seen: HashSet<String> = summary.newest.iter().map(|l| l.job_id.clone()).collect();
        assert_eq!(summary.newest.len(), LETTERS, "each letter read once");
        assert_eq!(seen, published, "every letter read");
    }

    let actor = tollgate::cli::cli_actor(None).unwrap();
    let (read, purged) = tokio::join!(
        tollgate::cli::dlq_summary(&env.config, 10_000),
        tollgate::cli::dlq_purge(&env.config, |_, _| Ok(true), &actor),
    );
    let read: usize = read.unwrap().counts.values().sum();
    let purged = purged.unwrap().purged as usize;
    assert!(
        read == LETTERS || read == 0,
        "the read ran wholly before or after the purge: {read}"
    );
    assert_eq!(purged, LETTERS, "the purge took every letter");
    assert!(
        env.dead_letters().await.is_empty(),
        "nothing the read held survived the purge"
    );
    env.cleanup().await;
}

/// A dead-letter read or replay through the admin API that outlived its
/// request was dropped midway when the server answered 408: the letters
/// already copied were then there twice, the installation's dead-letter
/// lock stayed held for its 30 s (so the next read failed as "busy"), and
/// the replay went unaudited. Each now runs to its end on a task of its
/// own, and the API answers, in JSON, before the request times out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_letter_read_or_replay_outliving_its_request_runs_to_its_end() {
    const LETTERS: usize = 2000;
    const TOKEN: &str = "a-token-of-twenty-bytes";
    let env = TestEnv::new_with("http://127.0.0.1:9/unused", |c| {
        c.http_request_timeout_ms = 100;
    })
    .await;
    let dead_letter_exchange = env.broker.topology().dead_letter_exchange();
    let published: HashSet<String> = (0..LETTERS).map(|i| format!("dead-{i}")).collect();
    let (broker, exchange) = (&env.broker, &dead_letter_exchange);
    futures::future::join_all(published.iter().map(|id| async move {
        let mut headers = tollgate_amqp::lapin::types::FieldTable::default();
        tollgate_amqp::headers::set_text(&mut headers, tollgate_amqp::headers::REASON, "rejected");
        let body = format!(r#"{{"id":"{id}","tenant":"acme"}}"#);
        let props = tollgate_amqp::job_properties().with_headers(headers);
        broker
            .publish(exchange, "acme", body.as_bytes(), props)
            .await
            .unwrap();
    }))
    .await;
    let addr = env.serve_admin(TOKEN).await;
    let http = reqwest::Client::new();

    let read = http
        .get(format!("http://{addr}/v1/dlq?limit=1"))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap();
    let status = read.status();
    let body: serde_json::Value = read.json().await.expect("a JSON answer, not an empty 408");
    assert!(status == 200 || status == 503, "{status}: {body}");
    // The next read waits for the one the API started, then sees the queue
    // as it was: every letter, once.
    let letters = env.dead_letters().await;
    assert_eq!(letters.len(), LETTERS, "no letter twice, none lost");
    let seen: HashSet<String> = letters.into_iter().map(|l| l.job_id).collect();
    assert_eq!(seen, published);

    let mut actor = reqwest::header::HeaderMap::new();
    let name = reqwest::header::HeaderValue::from_bytes("José".as_bytes()).unwrap();
    actor.insert("x-tollgate-actor", name);
    let replay = http
        .post(format!("http://{addr}/v1/dlq/replay"))
        .bearer_auth(TOKEN)
        .headers(actor)
        .json(&serde_json::json!({"reason": "rejected"}))
        .send()
        .await
        .unwrap();
    let status = replay.status();
    let body: serde_json::Value = replay
        .json()
        .await
        .expect("a JSON answer, not an empty 408");
    assert!(status == 200 || status == 202, "{status}: {body}");
    wait_for(
        "the replay's audit entry",
        Duration::from_secs(60),
        || async {
            let audit = env.quotas.history(None, 10).await.unwrap();
            audit.iter().any(|e| e.target == "dlq")
        },
    )
    .await;
    let audit = env.quotas.history(None, 10).await.unwrap();
    let entry = audit.iter().find(|e| e.target == "dlq").unwrap();
    assert_eq!(
        (entry.action.as_str(), entry.who.as_str()),
        ("replay", "api:José")
    );
    assert_eq!(
        entry.detail.as_deref(),
        Some("replayed 2000 (reason rejected, tenant any); 0 left")
    );
    assert_eq!(env.pending().await as usize, LETTERS, "each replayed once");
    assert!(env.dead_letters().await.is_empty());
    env.cleanup().await;
}

/// A job that shutdown stops before its provider call (too late in the
/// grace period to begin one) is parked for the next pod, its progress
/// with it. It used to be handed back to the queue, which counts as a
/// delivery that never settled: at `delivery_limit = 1` one such shutdown
/// dead-lettered it as `poison` (found in review at the default limit of
/// 5, after five shutdowns in a row) though it never reached the provider.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_stopped_by_shutdown_before_its_call_is_parked_not_counted_as_poison() {
    let provider = FakeProvider::start(fake_provider::slow_ok(Duration::from_millis(1_500)))
        .await
        .unwrap();
    let env = TestEnv::new_with(&provider.url(), |c| c.delivery_limit = 1).await;
    let one_call = |c: &mut tollgate::config::Config| {
        c.concurrency = 1;
        c.provider_timeout_ms = 3_000;
        // Shorter than the provider timeout: no call begins once stopping.
        c.shutdown_grace_ms = 2_000;
    };
    let worker = env.spawn_worker_with(one_call).await;
    let jobs = env.publish("stopped", 2, |_| {}).await;
    wait_for("the first call", Duration::from_secs(10), || async {
        !provider.received().is_empty()
    })
    .await;
    // The second job waits for the one call slot; stop meanwhile.
    worker.stop().await.unwrap();
    assert_eq!(provider.received().len(), 1, "no call began after the stop");

    let worker = env.spawn_worker_with(one_call).await;
    wait_for("both jobs sent", Duration::from_secs(20), || async {
        provider.accepted() >= 2
    })
    .await;
    let (sent, repeats) = effects(&provider.received());
    assert_eq!(sent, ids(&jobs));
    assert_eq!(repeats, 0);
    assert!(env.dead_letters().await.is_empty());
    env.stop_when_drained([worker]).await;
}

/// Redis goes away just as the provider accepts a call, for longer than the
/// call's lease (provider timeout + 5 s). The worker used to retry the sent
/// record for 4 s, then ack the delivery without it: a later job with the
/// same idempotency key, once the lease had expired, found no record and
/// was sent again. Now a running worker keeps retrying, the delivery
/// unacked, until Redis answers: the later job is a duplicate.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sent_record_outlasting_its_lease_is_written_once_redis_returns() {
    use std::io::Write;

    const PAUSE_MS: u64 = 9_000;
    let redis = PrivateRedis::start().await;
    let port = redis.port;
    let paused = Arc::new(AtomicBool::new(false));
    let pause = Arc::clone(&paused);
    let provider = FakeProvider::start(Arc::new(move |_, _| {
        // Redis stops answering as the first call is accepted.
        if !pause.swap(true, Ordering::SeqCst) {
            let mut redis = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
            write!(redis, "CLIENT PAUSE {PAUSE_MS} ALL\r\n").unwrap();
        }
        Reply::ok()
    }))
    .await
    .unwrap();
    let url = redis.url();
    let env = TestEnv::new_with(&provider.url(), |c| {
        c.redis_url = tollgate_core::SecretUrl::new(url);
        c.provider_timeout_ms = 2_000;
    })
    .await;
    let worker = env.spawn_worker().await;
    let key = format!("k-{}", uuid::Uuid::new_v4().simple());
    let first = env
        .publish("acme", 1, |a| a.idempotency_key = Some(key.clone()))
        .await;
    let completed = |n: f64| {
        let metrics = &worker.metrics;
        async move { metrics.counter_sum("tollgate_jobs_completed_total", &[]) >= n }
    };
    wait_for("the first job settled", Duration::from_secs(60), || {
        completed(1.0)
    })
    .await;
    assert!(paused.load(Ordering::SeqCst));
    // Another job with the same key, once the first is settled (and its
    // lease long expired).
    let second = env
        .publish("acme", 1, |a| a.idempotency_key = Some(key.clone()))
        .await;
    wait_for("the second job settled", Duration::from_secs(60), || {
        completed(2.0)
    })
    .await;
    let calls = provider.received();
    eprintln!(
        "Redis paused {PAUSE_MS} ms after a 200: jobs {} and {} made {} call(s)",
        first[0].id,
        second[0].id,
        calls.len()
    );
    assert_eq!(calls.len(), 1, "the key was sent once: {calls:?}");
    assert_eq!(
        worker
            .metrics
            .counter_sum("tollgate_jobs_completed_total", &[("outcome", "duplicate")]),
        1.0
    );
    worker.stop().await.unwrap();
    env.cleanup().await;
}

/// The other side of retrying a sent record until Redis answers: a worker
/// stopped meanwhile still stops (it retries a few seconds more, then lets
/// the delivery go, the documented limit), instead of waiting for Redis
/// for ever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_stopped_while_redis_is_away_after_a_call_still_stops() {
    use std::io::Write;

    let redis = PrivateRedis::start().await;
    let port = redis.port;
    let provider = FakeProvider::start(Arc::new(move |_, _| {
        let mut redis = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
        write!(redis, "CLIENT PAUSE 600000 ALL\r\n").unwrap();
        Reply::ok()
    }))
    .await
    .unwrap();
    let url = redis.url();
    let env = TestEnv::new_with(&provider.url(), |c| {
        c.redis_url = tollgate_core::SecretUrl::new(url);
    })
    .await;
    let worker = env.spawn_worker().await;
    env.publish("acme", 1, |_| {}).await;
    wait_for("the call", Duration::from_secs(30), || async {
        provider.accepted() == 1
    })
    .await;
    let stopped = tokio::time::timeout(Duration::from_secs(120), worker.stop()).await;
    assert!(
        stopped.is_ok(),
        "the worker never stopped while Redis was away"
    );
    let mut unpause = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    write!(unpause, "CLIENT UNPAUSE\r\n").unwrap();
    env.cleanup().await;
}

/// A delay tier's queue deleted under a running worker: the broker returns
/// every park to it as unroutable, without closing the channel. The worker
/// used to retry that park forever (only a closed channel made it declare
/// the topology again), and the tenant's lane stalled behind it. Now an
/// unroutable publish declares the topology again, and every job is sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deleted_delay_queue_is_declared_again_and_nothing_stalls() {
    let provider = FakeProvider::start(fake_provider::always_ok())
        .await
        .unwrap();
    let env = TestEnv::new(&provider.url()).await;
    env.set_quota("paced", "10/s", 1).await;
    let worker = env.spawn_worker().await;
    // The delay queues are still empty.
    delete_delay_tiers(&env, Deleted::Queues).await;
    let jobs = env.publish("paced", 30, |_| {}).await;
    wait_for("every job's effect", Duration::from_secs(60), || async {
        effects(&provider.received()).0.len() >= 30
    })
    .await;
    let (sent, repeats) = effects(&provider.received());
    assert_eq!(sent, ids(&jobs));
    assert_eq!(repeats, 0);
    assert!(env.dead_letters().await.is_empty());
    worker.stop().await.unwrap();
    env.cleanup().await;
}
