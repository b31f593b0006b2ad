//! Bad input ends in the dead-letter queue with a precise reason, and
//! nothing else is affected.

use std::time::Duration;

use tollgate_tests::{FakeProvider, TestEnv, fake_provider, wait_for};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_messages_are_dead_lettered_and_good_jobs_around_them_are_sent() {
    let provider = FakeProvider::start(fake_provider::always_ok())
        .await
        .unwrap();
    let env = TestEnv::new(&provider.url()).await;
    let worker = env.spawn_worker_with(|c| c.max_body_bytes = 4096).await;

    let oversized = format!(
        r#"{{"id":"big","tenant":"acme","payload":"{}"}}"#,
        "x".repeat(5000)
    );
    let bad: [(&str, Vec<u8>, &str); 8] = [
        ("acme", b"this is not json".to_vec(), "not a valid job"),
        ("acme", br#"{"id":"m1"}"#.to_vec(), "missing field `tenant`"),
        (
            "bad tenant!",
            br#"{"id":"m2","tenant":"bad tenant!"}"#.to_vec(),
            "invalid tenant",
        ),
        (
            "acme",
            br#"{"id":"m3","tenant":"acme","due_at":"next tuesday"}"#.to_vec(),
            "invalid due_at",
        ),
        ("acme", oversized.into_bytes(), "the limit is 4096"),
        (
            "acme",
            br#"{"id":"m5","tenant":"acme","kind":"fax"}"#.to_vec(),
            "unknown kind",
        ),
        // A tenant named like a route's hash tag would take that route's
        // quota as its own, and its permits from the route's bucket.
        (
            "route:email",
            br#"{"id":"m7","tenant":"route:email"}"#.to_vec(),
            "names a route's keys",
        ),
        // The error quotes the field's name: its escape sequence must not
        // reach the detail header (nor `dlq list`'s terminal).
        (
            "acme",
            br#"{"id":"m6","tenant":"acme","\u001b[2Jx":1}"#.to_vec(),
            "unknown field `?[2Jx`",
        ),
    ];
    let mut good = Vec::new();
    for (routing_key, body, _) in &bad {
        good.extend(env.publish("acme", 5, |_| {}).await);
        env.publish_raw(routing_key, body).await;
    }
    good.extend(env.publish("acme", 5, |_| {}).await);

    wait_for("every good job sent", Duration::from_secs(30), || async {
        provider.accepted() >= good.len()
    })
    .await;
    wait_for(
        "every bad message dead-lettered",
        Duration::from_secs(10),
        || async { env.dead_letters().await.len() >= bad.len() },
    )
    .await;

    let letters = env.dead_letters().await;
    assert_eq!(letters.len(), bad.len());
    for (_, _, expected) in &bad {
        let hit = letters.iter().find(|l| l.detail.contains(expected));
        let letter =
            hit.unwrap_or_else(|| panic!("no dead letter says {expected:?}: {letters:#?}"));
        assert_eq!(letter.reason, "malformed");
    }
    for letter in &letters {
        assert!(
            !letter.detail.chars().any(char::is_control),
            "{:?}",
            letter.detail
        );
    }
    assert_eq!(
        provider.received().len(),
        good.len(),
        "no bad message reached the provider"
    );
    assert!(worker.is_running(), "the worker survived");
    assert_eq!(
        worker
            .metrics
            .counter_sum("tollgate_dead_letters_total", &[("reason", "malformed")]),
        bad.len() as f64
    );
    worker.stop().await.unwrap();
    env.cleanup().await;
}
