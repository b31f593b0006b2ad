//! Fair, precise scheduling: a tenant's backlog never delays another
//! tenant, scheduled jobs are never early, and far-future jobs are parked,
//! not held.
//!
//! The consumer-timeout test changes a broker-wide setting, so it is
//! `#[ignore]`d here and run alone in the serial phase of `make test`.

use std::collections::HashSet;
use std::process::Command;
use std::time::{Duration, Instant};

use futures::StreamExt;
use tollgate_amqp::ShardQueue;
use tollgate_amqp::lapin::options::{
    BasicConsumeOptions, BasicQosOptions, QueueDeclareOptions, QueueDeleteOptions,
};
use tollgate_amqp::lapin::types::FieldTable;
use tollgate_core::UnixMillis;
use tollgate_quota::{Change, Target};
use tollgate_tests::{
    FakeProvider, TestEnv, arrivals_of, effects, fake_provider, max_in_window, now, wait_for,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_noisy_tenant_never_delays_a_quiet_one() {
    let provider = FakeProvider::start_punctual(fake_provider::always_ok())
        .await
        .unwrap();
    let env = TestEnv::new(&provider.url()).await;
    env.set_quota("noisy", "10/s", 1).await;
    env.set_quota("quiet", "100/s", 1).await;
    let workers = [env.spawn_worker().await, env.spawn_worker().await];
    env.publish("noisy", 3000, |_| {}).await;

    // The quiet tenant sends one job every 0.5 s while the backlog drains.
    let mut quiet = Vec::new();
    for _ in 0..24 {
        let published = now();
        for job in env.publish("quiet", 1, |_| {}).await {
            quiet.push((job, published));
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let quiet_keys: HashSet<String> = quiet
        .iter()
        .map(|(j, _)| j.idempotency_key.to_string())
        .collect();
    wait_for("every quiet job", Duration::from_secs(20), || async {
        quiet_keys.is_subset(&effects(&provider.received()).0)
    })
    .await;
    let received = provider.received();
    let noisy_sent = received.iter().filter(|r| r.tenant == "noisy").count();
    let quiet_lags: Vec<i64> = quiet
        .iter()
        .map(|(job, published)| {
            let sent = received
                .iter()
                .find(|r| r.job_id == job.id.as_str())
                .expect("sent");
            sent.at.0 - published.0
        })
        .collect();
    eprintln!(
        "noisy neighbour: quiet lags (ms) {quiet_lags:?}; noisy sent {noisy_sent} of 3000 meanwhile"
    );
    // All of the quiet tenant's jobs went out while the noisy backlog was
    // still almost whole: it never waited behind it.
    assert!(
        noisy_sent < 300,
        "the noisy backlog drained first ({noisy_sent} sent)"
    );
    let noisy = arrivals_of(&received, "noisy");
    let worst = max_in_window(&noisy, Duration::from_secs(1));
    assert!(worst <= 11, "noisy sent {worst} in one second at 10/s");
    assert_eq!(effects(&received).1, 0, "nothing sent twice");
    for w in workers {
        w.stop().await.unwrap();
    }
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scheduled_jobs_are_never_early_and_all_go() {
    let provider = FakeProvider::start(fake_provider::always_ok())
        .await
        .unwrap();
    let env = TestEnv::new(&provider.url()).await;
    env.set_quota("cron", "100/s", 10).await;
    let worker = env.spawn_worker().await;
    let mut jobs = Vec::new();
    let mut seed: u64 = 0x5eed;
    for _ in 0..150 {
        seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let due_in = Duration::from_millis(2_000 + (seed >> 33) % 18_000);
        jobs.extend(env.publish("cron", 1, |a| a.due_in = Some(due_in)).await);
    }
    wait_for("all 150", Duration::from_secs(60), || async {
        provider.accepted() >= 150
    })
    .await;
    let received = provider.received();
    let mut lags = Vec::new();
    for job in &jobs {
        let sent = received
            .iter()
            .find(|r| r.job_id == job.id.as_str())
            .expect("sent");
        let due = job.due_at.expect("scheduled");
        assert!(
            sent.at >= due,
            "{} sent at {} before its due time {}",
            job.id,
            sent.at,
            due
        );
        lags.push(sent.at.0 - due.0);
    }
    lags.sort_unstable();
    eprintln!(
        "150 scheduled jobs: lag p50 {} ms, p99 {} ms, max {} ms",
        lags[74], lags[148], lags[149]
    );
    assert_eq!(
        effects(&received),
        (
            jobs.iter().map(|j| j.idempotency_key.to_string()).collect(),
            0
        )
    );
    worker.stop().await.unwrap();
    env.cleanup().await;
}

/// Restores the broker's default consumer timeout whatever happens.
struct ConsumerTimeoutGuard;

impl Drop for ConsumerTimeoutGuard {
    fn drop(&mut self) {
        set_consumer_timeout(1_800_000);
    }
}

fn set_consumer_timeout(ms: u64) {
    let expr = format!("application:set_env(rabbit, consumer_timeout, {ms}).");
    let ok = Command::new("rabbitmqctl")
        .args(["-q", "eval", &expr])
        .status()
        .unwrap()
        .success();
    assert!(ok, "rabbitmqctl eval failed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "shortens the broker-wide consumer_timeout: run alone (make test runs it in its serial phase)"]
async fn a_job_due_in_two_hours_is_parked_and_consumer_timeout_never_fires() {
    let provider = FakeProvider::start(fake_provider::always_ok())
        .await
        .unwrap();
    let env = TestEnv::new(&provider.url()).await;
    let _guard = ConsumerTimeoutGuard;
    set_consumer_timeout(3_000);
    let worker = env.spawn_worker().await;
    let job = env
        .publish("later", 1, |a| a.due_in = Some(Duration::from_secs(7200)))
        .await;

    // A control consumer that holds a message unacked, as a worker that
    // slept on a due time would: the broker closes its channel.
    let (conn, channel) = env.raw_channel().await;
    let control = format!("{}.control", env.config.prefix);
    let durable = QueueDeclareOptions {
        durable: true,
        ..Default::default()
    };
    let mut args = FieldTable::default();
    args.insert(
        "x-queue-type".into(),
        tollgate_amqp::lapin::types::AMQPValue::LongString("quorum".into()),
    );
    channel
        .queue_declare(control.as_str().into(), durable, args)
        .await
        .unwrap();
    env.broker
        .publish("", &control, b"held", tollgate_amqp::job_properties())
        .await
        .unwrap();
    channel
        .basic_qos(1, BasicQosOptions::default())
        .await
        .unwrap();
    let mut held = channel
        .basic_consume(
            control.as_str().into(),
            "control".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    let _unacked = held.next().await.unwrap().unwrap();
    let started = Instant::now();
    wait_for(
        "the broker to close the control's channel",
        Duration::from_secs(150),
        || async { !channel.status().connected() },
    )
    .await;
    eprintln!(
        "consumer_timeout closed the control channel after {:?}",
        started.elapsed()
    );

    // Meanwhile the 2-hour job sits in the 1 h delay tier, acked, and the
    // worker's session was never lost.
    let tier = env.broker.topology().tier(Duration::from_secs(3600));
    assert_eq!(
        env.broker.queue_depth(&tier).await.unwrap(),
        1,
        "parked in the 1 h tier"
    );
    assert!(
        worker.worker.readiness().await.ready(),
        "the worker's channel is alive"
    );
    assert_eq!(
        worker
            .metrics
            .counter_sum("tollgate_parked_total", &[("reason", "not_due")]),
        1.0
    );
    assert!(provider.received().is_empty());
    assert!(job[0].due_at.unwrap() > UnixMillis(0));

    let fresh = conn.create_channel().await.unwrap();
    fresh
        .queue_delete(control.as_str().into(), QueueDeleteOptions::default())
        .await
        .unwrap();
    let _ = conn.close(200, "done".into()).await;
    worker.stop().await.unwrap();
    env.cleanup().await;
}

/// `concurrency = 1` (one provider call at a time, as a fragile provider
/// wants) once also meant a prefetch of one: the pod's only delivery slot
/// held the noisy tenant's next reservation, and a quiet tenant queued
/// behind the backlog waited for all of it. Now `concurrency` bounds the
/// calls and the prefetch stays large enough to look past the backlog.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_call_at_a_time_still_reaches_a_tenant_behind_a_backlog() {
    quiet_behind_a_backlog("one call at a time", |c| c.concurrency = 1).await;
}

/// A prefetch forced down to one delivery per work queue: the slot must
/// not sit on the noisy tenant's reservations or short waits. With no hold
/// room, its jobs take only imminent reservations and park otherwise, so
/// the quiet tenant's jobs get through (they waited for the whole 60 s
/// backlog before).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_delivery_per_work_queue_still_reaches_a_tenant_behind_a_backlog() {
    quiet_behind_a_backlog("prefetch 1", |c| {
        c.concurrency = 1;
        c.prefetch = Some(1);
    })
    .await;
}

/// One work queue; a noisy tenant's 100-job backlog at 2/s (50 s of work),
/// then 5 jobs of a quiet tenant behind it. The quiet jobs must go out
/// before most of the backlog, and the noisy tenant must stay within its
/// quota; at most one provider call at a time. (The first pass over the
/// backlog takes one park confirmed by the broker per job; on a machine
/// whose broker confirms slowly, 300 jobs at 5/s measured how slow the
/// disk was, not whether the quiet tenant waits for the backlog.)
async fn quiet_behind_a_backlog(setting: &str, tweak: impl FnOnce(&mut tollgate::config::Config)) {
    const CALL: Duration = Duration::from_millis(100);
    let provider = FakeProvider::start_punctual(fake_provider::slow_ok(CALL))
        .await
        .unwrap();
    // One work queue: the quiet tenant's jobs are behind the whole backlog.
    let env = TestEnv::new_with(&provider.url(), |c| c.shards = 1).await;
    env.set_quota("noisy", "2/s", 1).await;
    env.set_quota("quiet", "100/s", 1).await;
    let worker = env.spawn_worker_with(tweak).await;
    env.publish("noisy", 100, |_| {}).await;
    let quiet = env.publish("quiet", 5, |_| {}).await;

    wait_for_quiet_sends(&provider, 5).await;
    let received = provider.received();
    let noisy_before = received
        .iter()
        .take_while(|r| r.tenant != "quiet" || !r.job_id.ends_with(quiet[4].id.as_str()))
        .filter(|r| r.tenant == "noisy")
        .count();
    eprintln!(
        "{setting}: the quiet tenant's 5 jobs went out after {noisy_before} of the 100 noisy ones"
    );
    assert!(
        noisy_before < 100 / 2,
        "{setting}: the quiet tenant waited for most of the backlog ({noisy_before} noisy sends first)"
    );
    let noisy = arrivals_of(&received, "noisy");
    assert!(
        max_in_window(&noisy, Duration::from_secs(1)) <= 2,
        "{setting}: the noisy tenant went over 2 in a second"
    );
    // Still one call at a time: each takes CALL at the provider, so no two
    // arrive closer than that.
    let arrivals: Vec<Instant> = received.iter().map(|r| r.instant).collect();
    let overlapping = arrivals.windows(2).filter(|w| w[1] - w[0] < CALL).count();
    assert_eq!(
        overlapping, 0,
        "{setting}: two provider calls were in flight at once"
    );
    worker.stop().await.unwrap();
    env.cleanup().await;
}

/// A parked copy comes back through a lane of its own, not behind fresh
/// work. One work queue, one delivery per queue, one call at a time: a
/// paced tenant's first job goes, its next two are parked for their slots
/// (half a second apart), and then 300 fresh jobs of an unlimited tenant
/// fill the work queue behind them, each call taking 20 ms. Came the
/// parked copies back into the work queue, they would go out after all 300
/// (as they did); through the return queue they go out while the backlog
/// is still being sent (after 40 of 200 on an idle machine, 140 of 200
/// with the whole suite running beside it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_copy_back_from_a_wait_does_not_queue_behind_fresh_work() {
    const CALL: Duration = Duration::from_millis(20);
    const BULK: u32 = 300;
    let provider = FakeProvider::start(fake_provider::slow_ok(CALL))
        .await
        .unwrap();
    let env = TestEnv::new_with(&provider.url(), |c| c.shards = 1).await;
    env.set_quota("paced", "2/s", 1).await;
    env.set_quota("bulk", "10000/s", 100).await;
    let paced = env.publish("paced", 3, |_| {}).await;
    env.publish("bulk", BULK, |_| {}).await;
    let worker = env
        .spawn_worker_with(|c| {
            c.concurrency = 1;
            c.prefetch = Some(1);
        })
        .await;

    wait_for("every job sent", Duration::from_secs(60), || async {
        provider.accepted() >= BULK as usize + 3
    })
    .await;
    let received = provider.received();
    let (sent, _) = effects(&received);
    assert_eq!(sent.len(), BULK as usize + 3, "each job sent once");
    let last_paced = received
        .iter()
        .rposition(|r| r.tenant == "paced")
        .expect("the paced tenant sent");
    let bulk_before = received[..last_paced]
        .iter()
        .filter(|r| r.tenant == "bulk")
        .count();
    eprintln!(
        "the paced tenant's last job ({}) went out after {bulk_before} of the {BULK} bulk jobs",
        paced[2].id
    );
    assert!(
        bulk_before < BULK as usize,
        "a parked copy waited behind the whole fresh backlog ({bulk_before} bulk sends first)"
    );
    worker.stop().await.unwrap();
    env.cleanup().await;
}

/// A tenant's jobs are served by priority within its quota: 30 low, then 30
/// normal, then 5 high jobs published at once at 5/s. The high ones go out
/// before the backlog published ahead of them, the normal ones before the
/// low ones; every job once, never over the quota.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenants_jobs_go_out_high_then_normal_then_low() {
    use tollgate_core::Priority::{High, Low, Normal};
    let provider = FakeProvider::start_punctual(fake_provider::always_ok())
        .await
        .unwrap();
    let env = TestEnv::new(&provider.url()).await;
    env.set_quota("acme", "5/s", 1).await;
    let worker = env.spawn_worker().await;
    let mut class = std::collections::HashMap::new();
    for (priority, count) in [(Low, 30), (Normal, 30), (High, 5)] {
        for job in env.publish("acme", count, |a| a.priority = priority).await {
            class.insert(job.id.as_str().to_owned(), priority);
        }
    }
    wait_for("every job", Duration::from_secs(60), || async {
        provider.received().len() >= 65
    })
    .await;
    let received = provider.received();
    let order: Vec<_> = received
        .iter()
        .map(|r| {
            *class
                .iter()
                .find(|(id, _)| r.job_id.ends_with(id.as_str()))
                .expect("one of ours")
                .1
        })
        .collect();
    let ids: HashSet<&str> = received.iter().map(|r| r.job_id.as_str()).collect();
    assert_eq!(ids.len(), 65, "every job once");
    let at = |p| order.iter().rposition(|&c| c == p).unwrap();
    // Only what was reserved before the later jobs arrived may go ahead of
    // them (the 500 ms horizon at 5/s: a few low jobs).
    let before_last_high = at(High) + 1 - 5;
    let low_before_last_normal = order[..at(Normal)].iter().filter(|&&c| c == Low).count();
    eprintln!(
        "priority: {before_last_high} jobs before the last high one, \
         {low_before_last_normal} low ones before the last normal one: {order:?}"
    );
    assert!(before_last_high <= 5, "{order:?}");
    assert!(low_before_last_normal <= 5, "{order:?}");
    let times: Vec<Instant> = received.iter().map(|r| r.instant).collect();
    assert!(max_in_window(&times, Duration::from_secs(1)) <= 5);
    worker.stop().await.unwrap();
    env.cleanup().await;
}

/// A fresh backlog that can only park is looked past: with one delivery
/// per work queue, a pod opens look-ahead consumers on the queue while
/// what it delivers is parked, so a quiet tenant behind the backlog is sent
/// before the first pass over it ends, and the look-ahead closes once the
/// queue has nothing left to look past. Each quiet job goes once and the
/// noisy tenant keeps to its quota.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backlog_that_only_parks_is_looked_past_and_the_look_ahead_closes_after() {
    const BACKLOG: u32 = 400;
    let provider = FakeProvider::start_punctual(fake_provider::always_ok())
        .await
        .unwrap();
    let env = TestEnv::new_with(&provider.url(), |c| c.shards = 1).await;
    env.set_quota("noisy", "1/s", 1).await;
    env.set_quota("quiet", "100/s", 1).await;
    let worker = env
        .spawn_worker_with(|c| {
            c.concurrency = 1;
            c.prefetch = Some(1);
        })
        .await;
    let queue = env.broker.topology().work_queues().remove(0);
    let (_conn, channel) = env.raw_channel().await;
    assert_eq!(consumers_on(&channel, &queue).await, 1, "one main consumer");
    env.publish("noisy", BACKLOG, |_| {}).await;
    let quiet = env.publish("quiet", 3, |_| {}).await;
    wait_for_look_ahead(&channel, &queue, true).await;
    wait_for_quiet_sends(&provider, 3).await;
    wait_for_look_ahead(&channel, &queue, false).await;
    let received = provider.received();
    let quiet_sent: Vec<&str> = received
        .iter()
        .filter(|r| r.tenant == "quiet")
        .map(|r| r.job_id.as_str())
        .collect();
    assert_eq!(quiet_sent.len(), 3, "each quiet job once: {quiet_sent:?}");
    for job in &quiet {
        assert!(
            quiet_sent.iter().any(|id| id.ends_with(job.id.as_str())),
            "{} sent",
            job.id
        );
    }
    let noisy = arrivals_of(&received, "noisy");
    assert!(
        noisy.len() < BACKLOG as usize / 10,
        "the quiet jobs went before the backlog was sent ({} noisy sends)",
        noisy.len()
    );
    assert!(
        max_in_window(&noisy, Duration::from_secs(1)) <= 1,
        "the noisy tenant went over its 1/s"
    );
    worker.stop().await.unwrap();
    env.cleanup().await;
}

/// Tenants behind another's backlog on one work queue and one shared route
/// get their shares at one delivery per queue. The backlog's tenant, alone
/// on the route when it starts, has the whole route as its share: its jobs
/// are granted a slot each and held for it, never parked, and the pod
/// used to hold one of them at a time, so the others were reached only
/// once the whole backlog had gone out (300 jobs at 30/s, 10 s). A pod now
/// looks past deliveries it holds for later slots as it does past ones it
/// parks. Each job goes once and the route keeps its 30/s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenants_behind_a_backlog_on_their_shared_route_get_their_shares_at_one_delivery() {
    behind_a_backlog_on_a_shared_route(1).await;
}

/// 300 jobs of `first`, then 20 each of `second` and `third`, on one work
/// queue and a 30/s route, through one worker at `prefetch`.
async fn behind_a_backlog_on_a_shared_route(prefetch: u16) {
    const BACKLOG: u32 = 300;
    let provider = FakeProvider::start_punctual(fake_provider::always_ok())
        .await
        .unwrap();
    let env = TestEnv::new_with(&provider.url(), |c| c.shards = 1).await;
    let route = tollgate_core::Kind::parse("default").unwrap();
    env.change(
        Target::Route(route),
        Change::SetQuota {
            quota: tollgate_core::Quota::new("30/s".parse().unwrap(), 1).unwrap(),
            concurrency: None,
            weight: None,
            adaptive: None,
        },
    )
    .await;
    for tenant in ["first", "second", "third"] {
        env.set_quota(tenant, "100/s", 1).await;
    }
    let worker = env
        .spawn_worker_with(|c| {
            c.concurrency = 1;
            c.prefetch = Some(prefetch);
        })
        .await;
    env.publish("first", BACKLOG, |_| {}).await;
    env.publish("second", 20, |_| {}).await;
    env.publish("third", 20, |_| {}).await;
    wait_for(
        "the tenants behind the backlog",
        Duration::from_secs(60),
        || async {
            let received = provider.received();
            ["second", "third"]
                .iter()
                .all(|t| received.iter().filter(|r| r.tenant == *t).count() >= 20)
        },
    )
    .await;
    let first_sent = arrivals_of(&provider.received(), "first").len();
    eprintln!("prefetch {prefetch}: {first_sent} of its {BACKLOG} jobs went before the others' 40");
    assert!(
        first_sent < BACKLOG as usize / 2,
        "the others waited for the backlog: {first_sent} of its {BACKLOG} jobs went before theirs"
    );
    wait_for("the backlog", Duration::from_secs(60), || async {
        arrivals_of(&provider.received(), "first").len() >= BACKLOG as usize
    })
    .await;
    let received = provider.received();
    assert_eq!(effects(&received).1, 0, "a job was sent twice");
    assert_eq!(received.len(), BACKLOG as usize + 40, "every job once");
    let times: Vec<Instant> = received.iter().map(|r| r.instant).collect();
    assert!(
        max_in_window(&times, Duration::from_secs(1)) <= 30,
        "the route went over its 30/s"
    );
    worker.stop().await.unwrap();
    env.cleanup().await;
}

/// Copies back for their places are looked past on their return queue as a
/// backlog is on its work queue. With one delivery per queue, each copy
/// back a few ms before its slot was held in that one delivery, the copies
/// behind it, due as soon, waited for it and came back late for their
/// places: many tenants each well inside their quotas went out at what
/// one delivery could hold, not at the sum of their quotas. A pod now
/// opens look-ahead consumers on a return queue whose copies it holds for
/// later slots or parks again (counted in `tollgate_look_aheads_total`,
/// which outlives a look-ahead too short to see from outside), and closes
/// them once the queue is quiet.
/// Each job goes once and no tenant goes over its quota.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn copies_held_for_their_slots_are_looked_past_on_their_return_queue() {
    const TENANTS: usize = 30;
    const JOBS: u32 = 8;
    let provider = FakeProvider::start_punctual(fake_provider::always_ok())
        .await
        .unwrap();
    let env = TestEnv::new_with(&provider.url(), |c| c.shards = 1).await;
    let tenants: Vec<String> = (0..TENANTS).map(|i| format!("many-{i}")).collect();
    for tenant in &tenants {
        env.set_quota(tenant, "2/s", 1).await;
    }
    let worker = env
        .spawn_worker_with(|c| {
            c.concurrency = 1;
            c.prefetch = Some(1);
        })
        .await;
    let queue = env.broker.topology().queues(ShardQueue::Return).remove(0);
    let (_conn, channel) = env.raw_channel().await;
    assert_eq!(consumers_on(&channel, &queue).await, 1, "one main consumer");
    for tenant in &tenants {
        env.publish(tenant, JOBS, |_| {}).await;
    }
    let total = TENANTS * JOBS as usize;
    wait_for("every job", Duration::from_secs(60), || async {
        provider.received().len() >= total
    })
    .await;
    let opened = worker
        .metrics
        .counter_sum("tollgate_look_aheads_total", &[("lane", "return")]);
    assert!(opened > 0.0, "no look-ahead opened on the return queue");
    wait_for_look_ahead(&channel, &queue, false).await;
    let received = provider.received();
    assert_eq!(effects(&received).1, 0, "a job was sent twice");
    assert_eq!(received.len(), total, "every job once, none refused");
    for tenant in &tenants {
        let times = arrivals_of(&received, tenant);
        assert_eq!(times.len(), JOBS as usize, "{tenant}'s jobs");
        assert!(
            max_in_window(&times, Duration::from_secs(1)) <= 2,
            "{tenant} went over its 2/s"
        );
    }
    worker.stop().await.unwrap();
    env.cleanup().await;
}

/// Waits (up to 30 s) until `queue` has a look-ahead consumer besides its
/// main one (`open`), or only its main one again (`!open`: the look-ahead
/// closes once the queue is quiet).
async fn wait_for_look_ahead(channel: &tollgate_amqp::lapin::Channel, queue: &str, open: bool) {
    let what = if open {
        format!("a look-ahead consumer on {queue}")
    } else {
        format!("the look-ahead on {queue} to close once it is quiet")
    };
    wait_for(&what, Duration::from_secs(30), || async {
        let consumers = consumers_on(channel, queue).await;
        if open { consumers > 1 } else { consumers == 1 }
    })
    .await;
}

/// How many consumers `queue` has now (a passive declare).
async fn consumers_on(channel: &tollgate_amqp::lapin::Channel, queue: &str) -> u32 {
    channel
        .queue_declare(
            queue.into(),
            QueueDeclareOptions {
                passive: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap_or_else(|e| panic!("{queue}: {e}"))
        .consumer_count()
}

/// Waits (up to a minute) until the provider got `n` jobs of the tenant
/// `quiet`.
async fn wait_for_quiet_sends(provider: &FakeProvider, n: usize) {
    wait_for("the quiet jobs", Duration::from_secs(60), || async {
        provider
            .received()
            .iter()
            .filter(|r| r.tenant == "quiet")
            .count()
            >= n
    })
    .await;
}
