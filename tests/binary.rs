//! The `tollgate` binary end to end: CLI verbs, the worker process with its
//! HTTP endpoints, and a graceful exit on SIGTERM.

use std::process::{Command, Stdio};
use std::time::Duration;

use tollgate_amqp::ShardQueue;
use tollgate_tests::{
    FakeProvider, TestEnv, WorkerProcess, fake_provider, free_port, tollgate_bin, wait_for,
};

/// Runs `tollgate <args>` against this test's prefix; returns stdout.
fn tollgate(env: &TestEnv, args: &[&str]) -> String {
    tollgate_with(env, args, &[])
}

/// [`tollgate`] with more environment variables.
fn tollgate_with(env: &TestEnv, args: &[&str], vars: &[(&str, &str)]) -> String {
    let out = Command::new(tollgate_bin())
        .args(args)
        .envs(vars.iter().copied())
        .env("TOLLGATE_PREFIX", &env.config.prefix)
        .env("TOLLGATE_SHARDS", env.config.shards.to_string())
        .output()
        .expect("tollgate runs");
    assert!(
        out.status.success(),
        "tollgate {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("utf-8 output")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_binary_runs_a_worker_and_every_verb_works() {
    let provider = FakeProvider::start(fake_provider::always_ok())
        .await
        .unwrap();
    let env = TestEnv::new(&provider.url()).await;

    let out = tollgate(&env, &["topology", "declare"]);
    assert!(
        out.contains(&format!("{}.jobs", env.config.prefix)),
        "{out}"
    );
    let out = tollgate(
        &env,
        &["quota", "set", "acme", "--rate", "50/s", "--burst", "2"],
    );
    assert_eq!(out.trim(), "tenant:acme: default quota → 50/s burst 2");
    let out = tollgate(&env, &["quota", "get", "acme"]);
    assert!(
        out.starts_with("tenant:acme: 50/s burst 2 (changed by cli:"),
        "{out}"
    );
    // Who acted: --actor, else $USER@hostname (it was `cli:unknown`).
    tollgate(
        &env,
        &[
            "quota", "set", "alice-t", "--rate", "5/s", "--actor", "alice",
        ],
    );
    tollgate_with(&env, &["tenant", "pause", "alice-t"], &[("USER", "bob")]);
    let out = tollgate(&env, &["quota", "history", "alice-t"]);
    let whos: Vec<&str> = out
        .lines()
        .filter_map(|l| l.split_whitespace().nth(3))
        .collect();
    assert_eq!(whos.len(), 2, "{out}");
    assert!(whos[0].starts_with("cli:bob@"), "{out}");
    assert_eq!(whos[1], "cli:alice", "{out}");
    let bad = Command::new(tollgate_bin())
        .args(["tenant", "resume", "alice-t", "--actor", ""])
        .env("TOLLGATE_PREFIX", &env.config.prefix)
        .output()
        .unwrap();
    assert_eq!(bad.status.code(), Some(64), "an empty --actor is bad usage");
    // TOLLGATE_ACTOR, as --help says (it was refused as an unknown setting).
    tollgate_with(
        &env,
        &["tenant", "resume", "alice-t"],
        &[("TOLLGATE_ACTOR", "carol")],
    );
    let out = tollgate(&env, &["quota", "history", "alice-t", "--limit", "1"]);
    assert!(out.contains(" cli:carol "), "{out}");
    // A worker with nowhere to send is bad configuration, like any other.
    let no_route = Command::new(tollgate_bin())
        .arg("worker")
        .env("TOLLGATE_PREFIX", &env.config.prefix)
        .env_remove("TOLLGATE_PROVIDER_URL")
        .output()
        .unwrap();
    assert_eq!(no_route.status.code(), Some(64), "{no_route:?}");
    assert!(
        String::from_utf8_lossy(&no_route.stderr).contains("no provider route"),
        "{no_route:?}"
    );
    // A weight alone keeps the quota; a rate without --weight clears it.
    let out = tollgate(&env, &["quota", "set", "acme", "--weight", "3"]);
    assert_eq!(
        out.trim(),
        "tenant:acme: 50/s burst 2 → 50/s burst 2, weight 3"
    );
    let bad = Command::new(tollgate_bin())
        .args(["quota", "set", "--route", "email", "--weight", "2"])
        .env("TOLLGATE_PREFIX", &env.config.prefix)
        .output()
        .unwrap();
    assert!(!bad.status.success());
    assert!(
        String::from_utf8_lossy(&bad.stderr).contains("--weight applies to tenants"),
        "{bad:?}"
    );
    for (args, refusal) in [
        (&["--weight", "0"][..], "weight 0 is not between 1 and 1000"),
        (
            &["--rate", "20/s", "--concurrency", "0"],
            "concurrency must be at least 1",
        ),
    ] {
        let bad = Command::new(tollgate_bin())
            .args(["quota", "set", "acme"])
            .args(args)
            .env("TOLLGATE_PREFIX", &env.config.prefix)
            .output()
            .unwrap();
        assert_eq!(bad.status.code(), Some(2), "clap's usage error: {args:?}");
        assert!(
            String::from_utf8_lossy(&bad.stderr).contains(refusal),
            "{bad:?}"
        );
    }
    // An adaptive quota: the rate is the ceiling; get shows what is learned.
    let out = tollgate(
        &env,
        &[
            "quota",
            "set",
            "globex",
            "--rate",
            "20/s",
            "--adaptive",
            "--min",
            "2/s",
        ],
    );
    assert!(
        out.contains("→ 20/s burst 1, adaptive (min 2/s, decrease 0.7, increase 0.05, probe 8 s)"),
        "{out}"
    );
    let out = tollgate(&env, &["quota", "get", "globex"]);
    assert!(out.contains("effective 20/s"), "{out}");
    for (args, says) in [
        (
            vec!["--rate", "20/s", "--adaptive", "--min", "30/s"],
            "--min 30/s is above the rate 20/s",
        ),
        (
            vec!["--rate", "20/s", "--adaptive", "--min", "fast"],
            "is not of the form N/s",
        ),
        (vec!["--rate", "20/s", "--min", "2/s"], "--adaptive"),
        (
            vec!["--rate", "20/s", "--shadow", "--adaptive"],
            "not to --shadow",
        ),
    ] {
        let bad = Command::new(tollgate_bin())
            .args(["quota", "set", "globex"])
            .args(&args)
            .env("TOLLGATE_PREFIX", &env.config.prefix)
            .output()
            .unwrap();
        assert!(!bad.status.success(), "{args:?}");
        let stderr = String::from_utf8_lossy(&bad.stderr);
        assert!(stderr.contains(says), "{args:?}: {stderr}");
    }
    let out = tollgate(&env, &["quota", "get", "globex"]);
    assert!(out.contains("min 2/s"), "nothing changed: {out}");
    let out = tollgate(&env, &["quota", "get", "nobody"]);
    assert!(
        out.contains("the default 10/s burst 1 (from config) applies"),
        "{out}"
    );
    let out = tollgate(&env, &["quota", "list"]);
    assert!(
        out.lines()
            .any(|l| l.starts_with("tenant:acme") && l.contains("50/s burst 2")),
        "{out}"
    );

    let port = free_port();
    // On one runtime thread, the least `runtime_threads` takes: every
    // verb below works against it as against the default two.
    let mut worker = WorkerProcess::command(&env, &provider.url(), port)
        .env("TOLLGATE_LOG_FORMAT", "json")
        .env("TOLLGATE_RUNTIME_THREADS", "1")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("worker starts");
    let http = reqwest::Client::new();
    let base = format!("http://127.0.0.1:{port}");
    wait_for("/readyz to answer 200", Duration::from_secs(20), || async {
        http.get(format!("{base}/readyz"))
            .send()
            .await
            .is_ok_and(|r| r.status() == 200)
    })
    .await;
    let health = http.get(format!("{base}/healthz")).send().await.unwrap();
    assert_eq!(health.status(), 200);

    tollgate(
        &env,
        &[
            "publish",
            "--tenant",
            "acme",
            "--count",
            "20",
            "--payload",
            r#"{"to":"x"}"#,
        ],
    );
    tollgate(
        &env,
        &[
            "publish", "--tenant", "acme", "--due-in", "1500ms", "--id", "later-1",
        ],
    );
    // A payload read from a file (`@-` reads stdin the same way).
    let file = std::env::temp_dir().join(format!("{}-payload.json", env.config.prefix));
    std::fs::write(&file, r#"{"to":"from-a-file"}"#).unwrap();
    let at_file = format!("@{}", file.display());
    tollgate(
        &env,
        &[
            "publish",
            "--tenant",
            "acme",
            "--id",
            "filed-1",
            "--payload",
            &at_file,
        ],
    );
    std::fs::remove_file(&file).unwrap();
    wait_for("22 sends", Duration::from_secs(20), || async {
        provider.accepted() >= 22
    })
    .await;
    let filed = provider
        .received()
        .into_iter()
        .find(|r| r.job_id == "filed-1")
        .unwrap();
    assert_eq!(filed.body, r#"{"to":"from-a-file"}"#);
    let later = provider
        .received()
        .into_iter()
        .find(|r| r.job_id == "later-1")
        .unwrap();
    assert_eq!(later.body, "{}");
    assert!(
        provider
            .received()
            .iter()
            .filter(|r| r.job_id != "later-1" && r.job_id != "filed-1")
            .all(|r| r.body == r#"{"to":"x"}"#)
    );

    let scrape = || async {
        http.get(format!("{base}/metrics"))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap()
    };
    // The provider counts a send before the worker has recorded it and let
    // its delivery go.
    wait_for(
        "the last delivery let go",
        Duration::from_secs(20),
        || async { scrape().await.contains("tollgate_jobs_in_flight 0") },
    )
    .await;
    let metrics = scrape().await;
    for line in [
        r#"tollgate_jobs_completed_total{outcome="sent",tenant="acme"} 22"#,
        r#"tollgate_provider_requests_total{outcome="sent",route="default",tenant="acme"} 22"#,
        r#"tollgate_parked_total{reason="not_due",tenant="acme"} 1"#,
        "tollgate_jobs_in_flight 0",
    ] {
        assert!(metrics.contains(line), "missing {line:?} in\n{metrics}");
    }
    for family in [
        "tollgate_queue_age_seconds_bucket",
        "tollgate_due_lag_seconds_bucket",
        "tollgate_quota_wait_seconds_bucket",
    ] {
        assert!(
            metrics.contains(&format!("{family}{{tenant=\"acme\"")),
            "{family} missing"
        );
    }

    // A malformed message shows up in `dlq list`.
    env.publish_raw("acme", b"{oops").await;
    wait_for("the dead letter", Duration::from_secs(10), || async {
        !env.dead_letters().await.is_empty()
    })
    .await;
    let out = tollgate(&env, &["dlq", "list"]);
    assert!(out.contains("1 dead letter"), "{out}");
    assert!(
        out.lines().any(|l| l.starts_with("malformed")
            && l.contains("acme")
            && l.trim_end().ends_with('1')),
        "{out}"
    );
    assert!(out.contains("body is not a valid job"), "{out}");

    // SIGTERM: the worker drains and exits 0.
    let pid = worker.id().to_string();
    assert!(
        Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .unwrap()
            .success()
    );
    let status = tokio::task::spawn_blocking(move || {
        let status = worker.wait().expect("wait for worker");
        let mut logs = String::new();
        use std::io::Read;
        worker
            .stderr
            .take()
            .unwrap()
            .read_to_string(&mut logs)
            .unwrap();
        (status, logs)
    })
    .await
    .unwrap();
    assert!(
        status.0.success(),
        "worker exit: {:?}\n{}",
        status.0,
        status.1
    );
    // One JSON line per decision, never the payload.
    let decisions: Vec<serde_json::Value> = status
        .1
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .filter(|v: &serde_json::Value| v["message"] == "decision")
        .collect();
    assert!(decisions.len() >= 21, "{} decision lines", decisions.len());
    for d in &decisions {
        for field in [
            "job_id",
            "tenant_id",
            "decision",
            "wait_ms",
            "attempt",
            "idempotency_key",
        ] {
            assert!(!d[field].is_null(), "{field} missing in {d}");
        }
    }
    assert!(
        !status.1.contains(r#"\"to\":\"x\""#) && !status.1.contains(r#""to":"x""#),
        "payload leaked into logs"
    );
    env.cleanup().await;
}

/// An empty `TOLLGATE_ADMIN_TOKEN=` (or an empty mounted token file) once
/// opened the admin API to anyone: now the worker refuses to start, exit 64,
/// naming the setting.
#[test]
fn a_worker_refuses_an_empty_or_short_admin_token() {
    let dir = std::env::temp_dir().join(format!("tollgate-token-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let empty_file = dir.join("admin-token");
    std::fs::write(&empty_file, "\n").unwrap();
    let cases: [(&str, String, &str); 3] = [
        (
            "TOLLGATE_ADMIN_TOKEN",
            String::new(),
            "TOLLGATE_ADMIN_TOKEN",
        ),
        (
            "TOLLGATE_ADMIN_TOKEN",
            "short-token".into(),
            "TOLLGATE_ADMIN_TOKEN",
        ),
        (
            "TOLLGATE_ADMIN_TOKEN_FILE",
            empty_file.display().to_string(),
            "TOLLGATE_ADMIN_TOKEN_FILE",
        ),
    ];
    for (key, value, named) in cases {
        let mut child = Command::new(tollgate_bin())
            .arg("worker")
            .env("TOLLGATE_PROVIDER_URL", "http://127.0.0.1:9/send")
            .env("TOLLGATE_HTTP_ADDR", "127.0.0.1:0")
            .env(
                "TOLLGATE_PREFIX",
                format!("tgtest-token-{}", std::process::id()),
            )
            .env(key, &value)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("tollgate runs");
        // A worker that started despite the token would run forever.
        let started = std::time::Instant::now();
        while child.try_wait().unwrap().is_none() && started.elapsed() < Duration::from_secs(20) {
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = child.kill();
        let out = child.wait_with_output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(
            out.status.code(),
            Some(64),
            "{key}={value:?} must refuse to start: {stderr}"
        );
        assert!(
            stderr.contains(named) && stderr.contains("at least 16"),
            "{key}={value:?}: the error names {named}: {stderr}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// A runtime of no threads would never run a task: refused before anything
/// starts, exit 64, naming the setting.
#[test]
fn a_runtime_of_no_threads_is_refused_by_name() {
    let out = Command::new(tollgate_bin())
        .args(["quota", "get", "acme"])
        .env("TOLLGATE_RUNTIME_THREADS", "0")
        .env(
            "TOLLGATE_PREFIX",
            format!("tgtest-threads-{}", std::process::id()),
        )
        .output()
        .expect("tollgate runs");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(64), "{stderr}");
    assert!(
        stderr.contains("runtime_threads must be at least 1"),
        "{stderr}"
    );
}

/// A queue argument changed by configuration (here `delivery_limit`) cannot
/// be applied to a queue that exists: the error says which setting, where
/// the procedure is, and quotes the broker once (it quoted it three times,
/// naming no setting).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_changed_queue_argument_is_named_with_the_way_out() {
    let env = TestEnv::new("http://127.0.0.1:9/unused").await;
    let changed = env.config.delivery_limit + 1;
    let out = Command::new(tollgate_bin())
        .args(["topology", "declare"])
        .env("TOLLGATE_PREFIX", &env.config.prefix)
        .env("TOLLGATE_SHARDS", env.config.shards.to_string())
        .env("TOLLGATE_DELIVERY_LIMIT", changed.to_string())
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    let ours = stderr
        .lines()
        .find(|l| l.starts_with("tollgate: "))
        .unwrap_or_else(|| panic!("no error line: {stderr}"));
    assert!(ours.contains("exists with other arguments"), "{ours}");
    assert!(ours.contains("delivery_limit"), "{ours}");
    assert!(
        ours.contains("Changing queue arguments needs new queues"),
        "{ours}"
    );
    assert_eq!(ours.matches("inequivalent arg").count(), 1, "{ours}");
    env.cleanup().await;
}

/// `publish` publishes into an installation and never declares one: under a
/// prefix nobody declared it says so at once (it used to build a whole
/// installation nobody served, and with a larger `shards` than the fleet's,
/// bind work queues no worker consumed, stranding jobs for good); and a job
/// the workers would dead-letter as malformed is refused before it is sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publish_never_declares_and_refuses_what_workers_would_dead_letter() {
    let env = TestEnv::new("http://127.0.0.1:9/unused").await;
    let publish = |prefix: &str, args: &[&str]| {
        Command::new(tollgate_bin())
            .args(["publish", "--tenant", "acme"])
            .args(args)
            .env("TOLLGATE_PREFIX", prefix)
            .env("TOLLGATE_SHARDS", (env.config.shards + 2).to_string())
            .output()
            .unwrap()
    };
    let nobody = format!("{}-typo", env.config.prefix);
    let out = publish(&nobody, &[]);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("tollgate topology declare"), "{stderr}");
    assert!(!stderr.contains("retrying"), "refused at once: {stderr}");
    let mut typo = env.config.clone();
    typo.prefix = nobody;
    let broker = tollgate::cli::connect_broker(&typo, "test").await.unwrap();
    assert!(
        matches!(
            broker.check_installed().await,
            Err(tollgate_amqp::AmqpError::NotInstalled(_))
        ),
        "the failed publish declared nothing"
    );
    broker.close().await;

    // Into the real installation, with more shards than it has: no work
    // queue of its own is bound.
    let out = publish(&env.config.prefix, &["--count", "3"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let extra = env
        .broker
        .queue_depth(
            &env.broker
                .topology()
                .queue(ShardQueue::Work, env.config.shards),
        )
        .await;
    assert!(
        extra.is_err(),
        "a work queue past the fleet's shards: {extra:?}"
    );
    assert_eq!(env.pending().await, 3);

    let out = publish(&env.config.prefix, &["--count", "0"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--count must be at least 1"));

    let out = publish(
        &env.config.prefix,
        &["--due-in", "1h", "--expires-in", "10m"],
    );
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("expires_at is before due_at"), "{stderr}");
    assert_eq!(env.pending().await, 3, "nothing more was published");
    env.cleanup().await;
}
