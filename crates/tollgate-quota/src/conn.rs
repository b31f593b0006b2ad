//! A Redis connection for the hot path: one multiplexed connection shared by
//! every task, created through a deadpool pool (which owns the connect and
//! response timeouts) and replaced when it breaks.
//!
//! Why not `pool.get()` per call: deadpool-redis pings on every checkout to
//! recycle the connection, which would double the round trips of the permit
//! path. A multiplexed connection already pipelines concurrent callers.
//!
//! A Redis Cluster (`redis_url` listing its nodes) gets a cluster connection
//! instead: it follows the slots (`MOVED`, a replica promoted on failover) by
//! itself. An installation's keys then spread over the slots ([`Keys`]);
//! every script call and pipeline names one slot's keys
//! ([`Redis::query_groups`] runs several such at once), and the commands
//! that name no key go to every master ([`Redis::ping`],
//! [`Redis::keys_matching`]) or to the installation's slot.

use std::sync::Mutex;
use std::time::Duration;

use deadpool_redis::{Manager, Pool, Runtime};
use redis::aio::{ConnectionLike, MultiplexedConnection};
use redis::cluster::ClusterClient;
use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::{
    MultipleNodeRoutingInfo, ResponsePolicy, Route, RoutingInfo, SingleNodeRoutingInfo, Slot,
    SlotAddr,
};
use redis::{AsyncConnectionConfig, Cmd, Pipeline, RedisFuture, Value};

use crate::{Keys, QuotaError};

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
    /// Whether `url` names a Redis tollgate can connect to; the error says
    /// what is wrong with it (the caller names the setting and redacts it).
    /// Several URLs, separated by commas, name the nodes of a Redis Cluster
    /// (any one that answers is enough to find the rest).
    pub fn check_url(url: &str) -> Result<(), String> {
        use redis::IntoConnectionInfo;
        let nodes = Self::nodes_of(url);
        for (i, node) in nodes.iter().enumerate() {
            let which = if nodes.len() > 1 {
                format!(" (node {} of {})", i + 1, nodes.len())
            } else {
                String::new()
            };
            node.into_connection_info().map_err(|e| {
                format!(
                    "is not a Redis URL{which} (redis://[user:password@]host:port[/db], \
                     rediss:// for TLS, redis+unix:///path): {e}"
                )
            })?;
            if nodes.len() > 1 && node.starts_with("redis+unix") {
                return Err(format!(
                    "names a Redis Cluster node{which} by a unix socket: a cluster's nodes \
                     are reached over TCP"
                ));
            }
        }
        if nodes.len() > 1 {
            // Building the client connects to nothing; it checks that the
            // nodes agree (one password, user, database, TLS mode).
            ClusterClient::new(nodes)
                .map_err(|e| format!("names a Redis Cluster whose nodes disagree: {e}"))?;
        }
        Ok(())
    }

    fn nodes_of(url: &str) -> Vec<&str> {
        url.split(',').map(str::trim).collect()
    }

    /// Whether `url` names a Redis Cluster (several nodes).
    pub fn is_cluster(&self) -> bool {
        Self::nodes_of(&self.url).len() > 1
    }
}

/// Where connections come from: one Redis, or a cluster.
enum Source {
    One(Pool),
    Cluster(Box<ClusterClient>),
}

/// A connection to one Redis or to a cluster; cheap to clone, shared.
#[derive(Clone)]
pub enum Conn {
    One(MultiplexedConnection),
    Cluster(ClusterConnection),
}

impl ConnectionLike for Conn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Conn::One(c) => c.req_packed_command(cmd),
            Conn::Cluster(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        cmd: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Conn::One(c) => c.req_packed_commands(cmd, offset, count),
            Conn::Cluster(c) => c.req_packed_commands(cmd, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Conn::One(c) => c.get_db(),
            Conn::Cluster(c) => c.get_db(),
        }
    }
}

impl Conn {
    /// Runs a command that names no key (`SCAN`, `TIME`) where the keys
    /// like `near` live: on a cluster, the primary of its slot.
    pub async fn query_near<T: redis::FromRedisValue>(
        &mut self,
        cmd: &Cmd,
        near: &str,
    ) -> redis::RedisResult<T> {
        match self {
            Conn::One(c) => cmd.query_async(c).await,
            Conn::Cluster(c) => {
                let route = Route::with_slot(Slot::for_key(near), SlotAddr::Master);
                let routing = RoutingInfo::SingleNode(SingleNodeRoutingInfo::SpecificNode(route));
                let value = c.route_command(cmd.clone(), routing).await?;
                redis::from_redis_value(value).map_err(Into::into)
            }
        }
    }
}

pub struct Redis {
    source: Source,
    shared: Mutex<Option<Conn>>,
}

impl Redis {
    pub fn new(settings: &RedisSettings) -> Result<Self, QuotaError> {
        let source = if settings.is_cluster() {
            Source::Cluster(Box::new(Self::cluster_client(settings)?))
        } else {
            Source::One(Self::pool(settings)?)
        };
        Ok(Self {
            source,
            shared: Mutex::new(None),
        })
    }

    fn pool(settings: &RedisSettings) -> Result<Pool, QuotaError> {
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
        Pool::builder(manager)
            .max_size(4)
            .runtime(Runtime::Tokio1)
            .wait_timeout(Some(settings.connect_timeout))
            .create_timeout(Some(settings.connect_timeout))
            .recycle_timeout(Some(settings.response_timeout))
            .build()
            .map_err(|e| QuotaError::Unavailable(format!("building the redis pool: {e}")))
    }

    fn cluster_client(settings: &RedisSettings) -> Result<ClusterClient, QuotaError> {
        let mut builder = ClusterClient::builder(RedisSettings::nodes_of(&settings.url))
            .response_timeout(settings.response_timeout)
            .connection_timeout(settings.connect_timeout);
        if let Some(pem) = &settings.ca_pem {
            builder = builder.certs(redis::TlsCertificates {
                client_tls: None,
                root_cert: Some(pem.clone()),
            });
        }
        Ok(builder.build()?)
    }

    /// Whether this is a Redis Cluster (a call may name one slot's keys).
    pub fn is_cluster(&self) -> bool {
        matches!(self.source, Source::Cluster(_))
    }

    /// The key layout for `prefix` on this Redis ([`Keys::on_cluster`] on a
    /// cluster).
    pub fn keys(&self, prefix: &str) -> Keys {
        match self.source {
            Source::One(_) => Keys::new(prefix),
            Source::Cluster(_) => Keys::on_cluster(prefix),
        }
    }

    /// Runs each pipeline (each naming the keys of one slot), all in
    /// flight at once on the shared connection, and returns each one's
    /// replies (those of its commands not ignored), in order.
    pub async fn query_groups(&self, groups: Vec<Pipeline>) -> Result<Vec<Vec<Value>>, QuotaError> {
        let conn = self.conn().await?;
        let mut calls = tokio::task::JoinSet::new();
        for (i, pipe) in groups.into_iter().enumerate() {
            let mut conn = conn.clone();
            calls.spawn(async move { (i, pipe.query_async::<Vec<Value>>(&mut conn).await) });
        }
        let mut replies = vec![Vec::new(); calls.len()];
        while let Some(done) = calls.join_next().await {
            let (i, reply) = done.map_err(|e| QuotaError::Unavailable(e.to_string()))?;
            replies[i] = reply.map_err(|e| self.classify(e))?;
        }
        Ok(replies)
    }

    /// The shared connection, connecting first if there is none.
    pub async fn conn(&self) -> Result<Conn, QuotaError> {
        if let Some(conn) = self.shared.lock().expect("not poisoned").clone() {
            return Ok(conn);
        }
        let conn = match &self.source {
            Source::One(pool) => {
                let fresh = pool
                    .get()
                    .await
                    .map_err(|e| QuotaError::Unavailable(e.to_string()))?;
                Conn::One(deadpool_redis::Connection::take(fresh))
            }
            Source::Cluster(client) => Conn::Cluster(
                client
                    .get_async_connection()
                    .await
                    .map_err(|e| QuotaError::Unavailable(e.to_string()))?,
            ),
        };
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

    /// `INFO section` of every node that holds data: the one Redis, or each
    /// master of a cluster (tools and the bench add them up).
    pub async fn info(&self, section: &str) -> Result<Vec<String>, QuotaError> {
        let mut conn = self.conn().await?;
        let reply: Value = redis::cmd("INFO")
            .arg(section)
            .query_async(&mut conn)
            .await
            .map_err(|e| self.classify(e))?;
        let parts = match reply {
            Value::Map(by_node) => by_node.into_iter().map(|(_, text)| text).collect(),
            one => vec![one],
        };
        parts
            .into_iter()
            .map(|text| {
                redis::from_redis_value(text).map_err(|e| QuotaError::BadReply(e.to_string()))
            })
            .collect()
    }

    /// Round trip check for readiness probes. On a cluster, every master
    /// must answer: an installation's tenants and routes spread over all of
    /// them, so one that does not answer leaves decisions unmade.
    pub async fn ping(&self) -> Result<(), QuotaError> {
        let mut conn = self.conn().await?;
        let answered = match &mut conn {
            Conn::One(c) => redis::cmd("PING").query_async::<String>(c).await.map(drop),
            Conn::Cluster(c) => {
                let every_master = RoutingInfo::MultiNode((
                    MultipleNodeRoutingInfo::AllMasters,
                    Some(ResponsePolicy::AllSucceeded),
                ));
                c.route_command(redis::cmd("PING"), every_master)
                    .await
                    .map(drop)
            }
        };
        answered.map_err(|e| self.classify(e))
    }

    /// Every key matching `pattern`: `SCAN` on one Redis; on a cluster,
    /// `KEYS` on every master (it blocks each while it runs: for tests,
    /// the demo and the bench's cleanup, never the hot path).
    pub async fn keys_matching(&self, pattern: &str) -> Result<Vec<String>, QuotaError> {
        let mut conn = self.conn().await?;
        if let Conn::Cluster(c) = &mut conn {
            return redis::cmd("KEYS")
                .arg(pattern)
                .query_async(c)
                .await
                .map_err(|e| self.classify(e));
        }
        let mut cursor: u64 = 0;
        let mut all = Vec::new();
        loop {
            let (next, batch): (u64, Vec<String>) = redis::cmd("SCAN")
                .arg(cursor)
                .arg("MATCH")
                .arg(pattern)
                .arg("COUNT")
                .arg(1000)
                .query_async(&mut conn)
                .await
                .map_err(|e| self.classify(e))?;
            all.extend(batch);
            if next == 0 {
                return Ok(all);
            }
            cursor = next;
        }
    }
}
