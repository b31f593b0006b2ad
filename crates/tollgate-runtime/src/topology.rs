//! Declaring the RabbitMQ topology as a worker (and `tollgate topology
//! declare`) does: the exchanges and queues, then the queues of every lane
//! (work, return, recheck) a larger `shards` left behind, drained rather
//! than stranded.

use tollgate_amqp::Broker;
use tollgate_quota::QuotaStore;

/// Declares the topology, and drains the queues of every lane a larger
/// `shards` left behind; returns their names. How many shards may exist is
/// recorded in Redis at every declaration; `beyond` (from `tollgate topology
/// declare --drain-from`) names it when Redis lost that record; without
/// either (a new installation) nothing is probed, as probing a missing
/// queue makes the broker close a channel, which lapin logs as an error.
/// With Redis unreachable, work queues are probed from `shards` up to the
/// first missing one: a worker that starts while Redis is down still finds
/// the queues a larger `shards` left, unless a gap hides them.
pub async fn declare(
    broker: &Broker,
    store: &QuotaStore,
    beyond: Option<u16>,
) -> anyhow::Result<Vec<String>> {
    broker.declare_topology().await?;
    let shards = broker.topology().shards();
    let recorded = match store.work_queues().await {
        Ok(recorded) => Ok(recorded),
        Err(e) => {
            tracing::warn!(
                error = %e,
                "Redis holds the record of work queues left by a larger shards: looking for \
                 them up to the first missing one"
            );
            Err(e)
        }
    };
    let known = match &recorded {
        Ok(recorded) => Some(recorded.max(&beyond).unwrap_or(shards)),
        Err(_) => beyond,
    };
    let stale = broker.drain_stale_shards(known).await?;
    // The highest stale work queue bounds what exists: an operator may have
    // deleted lower ones.
    let exist = (shards..u16::MAX)
        .take_while(|&i| known.is_none_or(|k| i < k))
        .filter(|&i| stale.contains(&broker.topology().work_queue(i)))
        .max()
        .map_or(shards, |i| i + 1);
    if let Ok(recorded) = recorded
        && recorded != Some(exist)
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
