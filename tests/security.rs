//! Hostile input and secure defaults: malformed messages end in the DLQ with
//! a precise reason while valid jobs around them are sent once; `amqps://`
//! and `rediss://` verify the server against the configured CA; passwords in
//! URLs never reach an error message or a log line.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use tollgate_amqp::job_properties;
use tollgate_amqp::lapin::BasicProperties;
use tollgate_amqp::lapin::types::{AMQPValue, FieldTable, LongString};
use tollgate_core::SecretUrl;
use tollgate_core::ports::PermitStore;
use tollgate_tests::{
    FakeProvider, TestEnv, effects, fake_provider, free_port, tollgate_bin, wait_for,
};

fn with_header(name: &str, value: AMQPValue) -> BasicProperties {
    let mut headers = FieldTable::default();
    headers.insert(name.into(), value);
    job_properties().with_headers(headers)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_messages_are_dead_lettered_with_a_precise_reason() {
    let provider = FakeProvider::start(fake_provider::always_ok())
        .await
        .unwrap();
    let env = TestEnv::new(&provider.url()).await;
    env.set_quota("good", "500/s", 50).await;
    let worker = env.spawn_worker_with(|c| c.max_body_bytes = 8192).await;

    let long = |n| "x".repeat(n);
    let deep = format!(
        r#"{{"id":"deep","tenant":"good","payload":{}{}}}"#,
        "[".repeat(100),
        "]".repeat(100)
    );
    // (routing key, body, extra properties, what the dead letter must say)
    let cases: Vec<(String, Vec<u8>, Option<BasicProperties>, &str)> = vec![
        ("good".into(), b"not json".to_vec(), None, "not a valid job"),
        ("good".into(), b"".to_vec(), None, "not a valid job"),
        ("good".into(), b"[]".to_vec(), None, "invalid type"),
        ("good".into(), br#""a string""#.to_vec(), None, "invalid type"),
        ("good".into(), b"null".to_vec(), None, "invalid type"),
        ("good".into(), br#"{"tenant":"good"}"#.to_vec(), None, "missing field `id`"),
        ("good".into(), br#"{"id":"h6"}"#.to_vec(), None, "missing field `tenant`"),
        ("good".into(), br#"{"id":7,"tenant":"good"}"#.to_vec(), None, "invalid type"),
        ("good".into(), br#"{"id":"h8","tenant":42}"#.to_vec(), None, "invalid type"),
        ("a b".into(), br#"{"id":"h9","tenant":"a b"}"#.to_vec(), None, "invalid tenant"),
        ("good".into(), "{\"id\":\"h10\",\"tenant\":\"go\\u0007od\"}".as_bytes().to_vec(), None, "invalid tenant"),
        ("x{y}".into(), br#"{"id":"h11","tenant":"x{y}"}"#.to_vec(), None, "invalid tenant"),
        ("good".into(), format!(r#"{{"id":"h12","tenant":"{}"}}"#, long(65)).into_bytes(), None, "65 characters long"),
        ("good".into(), br#"{"id":"h13","tenant":""}"#.to_vec(), None, "tenant is empty"),
        ("good".into(), format!(r#"{{"id":"{}","tenant":"good"}}"#, long(129)).into_bytes(), None, "the limit is 128"),
        ("good".into(), b"{\"id\":\"h15\\n\",\"tenant\":\"good\"}".to_vec(), None, "invalid id"),
        ("good".into(), "{\"id\":\"h16\\u0000\",\"tenant\":\"good\"}".as_bytes().to_vec(), None, "invalid id"),
        ("good".into(), br#"{"id":"h17","tenant":"good","due_at":"9999-12-31T23:59:59Z"}"#.to_vec(), None, "year 9999"),
        ("good".into(), br#"{"id":"h18","tenant":"good","due_at":"tomorrow"}"#.to_vec(), None, "invalid due_at"),
        ("good".into(), br#"{"id":"h19","tenant":"good","due_at":1234567}"#.to_vec(), None, "invalid type"),
        (
            "good".into(),
            br#"{"id":"h20","tenant":"good","due_at":"2030-01-02T00:00:00Z","expires_at":"2030-01-01T00:00:00Z"}"#.to_vec(),
            None,
            "expires_at is before due_at",
        ),
        ("good".into(), br#"{"id":"h21","tenant":"good","expires_at":"1999-01-01T00:00:00Z"}"#.to_vec(), None, "year 1999"),
        ("good".into(), br#"{"id":"h22","id":"h22b","tenant":"good"}"#.to_vec(), None, "duplicate field `id`"),
        ("good".into(), br#"{"id":"h23","tenant":"good","admin":true}"#.to_vec(), None, "unknown field `admin`"),
        ("good".into(), br#"{"id":"h24","tenant":"good","due_at":1e400}"#.to_vec(), None, "not a valid job"),
        ("good".into(), deep.into_bytes(), None, "nests deeper than 32"),
        ("good".into(), format!(r#"{{"id":"h26","tenant":"good","payload":"{}"}}"#, long(9000)).into_bytes(), None, "the limit is 8192"),
        ("good".into(), b"{\"id\":\"h27\xff\xfe\",\"tenant\":\"good\"}".to_vec(), None, "not a valid job"),
        ("good".into(), br#"{"id":"h28","tenant":"good","kind":"EMAIL!"}"#.to_vec(), None, "invalid kind"),
        ("good".into(), br#"{"id":"h29","tenant":"good","kind":"fax"}"#.to_vec(), None, "unknown kind"),
        ("good".into(), br#"{"id":"h30","tenant":"good","idempotency_key":""}"#.to_vec(), None, "idempotency_key is empty"),
        ("other".into(), br#"{"id":"h31","tenant":"good"}"#.to_vec(), None, "not the job's tenant"),
        (
            "good".into(),
            br#"{"id":"h32","tenant":"good"}"#.to_vec(),
            Some(with_header("x-tollgate-attempt", AMQPValue::LongString(LongString::from("three")))),
            "expected an integer",
        ),
        (
            "good".into(),
            br#"{"id":"h33","tenant":"good"}"#.to_vec(),
            Some(with_header("x-tollgate-quota-wait-ms", AMQPValue::LongLongInt(-5))),
            "-5 is negative",
        ),
        (
            "good".into(),
            br#"{"id":"h34","tenant":"good"}"#.to_vec(),
            Some(with_header("x-tollgate-attempt", AMQPValue::LongLongInt(1 << 40))),
            "too large",
        ),
    ];
    assert!(cases.len() >= 25);

    let mut valid = Vec::new();
    for (i, (routing_key, body, props, _)) in cases.iter().enumerate() {
        valid.extend(
            env.publish("good", if i % 3 == 0 { 3 } else { 2 }, |_| {})
                .await,
        );
        env.publish_raw_with(
            routing_key,
            body,
            props.clone().unwrap_or_else(job_properties),
        )
        .await;
    }
    valid.extend(
        env.publish("good", 100usize.saturating_sub(valid.len()) as u32, |_| {})
            .await,
    );
    assert!(valid.len() >= 100);

    wait_for(
        "every hostile message dead-lettered",
        Duration::from_secs(30),
        || async { env.dead_letters().await.len() >= cases.len() },
    )
    .await;
    wait_for("every valid job sent", Duration::from_secs(30), || async {
        effects(&provider.received()).0.len() >= valid.len()
    })
    .await;
    let letters = env.dead_letters().await;
    assert_eq!(letters.len(), cases.len(), "exactly the hostile ones");
    let mut unmatched: Vec<&str> = Vec::new();
    for (_, _, _, expected) in &cases {
        if !letters
            .iter()
            .any(|l| l.reason == "malformed" && l.detail.contains(expected))
        {
            unmatched.push(expected);
        }
    }
    assert!(
        unmatched.is_empty(),
        "no dead letter says {unmatched:?}; got {:#?}",
        letters.iter().map(|l| &l.detail).collect::<Vec<_>>()
    );
    let (sent, repeats) = effects(&provider.received());
    let expected: HashSet<String> = valid
        .iter()
        .map(|j| j.idempotency_key.to_string())
        .collect();
    assert_eq!(sent, expected, "published {} valid = sent", valid.len());
    assert_eq!(repeats, 0);
    assert!(worker.is_running(), "the worker survived");
    worker.stop().await.unwrap();
    env.cleanup().await;
}

/// A throw-away CA, a server certificate for 127.0.0.1 signed by it, and a
/// second, unrelated CA.
struct Pki {
    dir: PathBuf,
}

impl Pki {
    fn new() -> Self {
        let dir =
            std::env::temp_dir().join(format!("tgtest-pki-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(&dir).unwrap();
        let openssl = |args: &[&str]| {
            let out = Command::new("openssl")
                .args(args)
                .current_dir(&dir)
                .output()
                .unwrap();
            assert!(
                out.status.success(),
                "openssl {args:?}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        };
        for ca in ["ca", "wrong-ca"] {
            openssl(&[
                "req",
                "-x509",
                "-newkey",
                "rsa:2048",
                "-nodes",
                "-days",
                "2",
                "-subj",
                &format!("/CN=tollgate test {ca}"),
                "-keyout",
                &format!("{ca}.key"),
                "-out",
                &format!("{ca}.pem"),
            ]);
        }
        openssl(&[
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-subj",
            "/CN=127.0.0.1",
            "-keyout",
            "server.key",
            "-out",
            "server.csr",
        ]);
        std::fs::write(
            dir.join("san.ext"),
            "subjectAltName=IP:127.0.0.1,DNS:localhost\n",
        )
        .unwrap();
        openssl(&[
            "x509",
            "-req",
            "-in",
            "server.csr",
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-days",
            "2",
            "-extfile",
            "san.ext",
            "-out",
            "server.pem",
        ]);
        Self { dir }
    }

    fn path(&self, name: &str) -> String {
        self.dir.join(name).display().to_string()
    }
}

impl Drop for Pki {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

struct Guard(Child);

impl Drop for Guard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

async fn listening(port: u16) {
    wait_for("a TLS listener", Duration::from_secs(10), || async move {
        std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()
    })
    .await;
}

fn tls_redis(pki: &Pki) -> (Guard, u16) {
    let port = free_port();
    let child = Command::new("redis-server")
        .args([
            "--port",
            "0",
            "--tls-port",
            &port.to_string(),
            "--bind",
            "127.0.0.1",
        ])
        .args([
            "--tls-cert-file",
            &pki.path("server.pem"),
            "--tls-key-file",
            &pki.path("server.key"),
        ])
        .args([
            "--tls-ca-cert-file",
            &pki.path("ca.pem"),
            "--tls-auth-clients",
            "no",
        ])
        .args(["--save", "", "--appendonly", "no"])
        .stdout(Stdio::null())
        .spawn()
        .expect("redis-server with TLS starts");
    (Guard(child), port)
}

/// A TLS front for the shared RabbitMQ (socat), so amqps:// is exercised
/// without reconfiguring the broker other tests use.
fn tls_rabbitmq(pki: &Pki) -> (Guard, u16) {
    let port = free_port();
    let listen = format!(
        "OPENSSL-LISTEN:{port},bind=127.0.0.1,reuseaddr,fork,cert={},key={},verify=0",
        pki.path("server.pem"),
        pki.path("server.key")
    );
    let child = Command::new("socat")
        .args([&listen, "TCP:127.0.0.1:5672"])
        .stderr(Stdio::null())
        .spawn()
        .expect("socat starts (apt install socat)");
    (Guard(child), port)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn amqps_and_rediss_verify_the_server_against_the_configured_ca() {
    let pki = Pki::new();
    let (_redis, redis_port) = tls_redis(&pki);
    let (_rabbit, amqps_port) = tls_rabbitmq(&pki);
    listening(redis_port).await;
    listening(amqps_port).await;
    let provider = FakeProvider::start(fake_provider::always_ok())
        .await
        .unwrap();
    let rediss = format!("rediss://127.0.0.1:{redis_port}");
    let amqps = format!("amqps://guest:guest@127.0.0.1:{amqps_port}/%2f");
    let ca = pki.path("ca.pem");
    let env = TestEnv::new_with(&provider.url(), |c| {
        c.redis_url = SecretUrl::new(rediss.clone());
        c.amqp_url = SecretUrl::new(amqps.clone());
        c.tls_ca_file = Some(ca.clone());
    })
    .await;

    // The right CA: a worker over amqps:// and rediss:// sends a job.
    env.set_quota("secure", "10/s", 1).await;
    let worker = env.spawn_worker().await;
    let jobs = env.publish("secure", 3, |_| {}).await;
    wait_for("3 sends over TLS", Duration::from_secs(20), || async {
        provider.accepted() >= 3
    })
    .await;
    assert_eq!(effects(&provider.received()).0.len(), jobs.len());
    worker.stop().await.unwrap();

    // The wrong CA: both fail, and say why.
    let mut wrong = env.config.clone();
    wrong.tls_ca_file = Some(pki.path("wrong-ca.pem"));
    let amqp_err = tollgate::cli::connect_broker(&wrong, "test")
        .await
        .err()
        .expect("amqps must fail");
    let amqp_err = format!("{amqp_err:#}");
    assert!(
        amqp_err.contains("connecting to RabbitMQ at amqps://"),
        "{amqp_err}"
    );
    assert!(
        amqp_err.to_lowercase().contains("certificate") || amqp_err.contains("UnknownIssuer"),
        "{amqp_err}"
    );
    let redis = tollgate_quota::Redis::new(&wrong.redis_settings()).unwrap();
    let redis_err = redis
        .ping()
        .await
        .expect_err("rediss must fail")
        .to_string();
    assert!(
        redis_err.to_lowercase().contains("certificate") || redis_err.contains("UnknownIssuer"),
        "{redis_err}"
    );
    // And with no CA configured the private CA is not trusted either.
    let mut system_roots = env.config.clone();
    system_roots.tls_ca_file = None;
    let permits = tollgate_quota::RedisPermits::new(
        std::sync::Arc::new(tollgate_quota::Redis::new(&system_roots.redis_settings()).unwrap()),
        tollgate_quota::Keys::new("unused"),
        system_roots.permit_settings().unwrap(),
    );
    assert!(permits.ping().await.is_err());
    eprintln!("wrong CA: amqps → {amqp_err}\nwrong CA: rediss → {redis_err}");
    env.cleanup().await;
}

/// A CLI invocation: arguments and environment.
type CliCase<'a> = (Vec<&'a str>, Vec<(&'a str, String)>);

fn run_cli(args: &[&str], env: &[(&str, String)]) -> (bool, String) {
    let mut command = Command::new(tollgate_bin());
    command
        .args(args)
        .env("TOLLGATE_PROVIDER_URL", "http://127.0.0.1:9/send");
    for (k, v) in env {
        command.env(k, v);
    }
    let out = command.output().unwrap();
    (
        out.status.success(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn passwords_in_urls_never_reach_errors_or_logs() {
    const CANARY: &str = "CANARY-pw-91d2";
    let closed = free_port();
    let bad_amqp = format!("amqp://guest:{CANARY}@127.0.0.1:{closed}/%2f");
    let bad_redis = format!("redis://:{CANARY}@127.0.0.1:{closed}");
    // The broker refuses the password: an authentication error.
    let wrong_password = format!("amqp://guest:{CANARY}@127.0.0.1:5672/%2f");

    let cases: Vec<CliCase> = vec![
        (
            vec!["topology", "declare"],
            vec![("TOLLGATE_AMQP_URL", bad_amqp.clone())],
        ),
        (
            vec!["topology", "declare"],
            vec![("TOLLGATE_AMQP_URL", wrong_password.clone())],
        ),
        (
            vec!["dlq", "list"],
            vec![("TOLLGATE_AMQP_URL", bad_amqp.clone())],
        ),
        (
            vec!["quota", "get", "acme"],
            vec![("TOLLGATE_REDIS_URL", bad_redis.clone())],
        ),
        (
            vec!["quota", "list"],
            vec![("TOLLGATE_REDIS_URL", bad_redis.clone())],
        ),
    ];
    for (args, vars) in &cases {
        let (ok, output) = run_cli(args, vars);
        assert!(!ok, "{args:?} should fail");
        assert!(
            !output.contains(CANARY),
            "{args:?} leaked the password: {output}"
        );
        assert!(
            output.contains("REDACTED") || output.contains("redis"),
            "{args:?} says what failed: {output}"
        );
    }

    // A worker that cannot reach either keeps retrying; its logs stay clean.
    let port = free_port();
    let log: &Path = &std::env::temp_dir().join(format!(
        "tgtest-canary-{}.log",
        uuid::Uuid::new_v4().simple()
    ));
    let mut worker = Command::new(tollgate_bin())
        .arg("worker")
        .env("TOLLGATE_AMQP_URL", &wrong_password)
        .env("TOLLGATE_REDIS_URL", &bad_redis)
        .env(
            "TOLLGATE_PROVIDER_URL",
            format!("https://user:{CANARY}@provider.example/send"),
        )
        .env("TOLLGATE_HTTP_ADDR", format!("127.0.0.1:{port}"))
        .env("TOLLGATE_LOG_FORMAT", "json")
        .env("RUST_LOG", "debug")
        .stderr(std::fs::File::create(log).unwrap())
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let ready = format!("http://127.0.0.1:{port}/readyz");
    wait_for("/readyz to answer", Duration::from_secs(10), || async {
        reqwest::get(&ready).await.is_ok_and(|r| r.status() == 503)
    })
    .await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let metrics = reqwest::get(format!("http://127.0.0.1:{port}/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let _ = worker.kill();
    let _ = worker.wait();
    let logs = std::fs::read_to_string(log).unwrap();
    let _ = std::fs::remove_file(log);
    for dependency in ["RabbitMQ", "Redis"] {
        assert!(
            logs.contains(&format!("{dependency} is unreachable")),
            "the worker says what fails: {logs}"
        );
    }
    assert!(
        !logs.contains(CANARY),
        "a password reached the logs:\n{logs}"
    );
    assert!(!metrics.contains(CANARY));
}

/// Calls of one Redis command so far (`INFO commandstats`).
async fn redis_calls(url: &str, command: &str) -> u64 {
    let settings = tollgate_quota::RedisSettings {
        url: url.to_owned(),
        ca_pem: None,
        response_timeout: Duration::from_secs(1),
        connect_timeout: Duration::from_secs(1),
    };
    let redis = tollgate_quota::Redis::new(&settings).unwrap();
    let mut conn = redis.conn().await.unwrap();
    let info: String = tollgate_quota::redis_cmd("INFO")
        .arg("commandstats")
        .query_async(&mut conn)
        .await
        .unwrap();
    let prefix = format!("cmdstat_{command}:calls=");
    info.lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .and_then(|rest| rest.split(',').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or(0)
}

/// Reads from `stream` until the server closes it (or `within` passes):
/// true when closed.
async fn closed_by_server(stream: &mut tokio::net::TcpStream, within: Duration) -> bool {
    use tokio::io::AsyncReadExt;
    let mut buf = [0u8; 1024];
    let read = async {
        loop {
            match stream.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
        }
    };
    tokio::time::timeout(within, read).await.is_ok()
}

/// The HTTP port is reachable by anything in the cluster: it once had no
/// connection limit and no timeouts (a client that stalls its headers held
/// a connection forever), and every `/readyz` probe PINGed Redis on the hot
/// path's connection. Now: at most `http_max_connections`, idle connections
/// closed, a stalled body answered 408, and Redis asked at most once a
/// second whatever the probe rate.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_http_port_bounds_connections_stalled_clients_and_probes() {
    use tokio::io::AsyncWriteExt;
    let redis = tollgate_tests::PrivateRedis::start().await;
    let url = redis.url();
    let env = TestEnv::new_with("http://127.0.0.1:9/unused", |c| {
        c.redis_url = SecretUrl::new(url.clone());
        c.http_max_connections = 2;
        c.http_request_timeout_ms = 500;
    })
    .await;
    let worker = env.spawn_worker().await;
    let router = tollgate::http::router(worker.metrics.clone(), worker.worker.clone()).merge(
        tollgate::admin::router(env.admin_state("a-token-of-twenty-bytes")),
    );
    let addr = env.serve(router).await;
    let http = reqwest::Client::builder()
        .pool_max_idle_per_host(0)
        .build()
        .unwrap();
    let healthz = format!("http://{addr}/healthz");

    // Two clients that stall in their headers take both slots…
    let mut stalled = Vec::new();
    for _ in 0..2 {
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        s.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
            .await
            .unwrap();
        stalled.push(s);
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(
        http.get(&healthz).send().await.is_err(),
        "a third connection is refused while two are held"
    );
    // …and are closed once idle past the timeout, freeing the slots.
    for s in &mut stalled {
        assert!(
            closed_by_server(s, Duration::from_secs(10)).await,
            "a stalled connection is closed"
        );
    }
    let ok = http.get(&healthz).send().await.unwrap();
    assert_eq!(ok.status(), 200);

    // A request whose body never finishes is answered 408.
    let mut slow = tokio::net::TcpStream::connect(addr).await.unwrap();
    slow.write_all(
        b"PUT /v1/tenants/acme/quota HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer a-token-of-twenty-bytes\r\n\
          Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"rate\":",
    )
    .await
    .unwrap();
    let answer = tokio::time::timeout(Duration::from_secs(10), async {
        use tokio::io::AsyncReadExt;
        let mut buf = vec![0u8; 64];
        let n = slow.read(&mut buf).await.unwrap_or(0);
        String::from_utf8_lossy(&buf[..n]).into_owned()
    })
    .await
    .expect("an answer, not a hang");
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer:?}");
    assert!(
        env.quotas
            .get(&tollgate_quota::Target::Tenant(TestEnv::tenant("acme")))
            .await
            .unwrap()
            .is_none()
    );

    // 100 probes ask Redis at most once a second. Their connection needs a
    // free slot: the 408's connection is closed by the server, and the one
    // before it frees its slot once the server has seen it go (the probes'
    // first connection, made before that, is closed at once).
    assert!(
        closed_by_server(&mut slow, Duration::from_secs(10)).await,
        "the connection answered 408 is closed"
    );
    let readyz = format!("http://{addr}/readyz");
    let keep_alive = reqwest::Client::new();
    // Each answer is read to its end, so its connection (the one free slot)
    // is used again: a response dropped before its body arrived takes the
    // connection with it, and the next probe's new one finds no slot.
    let probe = || async {
        let answer = keep_alive.get(&readyz).send().await?;
        let status = answer.status();
        answer.bytes().await?;
        Ok::<_, reqwest::Error>(status)
    };
    let mut attempts = 0;
    while probe().await.is_err() {
        attempts += 1;
        assert!(attempts < 50, "no slot freed for the probes");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let before = redis_calls(&url, "ping").await;
    let started = std::time::Instant::now();
    for _ in 0..100 {
        assert_eq!(probe().await.unwrap(), 200, "ready");
    }
    let pings = redis_calls(&url, "ping").await - before;
    let allowed = 1 + started.elapsed().as_secs();
    assert!(
        pings <= allowed,
        "{pings} Redis PINGs for 100 probes in {:?}",
        started.elapsed()
    );
    worker.stop().await.unwrap();
    env.cleanup().await;
}
