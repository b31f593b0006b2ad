//! A Redis connection for the hot path: one multiplexed connection shared by
//! every task, created through a deadpool pool (which owns the connect and
//! response timeouts) and replaced when it breaks.
//!
//! Why not `pool.get()` per call: deadpool-redis pings on every checkout to
//! recycle the connection, which would double the round trips of the permit
//! path. A multiplexed connection already pipelines concurrent callers.

use std::sync::Mutex;
use std::time::Duration;

use deadpool_redis::{Manager, Pool, Runtime};
use redis::AsyncConnectionConfig;
use redis::aio::MultiplexedConnection;

use crate::QuotaError;

#[derive(Clone)]
pub struct RedisSettings {
    pub url: String,
    /// PEM bundle trusted for `rediss://` instead of the system roots.
    pub ca_pem: Option<Vec<u8>>,
    /// Per-command response timeout (redis 1.x defaults to 500 ms otherwise).
    pub response_timeout: Duration,
    pub connect_timeout: Duration,
}

impl RedisSettings {
    /// Whether `url` names one Redis tollgate can connect to; the error says
    /// what is wrong with it (the caller names the setting and redacts it).
    pub fn check_url(url: &str) -> Result<(), String> {
        use redis::IntoConnectionInfo;
        if url.contains(',') {
            return Err(
                "lists several URLs: tollgate connects to one Redis, a primary (with \
                        replicas and failover behind one address), not a Redis Cluster"
                    .into(),
            );
        }
        url.into_connection_info().map(drop).map_err(|e| {
            format!(
                "is not a Redis URL (redis://[user:password@]host:port[/db], rediss:// for TLS, \
                 redis+unix:///path): {e}"
            )
        })
    }
}

pub struct Redis {
    pool: Pool,
    shared: Mutex<Option<MultiplexedConnection>>,
}

impl Redis {
    pub fn new(settings: &RedisSettings) -> Result<Self, QuotaError> {
        let config = AsyncConnectionConfig::new()
            .set_response_timeout(Some(settings.response_timeout))
            .set_connection_timeout(Some(settings.connect_timeout));
        let manager = match &settings.ca_pem {
            Some(pem) if settings.url.starts_with("rediss://") => {
                // The client built with our roots carries them in its
                // connection info, which the pool then connects with.
                let certs = redis::TlsCertificates {
                    client_tls: None,
                    root_cert: Some(pem.clone()),
                };
                let client = redis::Client::build_with_tls(settings.url.as_str(), certs)?;
                Manager::new_with_config(client.get_connection_info().clone(), config)?
            }
            _ => Manager::new_with_config(settings.url.as_str(), config)?,
        };
        let pool = Pool::builder(manager)
            .max_size(4)
            .runtime(Runtime::Tokio1)
            .wait_timeout(Some(settings.connect_timeout))
            .create_timeout(Some(settings.connect_timeout))
            .recycle_timeout(Some(settings.response_timeout))
            .build()
            .map_err(|e| QuotaError::Unavailable(format!("building the redis pool: {e}")))?;
        Ok(Self {
            pool,
            shared: Mutex::new(None),
        })
    }

    /// The shared connection, connecting first if there is none.
    pub async fn conn(&self) -> Result<MultiplexedConnection, QuotaError> {
        if let Some(conn) = self.shared.lock().expect("not poisoned").clone() {
            return Ok(conn);
        }
        let fresh = self
            .pool
            .get()
            .await
            .map_err(|e| QuotaError::Unavailable(e.to_string()))?;
        let conn = deadpool_redis::Connection::take(fresh);
        *self.shared.lock().expect("not poisoned") = Some(conn.clone());
        Ok(conn)
    }

    /// Maps a command error, dropping the shared connection when it is
    /// broken so the next call reconnects.
    pub fn classify(&self, err: redis::RedisError) -> QuotaError {
        if err.is_io_error()
            || err.is_timeout()
            || err.is_connection_dropped()
            || err.is_unrecoverable_error()
        {
            *self.shared.lock().expect("not poisoned") = None;
            QuotaError::Unavailable(err.to_string())
        } else {
            QuotaError::Redis(err)
        }
    }

    /// Round trip check for readiness probes.
    pub async fn ping(&self) -> Result<(), QuotaError> {
        let mut conn = self.conn().await?;
        redis::cmd("PING")
            .query_async::<String>(&mut conn)
            .await
            .map(drop)
            .map_err(|e| self.classify(e))
    }
}
