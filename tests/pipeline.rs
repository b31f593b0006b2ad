//! The whole pipeline on real RabbitMQ and Redis with a local provider.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use tollgate_amqp::ShardQueue;
use tollgate_amqp::lapin::BasicProperties;
use tollgate_amqp::lapin::options::BasicGetOptions;
use tollgate_amqp::lapin::types::FieldTable;
use tollgate_core::{Lane, Progress, TenantId, UnixMillis};
use tollgate_tests::{FakeProvider, TestEnv, fake_provider, wait_for};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn five_hundred_jobs_for_three_tenants_reach_the_provider_exactly_once() {
    let provider = FakeProvider::start(fake_provider::always_ok())
        .await
        .unwrap();
    let env = TestEnv::new(&provider.url()).await;
    for tenant in ["alpha", "beta", "gamma"] {
        env.set_quota(tenant, "2000/s", 100).await;
    }
    let worker = env.spawn_worker().await;
    let mut published = Vec::new();
    for (tenant, count) in [("alpha", 200), ("beta", 150), ("gamma", 150)] {
        published.extend(env.publish(tenant, count, |_| {}).await);
    }

    wait_for("500 accepted sends", Duration::from_secs(60), || async {
        provider.accepted() >= 500
    })
    .await;
    // Give any stray duplicate a chance to show up before counting.
    tokio::time::sleep(Duration::from_millis(500)).await;

    let received = provider.received();
    assert_eq!(received.len(), 500, "no request beyond the 500 jobs");
    let keys: HashSet<_> = received
        .iter()
        .map(|r| r.idempotency_key.as_str())
        .collect();
    assert_eq!(
        keys.len(),
        500,
        "each idempotency key reached the provider once"
    );
    let expected: HashSet<_> = published
        .iter()
        .map(|j| j.idempotency_key.as_str())
        .collect();
    assert_eq!(keys, expected);
    let mut per_tenant: HashMap<&str, usize> = HashMap::new();
    for r in &received {
        *per_tenant.entry(r.tenant.as_str()).or_default() += 1;
        assert_eq!(r.attempt, 1);
        assert_eq!(r.body, "{}");
    }
    assert_eq!(
        per_tenant,
        HashMap::from([("alpha", 200), ("beta", 150), ("gamma", 150)])
    );

    wait_for("queues to drain", Duration::from_secs(10), || async {
        env.pending().await == 0
    })
    .await;
    assert!(env.dead_letters().await.is_empty());
    assert_eq!(
        worker
            .metrics
            .counter_sum("tollgate_jobs_completed_total", &[("outcome", "sent")]),
        500.0
    );
    worker.stop().await.expect("worker stops cleanly");
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_due_in_three_seconds_is_sent_on_time_and_not_before() {
    let provider = FakeProvider::start(fake_provider::always_ok())
        .await
        .unwrap();
    let env = TestEnv::new(&provider.url()).await;
    let worker = env.spawn_worker().await;
    let jobs = env
        .publish("sched", 1, |a| a.due_in = Some(Duration::from_secs(3)))
        .await;
    let due_at = jobs[0].due_at.expect("has a due time");

    wait_for("the scheduled send", Duration::from_secs(20), || async {
        provider.accepted() == 1
    })
    .await;
    let sent = &provider.received()[0];
    assert_eq!(sent.job_id, jobs[0].id.as_str());
    assert!(
        sent.at >= due_at,
        "sent at {} before its due time {}",
        sent.at,
        due_at
    );
    // It was parked (one wait) rather than held for 3 s: one hop through
    // the 2 s tier, then an in-process hold for the last part under 1 s.
    let m = &worker.metrics;
    assert_eq!(
        m.counter_sum("tollgate_parked_total", &[("reason", "not_due")]),
        1.0
    );
    assert_eq!(
        m.counter_sum("tollgate_tier_publishes_total", &[("tier", "2s")]),
        1.0
    );
    let lateness = UnixMillis(sent.at.0 - due_at.0);
    eprintln!("due lag of the scheduled job: {} ms", lateness.0);
    worker.stop().await.unwrap();
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_recorded_idempotency_key_is_never_sent_again() {
    let provider = FakeProvider::start(fake_provider::always_ok())
        .await
        .unwrap();
    let env = TestEnv::new(&provider.url()).await;
    let worker = env.spawn_worker().await;
    env.publish("dup", 1, |a| {
        a.idempotency_key = Some("renewal-2026-12".into())
    })
    .await;
    wait_for("the first send", Duration::from_secs(10), || async {
        provider.accepted() == 1
    })
    .await;
    // Two more jobs carrying the same key, published after it was sent.
    env.publish("dup", 2, |a| {
        a.idempotency_key = Some("renewal-2026-12".into())
    })
    .await;
    wait_for(
        "both duplicates to complete",
        Duration::from_secs(10),
        || async {
            worker
                .metrics
                .counter_sum("tollgate_jobs_completed_total", &[("outcome", "duplicate")])
                == 2.0
        },
    )
    .await;
    assert_eq!(
        provider.received().len(),
        1,
        "the provider saw the key once"
    );
    worker.stop().await.unwrap();
    env.cleanup().await;
}

/// An installation declared as one with 4 shards is (which records them),
/// and a provider that accepts everything.
async fn four_shards() -> (FakeProvider, TestEnv) {
    let provider = FakeProvider::start(fake_provider::always_ok())
        .await
        .unwrap();
    let env = TestEnv::new_with(&provider.url(), |c| c.shards = 4).await;
    tollgate_runtime::topology::declare(&env.broker, &env.quotas, None)
        .await
        .unwrap();
    (provider, env)
}

/// 40 tenants with room to send, 2 jobs each, spread over the work queues.
async fn forty_tenants_two_jobs_each(env: &TestEnv) -> Vec<String> {
    let tenants: Vec<String> = (0..40).map(|i| format!("t{i}")).collect();
    for tenant in &tenants {
        env.set_quota(tenant, "100/s", 10).await;
        env.publish(tenant, 2, |_| {}).await;
    }
    tenants
}

/// Shrinking `shards` once left the higher work queues bound to the jobs
/// exchange and consumed by nobody: their jobs waited forever. A worker
/// with fewer shards now unbinds them and the shards' other queues (no new
/// job or returning copy lands there) and drains them until they are empty.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shrinking_shards_drains_the_queues_left_behind() {
    let (provider, env) = four_shards().await;
    let tenants = forty_tenants_two_jobs_each(&env).await;
    let topology = env.broker.topology().clone();
    let (high, low) = (topology.work_queue(2), topology.work_queue(3));
    let stranded =
        env.broker.queue_depth(&high).await.unwrap() + env.broker.queue_depth(&low).await.unwrap();
    assert!(stranded > 0, "some tenants hash to work queues 2 and 3");

    let worker = env.spawn_worker_with(|c| c.shards = 2).await;
    wait_for("every job sent", Duration::from_secs(30), || async {
        provider.accepted() >= 80
    })
    .await;
    worker.stop().await.unwrap();
    // No new job lands on the queues beyond the new shard count.
    for tenant in &tenants {
        env.publish(tenant, 1, |_| {}).await;
    }
    // Nor does a copy coming back from a wait, through either lane.
    let lanes = [ShardQueue::Return, ShardQueue::Recheck];
    for (tenant, kind) in tenants.iter().flat_map(|t| lanes.map(|k| (t, k))) {
        env.broker
            .publish(&topology.exchange(kind), tenant, b"{}", Default::default())
            .await
            .unwrap();
    }
    for kind in ShardQueue::ALL {
        for queue in [topology.queue(kind, 2), topology.queue(kind, 3)] {
            assert_eq!(env.broker.queue_depth(&queue).await.unwrap(), 0, "{queue}");
        }
    }
    let (sent, _) = tollgate_tests::effects(&provider.received());
    assert_eq!(sent.len(), 80, "each job sent once");
    env.cleanup().await;
}

/// An operator who deletes a drained queue of a stale shard before a higher
/// one has emptied (the note says to delete each once it stays empty) left
/// the higher one consumed by nobody: the probe stopped at the first missing
/// work queue, and the record of how many exist fell to the new count. Every
/// stale work queue up to the record is now probed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_shard_behind_a_deleted_one_is_still_drained() {
    use tollgate_amqp::lapin::options::QueueDeleteOptions;

    let (provider, env) = four_shards().await;
    let topology = env.broker.topology().clone();
    let (conn, channel) = env.raw_channel().await;
    for kind in ShardQueue::ALL {
        channel
            .queue_delete(
                topology.queue(kind, 2).as_str().into(),
                QueueDeleteOptions::default(),
            )
            .await
            .unwrap();
    }
    conn.close(200, "deleted".into()).await.unwrap();
    forty_tenants_two_jobs_each(&env).await;
    let beyond = env
        .broker
        .queue_depth(&topology.work_queue(3))
        .await
        .unwrap();
    assert!(beyond > 0, "some tenants hash to work queue 3");

    let worker = env.spawn_worker_with(|c| c.shards = 2).await;
    wait_for("every job sent", Duration::from_secs(30), || async {
        provider.accepted() >= 80
    })
    .await;
    worker.stop().await.unwrap();
    assert_eq!(
        env.quotas.work_queues().await.unwrap(),
        Some(4),
        "work.3 still exists"
    );
    let (sent, _) = tollgate_tests::effects(&provider.received());
    assert_eq!(sent.len(), 80, "each job sent once");
    env.cleanup().await;
}

/// A parked copy expires into the lane it was parked for: one marked for a
/// recheck (its wait goes on) into a recheck queue, any other into a return
/// queue, never into a work queue behind fresh jobs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_copy_comes_back_through_the_lane_it_was_parked_for() {
    let env = TestEnv::new("http://127.0.0.1:9").await;
    let topology = env.broker.topology().clone();
    let tier = topology.tier(env.config.tiers().unwrap().shortest());
    for lane in [Lane::Due, Lane::Recheck, Lane::Recheck] {
        let mut headers = FieldTable::default();
        tollgate_amqp::headers::write_lane(&mut headers, lane);
        let props = BasicProperties::default().with_headers(headers);
        env.broker
            .publish(&tier, "acme", b"{}", props)
            .await
            .unwrap();
    }
    let depth = async |kind: ShardQueue| {
        let mut total = 0;
        for queue in topology.queues(kind) {
            total += env.broker.queue_depth(&queue).await.unwrap();
        }
        total
    };
    wait_for("the copies to expire", Duration::from_secs(10), || async {
        depth(ShardQueue::Return).await + depth(ShardQueue::Recheck).await == 3
    })
    .await;
    assert_eq!(depth(ShardQueue::Return).await, 1, "the due copy");
    assert_eq!(depth(ShardQueue::Recheck).await, 2, "the copies to recheck");
    assert_eq!(depth(ShardQueue::Work).await, 0);
    env.cleanup().await;
}

/// The one job in the work queues, taken unacked on `channel` (a confirmed
/// publish is already in its queue).
async fn take_from_work_queues(
    channel: &tollgate_amqp::lapin::Channel,
    topology: &tollgate_amqp::Topology,
) -> tollgate_amqp::lapin::message::Delivery {
    let mut delivery = None;
    for queue in topology.queues(ShardQueue::Work) {
        if let Some(msg) = channel
            .basic_get(queue.as_str().into(), BasicGetOptions::default())
            .await
            .unwrap()
        {
            delivery = Some(msg.delivery);
        }
    }
    delivery.expect("the job in a work queue")
}

/// A copy to recheck stays in its tier only as long as `park` says (the
/// worker brings such copies back aligned to their places, so the copies
/// of a backlog parked together do not come back as one herd).
#[tokio::test]
async fn a_parked_copy_stays_in_its_tier_as_long_as_it_was_parked_for() {
    let env = TestEnv::new("http://127.0.0.1:9").await;
    let topology = env.broker.topology().clone();
    env.broker
        .publish(
            &topology.jobs_exchange(),
            "acme",
            br#"{"x":1}"#,
            tollgate_amqp::job_properties(),
        )
        .await
        .unwrap();
    let (_conn, channel) = env.raw_channel().await;
    let delivery = take_from_work_queues(&channel, &topology).await;
    let hour = Duration::from_secs(3600);
    env.broker
        .park(
            &delivery,
            &TenantId::parse("acme").unwrap(),
            &Progress::default(),
            hour,
            Lane::Recheck,
            Duration::from_millis(200),
        )
        .await
        .unwrap();
    tollgate_amqp::Acks::default().ack(&delivery).await.unwrap();
    let recheck = async || {
        let mut total = 0;
        for queue in topology.queues(ShardQueue::Recheck) {
            total += env.broker.queue_depth(&queue).await.unwrap();
        }
        total
    };
    // Parked for an hour by its tier, back after its stay.
    wait_for(
        "the copy back from the 1 h tier",
        Duration::from_secs(20),
        || async { recheck().await == 1 },
    )
    .await;
    assert_eq!(
        env.broker.queue_depth(&topology.tier(hour)).await.unwrap(),
        0
    );
    env.cleanup().await;
}

/// A producer's AMQP `expiration` does not follow its job into the
/// dead-letter queue (which dead-letters nowhere: the letter would vanish
/// when it ran out), nor into a replay; the other properties it set do.
#[tokio::test]
async fn a_producers_expiration_never_reaches_a_dead_letter() {
    let env = TestEnv::new("http://127.0.0.1:9").await;
    let topology = env.broker.topology().clone();
    let props = tollgate_amqp::job_properties()
        .with_expiration("600000".into())
        .with_message_id("m-1".into());
    env.publish_raw_with("acme", br#"{"x":1}"#, props).await;
    let (_conn, channel) = env.raw_channel().await;
    let delivery = take_from_work_queues(&channel, &topology).await;
    assert!(delivery.properties.expiration().is_some());
    env.broker
        .dead_letter(
            &delivery,
            None,
            tollgate_core::DeadReason::Malformed,
            "test",
            UnixMillis(0),
        )
        .await
        .unwrap();
    tollgate_amqp::Acks::default().ack(&delivery).await.unwrap();
    let letter = channel
        .basic_get(
            topology.dead_queue().as_str().into(),
            BasicGetOptions::default(),
        )
        .await
        .unwrap()
        .expect("the dead letter");
    let props = &letter.delivery.properties;
    assert_eq!(props.expiration(), &None);
    assert_eq!(props.message_id().as_ref().map(|m| m.as_str()), Some("m-1"));
    assert_eq!(props.delivery_mode(), &Some(2));
    env.cleanup().await;
}

/// A job published with an AMQP `expiration` that runs out in its work
/// queue is dead-lettered by RabbitMQ itself: `dlq list` says it expired
/// and why, where it used to call it `poison` with no detail.
#[tokio::test]
async fn a_job_whose_amqp_expiration_ran_out_is_listed_as_expired() {
    let env = TestEnv::new("http://127.0.0.1:9").await;
    let props = tollgate_amqp::job_properties().with_expiration("1".into());
    env.publish_raw_with("acme", br#"{"id":"short-lived","tenant":"acme"}"#, props)
        .await;
    wait_for("the dead letter", Duration::from_secs(20), || async {
        !env.dead_letters().await.is_empty()
    })
    .await;
    let letters = env.dead_letters().await;
    assert_eq!(letters.len(), 1, "{letters:?}");
    assert_eq!(letters[0].reason, "expired");
    assert_eq!(letters[0].job_id, "short-lived");
    assert!(
        letters[0].detail.contains("AMQP expiration"),
        "{:?}",
        letters[0].detail
    );
    env.cleanup().await;
}

/// Acks coalesced with `multiple` settle exactly what was asked: deliveries
/// of six tenants (over the work queues their hashes pick) on one channel,
/// acked out of order, some handed
/// back, one never settled. The one never settled returns to its queue when
/// the channel closes (a `multiple` that covered it would have lost it),
/// the ones handed back come again, and every other is gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn coalesced_acks_never_settle_a_delivery_still_in_work() {
    use futures::StreamExt;

    let env = TestEnv::new("http://127.0.0.1:9").await;
    let tenants = ["acme", "globex", "initech", "umbrella", "hooli", "stark"];
    for i in 0..48 {
        let tenant = tenants[i % tenants.len()];
        env.publish_raw(tenant, format!(r#"{{"n":{i}}}"#).as_bytes())
            .await;
    }
    let mut consumption = env.broker.consume("acks-test", 64).await.unwrap();
    let mut deliveries = Vec::new();
    while deliveries.len() < 48 {
        let next = tokio::time::timeout(Duration::from_secs(10), consumption.deliveries.next())
            .await
            .expect("all 48 delivered")
            .expect("the consumer lives")
            .1
            .unwrap();
        deliveries.push(next);
    }
    let tenants_seen: HashSet<_> = deliveries.iter().map(|d| d.routing_key.clone()).collect();
    assert!(
        tenants_seen.len() > 1,
        "the deliveries are of several tenants"
    );
    deliveries.sort_by_key(|d| d.delivery_tag);
    // The lowest tag stays in work; three in the middle are handed back.
    let held = deliveries.remove(0);
    let back: Vec<_> = deliveries.drain(4..7).collect();
    let acks = consumption.acks.clone();
    for d in &back {
        acks.requeue(&d.acker, d.delivery_tag).await.unwrap();
    }
    // The rest acked all at once, highest tags first.
    let acking = deliveries
        .iter()
        .rev()
        .map(|d| acks.ack(d))
        .collect::<Vec<_>>();
    for acked in futures::future::join_all(acking).await {
        acked.unwrap();
    }
    // The three handed back come again; acked now, they leave too.
    for _ in 0..3 {
        let again = tokio::time::timeout(Duration::from_secs(10), consumption.deliveries.next())
            .await
            .expect("a delivery handed back comes again")
            .expect("the consumer lives")
            .1
            .unwrap();
        assert!(again.redelivered);
        acks.ack(&again).await.unwrap();
    }
    consumption.control.close().await;
    drop(consumption);
    wait_for(
        "the delivery never settled to return to its queue",
        Duration::from_secs(10),
        || async { env.pending().await == 1 },
    )
    .await;
    let (_conn, channel) = env.raw_channel().await;
    let mut left = Vec::new();
    for queue in env.broker.topology().queues(ShardQueue::Work) {
        while let Some(msg) = channel
            .basic_get(queue.as_str().into(), BasicGetOptions::default())
            .await
            .unwrap()
        {
            left.push(msg.delivery.data.clone());
        }
    }
    assert_eq!(left, vec![held.data.clone()], "only the one never settled");
    env.cleanup().await;
}

/// A look-ahead consumer takes a work queue's deliveries past its main
/// consumer's prefetch, on the same channel (the same acks settle them),
/// and once cancelled takes no more: the rest come by the main consumer,
/// each message once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_look_ahead_takes_deliveries_past_the_prefetch_until_cancelled() {
    use tollgate_amqp::{Source, Via};

    const JOBS: usize = 30;
    let main = Source::Lane {
        queue: 0,
        via: Via::Main,
    };
    let env = TestEnv::new_with("http://127.0.0.1:9", |c| c.shards = 1).await;
    for i in 0..JOBS {
        env.publish_raw("acme", format!(r#"{{"n":{i}}}"#).as_bytes())
            .await;
    }
    // One delivery per queue by the main consumers.
    let mut consumption = env.broker.consume("ahead-test", 1).await.unwrap();
    let (source, first) = next_delivery(&mut consumption).await;
    assert_eq!(source, main);
    let ahead = consumption.control.look_ahead(0, 8).await.unwrap();
    consumption.deliveries.push(ahead);
    let mut bodies = HashSet::from([first.data.clone()]);
    let mut by_ahead = Vec::new();
    for _ in 0..8 {
        let (source, delivery) = next_delivery(&mut consumption).await;
        assert_eq!(
            source,
            Source::Lane {
                queue: 0,
                via: Via::Ahead
            },
            "the main consumer's one delivery is still in hand"
        );
        assert!(bodies.insert(delivery.data.clone()), "delivered once");
        by_ahead.push(delivery);
    }
    consumption.control.stop_looking_ahead(0).await.unwrap();
    for delivery in by_ahead.iter().chain([&first]) {
        consumption.acks.ack(delivery).await.unwrap();
    }
    while bodies.len() < JOBS {
        let (source, delivery) = next_delivery(&mut consumption).await;
        assert_eq!(source, main, "a cancelled look-ahead takes no more");
        assert!(bodies.insert(delivery.data.clone()), "delivered once");
        consumption.acks.ack(&delivery).await.unwrap();
    }
    // Anything left unacked would return to the queue as the channel closes.
    consumption.control.close().await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(env.pending().await, 0, "every delivery was acked once");
    env.cleanup().await;
}

async fn next_delivery(
    consumption: &mut tollgate_amqp::Consumption,
) -> (
    tollgate_amqp::Source,
    tollgate_amqp::lapin::message::Delivery,
) {
    use futures::StreamExt;
    let (source, delivery) =
        tokio::time::timeout(Duration::from_secs(10), consumption.deliveries.next())
            .await
            .expect("a delivery")
            .expect("the consumers live");
    (source, delivery.unwrap())
}
