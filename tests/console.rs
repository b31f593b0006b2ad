//! The operator console in a real browser: headless Chromium driven over
//! WebDriver (chromedriver), against a real admin API on a real Redis.
//! `make test` installs Debian's `chromium` and `chromium-driver` when they
//! are missing. Screenshots of the pages go to `target/console-screenshots/`.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use base64::Engine;
use serde_json::{Value, json};
use tollgate_core::Quota;
use tollgate_quota::{Actor, Change, Target};
use tollgate_tests::{FakeProvider, TestEnv, fake_provider, free_port, wait_for};

const TOKEN: &str = "console-test-token-0123456789";
/// How long the page gets to show what a step waits for.
const PATIENCE: Duration = Duration::from_secs(20);

/// The W3C WebDriver element reference key.
const ELEMENT: &str = "element-6066-11e4-a52e-4f735466cecf";

/// A chromedriver process and one headless Chromium session in it.
struct Browser {
    driver: Child,
    http: reqwest::Client,
    session: String,
    _profile: TempDir,
}

struct TempDir(PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn executable(names: &[&str]) -> String {
    for name in names {
        for dir in ["/usr/bin", "/usr/local/bin", "/usr/lib/chromium"] {
            let path = format!("{dir}/{name}");
            if std::path::Path::new(&path).exists() {
                return path;
            }
        }
    }
    panic!(
        "{} not found: install Debian's chromium and chromium-driver (`make test` does)",
        names.join(" or ")
    );
}

impl Browser {
    async fn start() -> Self {
        let chromedriver = executable(&["chromedriver"]);
        let chromium = executable(&["chromium", "chromium-browser"]);
        let port = free_port();
        let driver = Command::new(chromedriver)
            .arg(format!("--port={port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("chromedriver starts");
        let base = format!("http://127.0.0.1:{port}");
        let http = reqwest::Client::new();
        let deadline = Instant::now() + PATIENCE;
        while http.get(format!("{base}/status")).send().await.is_err() {
            assert!(Instant::now() < deadline, "chromedriver never listened");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let profile = std::env::temp_dir().join(format!(
            "tollgate-console-{}",
            uuid::Uuid::new_v4().simple()
        ));
        let args = [
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--window-size=1280,900",
        ]
        .iter()
        .map(|a| a.to_string())
        .chain([format!("--user-data-dir={}", profile.display())])
        .collect::<Vec<_>>();
        let created: Value = http
            .post(format!("{base}/session"))
            .json(&json!({"capabilities": {"alwaysMatch": {
                "browserName": "chrome",
                "goog:chromeOptions": {"binary": chromium, "args": args},
            }}}))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        let session = created["value"]["sessionId"]
            .as_str()
            .unwrap_or_else(|| panic!("a browser session: {created}"))
            .to_owned();
        Self {
            driver,
            http,
            session: format!("{base}/session/{session}"),
            _profile: TempDir(profile),
        }
    }

    async fn call(&self, method: reqwest::Method, path: &str, body: Value) -> Value {
        let request = self.http.request(method, format!("{}{path}", self.session));
        let request = if body.is_null() {
            request
        } else {
            request.json(&body)
        };
        let reply: Value = request.send().await.unwrap().json().await.unwrap();
        reply["value"].clone()
    }

    async fn goto(&self, url: &str) {
        self.call(reqwest::Method::POST, "/url", json!({ "url": url }))
            .await;
    }

    async fn find(&self, css: &str) -> String {
        let found = self
            .call(
                reqwest::Method::POST,
                "/element",
                json!({"using": "css selector", "value": css}),
            )
            .await;
        found[ELEMENT]
            .as_str()
            .unwrap_or_else(|| panic!("no element {css}: {found}"))
            .to_owned()
    }

    async fn fill(&self, css: &str, text: &str) {
        let id = self.find(css).await;
        self.call(
            reqwest::Method::POST,
            &format!("/element/{id}/clear"),
            json!({}),
        )
        .await;
        self.call(
            reqwest::Method::POST,
            &format!("/element/{id}/value"),
            json!({ "text": text }),
        )
        .await;
    }

    /// Clicks the element once the page lets it be clicked: it may not be
    /// shown yet (the page after sign-in), and the page may replace it
    /// between the find and the click (the tenant list re-renders every
    /// 2 s: a click on a row it just replaced is refused as stale).
    async fn click(&self, css: &str) {
        let deadline = Instant::now() + PATIENCE;
        loop {
            let id = self.find(css).await;
            let reply = self
                .call(
                    reqwest::Method::POST,
                    &format!("/element/{id}/click"),
                    json!({}),
                )
                .await;
            match reply["error"].as_str() {
                None => return,
                Some(
                    "stale element reference"
                    | "element not interactable"
                    | "element click intercepted",
                ) if Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                Some(error) => panic!("clicking {css}: {error}: {}", reply["message"]),
            }
        }
    }

    /// The element's rendered text ("" while it is hidden).
    async fn text(&self, css: &str) -> String {
        let id = self.find(css).await;
        let text = self
            .call(
                reqwest::Method::GET,
                &format!("/element/{id}/text"),
                Value::Null,
            )
            .await;
        text.as_str().unwrap_or_default().to_owned()
    }

    async fn value(&self, css: &str) -> String {
        let id = self.find(css).await;
        let value = self
            .call(
                reqwest::Method::GET,
                &format!("/element/{id}/property/value"),
                Value::Null,
            )
            .await;
        value.as_str().unwrap_or_default().to_owned()
    }

    /// Waits until the element's text contains `wanted`; returns the text.
    async fn until_text(&self, css: &str, wanted: &str) -> String {
        let deadline = Instant::now() + PATIENCE;
        loop {
            let text = self.text(css).await;
            if text.contains(wanted) {
                return text;
            }
            assert!(
                Instant::now() < deadline,
                "{css} never showed {wanted:?}; it shows {text:?}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    async fn screenshot(&self, name: &str) {
        let png = self
            .call(reqwest::Method::GET, "/screenshot", Value::Null)
            .await;
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(png.as_str().expect("a screenshot"))
            .unwrap();
        let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/console-screenshots");
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join(format!("{name}.png")), bytes).unwrap();
    }

    async fn quit(mut self) {
        self.call(reqwest::Method::DELETE, "", Value::Null).await;
        let _ = self.driver.kill();
        let _ = self.driver.wait();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_signs_in_sees_a_tenant_and_changes_its_quota() {
    let provider = FakeProvider::start(fake_provider::always_ok())
        .await
        .unwrap();
    let env = TestEnv::new(&provider.url()).await;
    let acme = Target::Tenant(TestEnv::tenant("acme"));
    let setup = Actor {
        who: "test".into(),
        source: "cli",
    };
    for (name, rate) in [("acme", "5/s"), ("globex", "2/s")] {
        let change = Change::SetQuota {
            quota: Quota::parse(rate, 1).unwrap(),
            concurrency: None,
            weight: None,
            adaptive: None,
        };
        env.quotas
            .apply(&Target::Tenant(TestEnv::tenant(name)), change, &setup)
            .await
            .unwrap();
    }
    // Traffic: acme has a backlog at 5/s, so it sends and has jobs in line
    // for the whole test (400 jobs last 80 s; a loaded CI machine has taken
    // more than the 8 s that 40 would last just to reach the tenant list);
    // initech, with nothing stored, sends one job on the default quota.
    let worker = env.spawn_worker().await;
    env.publish("acme", 400, |_| {}).await;
    env.publish("initech", 1, |_| {}).await;
    wait_for("acme's first sends and initech's", PATIENCE, || async {
        let received = provider.received();
        received.iter().any(|r| r.tenant == "initech") && received.len() >= 5
    })
    .await;

    let addr = env.serve_admin(TOKEN).await;
    let browser = Browser::start().await;
    browser.goto(&format!("http://{addr}/console/")).await;

    // A wrong token: the sign-in error, and nothing else of the console.
    browser
        .fill("#login-token", "not-the-token-0123456789")
        .await;
    browser.fill("#login-actor", "alice").await;
    browser.click("#login-form button[type=submit]").await;
    let refused = browser
        .until_text("#login-error", "missing or wrong bearer token")
        .await;
    assert!(refused.starts_with("Sign-in refused"), "{refused}");
    assert_eq!(
        browser.text("#tenant-table").await,
        "",
        "the list stays hidden"
    );
    browser.screenshot("login-refused").await;

    // The right one: the tenant list.
    browser.fill("#login-token", TOKEN).await;
    browser.click("#login-form button[type=submit]").await;
    let list = browser.until_text("#tenant-table tbody", "acme").await;
    assert!(list.contains("5/s") && list.contains("globex"), "{list}");
    assert_eq!(browser.text("#actor-name").await, "alice");
    browser.fill("#search", "glo").await;
    let filtered = browser.until_text("#page-info", "1–1 of 1").await;
    assert_eq!(filtered, "1–1 of 1");
    assert!(!browser.text("#tenant-table tbody").await.contains("acme"));
    browser.fill("#search", "").await;
    browser.until_text("#page-info", "1–3 of 3").await;
    let listed = browser.text("#tenant-table tbody").await;
    assert!(
        listed.contains("initech default"),
        "a tenant with traffic and no stored quota is listed on the default: {listed}"
    );
    // acme is sending and waiting for its quota; the fleet-wide figures say so.
    let row = browser
        .until_text("#tenant-table tbody tr:first-child", "quota: ")
        .await;
    assert!(row.contains("job(s) in line"), "{row}");
    // Each pod adds its tally of calls twice a second.
    wait_for(
        "acme's sends counted with their due lags",
        Duration::from_secs(10),
        || async {
            let a = env.activity("acme").await;
            a.sent_per_s_10s > 0.0 && a.due_lag_p95_s.is_some()
        },
    )
    .await;
    let sent = env.activity("acme").await;
    assert!(sent.sent_per_s_10s > 0.0 && sent.queued > 0, "{sent:?}");
    assert!(
        sent.due_lag_p95_s.is_some(),
        "first attempts count their due lag: {sent:?}"
    );
    assert!(row.contains("≤ "), "the due-lag p95 is shown: {row}");
    browser.click("#sort option[value=behind]").await;
    let first = browser
        .until_text("#tenant-table tbody tr:first-child", "acme")
        .await;
    assert!(
        first.contains("in line"),
        "the tenant most behind comes first: {first}"
    );
    browser.screenshot("tenants").await;

    // Open acme, change its quota through the form.
    browser.click("#tenant-table a[href='#tenant=acme']").await;
    browser.until_text("#tenant-settings", "5/s").await;
    assert_eq!(browser.value("#quota-rate").await, "5/s");
    browser.fill("#quota-rate", "7/s").await;
    browser.click("#quota-form button[type=submit]").await;
    browser.until_text("#quota-ok", "Saved: acme 7/s").await;
    let stored = env.quotas.get(&acme).await.unwrap().expect("acme's quota");
    assert_eq!(stored.quota, Some(Quota::parse("7/s", 1).unwrap()));
    let history = env.quotas.history(Some(&acme), 10).await.unwrap();
    assert_eq!(
        history[0].who, "console:alice",
        "audited with the actor typed at sign-in"
    );
    assert_eq!(history[0].source, "console");
    browser.until_text("#history-table", "console:alice").await;
    browser.screenshot("tenant").await;

    // A malformed rate: the CLI's error, and nothing changes.
    browser.fill("#quota-rate", "seven/s").await;
    browser.click("#quota-form button[type=submit]").await;
    let cli_error = Quota::parse("seven/s", 1).unwrap_err().to_string();
    browser.until_text("#quota-error", &cli_error).await;
    let unchanged = env.quotas.get(&acme).await.unwrap().unwrap();
    assert_eq!(unchanged.quota, Some(Quota::parse("7/s", 1).unwrap()));
    assert_eq!(
        env.quotas.history(Some(&acme), 10).await.unwrap().len(),
        history.len()
    );

    // A route's quota, from the same page: stored, audited, listed.
    browser.fill("#shared-target", "email").await;
    browser.fill("#shared-rate", "100/s").await;
    browser.click("#shared-form button[type=submit]").await;
    browser.until_text("#route-table", "route email").await;
    let email = Target::Route(tollgate_core::Kind::parse("email").unwrap());
    let route = env.quotas.get(&email).await.unwrap().expect("stored");
    assert_eq!(route.quota, Some(Quota::parse("100/s", 1).unwrap()));
    assert_eq!(route.updated_by.as_deref(), Some("console:alice"));
    browser.fill("#shared-target", "default").await;
    browser.fill("#shared-rate", "a lot").await;
    browser.click("#shared-form button[type=submit]").await;
    let refused = Quota::parse("a lot", 1).unwrap_err().to_string();
    browser.until_text("#shared-error", &refused).await;
    assert!(env.quotas.get(&Target::Default).await.unwrap().is_none());

    // Pause from the console: stored, and shown.
    browser.click("#pause").await;
    browser.until_text("#tenant-table tbody", "paused").await;
    assert!(env.quotas.get(&acme).await.unwrap().unwrap().paused);

    browser.quit().await;
    worker.stop().await.unwrap();
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_console_pages_forbid_inline_script_and_framing() {
    let env = TestEnv::new("http://127.0.0.1:9/unused").await;
    let addr = env.serve_admin(TOKEN).await;
    let http = reqwest::Client::new();
    for path in ["/console/", "/console/console.js", "/console/console.css"] {
        let page = http
            .get(format!("http://{addr}{path}"))
            .send()
            .await
            .unwrap();
        assert_eq!(page.status(), 200, "{path}");
        let headers = page.headers();
        let csp = headers["content-security-policy"].to_str().unwrap();
        assert!(
            csp.contains("script-src 'self'") && !csp.contains("unsafe"),
            "{csp}"
        );
        assert!(csp.contains("frame-ancestors 'none'"), "{csp}");
        assert_eq!(headers["x-frame-options"], "DENY");
        assert_eq!(headers["x-content-type-options"], "nosniff");
        assert!(!headers.contains_key("set-cookie"));
    }
    let page = http
        .get(format!("http://{addr}/console/"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(!page.contains("<script>"), "no inline script");
    let handler = page.split(|c: char| c.is_whitespace()).find(|word| {
        word.strip_prefix("on")
            .and_then(|rest| rest.split_once('='))
            .is_some_and(|(name, _)| {
                !name.is_empty() && name.chars().all(|c| c.is_ascii_alphabetic())
            })
    });
    assert_eq!(handler, None, "no inline event handlers");
    // The data behind the console needs the token.
    let page = http
        .get(format!("http://{addr}/v1/console/tenants"))
        .send()
        .await
        .unwrap();
    assert_eq!(page.status(), 401);
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_replays_and_purges_dead_letters_with_a_confirmation() {
    let env = TestEnv::new("http://127.0.0.1:9/unused").await;
    let worker = env.spawn_worker().await;
    for (tenant, n) in [("acme", 2), ("globex", 1)] {
        for _ in 0..n {
            env.publish_raw(tenant, b"not json").await;
        }
    }
    wait_for("three malformed dead letters", PATIENCE, || async {
        env.dead_letters().await.len() == 3
    })
    .await;
    // Replayed letters stay in the work queue: nothing dead-letters them again.
    worker.stop().await.unwrap();

    let addr = env.serve_admin(TOKEN).await;
    let browser = Browser::start().await;
    browser.goto(&format!("http://{addr}/console/")).await;
    browser.fill("#login-token", TOKEN).await;
    browser.fill("#login-actor", "Bob Ødegård 王").await;
    browser.click("#login-form button[type=submit]").await;
    browser.click("#dlq-refresh").await;
    let counts = browser.until_text("#dlq-counts tbody", "globex").await;
    assert!(counts.contains("malformed acme 2"), "{counts}");
    assert!(counts.contains("malformed globex 1"), "{counts}");
    browser.until_text("#dlq-depth", "3 dead letter(s)").await;
    browser.screenshot("dead-letters").await;

    // Replay acme's two.
    browser
        .click("#dlq-counts tbody tr:first-child button")
        .await;
    browser.until_text("#dlq-ok", "Replayed 2; 1 left.").await;
    // The console reads the queue again after the replay; reads take
    // turns, so this one sees the whole queue before or after it.
    wait_for("one dead letter left", PATIENCE, || async {
        env.dead_letters().await.len() == 1
    })
    .await;
    assert_eq!(env.dead_letters().await[0].tenant, "globex");
    assert_eq!(
        env.pending().await,
        2,
        "acme's two are back in the work queue"
    );

    // The API behind the buttons refuses what the CLI refuses.
    let bogus = reqwest::Client::new()
        .post(format!("http://{addr}/v1/dlq/replay"))
        .bearer_auth(TOKEN)
        .json(&json!({"reason": "bogus"}))
        .send()
        .await
        .unwrap();
    assert_eq!(bogus.status(), 400);
    let error: Value = bogus.json().await.unwrap();
    assert_eq!(
        error["error"],
        "reason \"bogus\" is not one of malformed, expired, rejected, exhausted, poison"
    );

    // Purge: a wrong name deletes nothing; the queue's name deletes all.
    browser.click("#dlq-purge").await;
    browser.fill("#dlq-confirm-name", "yes").await;
    browser.click("#dlq-confirm-yes").await;
    browser.until_text("#dlq-error", "not confirmed").await;
    wait_for(
        "the refused purge to leave the letter",
        PATIENCE,
        || async { env.dead_letters().await.len() == 1 },
    )
    .await;
    let queue = browser.text("#dlq-queue").await;
    browser.fill("#dlq-confirm-name", &queue).await;
    browser.click("#dlq-confirm-yes").await;
    browser.until_text("#dlq-ok", "Purged 1.").await;
    assert!(env.dead_letters().await.is_empty());

    let audit = env.quotas.history(None, 10).await.unwrap();
    let actions: Vec<_> = audit
        .iter()
        .filter(|e| e.target == "dlq")
        .map(|e| (e.action.as_str(), e.who.as_str()))
        .collect();
    assert_eq!(
        actions,
        [
            ("purge", "console:Bob Ødegård 王"),
            ("replay", "console:Bob Ødegård 王")
        ],
        "newest first"
    );
    browser.quit().await;
    env.cleanup().await;
}

/// The console's parked figures, fleet-wide from Redis: a tenant's
/// scheduled jobs and a job waiting out a 429's Retry-After are counted by
/// why they wait while their copies sit in a delay tier, and no longer once
/// they are sent. No browser: this is what the list's "parked" column shows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn parked_jobs_are_counted_by_why_they_wait_until_they_go() {
    use tollgate_core::ParkReason;
    use tollgate_tests::Reply;

    let provider = FakeProvider::start(std::sync::Arc::new(|req, earlier| {
        if req.tenant == "flaky" && earlier == 0 {
            Reply::throttled("8")
        } else {
            Reply::ok()
        }
    }))
    .await
    .unwrap();
    let env = TestEnv::new(&provider.url()).await;
    let worker = env.spawn_worker().await;
    env.publish("sched", 5, |a| a.due_in = Some(Duration::from_secs(12)))
        .await;
    env.publish("flaky", 1, |_| {}).await;

    wait_for(
        "the 5 scheduled jobs counted as parked, not due",
        Duration::from_secs(10),
        || async { env.activity("sched").await.parked_for(ParkReason::NotDue) == 5 },
    )
    .await;
    let sched = env.activity("sched").await;
    assert_eq!(sched.parked, [(ParkReason::NotDue, 5)], "{sched:?}");
    assert_eq!(
        sched.why_waiting(&Default::default()),
        "not due yet: 5 scheduled job(s) parked"
    );
    wait_for(
        "the throttled job counted as parked for its Retry-After",
        Duration::from_secs(10),
        || async {
            env.activity("flaky")
                .await
                .parked_for(ParkReason::Throttled)
                == 1
        },
    )
    .await;
    let addr = env.serve_admin(TOKEN).await;
    wait_for(
        "the admin API to show the parked count",
        Duration::from_secs(10),
        || async {
            let page: Value = reqwest::Client::new()
                .get(format!("http://{addr}/v1/console/tenants?prefix=sched"))
                .bearer_auth(TOKEN)
                .send()
                .await
                .unwrap()
                .json()
                .await
                .unwrap();
            page["tenants"][0]["activity"]["parked"] == json!({"not_due": 5})
        },
    )
    .await;

    wait_for("all 6 jobs sent", Duration::from_secs(40), || async {
        provider.accepted() == 6
    })
    .await;
    for tenant in ["sched", "flaky"] {
        let after = env.activity(tenant).await;
        assert!(after.parked.is_empty(), "{tenant}: {after:?}");
    }
    worker.stop().await.unwrap();
    env.cleanup().await;
}

/// The console's counts of a tenant's calls come from each pod's tally,
/// added twice a second: a pod that stops adds what it counted since its
/// last addition on its way out, so a stop loses none of them. Each call
/// is counted once: 429s, failures and sends apart, and the due lags of
/// first attempts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopping_worker_adds_the_calls_it_counted_last() {
    use tollgate_tests::Reply;

    // The first request of all is answered 429, the rest accepted.
    let first = std::sync::atomic::AtomicBool::new(true);
    let provider = FakeProvider::start(std::sync::Arc::new(move |_, _| {
        if first.swap(false, std::sync::atomic::Ordering::SeqCst) {
            Reply::throttled("1")
        } else {
            Reply::ok()
        }
    }))
    .await
    .unwrap();
    let env = TestEnv::new(&provider.url()).await;
    let worker = env.spawn_worker().await;
    env.publish("brief", 6, |_| {}).await;
    wait_for("all 6 jobs sent", Duration::from_secs(20), || async {
        provider.accepted() == 6
    })
    .await;
    worker.stop().await.unwrap();

    let counted = env.activity("brief").await;
    assert_eq!((counted.sent_per_s_5m * 300.0).round(), 6.0, "{counted:?}");
    assert_eq!(counted.throttled_5m, 1, "{counted:?}");
    assert_eq!(counted.failed_5m, 0, "{counted:?}");
    assert!(counted.due_lag_p95_s.is_some(), "{counted:?}");
    env.cleanup().await;
}
