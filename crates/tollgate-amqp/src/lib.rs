//! The RabbitMQ adapter: topology, a consumer over the queues of every
//! shard, and a
//! publisher whose every publish is confirmed by the broker before the
//! runtime acks the delivery it replaces (park, retry, dead letter).

mod acks;
pub mod headers;
mod nodes;
mod topology;

use std::time::Duration;

use futures::stream::{BoxStream, SelectAll, StreamExt};
use lapin::message::Delivery;
use lapin::options::{
    BasicCancelOptions, BasicConsumeOptions, BasicGetOptions, BasicNackOptions,
    BasicPublishOptions, BasicQosOptions, ConfirmSelectOptions, QueueDeclareOptions,
};
use lapin::types::{FieldTable, ShortString};
use lapin::{BasicProperties, Channel, Confirmation, Connection, ConnectionProperties};
use tollgate_core::{DeadReason, Job, Lane, Progress, SecretUrl, TenantId, UnixMillis};

pub use acks::Acks;
pub use lapin;
pub use nodes::Nodes;
pub use topology::{ShardQueue, Topology};

#[derive(Debug, thiserror::Error)]
pub enum AmqpError {
    #[error("connecting to RabbitMQ at {url}: {source}")]
    Connect {
        url: String,
        #[source]
        source: lapin::Error,
    },
    #[error(
        "RabbitMQ lacks the {0} plugin: run `rabbitmq-plugins enable {0}` (or `make services`)"
    )]
    MissingPlugin(&'static str),
    #[error("connecting to RabbitMQ: no node answered: {0}")]
    NoNode(String),
    // The cause is in the message, not the error chain: lapin's error
    // carries its own cause in its message too, and a chain printed it
    // three times over.
    #[error("declaring {name}: {cause}")]
    Declare { name: String, cause: lapin::Error },
    #[error(
        "{name} exists with other arguments than this configuration declares ({detail}): a \
         setting that shapes queues changed (delivery_limit, delay_tiers_ms, the queue type), \
         and RabbitMQ cannot change a queue's arguments. See docs/operations.md, \
         \"Changing queue arguments needs new queues\""
    )]
    Inequivalent { name: String, detail: String },
    #[error("publishing to {exchange}: {source}")]
    Publish {
        exchange: String,
        #[source]
        source: lapin::Error,
    },
    #[error(
        "{0} does not exist: no installation has this prefix (TOLLGATE_PREFIX) on this broker; \
         run `tollgate topology declare` with the fleet's settings first"
    )]
    NotInstalled(String),
    #[error("the broker refused (nacked) a publish to {0}")]
    Nacked(String),
    #[error("a publish to {exchange} with routing key {routing_key:?} reached no queue")]
    Unroutable {
        exchange: String,
        routing_key: String,
    },
    #[error("RabbitMQ channel: {0}")]
    Channel(#[from] lapin::Error),
    #[error("RabbitMQ did not answer {0} within {REPLY_TIMEOUT:?}")]
    Timeout(&'static str),
    #[error("acking: {0}")]
    Ack(String),
    #[error("the channel can no longer {0} this delivery: the broker redelivers it")]
    Unsettleable(&'static str),
}

/// How long any one exchange with the broker (connect, channel open,
/// topology declaration, consume, publish + confirm, ack, nack, cancel,
/// close) may take. lapin can leave such a future pending forever when the
/// connection dies under it (amqp-rs/lapin#409, #470); past this bound the
/// operation counts as failed, so a delivery is handed back instead of
/// holding a worker (and its shutdown) hostage. A publish that timed out
/// may still have landed: the copy is then a duplicate, which the
/// idempotency record turns into `duplicate`, never a second send.
pub const REPLY_TIMEOUT: Duration = Duration::from_secs(10);

async fn bounded<T>(
    what: &'static str,
    op: impl std::future::Future<Output = Result<T, AmqpError>>,
) -> Result<T, AmqpError> {
    tokio::time::timeout(REPLY_TIMEOUT, op)
        .await
        .map_err(|_| AmqpError::Timeout(what))?
}

impl AmqpError {
    fn declare(name: &str, cause: lapin::Error) -> Self {
        let text = cause.to_string();
        match text.find("inequivalent arg") {
            Some(at) => Self::Inequivalent {
                name: name.to_owned(),
                detail: text[at..].to_owned(),
            },
            None => Self::Declare {
                name: name.to_owned(),
                cause,
            },
        }
    }
}

/// One connection to RabbitMQ with a confirmed publisher channel.
pub struct Broker {
    conn: Connection,
    /// Which of the [`Nodes`] it is connected to.
    node: usize,
    topology: Topology,
    /// Replaced by [`Broker::repair_publisher`] when the broker closes it
    /// (a publish to a deleted exchange, a channel error), without touching
    /// the consumers' channel and the deliveries it holds.
    publisher: std::sync::RwLock<Channel>,
    /// One repair at a time; when the topology was last declared by one.
    repairing: tokio::sync::Mutex<Option<std::time::Instant>>,
    /// Queues of the shards beyond `shards` left by an installation that had
    /// more: unbound from their exchanges and consumed until empty.
    draining: std::sync::Mutex<Vec<String>>,
}

impl Broker {
    /// Connects to the first of `nodes` that answers, in turn from the one
    /// they say to try first. `ca_pem` is a PEM bundle trusted for
    /// `amqps://` instead of the system roots.
    pub async fn connect(
        nodes: &Nodes,
        ca_pem: Option<&str>,
        connection_name: &str,
        topology: Topology,
    ) -> Result<Self, AmqpError> {
        let mut failed = Vec::new();
        for (node, url) in nodes.in_turn() {
            match Self::connect_to(url, ca_pem, connection_name).await {
                Ok((conn, publisher)) => {
                    nodes.connected(node);
                    if !failed.is_empty() {
                        tracing::warn!(
                            node = %url,
                            unreachable = %failed.join("; "),
                            "connected to RabbitMQ after other nodes failed"
                        );
                    }
                    return Ok(Self {
                        conn,
                        node,
                        topology,
                        publisher: std::sync::RwLock::new(publisher),
                        repairing: tokio::sync::Mutex::new(None),
                        draining: std::sync::Mutex::new(Vec::new()),
                    });
                }
                Err(e) if nodes.len() == 1 => return Err(e),
                Err(e) => failed.push(e.to_string()),
            }
        }
        Err(AmqpError::NoNode(failed.join("; ")))
    }

    async fn connect_to(
        url: &SecretUrl,
        ca_pem: Option<&str>,
        connection_name: &str,
    ) -> Result<(Connection, Channel), AmqpError> {
        let props = ConnectionProperties::default().with_connection_name(connection_name.into());
        let tls = lapin::tcp::OwnedTLSConfig {
            identity: None,
            cert_chain: ca_pem.map(str::to_owned),
        };
        let err = |source| AmqpError::Connect {
            url: url.redacted(),
            source,
        };
        let runtime = lapin::runtime::default_runtime().map_err(err)?;
        bounded("the connection handshake", async {
            let conn = Connection::connect_with_config(url.expose(), props, tls, runtime)
                .await
                .map_err(err)?;
            let publisher = confirmed_channel(&conn).await?;
            Ok((conn, publisher))
        })
        .await
    }

    /// Which of the [`Nodes`] this connection went to.
    pub fn node(&self) -> usize {
        self.node
    }

    pub fn topology(&self) -> &Topology {
        &self.topology
    }

    /// The connection and the publisher channel are both open.
    pub fn is_connected(&self) -> bool {
        self.connection_alive() && self.publisher().status().connected()
    }

    /// The connection (and so the consumers' deliveries) is still open.
    pub fn connection_alive(&self) -> bool {
        self.conn.status().connected()
    }

    fn publisher(&self) -> Channel {
        self.publisher.read().expect("not poisoned").clone()
    }

    /// After a failed publish (`failure`, if one): if the broker closed the
    /// publisher channel, opens a new one in confirm mode, and declares the
    /// topology again (a deleted exchange is what usually closes it). A
    /// publish that reached no queue (a deleted queue: the channel stays
    /// open) declares it again too, at most once a second however many
    /// deliveries found it missing. Deliveries in hand are not affected:
    /// they live on the consumers' channel.
    pub async fn repair_publisher(&self, failure: Option<&AmqpError>) -> Result<(), AmqpError> {
        let mut declared = self.repairing.lock().await;
        if self.publisher().status().connected() {
            let unroutable = matches!(failure, Some(AmqpError::Unroutable { .. }));
            if !unroutable || declared.is_some_and(|at| at.elapsed() < Duration::from_secs(1)) {
                return Ok(());
            }
            tracing::warn!(
                "a publish reached no queue (one was deleted?): declaring the topology again"
            );
        } else {
            let fresh = bounded("a publisher channel", confirmed_channel(&self.conn)).await?;
            *self.publisher.write().expect("not poisoned") = fresh;
            tracing::warn!("the broker closed the publisher channel: reopened it");
        }
        self.declare_topology().await?;
        *declared = Some(std::time::Instant::now());
        Ok(())
    }

    /// Checks that the installation exists, by a passive declare of its
    /// jobs exchange. A producer publishes into an installation and never
    /// declares one: declared with the producer's settings, a `shards`
    /// larger than the fleet's bound work queues no worker consumes, and a
    /// mistyped prefix built a whole installation nobody serves.
    pub async fn check_installed(&self) -> Result<(), AmqpError> {
        let exchange = self.topology.jobs_exchange();
        self.on_channel("checking the jobs exchange", async |channel| {
            let options = lapin::options::ExchangeDeclareOptions {
                passive: true,
                ..Default::default()
            };
            let kind = lapin::ExchangeKind::Custom(topology::CONSISTENT_HASH.into());
            match channel
                .exchange_declare(
                    exchange.as_str().into(),
                    kind,
                    options,
                    FieldTable::default(),
                )
                .await
            {
                Ok(()) => Ok(()),
                Err(e) if e.to_string().contains("NOT_FOUND") => {
                    Err(AmqpError::NotInstalled(exchange.clone()))
                }
                Err(e) => Err(AmqpError::declare(&exchange, e)),
            }
        })
        .await
    }

    /// Declares the whole topology on a fresh channel (a failed declare
    /// closes its channel, so it must not be the publisher's).
    pub async fn declare_topology(&self) -> Result<(), AmqpError> {
        self.on_channel("the topology declaration", async |channel| {
            self.topology.declare(channel).await
        })
        .await
    }

    /// Runs `op` on a channel of its own (a failed operation closes its
    /// channel), then closes it; every step bounded by [`REPLY_TIMEOUT`].
    async fn on_channel<T>(
        &self,
        what: &'static str,
        op: impl AsyncFnOnce(&Channel) -> Result<T, AmqpError>,
    ) -> Result<T, AmqpError> {
        let channel = self.open_channel().await?;
        let result = bounded(what, op(&channel)).await;
        if channel.status().connected() {
            let _ = bounded("a channel close", async {
                Ok(channel.close(200, "done".into()).await?)
            })
            .await;
        }
        result
    }

    /// Shards left by a larger `shards`: each of their queues unbound from
    /// its exchange, so nothing new lands there, and drained by
    /// [`Broker::consume`]; returns their names. `known` is how many shards
    /// may exist; every work queue from `shards` up to it is probed (an
    /// operator may have deleted a lower one that had emptied first), or,
    /// with `known` `None` (no record of it), up to the first missing one.
    /// Probing a missing queue makes the broker close a channel, which lapin
    /// logs as an error: callers bound it.
    pub async fn drain_stale_shards(&self, known: Option<u16>) -> Result<Vec<String>, AmqpError> {
        let mut stale = Vec::new();
        for i in self.topology.shards()..known.unwrap_or(u16::MAX) {
            if !self.queue_exists(&self.topology.work_queue(i)).await? {
                if known.is_none() {
                    break;
                }
                continue;
            }
            for kind in ShardQueue::ALL {
                // A shard left by a version before the lanes has only a
                // work queue.
                let queue = self.topology.queue(kind, i);
                if kind != ShardQueue::Work && !self.queue_exists(&queue).await? {
                    continue;
                }
                self.on_channel("unbinding a stale shard", async |channel| {
                    self.topology.unbind_shard(channel, kind, i).await
                })
                .await?;
                stale.push(queue);
            }
        }
        stale.clone_into(&mut self.draining.lock().expect("not poisoned"));
        Ok(stale)
    }

    /// A new channel, bounded by [`REPLY_TIMEOUT`].
    async fn open_channel(&self) -> Result<Channel, AmqpError> {
        bounded("a channel open", async {
            Ok(self.conn.create_channel().await?)
        })
        .await
    }

    pub async fn delete_topology(&self) -> Result<(), AmqpError> {
        self.on_channel("deleting the topology", async |channel| {
            self.topology.delete(channel).await
        })
        .await
    }

    /// Publishes `body` and waits for the broker's confirm. `mandatory`, so a
    /// message that reaches no queue is an error, not a silent loss.
    pub async fn publish(
        &self,
        exchange: &str,
        routing_key: &str,
        body: &[u8],
        properties: BasicProperties,
    ) -> Result<(), AmqpError> {
        let options = BasicPublishOptions {
            mandatory: true,
            ..Default::default()
        };
        let err = |source| AmqpError::Publish {
            exchange: exchange.to_owned(),
            source,
        };
        let confirm = bounded("a publish confirm", async {
            self.publisher()
                .basic_publish(
                    exchange.into(),
                    routing_key.into(),
                    options,
                    body,
                    properties,
                )
                .await
                .map_err(err)?
                .await
                .map_err(err)
        })
        .await?;
        match confirm {
            Confirmation::Ack(None) => Ok(()),
            Confirmation::Ack(Some(_)) => Err(AmqpError::Unroutable {
                exchange: exchange.to_owned(),
                routing_key: routing_key.to_owned(),
            }),
            Confirmation::Nack(_) => Err(AmqpError::Nacked(exchange.to_owned())),
            Confirmation::NotRequested => unreachable!("the publisher channel is in confirm mode"),
        }
    }

    /// Publishes a new job to the jobs exchange, routing key = tenant.
    pub async fn publish_job(&self, job: &Job, first_seen: UnixMillis) -> Result<(), AmqpError> {
        let progress = Progress {
            first_seen: Some(first_seen),
            enqueued_at: Some(first_seen),
            ..Progress::default()
        };
        let mut headers = FieldTable::default();
        headers::write_progress(&mut headers, &progress);
        let props = job_properties()
            .with_message_id(job.id.as_str().into())
            .with_timestamp((first_seen.0 / 1000).max(0) as u64)
            .with_headers(headers);
        self.publish(
            &self.topology.jobs_exchange(),
            job.tenant.as_str(),
            &job.to_json(),
            props,
        )
        .await
    }

    /// Publishes a copy of `delivery` carrying `progress` to a delay tier,
    /// to stay there `stay` (at most the tier: a message's expiration
    /// shorter than its queue's wins, see [`Lane::stay`]). The copy
    /// expires, with the tenant as its routing key, into the lane `lane`
    /// names: a return queue or a recheck queue. The caller acks the
    /// delivery after this returns.
    pub async fn park(
        &self,
        delivery: &Delivery,
        tenant: &TenantId,
        progress: &Progress,
        tier: Duration,
        lane: Lane,
        stay: Duration,
    ) -> Result<(), AmqpError> {
        let mut headers = delivery.properties.headers().clone().unwrap_or_default();
        headers::write_progress(&mut headers, progress);
        headers::write_lane(&mut headers, lane);
        // Always set: an expiration the job was published with must not
        // follow its copy into the tier.
        let props = copy_properties(delivery, headers)
            .with_expiration(stay.min(tier).as_millis().to_string().into());
        self.publish(
            &self.topology.tier(tier),
            tenant.as_str(),
            &delivery.data,
            props,
        )
        .await
    }

    /// Publishes `delivery` to the dead-letter exchange with its reason.
    /// Body and headers are kept; the caller acks afterwards.
    pub async fn dead_letter(
        &self,
        delivery: &Delivery,
        progress: Option<&Progress>,
        reason: DeadReason,
        detail: &str,
        now: UnixMillis,
    ) -> Result<(), AmqpError> {
        let mut headers = delivery.properties.headers().clone().unwrap_or_default();
        if let Some(progress) = progress {
            headers::write_progress(&mut headers, progress);
        }
        headers::set_text(&mut headers, headers::REASON, reason.as_str());
        headers::set_text(&mut headers, headers::DETAIL, detail);
        headers.insert(
            headers::DEAD_AT_MS.into(),
            lapin::types::AMQPValue::LongLongInt(now.0),
        );
        let props = copy_properties(delivery, headers);
        self.publish(
            &self.topology.dead_letter_exchange(),
            delivery.routing_key.as_str(),
            &delivery.data,
            props,
        )
        .await
    }

    /// Consumes every queue of every shard ([`ShardQueue`]) on one channel.
    /// Each work queue's consumer gets an equal share of `prefetch` (rounded
    /// up), so a backlog on one queue cannot take every slot, and each other
    /// queue's as much again: copies back from a wait never queue behind
    /// fresh work for a delivery slot, nor copies due behind copies that
    /// come back only to park again. Any lane queue can be looked past
    /// beyond its share ([`ConsumerControl::look_ahead`]).
    pub async fn consume(
        &self,
        consumer_name: &str,
        prefetch: u16,
    ) -> Result<Consumption, AmqpError> {
        bounded(
            "starting the consumers",
            self.start_consumers(consumer_name, prefetch),
        )
        .await
    }

    async fn start_consumers(
        &self,
        consumer_name: &str,
        prefetch: u16,
    ) -> Result<Consumption, AmqpError> {
        let channel = self.open_channel().await?;
        let share = prefetch.div_ceil(self.topology.shards()).max(1);
        // Every lane may look ahead: a return queue's copies held a few ms
        // for their slots block the copies behind them as a fresh backlog
        // does, and a recheck queue's copies only ever park again.
        let lanes: Vec<(ShardQueue, String)> = ShardQueue::ALL
            .into_iter()
            .flat_map(|kind| {
                let queues = self.topology.queues(kind);
                queues.into_iter().map(move |queue| (kind, queue))
            })
            .collect();
        let mut queues: Vec<(String, Source)> = lanes
            .iter()
            .enumerate()
            .map(|(queue, (_, name))| {
                let source = Source::Lane {
                    queue,
                    via: Via::Main,
                };
                (name.clone(), source)
            })
            .collect();
        let draining = self.draining.lock().expect("not poisoned").clone();
        queues.extend(draining.into_iter().map(|name| (name, Source::Draining)));
        let mut deliveries = SelectAll::new();
        let mut tags = Vec::with_capacity(queues.len());
        for (i, (queue, source)) in queues.into_iter().enumerate() {
            let tag = ShortString::from(format!("{consumer_name}.{i}"));
            deliveries.push(consume_from(&channel, &queue, tag.clone(), share, source).await?);
            tags.push(tag);
        }
        Ok(Consumption {
            deliveries,
            acks: Acks::default(),
            control: ConsumerControl {
                channel,
                consumer_name: consumer_name.to_owned(),
                ahead: std::sync::Mutex::new(vec![Vec::new(); lanes.len()]),
                lanes,
                share,
                tags,
                opening: tokio::sync::Mutex::new(0),
            },
        })
    }

    /// Messages ready in `queue` (passive declare: fails if it is missing).
    pub async fn queue_depth(&self, queue: &str) -> Result<u32, AmqpError> {
        self.on_channel("a queue's depth", async |channel| {
            channel
                .queue_declare(queue.into(), passive(), FieldTable::default())
                .await
                .map(|q| q.message_count())
                .map_err(|e| AmqpError::declare(queue, e))
        })
        .await
    }

    /// Whether `queue` exists. (A passive declare of a missing queue makes
    /// the broker close the channel, which lapin logs as an error.)
    async fn queue_exists(&self, queue: &str) -> Result<bool, AmqpError> {
        self.on_channel("a queue probe", async |channel| {
            Ok(channel
                .queue_declare(queue.into(), passive(), FieldTable::default())
                .await
                .is_ok())
        })
        .await
    }

    /// Reads up to `limit` dead letters without removing or wearing them.
    ///
    /// A fetch-and-requeue peek raises a quorum queue's delivery count, and
    /// a dead queue with a delivery limit (RabbitMQ 4.x sets 20 by default)
    /// drops a letter listed that many times. So each letter read is moved:
    /// a copy (body, routing key and headers kept, the delivery count
    /// dropped) is published to the back of the dead queue and confirmed,
    /// then the original is acked. Reading the whole queue keeps its order.
    pub async fn peek_dead_letters(&self, limit: usize) -> Result<Vec<Delivery>, AmqpError> {
        Ok(self
            .sweep_dead_letters(limit, true, |_| Sweep::Keep)
            .await?
            .taken)
    }

    /// Moves dead letters back to the jobs exchange: every message of the
    /// DLQ for which `select` is true (at most `limit`) is republished with
    /// its body (so its idempotency key) unchanged and tollgate's progress
    /// headers removed (attempts start again), confirmed, then acked; the
    /// others are kept, unworn (see [`Broker::peek_dead_letters`]). The
    /// sweep stops at the `limit`th letter replayed: the letters it kept
    /// before then are behind those it did not reach. Returns (replayed,
    /// left).
    pub async fn replay_dead_letters(
        &self,
        select: impl Fn(&Delivery) -> bool,
        limit: usize,
    ) -> Result<(usize, usize), AmqpError> {
        if limit == 0 {
            let queue = self.topology.dead_queue();
            return Ok((0, self.queue_depth(&queue).await? as usize));
        }
        let (mut replayed, mut kept) = (0, 0);
        let swept = self
            .sweep_dead_letters(usize::MAX, false, |delivery| {
                if !select(delivery) {
                    kept += 1;
                    Sweep::Keep
                } else {
                    replayed += 1;
                    if replayed == limit {
                        Sweep::ReplayLast
                    } else {
                        Sweep::Replay
                    }
                }
            })
            .await?;
        Ok((replayed, kept + swept.unvisited))
    }

    /// Takes up to `limit` of the dead letters present when it starts, one
    /// at a time, and per `decide` republishes each to the back of the dead
    /// queue (keep) or to the jobs exchange (replay), acking the original
    /// only once its copy is confirmed. A failure leaves the letter where
    /// it was (handed back); at worst a crash between confirm and ack
    /// leaves one letter twice, never none. Callers run it to its end: one
    /// dropped midway leaves its letter unacked on a channel that stays
    /// open until the connection closes, and the letter is then there
    /// twice.
    ///
    /// One letter at a time, copies confirmed one by one, is slow (about 800
    /// letters a second on 2 cores) but keeps every ack followed by a round
    /// trip. Confirming copies a batch at a time, then acking the batch
    /// just before the channel closed, left some letters twice: the
    /// channel's client of a quorum queue (RabbitMQ 3.10's
    /// `rabbit_fifo_client`) stashes settlements while more commands than
    /// its soft limit (32) await the queue's answer, and the stash is lost
    /// when the channel closes, so those letters go back to the queue.
    async fn sweep_dead_letters(
        &self,
        limit: usize,
        collect: bool,
        mut decide: impl FnMut(&Delivery) -> Sweep,
    ) -> Result<Swept, AmqpError> {
        let queue = self.topology.dead_queue();
        let present = self.queue_depth(&queue).await? as usize;
        let channel = self.open_channel().await?;
        let mut unvisited = present.min(limit);
        let mut done = false;
        let result = async {
            let mut taken = Vec::new();
            while unvisited > 0 && !done {
                let Some(msg) = bounded("a basic.get", async {
                    channel
                        .basic_get(queue.as_str().into(), BasicGetOptions { no_ack: false })
                        .await
                        .map_err(|e| AmqpError::declare(&queue, e))
                })
                .await?
                else {
                    unvisited = 0;
                    break;
                };
                unvisited -= 1;
                let delivery = msg.delivery;
                let mut headers = delivery.properties.headers().clone().unwrap_or_default();
                let sweep = decide(&delivery);
                done = matches!(sweep, Sweep::ReplayLast);
                let exchange = match sweep {
                    // The delivery count goes: the copy starts unworn.
                    Sweep::Keep => {
                        headers = headers::without(headers, headers::RABBITMQ_DELIVERY_COUNT);
                        self.topology.dead_letter_exchange()
                    }
                    // Attempts start again.
                    Sweep::Replay | Sweep::ReplayLast => {
                        let rabbitmq = ["x-death", headers::RABBITMQ_DELIVERY_COUNT];
                        for name in headers::ALL.into_iter().chain(rabbitmq) {
                            headers = headers::without(headers, name);
                        }
                        self.topology.jobs_exchange()
                    }
                };
                let props = copy_properties(&delivery, headers);
                let moved = self
                    .publish(
                        &exchange,
                        delivery.routing_key.as_str(),
                        &delivery.data,
                        props,
                    )
                    .await;
                match moved {
                    Ok(()) => {
                        bounded("an ack", async {
                            Ok(channel
                                .basic_ack(delivery.delivery_tag, Default::default())
                                .await?)
                        })
                        .await?;
                        if collect {
                            taken.push(delivery);
                        }
                    }
                    Err(e) => {
                        let requeue = BasicNackOptions {
                            requeue: true,
                            ..Default::default()
                        };
                        let _ = channel.basic_nack(delivery.delivery_tag, requeue).await;
                        return Err(e);
                    }
                }
            }
            Ok::<_, AmqpError>(taken)
        }
        .await;
        let _ = bounded("a channel close", async {
            Ok(channel.close(200, "swept".into()).await?)
        })
        .await;
        Ok(Swept {
            taken: result?,
            unvisited,
        })
    }

    /// Deletes every message of `queue`; returns how many.
    pub async fn purge(&self, queue: &str) -> Result<u32, AmqpError> {
        self.on_channel("a purge", async |channel| {
            channel
                .queue_purge(queue.into(), Default::default())
                .await
                .map_err(|e| AmqpError::declare(queue, e))
        })
        .await
    }

    pub async fn close(&self) {
        let _ = bounded("a connection close", async {
            Ok(self.conn.close(200, "bye".into()).await?)
        })
        .await;
    }
}

/// What a sweep of the dead queue does with one letter.
enum Sweep {
    /// Back to the end of the dead queue, unworn.
    Keep,
    /// To the jobs exchange, attempts starting over.
    Replay,
    /// Replay, and take no more letters.
    ReplayLast,
}

/// What a sweep of the dead queue took, and how many letters present when
/// it began it did not reach.
struct Swept {
    taken: Vec<Delivery>,
    unvisited: usize,
}

/// The deliveries of every consumed queue, merged, and what is needed to stop
/// them: cancel the consumers (no new deliveries) but keep the channel open
/// until in-flight deliveries are acked.
pub struct Consumption {
    pub deliveries: Arrivals,
    /// Settles the deliveries (they share one channel).
    pub acks: Acks,
    pub control: ConsumerControl,
}

/// Which consumer a delivery came by.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Source {
    /// A lane's queue: a shard's work, return or recheck queue (its index
    /// in [`ConsumerControl::lane_queue`]).
    Lane { queue: usize, via: Via },
    /// A queue of a shard being retired, drained by its main consumer only.
    Draining,
}

/// Which of a lane queue's consumers a delivery came by.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Via {
    /// The queue's main consumer, with its share of the prefetch.
    Main,
    /// A look-ahead consumer ([`ConsumerControl::look_ahead`]).
    Ahead,
}

/// The deliveries of every consumer of a [`Consumption`], each with its
/// source; consumers opened later are pushed in.
pub type Arrivals = SelectAll<BoxStream<'static, (Source, Result<Delivery, lapin::Error>)>>;

/// Starts and stops the consumers of a [`Consumption`].
pub struct ConsumerControl {
    channel: Channel,
    consumer_name: String,
    /// The lanes' queues, each with its lane, in [`Source::Lane`]'s order:
    /// every work queue, then every return queue, then every recheck queue.
    lanes: Vec<(ShardQueue, String)>,
    /// Each main consumer's prefetch.
    share: u16,
    tags: Vec<ShortString>,
    /// The look-ahead consumers open on each lane queue.
    ahead: std::sync::Mutex<Vec<Vec<ShortString>>>,
    /// Held from a look-ahead's `basic.qos` to its `basic.consume` (the
    /// prefetch applies to the next consumer made on the channel); counts
    /// the look-aheads opened, for unique tags.
    opening: tokio::sync::Mutex<u64>,
}

impl ConsumerControl {
    /// Each main consumer's prefetch: its queue's share of the pod's.
    pub fn share(&self) -> u16 {
        self.share
    }

    /// How many lane queues are consumed ([`Source::Lane`]'s indices).
    pub fn lane_count(&self) -> usize {
        self.lanes.len()
    }

    /// Lane queue `queue`'s lane and name.
    pub fn lane_queue(&self, queue: usize) -> (ShardQueue, &str) {
        let (kind, name) = &self.lanes[queue];
        (*kind, name)
    }

    /// Opens one more consumer on lane queue `queue` with its own
    /// `prefetch`, on the same channel (so the same [`Acks`] settle its
    /// deliveries); push the stream into the [`Arrivals`].
    pub async fn look_ahead(
        &self,
        queue: usize,
        prefetch: u16,
    ) -> Result<BoxStream<'static, (Source, Result<Delivery, lapin::Error>)>, AmqpError> {
        bounded("a look-ahead consumer", async {
            let mut opened = self.opening.lock().await;
            *opened += 1;
            let tag = ShortString::from(format!("{}.ahead.{queue}.{opened}", self.consumer_name));
            let source = Source::Lane {
                queue,
                via: Via::Ahead,
            };
            let stream = consume_from(
                &self.channel,
                &self.lanes[queue].1,
                tag.clone(),
                prefetch,
                source,
            )
            .await?;
            self.ahead.lock().expect("not poisoned")[queue].push(tag);
            Ok(stream)
        })
        .await
    }

    /// Cancels every look-ahead consumer of lane queue `queue`; their
    /// deliveries in hand can still be acked.
    pub async fn stop_looking_ahead(&self, queue: usize) -> Result<(), AmqpError> {
        let tags = std::mem::take(&mut self.ahead.lock().expect("not poisoned")[queue]);
        self.cancel_tags(&tags).await
    }

    /// Stops new deliveries; deliveries in hand can still be acked.
    pub async fn cancel(&self) -> Result<(), AmqpError> {
        let ahead: Vec<ShortString> =
            std::mem::take(&mut *self.ahead.lock().expect("not poisoned"))
                .into_iter()
                .flatten()
                .collect();
        self.cancel_tags(&ahead).await?;
        self.cancel_tags(&self.tags).await
    }

    async fn cancel_tags(&self, tags: &[ShortString]) -> Result<(), AmqpError> {
        bounded("a consumer cancel", async {
            for tag in tags {
                self.channel
                    .basic_cancel(tag.clone(), BasicCancelOptions::default())
                    .await?;
            }
            Ok(())
        })
        .await
    }

    /// Closes the channel; anything still unacked returns to its queue.
    pub async fn close(&self) {
        let _ = bounded("a channel close", async {
            Ok(self.channel.close(200, "consumer done".into()).await?)
        })
        .await;
    }
}

/// A consumer of `queue` on `channel` with its own `prefetch`, its
/// deliveries marked with `source`.
async fn consume_from(
    channel: &Channel,
    queue: &str,
    tag: ShortString,
    prefetch: u16,
    source: Source,
) -> Result<BoxStream<'static, (Source, Result<Delivery, lapin::Error>)>, AmqpError> {
    // basic.qos with global=false applies to consumers created after it.
    channel
        .basic_qos(prefetch, BasicQosOptions { global: false })
        .await?;
    let consumer = channel
        .basic_consume(
            queue.into(),
            tag,
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;
    Ok(consumer.map(move |delivery| (source, delivery)).boxed())
}

fn passive() -> QueueDeclareOptions {
    QueueDeclareOptions {
        passive: true,
        ..Default::default()
    }
}

/// A channel in confirm mode: every publish on it is acked by the broker.
async fn confirmed_channel(conn: &Connection) -> Result<Channel, AmqpError> {
    let channel = conn.create_channel().await?;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await?;
    Ok(channel)
}

/// The properties of a copy of `delivery` (persistent) carrying `headers`.
///
/// Two of the producer's properties never follow a copy: its `expiration`
/// (a dead letter or a replayed job would vanish when it ran out, as no
/// queue of ours dead-letters further; a parked copy sets its own) and its
/// `user-id` (the broker refuses a publish whose user-id is not the
/// connection's user, so the copy could never be published).
fn copy_properties(delivery: &Delivery, headers: FieldTable) -> BasicProperties {
    let from = &delivery.properties;
    let mut props = BasicProperties::default()
        .with_delivery_mode(2)
        .with_headers(headers);
    type With = fn(BasicProperties, ShortString) -> BasicProperties;
    let texts: [(&Option<ShortString>, With); 8] = [
        (from.content_type(), BasicProperties::with_content_type),
        (
            from.content_encoding(),
            BasicProperties::with_content_encoding,
        ),
        (from.correlation_id(), BasicProperties::with_correlation_id),
        (from.reply_to(), BasicProperties::with_reply_to),
        (from.message_id(), BasicProperties::with_message_id),
        (from.kind(), BasicProperties::with_type),
        (from.app_id(), BasicProperties::with_app_id),
        (from.cluster_id(), BasicProperties::with_cluster_id),
    ];
    for (value, with) in texts {
        if let Some(value) = value {
            props = with(props, value.clone());
        }
    }
    if let Some(priority) = from.priority() {
        props = props.with_priority(*priority);
    }
    if let Some(timestamp) = from.timestamp() {
        props = props.with_timestamp(*timestamp);
    }
    props
}

/// Properties of a job message: JSON, persistent.
pub fn job_properties() -> BasicProperties {
    BasicProperties::default()
        .with_content_type("application/json".into())
        .with_delivery_mode(2)
}
