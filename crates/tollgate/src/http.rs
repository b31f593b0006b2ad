//! The one HTTP port: `/metrics`, `/healthz` (the process is alive — never
//! depends on RabbitMQ or Redis, so a broker outage does not restart pods),
//! `/readyz` (connected to both and consuming).

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
use futures::future::BoxFuture;
use tokio::net::TcpListener;
use tollgate_core::ports::{PermitStore, Provider};

use crate::metrics::Metrics;
use crate::worker::{Readiness, Worker};

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

/// Binds `addr` (port 0 picks a free port) and serves until `shutdown`.
/// Returns the bound address and the server task.
pub async fn serve(
    addr: SocketAddr,
    router: Router,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<(SocketAddr, tokio::task::JoinHandle<()>)> {
    let listener = TcpListener::bind(addr)
        .await
        .map_err(|e| anyhow::anyhow!("binding the HTTP port {addr}: {e}"))?;
    let bound = listener.local_addr()?;
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
