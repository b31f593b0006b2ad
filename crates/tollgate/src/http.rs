//! The one HTTP port: `/metrics`, `/healthz` (the process is alive — never
//! depends on RabbitMQ or Redis, so a broker outage does not restart pods),
//! `/readyz` (connected to both and consuming).
//!
//! The port is reachable by anything in the cluster, so it is bounded: at
//! most [`ServerLimits::max_connections`] connections (more are closed at
//! once), each closed when idle well past the request timeout (a client that
//! trickles or stalls its headers), and every request answered within the
//! request timeout (408 otherwise).

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
use futures::future::BoxFuture;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::{Instant, Sleep};
use tollgate_core::ports::{PermitStore, Provider};

use tollgate_runtime::{Metrics, Readiness, Worker};

/// Anything that can answer the readiness probe.
pub trait ReadyCheck: Send + Sync + 'static {
    fn readiness(&self) -> BoxFuture<'_, Readiness>;
}

impl<P: PermitStore, V: Provider> ReadyCheck for Worker<P, V> {
    fn readiness(&self) -> BoxFuture<'_, Readiness> {
        Box::pin(Worker::readiness(self))
    }
}

#[derive(Clone)]
struct AppState {
    metrics: Metrics,
    ready: Arc<dyn ReadyCheck>,
}

pub fn router(metrics: Metrics, ready: Arc<dyn ReadyCheck>) -> Router {
    Router::new()
        .route("/metrics", get(metrics_handler))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(ready_handler))
        .with_state(AppState { metrics, ready })
}

async fn metrics_handler(State(state): State<AppState>) -> impl IntoResponse {
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        state.metrics.render(),
    )
}

async fn ready_handler(State(state): State<AppState>) -> impl IntoResponse {
    let readiness = state.ready.readiness().await;
    let status = if readiness.ready() {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (status, axum::Json(readiness))
}

/// Bounds on the HTTP port.
#[derive(Clone, Copy, Debug)]
pub struct ServerLimits {
    /// Connections served at once; more are closed as they arrive.
    pub max_connections: usize,
    /// Longest a request may take (reading its body included): 408 after.
    /// A connection idle for twice as long (plus a second) is closed: well
    /// after a stalled request's 408 is due, so a busy pod still sends it.
    pub request_timeout: Duration,
}

/// Binds `addr` (port 0 picks a free port) and serves until `shutdown`.
/// Returns the bound address and the server task.
pub async fn serve(
    addr: SocketAddr,
    router: Router,
    limits: ServerLimits,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<(SocketAddr, tokio::task::JoinHandle<()>)> {
    let listener = TcpListener::bind(addr)
        .await
        .map_err(|e| anyhow::anyhow!("binding the HTTP port {addr}: {e}"))?;
    let bound = listener.local_addr()?;
    let listener = Bounded {
        listener,
        slots: Arc::new(Semaphore::new(limits.max_connections)),
        idle: limits.request_timeout * 2 + Duration::from_secs(1),
    };
    let router = router.layer(tower_http::timeout::TimeoutLayer::with_status_code(
        StatusCode::REQUEST_TIMEOUT,
        limits.request_timeout,
    ));
    let task = tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, router)
            .with_graceful_shutdown(shutdown)
            .await
        {
            tracing::error!(error = %e, "HTTP server failed");
        }
    });
    Ok((bound, task))
}

/// A listener that serves at most as many connections as it has slots.
struct Bounded {
    listener: TcpListener,
    slots: Arc<Semaphore>,
    idle: Duration,
}

impl axum::serve::Listener for Bounded {
    type Io = Guarded;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Guarded, SocketAddr) {
        loop {
            let (io, addr) = match self.listener.accept().await {
                Ok(accepted) => accepted,
                Err(e) => {
                    // Out of file descriptors and the like: wait, do not spin.
                    tracing::warn!(error = %e, "accepting an HTTP connection");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            };
            let Ok(slot) = Arc::clone(&self.slots).try_acquire_owned() else {
                tracing::debug!(%addr, "HTTP connection limit reached: closing a new connection");
                continue;
            };
            return (
                Guarded {
                    io,
                    _slot: slot,
                    idle: self.idle,
                    deadline: Box::pin(tokio::time::sleep(self.idle)),
                },
                addr,
            );
        }
    }

    fn local_addr(&self) -> io::Result<SocketAddr> {
        self.listener.local_addr()
    }
}

/// A connection holding one slot, closed when nothing moves on it for
/// `idle`.
struct Guarded {
    io: TcpStream,
    _slot: OwnedSemaphorePermit,
    idle: Duration,
    deadline: Pin<Box<Sleep>>,
}

impl Guarded {
    fn progressed(&mut self) {
        let next = Instant::now() + self.idle;
        self.deadline.as_mut().reset(next);
    }

    fn check_idle(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.deadline.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "HTTP connection idle for too long",
            ))),
            Poll::Pending => Poll::Pending,
        }
    }
}

impl AsyncRead for Guarded {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match Pin::new(&mut self.io).poll_read(cx, buf) {
            Poll::Ready(result) => {
                self.progressed();
                Poll::Ready(result)
            }
            Poll::Pending => self.check_idle(cx),
        }
    }
}

impl AsyncWrite for Guarded {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match Pin::new(&mut self.io).poll_write(cx, buf) {
            Poll::Ready(result) => {
                self.progressed();
                Poll::Ready(result)
            }
            Poll::Pending => self.check_idle(cx).map(|r| r.map(|()| 0)),
        }
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match Pin::new(&mut self.io).poll_write_vectored(cx, bufs) {
            Poll::Ready(result) => {
                self.progressed();
                Poll::Ready(result)
            }
            Poll::Pending => self.check_idle(cx).map(|r| r.map(|()| 0)),
        }
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }
}
