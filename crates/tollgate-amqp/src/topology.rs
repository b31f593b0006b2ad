//! The RabbitMQ topology, declared idempotently (`tollgate topology declare`
//! and at every worker start):
//!
//! ```text
//! producers ──rk=tenant──▶ {p}.jobs (x-consistent-hash) ──▶ {p}.work.0 … {p}.work.N-1  (quorum)
//!                              ▲                                │ delivery limit / rejects
//!    {p}.delay.<tier> (fanout) ─▶ {p}.delay.<tier> (quorum, TTL)     ▼
//!                      expired: dead-lettered back, rk=tenant     {p}.dlx (fanout) ──▶ {p}.dead
//! ```
//!
//! The jobs exchange hashes the routing key (the tenant), so each tenant
//! always lands on the same work queue and a parked copy returns to it.

use std::time::Duration;

use lapin::options::{
    ExchangeDeclareOptions, ExchangeDeleteOptions, QueueBindOptions, QueueDeclareOptions,
    QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{Channel, ExchangeKind};
use tollgate_core::DelayTiers;

use crate::AmqpError;

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
        format!("{}.jobs", self.prefix)
    }

    pub fn work_queues(&self) -> Vec<String> {
        (0..self.shards).map(|i| self.work_queue(i)).collect()
    }

    pub fn shards(&self) -> u16 {
        self.shards
    }

    /// The name of work queue `i` (which may lie beyond `shards`).
    pub fn work_queue(&self, i: u16) -> String {
        format!("{}.work.{i}", self.prefix)
    }

    /// Stops the jobs exchange routing to `queue` (a work queue beyond
    /// `shards`, being drained).
    pub async fn unbind_work_queue(&self, channel: &Channel, queue: &str) -> Result<(), AmqpError> {
        channel
            .queue_unbind(
                queue.into(),
                self.jobs_exchange().as_str().into(),
                "1".into(),
                FieldTable::default(),
            )
            .await
            .map_err(|e| AmqpError::declare(queue, e))
    }

    /// The tier's exchange and queue share this name.
    pub fn tier(&self, tier: Duration) -> String {
        format!("{}.delay.{}", self.prefix, DelayTiers::name(tier))
    }

    pub fn dead_letter_exchange(&self) -> String {
        format!("{}.dlx", self.prefix)
    }

    pub fn dead_queue(&self) -> String {
        format!("{}.dead", self.prefix)
    }

    /// Every queue, for depth checks and cleanup.
    pub fn all_queues(&self) -> Vec<String> {
        let mut queues = self.work_queues();
        queues.extend(self.tiers.iter().map(|&t| self.tier(t)));
        queues.push(self.dead_queue());
        queues
    }

    pub async fn declare(&self, channel: &Channel) -> Result<(), AmqpError> {
        let durable = ExchangeDeclareOptions {
            durable: true,
            ..Default::default()
        };
        let jobs = self.jobs_exchange();
        let dlx = self.dead_letter_exchange();
        declare_exchange(channel, &dlx, ExchangeKind::Fanout, durable).await?;
        declare_exchange(
            channel,
            &jobs,
            ExchangeKind::Custom("x-consistent-hash".into()),
            durable,
        )
        .await?;

        declare_queue(channel, &self.dead_queue(), quorum()).await?;
        bind(channel, &self.dead_queue(), &dlx, "").await?;

        for queue in self.work_queues() {
            let mut args = quorum();
            dead_letter_to(&mut args, &dlx);
            args.insert(
                "x-delivery-limit".into(),
                AMQPValue::LongLongInt(i64::from(self.delivery_limit)),
            );
            declare_queue(channel, &queue, args).await?;
            // Consistent-hash bindings carry a weight, not a pattern.
            bind(channel, &queue, &jobs, "1").await?;
        }

        for &tier in &self.tiers {
            let name = self.tier(tier);
            let mut args = quorum();
            // No x-dead-letter-routing-key: the copy keeps its routing key
            // (the tenant) and returns to the tenant's own work queue.
            dead_letter_to(&mut args, &jobs);
            args.insert(
                "x-message-ttl".into(),
                AMQPValue::LongLongInt(tier.as_millis() as i64),
            );
            declare_exchange(channel, &name, ExchangeKind::Fanout, durable).await?;
            declare_queue(channel, &name, args).await?;
            bind(channel, &name, &name, "").await?;
        }
        Ok(())
    }

    /// Deletes every queue and exchange of this prefix (tests and demo).
    pub async fn delete(&self, channel: &Channel) -> Result<(), AmqpError> {
        for queue in self.all_queues() {
            channel
                .queue_delete(queue.as_str().into(), QueueDeleteOptions::default())
                .await
                .map_err(|e| AmqpError::declare(&queue, e))?;
        }
        let mut exchanges = vec![self.jobs_exchange(), self.dead_letter_exchange()];
        exchanges.extend(self.tiers.iter().map(|&t| self.tier(t)));
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

fn long_string(s: &str) -> AMQPValue {
    AMQPValue::LongString(LongString::from(s))
}

async fn declare_exchange(
    channel: &Channel,
    name: &str,
    kind: ExchangeKind,
    options: ExchangeDeclareOptions,
) -> Result<(), AmqpError> {
    let custom = matches!(kind, ExchangeKind::Custom(_));
    channel
        .exchange_declare(
            ShortString::from(name),
            kind,
            options,
            FieldTable::default(),
        )
        .await
        .map_err(|e| {
            if custom && e.to_string().contains("invalid exchange type") {
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
