//! tollgate's own AMQP headers: the job's [`Progress`] between deliveries,
//! and the reason on dead letters. A producer could set these too, so they
//! are type-checked like the body.

use std::time::Duration;

use lapin::types::{AMQPValue, FieldTable, LongString};
use tollgate_core::ports::SharePlace;
use tollgate_core::{Lane, Malformed, ParkReason, Progress, UnixMillis};

pub const ATTEMPT: &str = "x-tollgate-attempt";
pub const FIRST_SEEN_MS: &str = "x-tollgate-first-seen-ms";
pub const QUOTA_WAIT_MS: &str = "x-tollgate-quota-wait-ms";
pub const NOT_BEFORE_MS: &str = "x-tollgate-not-before-ms";
pub const PARK_REASON: &str = "x-tollgate-park-reason";
pub const ENQUEUED_MS: &str = "x-tollgate-enqueued-ms";
pub const SLOT_INTERVAL_US: &str = "x-tollgate-slot-interval-us";
/// A place on a tenant's share of a route, in the route's virtual time.
pub const SHARE_PLACE: &str = "x-tollgate-share-place";
/// The tenant's step on the route's virtual time when that place was given.
pub const SHARE_STEP: &str = "x-tollgate-share-step";
pub const REDELIVERIES: &str = "x-tollgate-redeliveries";
/// Times in a row Redis (or an eligibility webhook) could not be reached.
pub const UNAVAILABLE: &str = "x-tollgate-unavailable";
/// 429s the job met (they use no attempt).
pub const THROTTLED: &str = "x-tollgate-throttled";
/// Set by RabbitMQ on a redelivered quorum-queue message: failed deliveries
/// of this copy so far.
pub const RABBITMQ_DELIVERY_COUNT: &str = "x-delivery-count";
/// On dead letters: `malformed`, `expired`, `rejected`, `exhausted`, `poison`.
pub const REASON: &str = "x-tollgate-reason";
/// On dead letters: the precise cause, for humans.
pub const DETAIL: &str = "x-tollgate-detail";
pub const DEAD_AT_MS: &str = "x-tollgate-dead-at-ms";
/// On a parked copy: `recheck` when it comes back through the recheck
/// queues ([`Lane::Recheck`]); absent, through the return queues. Without
/// the `x-` of the others: a headers exchange routes on it, and RabbitMQ's
/// headers exchange ignores arguments that begin with `x-`.
pub const LANE: &str = "tollgate-lane";

/// Every header tollgate writes.
pub const ALL: [&str; 16] = [
    LANE,
    REDELIVERIES,
    UNAVAILABLE,
    THROTTLED,
    ATTEMPT,
    FIRST_SEEN_MS,
    QUOTA_WAIT_MS,
    NOT_BEFORE_MS,
    PARK_REASON,
    ENQUEUED_MS,
    SLOT_INTERVAL_US,
    SHARE_PLACE,
    SHARE_STEP,
    REASON,
    DETAIL,
    DEAD_AT_MS,
];

/// `headers` without `name`.
pub fn without(headers: FieldTable, name: &str) -> FieldTable {
    if !headers.contains_key(name) {
        return headers;
    }
    let mut map = headers.inner().clone();
    map.remove(name);
    FieldTable::from(map)
}

fn int(headers: &FieldTable, name: &'static str) -> Result<Option<i64>, Malformed> {
    let Some(value) = headers.inner().get(name) else {
        return Ok(None);
    };
    let n = match *value {
        AMQPValue::ShortShortInt(n) => i64::from(n),
        AMQPValue::ShortShortUInt(n) => i64::from(n),
        AMQPValue::ShortInt(n) => i64::from(n),
        AMQPValue::ShortUInt(n) => i64::from(n),
        AMQPValue::LongInt(n) => i64::from(n),
        AMQPValue::LongUInt(n) => i64::from(n),
        AMQPValue::LongLongInt(n) => n,
        AMQPValue::Timestamp(n) => i64::try_from(n).unwrap_or(i64::MAX),
        _ => {
            return Err(Malformed::Header {
                name,
                reason: "expected an integer".into(),
            });
        }
    };
    if n < 0 {
        return Err(Malformed::Header {
            name,
            reason: format!("{n} is negative"),
        });
    }
    Ok(Some(n))
}

/// A header as text, if present and a string.
pub fn text(headers: &FieldTable, name: &str) -> Option<String> {
    match headers.inner().get(name)? {
        AMQPValue::LongString(s) => Some(String::from_utf8_lossy(s.as_bytes()).into_owned()),
        AMQPValue::ShortString(s) => Some(s.as_str().to_owned()),
        _ => None,
    }
}

/// Why RabbitMQ itself last dead-lettered a message, and from which queue:
/// the first entry of its `x-death` (`expired`, `delivery_limit`, …).
pub fn last_death(headers: &FieldTable) -> Option<(String, String)> {
    let AMQPValue::FieldArray(deaths) = headers.inner().get("x-death")? else {
        return None;
    };
    let AMQPValue::FieldTable(last) = deaths.as_slice().first()? else {
        return None;
    };
    Some((
        text(last, "reason")?,
        text(last, "queue").unwrap_or_default(),
    ))
}

/// [`read_progress`] of a delivery: RabbitMQ's `x-delivery-count` counts
/// only when the broker redelivered it. On a first delivery the header can
/// only be the producer's (or a copy moved back from the dead-letter queue
/// by hand, where it counted the deliveries that made it `poison`), and
/// counted, it dead-lettered the job as `poison` before any worker tried it.
pub fn read_delivery_progress(
    headers: Option<&FieldTable>,
    redelivered: bool,
) -> Result<Progress, Malformed> {
    match headers {
        Some(h) if !redelivered && h.contains_key(RABBITMQ_DELIVERY_COUNT) => {
            read_progress(Some(&without(h.clone(), RABBITMQ_DELIVERY_COUNT)))
        }
        _ => read_progress(headers),
    }
}

/// Reads the progress a delivery carries. Absent headers mean a fresh job.
pub fn read_progress(headers: Option<&FieldTable>) -> Result<Progress, Malformed> {
    let Some(h) = headers else {
        return Ok(Progress::default());
    };
    let park_reason = match h.inner().get(PARK_REASON) {
        None => None,
        Some(_) => Some(
            text(h, PARK_REASON)
                .and_then(|s| ParkReason::parse(&s))
                .ok_or(Malformed::Header {
                    name: PARK_REASON,
                    reason: "not a known park reason".into(),
                })?,
        ),
    };
    let attempt = int(h, ATTEMPT)?.unwrap_or(0);
    let unavailable = int(h, UNAVAILABLE)?.unwrap_or(0);
    let throttled = int(h, THROTTLED)?.unwrap_or(0);
    let share_step = int(h, SHARE_STEP)?.and_then(|v| u64::try_from(v).ok());
    Ok(Progress {
        attempt: u32::try_from(attempt).map_err(|_| Malformed::Header {
            name: ATTEMPT,
            reason: format!("{attempt} is too large"),
        })?,
        unavailable: u32::try_from(unavailable).map_err(|_| Malformed::Header {
            name: UNAVAILABLE,
            reason: format!("{unavailable} is not a count"),
        })?,
        throttled: u32::try_from(throttled).map_err(|_| Malformed::Header {
            name: THROTTLED,
            reason: format!("{throttled} is not a count"),
        })?,
        first_seen: int(h, FIRST_SEEN_MS)?.map(UnixMillis),
        quota_wait: Duration::from_millis(int(h, QUOTA_WAIT_MS)?.unwrap_or(0) as u64),
        // Checked like a job's own instants: a copy must not be parked
        // past 2200 by a header it carries.
        not_before: int(h, NOT_BEFORE_MS)?
            .map(|ms| {
                UnixMillis(ms)
                    .in_job_range()
                    .map_err(|e| Malformed::Header {
                        name: NOT_BEFORE_MS,
                        reason: e.to_string(),
                    })
            })
            .transpose()?,
        park_reason,
        enqueued_at: int(h, ENQUEUED_MS)?.map(UnixMillis),
        slot_interval: int(h, SLOT_INTERVAL_US)?.map(|us| Duration::from_micros(us as u64)),
        share_place: int(h, SHARE_PLACE)?
            .and_then(|v| u64::try_from(v).ok())
            .map(|at| SharePlace {
                at,
                step: share_step,
            }),
        // Earlier copies' unsettled deliveries plus this copy's.
        redeliveries: [int(h, REDELIVERIES)?, int(h, RABBITMQ_DELIVERY_COUNT)?]
            .into_iter()
            .flatten()
            .fold(0u32, |sum, n| {
                sum.saturating_add(u32::try_from(n).unwrap_or(u32::MAX))
            }),
    })
}

/// Writes `progress` into `headers`, replacing any previous values.
pub fn write_progress(headers: &mut FieldTable, progress: &Progress) {
    let mut set = |name: &str, value: Option<i64>| match value {
        Some(v) => {
            headers.insert(name.into(), AMQPValue::LongLongInt(v));
        }
        None => {
            remove(headers, name);
        }
    };
    set(ATTEMPT, Some(i64::from(progress.attempt)));
    set(FIRST_SEEN_MS, progress.first_seen.map(|t| t.0));
    set(QUOTA_WAIT_MS, Some(progress.quota_wait.as_millis() as i64));
    set(NOT_BEFORE_MS, progress.not_before.map(|t| t.0));
    set(ENQUEUED_MS, progress.enqueued_at.map(|t| t.0));
    set(
        SLOT_INTERVAL_US,
        progress.slot_interval.map(|d| d.as_micros() as i64),
    );
    set(
        SHARE_PLACE,
        progress.share_place.and_then(|p| i64::try_from(p.at).ok()),
    );
    set(
        SHARE_STEP,
        progress
            .share_place
            .and_then(|p| p.step)
            .and_then(|v| i64::try_from(v).ok()),
    );
    set(REDELIVERIES, Some(i64::from(progress.redeliveries)));
    set(
        UNAVAILABLE,
        (progress.unavailable > 0).then_some(i64::from(progress.unavailable)),
    );
    set(
        THROTTLED,
        (progress.throttled > 0).then_some(i64::from(progress.throttled)),
    );
    // This copy's count is folded into ours; the new copy starts from zero.
    set(RABBITMQ_DELIVERY_COUNT, None);
    match progress.park_reason {
        Some(r) => {
            headers.insert(
                PARK_REASON.into(),
                AMQPValue::LongString(LongString::from(r.as_str())),
            );
        }
        None => remove(headers, PARK_REASON),
    }
}

/// Names the lane a parked copy comes back through (see [`LANE`]).
pub fn write_lane(headers: &mut FieldTable, lane: Lane) {
    match lane {
        Lane::Recheck => set_text(headers, LANE, "recheck"),
        Lane::Due => remove(headers, LANE),
    }
}

pub fn set_text(headers: &mut FieldTable, name: &str, value: &str) {
    headers.insert(name.into(), AMQPValue::LongString(LongString::from(value)));
}

fn remove(headers: &mut FieldTable, name: &str) {
    *headers = without(std::mem::take(headers), name);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn progress_round_trips() {
        let progress = Progress {
            attempt: 2,
            first_seen: Some(UnixMillis(1_000)),
            quota_wait: Duration::from_millis(1_500),
            not_before: Some(UnixMillis(1_796_115_609_000)),
            park_reason: Some(ParkReason::Throttled),
            enqueued_at: Some(UnixMillis(8_000)),
            slot_interval: Some(Duration::from_micros(50_000)),
            share_place: Some(SharePlace {
                at: 1_765_000_000_123_456,
                step: Some(33_334),
            }),
            redeliveries: 2,
            unavailable: 3,
            throttled: 4,
        };
        let mut headers = FieldTable::default();
        write_progress(&mut headers, &progress);
        assert_eq!(read_progress(Some(&headers)).unwrap(), progress);
    }

    #[test]
    fn rabbitmqs_delivery_count_counts_only_on_a_redelivery() {
        let mut headers = FieldTable::default();
        headers.insert(REDELIVERIES.into(), AMQPValue::LongLongInt(1));
        headers.insert(RABBITMQ_DELIVERY_COUNT.into(), AMQPValue::LongLongInt(50));
        let count = |redelivered| {
            read_delivery_progress(Some(&headers), redelivered)
                .unwrap()
                .redeliveries
        };
        assert_eq!(count(true), 51);
        assert_eq!(
            count(false),
            1,
            "a producer's header is not the broker's count"
        );
    }

    #[test]
    fn a_not_before_past_2200_is_malformed() {
        let mut headers = FieldTable::default();
        headers.insert(NOT_BEFORE_MS.into(), AMQPValue::LongLongInt(i64::MAX));
        assert!(matches!(
            read_progress(Some(&headers)),
            Err(Malformed::Header {
                name: NOT_BEFORE_MS,
                ..
            })
        ));
    }

    #[test]
    fn redeliveries_add_up_across_copies() {
        let mut headers = FieldTable::default();
        headers.insert(REDELIVERIES.into(), AMQPValue::LongLongInt(2));
        headers.insert(RABBITMQ_DELIVERY_COUNT.into(), AMQPValue::LongInt(3));
        let progress = read_progress(Some(&headers)).unwrap();
        assert_eq!(progress.redeliveries, 5);
        write_progress(&mut headers, &progress);
        assert!(!headers.contains_key(RABBITMQ_DELIVERY_COUNT));
        assert_eq!(read_progress(Some(&headers)).unwrap().redeliveries, 5);
    }

    #[test]
    fn absent_headers_are_a_fresh_job() {
        assert_eq!(read_progress(None).unwrap(), Progress::default());
        assert_eq!(
            read_progress(Some(&FieldTable::default())).unwrap(),
            Progress::default()
        );
    }

    #[test]
    fn wrong_types_are_malformed() {
        let mut headers = FieldTable::default();
        set_text(&mut headers, ATTEMPT, "three");
        assert!(matches!(
            read_progress(Some(&headers)),
            Err(Malformed::Header { name: ATTEMPT, .. })
        ));
        let mut headers = FieldTable::default();
        headers.insert(ATTEMPT.into(), AMQPValue::LongLongInt(-1));
        assert!(read_progress(Some(&headers)).is_err());
        let mut headers = FieldTable::default();
        set_text(&mut headers, PARK_REASON, "bored");
        assert!(read_progress(Some(&headers)).is_err());
    }
}
