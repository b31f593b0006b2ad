//! Declaring the RabbitMQ topology as a worker (and `tollgate topology
//! declare`) does: the exchanges and queues, then the queues of every lane
//! (work, return, recheck) a larger `shards` left behind, drained rather
//! than stranded.

use tollgate_amqp::Broker;
use tollgate_quota::QuotaStore;

/// Declares the topology, and drains the queues of every lane a larger
/// `shards` left behind; returns their names. How many shards may exist is recorded
/// in Redis at every declaration; `beyond` (from `tollgate topology declare
/// --drain-from`) names it when Redis lost that record. With Redis
/// unreachable, only the declaration is done.
pub async fn declare(
    broker: &Broker,
    store: &QuotaStore,
    beyond: Option<u16>,
) -> anyhow::Result<Vec<String>> {
    broker.declare_topology().await?;
    let shards = broker.topology().shards();
    let recorded = match store.work_queues().await {
        Ok(recorded) => recorded,
        Err(e) => {
            tracing::warn!(error = %e, "not looking for work queues left by a larger shards");
            return Ok(Vec::new());
        }
    };
    // No record (a new installation, or Redis lost it): nothing is probed,
    // as probing a missing queue makes the broker close a channel.
    let known = recorded.max(beyond).unwrap_or(shards);
    let stale = broker.drain_stale_shards(known).await?;
    let stale_shards = (shards..known)
        .filter(|&i| stale.contains(&broker.topology().work_queue(i)))
        .count();
    let exist = shards + stale_shards as u16;
    if recorded != Some(exist)
        && let Err(e) = store.set_work_queues(exist).await
    {
        tracing::warn!(error = %e, "recording how many work queues exist");
    }
    Ok(stale)
}

/// What an operator needs to know about a work queue left by a larger
/// `shards`.
pub fn draining_note(queue: &str, depth: u32) -> String {
    format!(
        "{queue} is beyond TOLLGATE_SHARDS: unbound from its exchange (no new jobs land \
         there) and drained by every worker; {depth} job(s) left. Once it stays empty, delete \
         it: rabbitmqctl delete_queue {queue}"
    )
}
