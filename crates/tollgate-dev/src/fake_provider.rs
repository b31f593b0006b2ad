//! A local HTTP provider for the demo and the tests: it records every request
//! it receives and answers through a pluggable behaviour, such as a strict
//! per-tenant rate limit that returns 429 like a real provider would.

use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU8, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use tokio::sync::oneshot;
use tollgate_core::{Clock, UnixMillis};

use tollgate_runtime::system_clock::SystemClock;

/// One request as the provider saw it.
#[derive(Clone, Debug)]
pub struct Received {
    pub at: UnixMillis,
    pub instant: Instant,
    pub tenant: String,
    pub job_id: String,
    pub idempotency_key: String,
    pub attempt: u32,
    pub body: String,
    /// The status the behaviour answered.
    pub status: u16,
    pub method: String,
    /// The request path: `/send` unless a client followed a redirect.
    pub path: String,
}

/// What to answer.
#[derive(Clone, Debug)]
pub struct Reply {
    pub status: u16,
    pub retry_after: Option<String>,
    /// A `Location` header (to answer with a redirect).
    pub location: Option<String>,
    /// Wait this long before answering (to provoke timeouts).
    pub delay: Duration,
}

impl Reply {
    pub fn status(status: u16) -> Self {
        Self {
            status,
            retry_after: None,
            location: None,
            delay: Duration::ZERO,
        }
    }

    pub fn ok() -> Self {
        Self::status(200)
    }

    /// A 429 with this `Retry-After` value.
    pub fn throttled(retry_after: &str) -> Self {
        Self {
            retry_after: Some(retry_after.into()),
            ..Self::status(429)
        }
    }

    /// A redirect to `location`.
    pub fn redirect(status: u16, location: &str) -> Self {
        Self {
            location: Some(location.into()),
            ..Self::status(status)
        }
    }

    /// The same reply, answered after `delay`.
    pub fn after(self, delay: Duration) -> Self {
        Self { delay, ..self }
    }
}

/// Decides the reply to each request. Gets the request and how many earlier
/// requests carried the same idempotency key.
pub type Behavior = Arc<dyn Fn(&Received, usize) -> Reply + Send + Sync>;

/// Accepts everything.
pub fn always_ok() -> Behavior {
    Arc::new(|_, _| Reply::ok())
}

/// Accepts everything, each answer after `delay` (a slow provider).
pub fn slow_ok(delay: Duration) -> Behavior {
    Arc::new(move |_, _| Reply::ok().after(delay))
}

/// A provider that enforces its own per-tenant limit: at most `limit`
/// accepted requests in any sliding 1 s window, else 429 with
/// `Retry-After: 1`. Tenants not listed are unlimited.
pub fn strict_limits(limits: HashMap<String, u32>) -> Behavior {
    strict_by(
        move |key| limits.get(key).copied(),
        |req| req.tenant.clone(),
    )
}

/// [`strict_limits`] for one tenant whose limit may change while it runs
/// (a provider that changes its mind without notice).
pub fn strict_live_limit(tenant: &str, limit: Arc<AtomicU32>) -> Behavior {
    let tenant = tenant.to_owned();
    strict_by(
        move |key| (key == tenant).then(|| limit.load(Ordering::Relaxed)),
        |req| req.tenant.clone(),
    )
}

/// A provider that limits one account shared by every tenant: at most
/// `limit` accepted requests of all of them together in any sliding 1 s
/// window, else 429 with `Retry-After: 1`.
pub fn strict_account(limit: u32) -> Behavior {
    strict_by(move |_| Some(limit), |_| String::new())
}

/// Sliding-second limits on the requests `key` groups together (`None`:
/// that group is unlimited).
fn strict_by(
    limit_of: impl Fn(&str) -> Option<u32> + Send + Sync + 'static,
    key: impl Fn(&Received) -> String + Send + Sync + 'static,
) -> Behavior {
    let windows: Mutex<HashMap<String, VecDeque<Instant>>> = Mutex::new(HashMap::new());
    Arc::new(move |req, _| {
        let key = key(req);
        let Some(limit) = limit_of(&key) else {
            return Reply::ok();
        };
        let mut windows = windows.lock().expect("not poisoned");
        let window = windows.entry(key).or_default();
        while window
            .front()
            .is_some_and(|&t| req.instant.duration_since(t) >= Duration::from_secs(1))
        {
            window.pop_front();
        }
        if window.len() >= limit as usize {
            return Reply::throttled("1");
        }
        window.push_back(req.instant);
        Reply::ok()
    })
}

struct Shared {
    behavior: Behavior,
    log: Mutex<Vec<Received>>,
    seen: Mutex<HashMap<String, usize>>,
}

pub struct FakeProvider {
    addr: SocketAddr,
    shared: Arc<Shared>,
    stop: Option<oneshot::Sender<()>>,
}

impl FakeProvider {
    /// Serves on 127.0.0.1 on a free port, on the caller's runtime.
    pub async fn start(behavior: Behavior) -> anyhow::Result<Self> {
        let (provider, app, listener, stopped) = Self::prepare(behavior)?;
        tokio::spawn(serve(listener, app, stopped));
        Ok(provider)
    }

    /// Serves on a thread of its own at real-time priority, where the
    /// process may have it ([`Priority::of_providers`] says): for figures
    /// that count when requests arrive (a strict limit's 429s, sends in
    /// any second, lags). Up to several thousand requests a second: on this
    /// one thread the minimal pipeline's ceiling read 12–15 % lower, so a
    /// throughput ceiling is measured with [`FakeProvider::start`].
    ///
    /// The provider stands for a service on other machines; here it shares
    /// two cores with the pods, the broker and Redis. On the bench's runtime
    /// it waited for a core for 13–41 ms a few times a run while the pods
    /// sent on, then counted what had come meanwhile as one clump, and a
    /// strict limit answered 429: in a trace of the sweep's 200-tenant row,
    /// calls that four pods began within 2 ms of their slots returned
    /// together after 25–41 ms. At `SCHED_FIFO` it takes a core when a
    /// request comes, and does little with it. One thread, not a runtime of
    /// two workers: at real-time priority two workers took the cores from
    /// the pods (the minimal pipeline's ceiling a fifth to a third lower).
    pub async fn start_punctual(behavior: Behavior) -> anyhow::Result<Self> {
        let (provider, app, listener, stopped) = Self::prepare(behavior)?;
        std::thread::Builder::new()
            .name("fake-provider".into())
            .spawn(move || {
                let priority = if real_time() {
                    Priority::RealTime
                } else {
                    Priority::Normal
                };
                PRIORITY.store(priority as u8, Ordering::Relaxed);
                tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .expect("a runtime for the fake provider")
                    .block_on(serve(listener, app, stopped));
            })?;
        Ok(provider)
    }

    fn prepare(
        behavior: Behavior,
    ) -> anyhow::Result<(Self, Router, std::net::TcpListener, oneshot::Receiver<()>)> {
        let shared = Arc::new(Shared {
            behavior,
            log: Mutex::new(Vec::new()),
            seen: Mutex::new(HashMap::new()),
        });
        // Anything but `POST /send` (a client that followed a redirect) is
        // recorded too, and answered 200 as a lenient server would.
        let app = Router::new()
            .route("/send", post(handle))
            .fallback(stray)
            .with_state(Arc::clone(&shared));
        let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
        listener.set_nonblocking(true)?;
        let addr = listener.local_addr()?;
        let (stop, stopped) = oneshot::channel::<()>();
        let provider = Self {
            addr,
            shared,
            stop: Some(stop),
        };
        Ok((provider, app, listener, stopped))
    }

    pub fn url(&self) -> String {
        format!("http://{}/send", self.addr)
    }

    /// Every request so far, in arrival order.
    pub fn received(&self) -> Vec<Received> {
        self.shared.log.lock().expect("not poisoned").clone()
    }

    /// Requests answered 2xx so far.
    pub fn accepted(&self) -> usize {
        self.shared
            .log
            .lock()
            .expect("not poisoned")
            .iter()
            .filter(|r| (200..300).contains(&r.status))
            .count()
    }
}

impl Drop for FakeProvider {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

async fn serve(listener: std::net::TcpListener, app: Router, stopped: oneshot::Receiver<()>) {
    let listener =
        tokio::net::TcpListener::from_std(listener).expect("the fake provider's listener");
    let _ = axum::serve(listener, app)
        .with_graceful_shutdown(async {
            let _ = stopped.await;
        })
        .await;
}

/// The priority the last punctual provider got: 0 none started yet, else a
/// [`Priority`].
static PRIORITY: AtomicU8 = AtomicU8::new(0);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Priority {
    /// `SCHED_FIFO` 1: a request is answered and counted as it arrives.
    RealTime = 1,
    /// Not permitted (it needs root or `CAP_SYS_NICE`): the provider may
    /// wait for a core, and count what arrived meanwhile as one clump.
    Normal = 2,
}

impl Priority {
    /// What the providers of this process ran at, once one has started.
    pub fn of_providers() -> Option<Self> {
        match PRIORITY.load(Ordering::Relaxed) {
            1 => Some(Self::RealTime),
            2 => Some(Self::Normal),
            _ => None,
        }
    }

    pub fn describe(self) -> &'static str {
        match self {
            Self::RealTime => "its own thread at real-time priority (SCHED_FIFO 1)",
            Self::Normal => {
                "its own thread at normal priority (real-time priority needs root or \
                 CAP_SYS_NICE): it may count requests late, in clumps, on a busy machine"
            }
        }
    }
}

/// `SCHED_FIFO` 1 for the calling thread, where the process may have it.
#[cfg(target_os = "linux")]
fn real_time() -> bool {
    let param = libc::sched_param { sched_priority: 1 };
    // SAFETY: `param` is a valid `sched_param` for the call's duration; pid
    // 0 is the calling thread.
    unsafe { libc::sched_setscheduler(0, libc::SCHED_FIFO, &param) == 0 }
}

#[cfg(not(target_os = "linux"))]
fn real_time() -> bool {
    false
}

fn header(headers: &HeaderMap, name: &str) -> String {
    headers
        .get(name)
        .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
        .unwrap_or_default()
}

/// Records a request that is not `POST /send` and answers 200.
async fn stray(
    State(shared): State<Arc<Shared>>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let mut received = received(&headers, &body, &method, &uri);
    received.status = 200;
    shared.log.lock().expect("not poisoned").push(received);
    StatusCode::OK.into_response()
}

fn received(headers: &HeaderMap, body: &Bytes, method: &Method, uri: &Uri) -> Received {
    Received {
        at: SystemClock.now(),
        instant: Instant::now(),
        tenant: header(headers, "x-tollgate-tenant"),
        job_id: header(headers, "x-tollgate-job-id"),
        idempotency_key: header(headers, "idempotency-key"),
        attempt: header(headers, "x-tollgate-attempt").parse().unwrap_or(0),
        body: String::from_utf8_lossy(body).into_owned(),
        status: 0,
        method: method.to_string(),
        path: uri.path().to_owned(),
    }
}

async fn handle(State(shared): State<Arc<Shared>>, headers: HeaderMap, body: Bytes) -> Response {
    let mut received = received(&headers, &body, &Method::POST, &Uri::from_static("/send"));
    let earlier = {
        let mut seen = shared.seen.lock().expect("not poisoned");
        let n = seen.entry(received.idempotency_key.clone()).or_insert(0);
        *n += 1;
        *n - 1
    };
    let reply = (shared.behavior)(&received, earlier);
    received.status = reply.status;
    shared.log.lock().expect("not poisoned").push(received);
    if !reply.delay.is_zero() {
        tokio::time::sleep(reply.delay).await;
    }
    let status = StatusCode::from_u16(reply.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let mut response = status.into_response();
    for (name, value) in [
        ("retry-after", reply.retry_after),
        ("location", reply.location),
    ] {
        if let Some(value) = value.and_then(|v| v.parse().ok()) {
            response.headers_mut().insert(name, value);
        }
    }
    response
}

/// Most requests in any window of `width`, sliding over every request.
pub fn max_in_window(times: &[Instant], width: Duration) -> usize {
    let mut times = times.to_vec();
    times.sort();
    let (mut best, mut start) = (0, 0);
    for end in 0..times.len() {
        while times[end].duration_since(times[start]) >= width {
            start += 1;
        }
        best = best.max(end - start + 1);
    }
    best
}
