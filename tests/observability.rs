//! What operators see: the label set of every metric is pinned, no job id
//! or key is ever a label value, and a job's payload never reaches a log
//! line or a metric — checked on a real worker process doing real work.

use std::collections::{BTreeMap, BTreeSet};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use tollgate_tests::{FakeProvider, Received, Reply, TestEnv, WorkerProcess, free_port, wait_for};

/// Every family and its label names, as the README and the dashboards name them.
fn pinned() -> BTreeMap<&'static str, Vec<&'static str>> {
    BTreeMap::from([
        ("tollgate_queue_age_seconds", vec!["le", "tenant"]),
        ("tollgate_due_lag_seconds", vec!["le", "tenant"]),
        ("tollgate_quota_wait_seconds", vec!["le", "tenant"]),
        (
            "tollgate_permit_decisions_total",
            vec!["decision", "tenant"],
        ),
        (
            "tollgate_shadow_decisions_total",
            vec!["decision", "tenant"],
        ),
        (
            "tollgate_provider_requests_total",
            vec!["outcome", "route", "tenant"],
        ),
        (
            "tollgate_provider_request_duration_seconds",
            vec!["le", "outcome", "route"],
        ),
        ("tollgate_redis_call_duration_seconds", vec!["call", "le"]),
        ("tollgate_jobs_completed_total", vec!["outcome", "tenant"]),
        ("tollgate_parked_total", vec!["reason", "tenant"]),
        ("tollgate_dead_letters_total", vec!["reason", "tenant"]),
        ("tollgate_tier_publishes_total", vec!["tier"]),
        ("tollgate_look_aheads_total", vec!["lane"]),
        ("tollgate_redelivered_total", vec!["lane"]),
        ("tollgate_jobs_in_flight", vec![]),
        ("tollgate_consuming", vec![]),
        ("tollgate_build_info", vec!["version"]),
        ("tollgate_tenant_label_overflow_total", vec![]),
    ])
}

/// Families exported only once their event happens, which this run does
/// not force: a permit let go as late (a pod too busy to call within the
/// leeway, as on a loaded CI box), an adaptive quota's learned rate. Their
/// labels are pinned all the same when they appear.
fn when_they_happen() -> BTreeMap<&'static str, Vec<&'static str>> {
    BTreeMap::from([
        ("tollgate_late_permits_total", vec!["tenant"]),
        ("tollgate_quota_effective_rate", vec!["tenant"]),
        ("tollgate_route_effective_rate", vec!["route"]),
    ])
}

/// (family, label name → values) from the text exposition.
fn parse(text: &str) -> BTreeMap<String, BTreeMap<String, BTreeSet<String>>> {
    let mut out: BTreeMap<String, BTreeMap<String, BTreeSet<String>>> = BTreeMap::new();
    for line in text
        .lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
    {
        let (name, labels) = match line.split_once('{') {
            Some((name, rest)) => (name, rest.rsplit_once('}').map(|(l, _)| l).unwrap_or("")),
            None => (line.split_whitespace().next().unwrap_or(""), ""),
        };
        let family = ["_bucket", "_sum", "_count"]
            .iter()
            .find_map(|s| name.strip_suffix(s))
            .unwrap_or(name);
        let entry = out.entry(family.to_owned()).or_default();
        for pair in labels.split("\",").filter(|p| !p.is_empty()) {
            let (k, v) = pair.split_once("=\"").expect("label=\"value\"");
            entry
                .entry(k.to_owned())
                .or_default()
                .insert(v.trim_end_matches('"').to_owned());
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn labels_are_pinned_and_payloads_never_leak() {
    const CANARY: &str = "CANARY-7f3e-payload-must-not-leak";
    // Every outcome: sent, throttled once, failed then exhausted, rejected.
    let provider = FakeProvider::start(Arc::new(|r: &Received, earlier: usize| {
        match r.tenant.as_str() {
            "busy" if earlier == 0 => Reply::throttled("1"),
            "broken" => Reply::status(503),
            "picky" => Reply::status(400),
            _ => Reply::ok(),
        }
    }))
    .await
    .unwrap();
    let env = TestEnv::new(&provider.url()).await;
    env.set_quota("calm", "100/s", 10).await;
    env.change(
        tollgate_quota::Target::Tenant(TestEnv::tenant("calm")),
        tollgate_quota::Change::SetShadow(
            tollgate_core::Quota::new("1/s".parse().unwrap(), 1).unwrap(),
        ),
    )
    .await;

    let port = free_port();
    let log_path = std::env::temp_dir().join(format!("{}.log", env.config.prefix));
    let log = std::fs::File::create(&log_path).unwrap();
    let mut worker = WorkerProcess::command(&env, &provider.url(), port)
        .env("TOLLGATE_LOG_FORMAT", "json")
        .env("TOLLGATE_MAX_ATTEMPTS", "2")
        .env("TOLLGATE_BACKOFF_BASE_MS", "50")
        .env("RUST_LOG", "debug")
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .unwrap();

    let payload = format!(r#"{{"to":"{CANARY}","secret":"{CANARY}"}}"#);
    let mut jobs = Vec::new();
    for tenant in ["calm", "busy", "broken", "picky"] {
        jobs.extend(
            env.publish(tenant, 3, |a| a.payload = payload.clone())
                .await,
        );
    }
    jobs.extend(
        env.publish("calm", 2, |a| {
            a.payload = payload.clone();
            a.due_in = Some(Duration::from_millis(1_500));
        })
        .await,
    );
    // A malformed message carrying the canary too.
    env.publish_raw(
        "calm",
        format!(r#"{{"id":"bad","payload":"{CANARY}"}}"#).as_bytes(),
    )
    .await;

    wait_for("every job to end", Duration::from_secs(30), || async {
        let http = reqwest::Client::new();
        let Ok(resp) = http
            .get(format!("http://127.0.0.1:{port}/metrics"))
            .send()
            .await
        else {
            return false;
        };
        let text = resp.text().await.unwrap_or_default();
        let done: f64 = text
            .lines()
            .filter(|l| l.starts_with("tollgate_jobs_completed_total{"))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum();
        done >= 15.0
    })
    .await;
    let text = reqwest::get(format!("http://127.0.0.1:{port}/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let families = parse(&text);

    let expected: BTreeMap<_, _> = pinned().into_iter().chain(when_they_happen()).collect();
    for (family, labels) in &families {
        let want = expected
            .get(family.as_str())
            .unwrap_or_else(|| panic!("unpinned metric family {family}"));
        let have: Vec<&str> = labels.keys().map(String::as_str).collect();
        assert_eq!(&have, want, "labels of {family}");
    }
    for family in pinned().keys() {
        assert!(families.contains_key(*family), "{family} was not exported");
    }
    // Every job above asked Redis for a permit, and every one that reached
    // the provider for a record of its call: both series counted them.
    for call in ["permit", "complete"] {
        let series = format!("tollgate_redis_call_duration_seconds_count{{call=\"{call}\"}} ");
        let count: f64 = text
            .lines()
            .find_map(|l| l.strip_prefix(&series)?.parse().ok())
            .unwrap_or_else(|| panic!("no {series}"));
        assert!(count >= 12.0, "{series}{count}: fewer calls than jobs");
    }
    // No id, key or payload ever becomes a label value or appears at all.
    let values: BTreeSet<&String> = families
        .values()
        .flat_map(|l| l.values().flatten())
        .collect();
    for job in &jobs {
        assert!(
            !values.contains(&job.id.to_string()),
            "job id {} is a label",
            job.id
        );
        assert!(
            !text.contains(job.idempotency_key.as_str()),
            "key {} in /metrics",
            job.idempotency_key
        );
    }
    assert!(!text.contains(CANARY), "the payload reached /metrics");
    let outcomes = &families["tollgate_provider_requests_total"]["outcome"];
    assert_eq!(
        outcomes.iter().map(String::as_str).collect::<Vec<_>>(),
        ["failed", "rejected", "sent", "throttled"],
        "the run produced every provider outcome"
    );

    assert!(
        Command::new("kill")
            .args(["-TERM", &worker.id().to_string()])
            .status()
            .unwrap()
            .success()
    );
    assert!(worker.wait().unwrap().success());
    let logs = std::fs::read_to_string(&log_path).unwrap();
    let _ = std::fs::remove_file(&log_path);
    let decisions = logs.lines().filter(|l| l.contains("\"decision\"")).count();
    assert!(
        decisions >= 15,
        "only {decisions} decision lines at debug level"
    );
    assert!(!logs.contains(CANARY), "the payload reached a log line");
    assert!(
        !logs.contains("guest:guest"),
        "a credential reached a log line"
    );
    env.cleanup().await;
}
