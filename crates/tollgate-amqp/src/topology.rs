//! The RabbitMQ topology, declared idempotently (`tollgate topology declare`
//! and at every worker start):
//!
//! ```text
//! producers ──rk=tenant──▶ {p}.jobs (x-consistent-hash) ──▶ {p}.work.0 … {p}.work.N-1       (quorum)
//!                                                                │ delivery limit / rejects
//!    {p}.park.<tier> (fanout) ─▶ {p}.park.<tier> (quorum, TTL)    ▼
//!          expired: dead-lettered, rk=tenant                {p}.dlx (fanout) ──▶ {p}.dead
//!                                 ▼                              ▲
//!    {p}.expired (headers) ── tollgate-lane=recheck ──▶ {p}.rechecks (x-consistent-hash)
//!        │ anything else (alternate exchange)                  ──▶ {p}.recheck.0 … N-1 (quorum)
//!        ▼
//!    {p}.returns (x-consistent-hash) ──▶ {p}.return.0 … {p}.return.N-1                   (quorum)
//! ```
//!
//! Each exchange of a lane hashes the routing key (the tenant), so a tenant
//! always lands on the same shard of it. Workers consume three lanes per
//! shard, each with its own share of the prefetch, so none waits behind
//! another's backlog in a FIFO queue: fresh jobs (the work queues), parked
//! copies whose time has come (the return queues), and parked copies that
//! only come back to ask again and park once more (the recheck queues,
//! `tollgate_core::Lane`), which come back in herds.
//!
//! Before the lanes, the tiers were `{p}.delay.<tier>` and dead-lettered
//! into `{p}.jobs`. A queue's arguments cannot change, so the tiers have new
//! names; copies parked in the old ones by workers of an earlier version
//! still come back to the work queues when they expire.

use std::time::Duration;

use lapin::options::{
    ExchangeBindOptions, ExchangeDeclareOptions, ExchangeDeleteOptions, QueueBindOptions,
    QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{Channel, ExchangeKind};
use tollgate_core::DelayTiers;

use crate::{AmqpError, headers};

/// The queues of each shard, each fed by a consistent-hash exchange of its
/// own and consumed with its own share of the prefetch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ShardQueue {
    /// Fresh jobs, as producers publish them.
    Work,
    /// Parked copies whose wait ends about when they come back.
    Return,
    /// Parked copies that come back only to ask again and park once more.
    Recheck,
}

impl ShardQueue {
    pub const ALL: [Self; 3] = [Self::Work, Self::Return, Self::Recheck];

    /// The lane's name, as in its queues' names: `work`, `return`,
    /// `recheck`.
    pub fn lane(self) -> &'static str {
        self.names().1
    }

    /// The names of its exchange and (before `.<shard>`) of its queues.
    fn names(self) -> (&'static str, &'static str) {
        match self {
            Self::Work => ("jobs", "work"),
            Self::Return => ("returns", "return"),
            Self::Recheck => ("rechecks", "recheck"),
        }
    }
}

/// Names and shape of one tollgate installation's queues.
#[derive(Clone, Debug)]
pub struct Topology {
    prefix: String,
    shards: u16,
    tiers: Vec<Duration>,
    delivery_limit: u32,
}

impl Topology {
    pub fn new(
        prefix: impl Into<String>,
        shards: u16,
        tiers: &DelayTiers,
        delivery_limit: u32,
    ) -> Self {
        Self {
            prefix: prefix.into(),
            shards: shards.max(1),
            tiers: tiers.all().to_vec(),
            delivery_limit,
        }
    }

    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    pub fn jobs_exchange(&self) -> String {
        self.exchange(ShardQueue::Work)
    }

    /// The consistent-hash exchange that feeds `kind`'s queue on every
    /// shard.
    pub fn exchange(&self, kind: ShardQueue) -> String {
        format!("{}.{}", self.prefix, kind.names().0)
    }

    /// Where every expired parked copy goes first: a headers exchange that
    /// sends it on to its lane.
    pub fn expired_exchange(&self) -> String {
        format!("{}.expired", self.prefix)
    }

    pub fn work_queues(&self) -> Vec<String> {
        self.queues(ShardQueue::Work)
    }

    /// `kind`'s queue of every shard.
    pub fn queues(&self, kind: ShardQueue) -> Vec<String> {
        (0..self.shards).map(|i| self.queue(kind, i)).collect()
    }

    pub fn shards(&self) -> u16 {
        self.shards
    }

    /// The name of work queue `i` (which may lie beyond `shards`).
    pub fn work_queue(&self, i: u16) -> String {
        self.queue(ShardQueue::Work, i)
    }

    /// The name of shard `i`'s queue of `kind` (`i` may lie beyond
    /// `shards`).
    pub fn queue(&self, kind: ShardQueue, i: u16) -> String {
        format!("{}.{}.{i}", self.prefix, kind.names().1)
    }

    /// Stops `kind`'s exchange routing to shard `i`'s queue: a shard beyond
    /// `shards`, being drained.
    pub async fn unbind_shard(
        &self,
        channel: &Channel,
        kind: ShardQueue,
        i: u16,
    ) -> Result<(), AmqpError> {
        unbind(channel, &self.queue(kind, i), &self.exchange(kind)).await
    }

    /// The tier's exchange and queue share this name.
    pub fn tier(&self, tier: Duration) -> String {
        format!("{}.park.{}", self.prefix, DelayTiers::name(tier))
    }

    /// The tier's name before the lanes (see the module's note).
    fn legacy_tier(&self, tier: Duration) -> String {
        format!("{}.delay.{}", self.prefix, DelayTiers::name(tier))
    }

    pub fn dead_letter_exchange(&self) -> String {
        format!("{}.dlx", self.prefix)
    }

    pub fn dead_queue(&self) -> String {
        format!("{}.dead", self.prefix)
    }

    /// The delay tiers' queues (each named as its exchange).
    pub fn tier_queues(&self) -> Vec<String> {
        self.tiers.iter().map(|&t| self.tier(t)).collect()
    }

    /// Every queue, for depth checks and cleanup.
    pub fn all_queues(&self) -> Vec<String> {
        let mut queues: Vec<String> = ShardQueue::ALL
            .into_iter()
            .flat_map(|kind| self.queues(kind))
            .collect();
        queues.extend(self.tier_queues());
        queues.push(self.dead_queue());
        queues
    }

    pub async fn declare(&self, channel: &Channel) -> Result<(), AmqpError> {
        let durable = ExchangeDeclareOptions {
            durable: true,
            ..Default::default()
        };
        let dlx = self.dead_letter_exchange();
        let expired = self.expired_exchange();
        declare_exchange(channel, &dlx, ExchangeKind::Fanout, durable, None).await?;
        for kind in ShardQueue::ALL {
            let exchange = self.exchange(kind);
            let hashed = ExchangeKind::Custom(CONSISTENT_HASH.into());
            declare_exchange(channel, &exchange, hashed, durable, None).await?;
            for queue in self.queues(kind) {
                let mut args = quorum();
                dead_letter_to(&mut args, &dlx);
                args.insert(
                    "x-delivery-limit".into(),
                    AMQPValue::LongLongInt(i64::from(self.delivery_limit)),
                );
                declare_queue(channel, &queue, args).await?;
                // Consistent-hash bindings carry a weight, not a pattern.
                bind(channel, &queue, &exchange, "1").await?;
            }
        }
        declare_queue(channel, &self.dead_queue(), quorum()).await?;
        bind(channel, &self.dead_queue(), &dlx, "").await?;

        // A copy marked for the recheck lane goes there; any other, to the
        // return lane (the alternate exchange takes what matches nothing).
        let returns = self.exchange(ShardQueue::Return);
        declare_exchange(
            channel,
            &expired,
            ExchangeKind::Headers,
            durable,
            Some(&returns),
        )
        .await?;
        let mut recheck = FieldTable::default();
        recheck.insert("x-match".into(), long_string("all"));
        recheck.insert(headers::LANE.into(), long_string("recheck"));
        channel
            .exchange_bind(
                self.exchange(ShardQueue::Recheck).as_str().into(),
                expired.as_str().into(),
                "".into(),
                ExchangeBindOptions::default(),
                recheck,
            )
            .await
            .map_err(|e| AmqpError::declare(&expired, e))?;

        for &tier in &self.tiers {
            let name = self.tier(tier);
            let mut args = quorum();
            // No x-dead-letter-routing-key: the copy keeps its routing key
            // (the tenant) and comes back to the tenant's shard of its lane.
            dead_letter_to(&mut args, &expired);
            args.insert(
                "x-message-ttl".into(),
                AMQPValue::LongLongInt(tier.as_millis() as i64),
            );
            declare_exchange(channel, &name, ExchangeKind::Fanout, durable, None).await?;
            declare_queue(channel, &name, args).await?;
            bind(channel, &name, &name, "").await?;
        }
        Ok(())
    }

    /// Deletes every queue and exchange of this prefix (tests and demo),
    /// the tiers of before the lanes too.
    pub async fn delete(&self, channel: &Channel) -> Result<(), AmqpError> {
        let legacy = self.tiers.iter().map(|&t| self.legacy_tier(t));
        let mut queues = self.all_queues();
        queues.extend(legacy.clone());
        for queue in queues {
            channel
                .queue_delete(queue.as_str().into(), QueueDeleteOptions::default())
                .await
                .map_err(|e| AmqpError::declare(&queue, e))?;
        }
        let mut exchanges: Vec<String> = ShardQueue::ALL
            .into_iter()
            .map(|kind| self.exchange(kind))
            .collect();
        exchanges.push(self.expired_exchange());
        exchanges.push(self.dead_letter_exchange());
        exchanges.extend(self.tier_queues());
        exchanges.extend(legacy);
        for exchange in exchanges {
            channel
                .exchange_delete(exchange.as_str().into(), ExchangeDeleteOptions::default())
                .await
                .map_err(|e| AmqpError::declare(&exchange, e))?;
        }
        Ok(())
    }
}

fn quorum() -> FieldTable {
    let mut args = FieldTable::default();
    args.insert("x-queue-type".into(), long_string("quorum"));
    args
}

/// At-least-once dead-lettering: the message leaves the source queue only
/// once the target confirmed it. Requires `x-overflow: reject-publish`.
fn dead_letter_to(args: &mut FieldTable, exchange: &str) {
    args.insert("x-dead-letter-exchange".into(), long_string(exchange));
    args.insert(
        "x-dead-letter-strategy".into(),
        long_string("at-least-once"),
    );
    args.insert("x-overflow".into(), long_string("reject-publish"));
}

/// The type of the exchanges that spread tenants over the shards' queues
/// (the `rabbitmq_consistent_hash_exchange` plugin's).
pub(crate) const CONSISTENT_HASH: &str = "x-consistent-hash";

fn long_string(s: &str) -> AMQPValue {
    AMQPValue::LongString(LongString::from(s))
}

/// Declares an exchange, with `alternate` taking what it cannot route.
async fn declare_exchange(
    channel: &Channel,
    name: &str,
    kind: ExchangeKind,
    options: ExchangeDeclareOptions,
    alternate: Option<&str>,
) -> Result<(), AmqpError> {
    let custom = matches!(kind, ExchangeKind::Custom(_));
    let mut args = FieldTable::default();
    if let Some(alternate) = alternate {
        args.insert("alternate-exchange".into(), long_string(alternate));
    }
    channel
        .exchange_declare(ShortString::from(name), kind, options, args)
        .await
        .map_err(|e| {
            // RabbitMQ 3.10 says "unknown exchange type", older ones
            // "invalid exchange type".
            if custom && e.to_string().contains("exchange type") {
                AmqpError::MissingPlugin("rabbitmq_consistent_hash_exchange")
            } else {
                AmqpError::declare(name, e)
            }
        })
}

async fn declare_queue(channel: &Channel, name: &str, args: FieldTable) -> Result<(), AmqpError> {
    let options = QueueDeclareOptions {
        durable: true,
        ..Default::default()
    };
    channel
        .queue_declare(name.into(), options, args)
        .await
        .map(drop)
        .map_err(|e| AmqpError::declare(name, e))
}

/// Undoes [`bind`] with a consistent-hash weight of 1.
async fn unbind(channel: &Channel, queue: &str, exchange: &str) -> Result<(), AmqpError> {
    channel
        .queue_unbind(
            queue.into(),
            exchange.into(),
            "1".into(),
            FieldTable::default(),
        )
        .await
        .map_err(|e| AmqpError::declare(queue, e))
}

async fn bind(channel: &Channel, queue: &str, exchange: &str, key: &str) -> Result<(), AmqpError> {
    channel
        .queue_bind(
            queue.into(),
            exchange.into(),
            key.into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await
        .map_err(|e| AmqpError::declare(queue, e))
}
