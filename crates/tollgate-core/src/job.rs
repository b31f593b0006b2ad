//! The job message: its wire format, decoding with limits, and the progress a
//! job carries between deliveries (tollgate's own AMQP headers).

use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;

use crate::clock::UnixMillis;
use crate::ids::{IdError, IdempotencyKey, JobId, Kind, TenantId};
use crate::outcome::ParkReason;

/// A validated job: decoded by [`decode`], or built by a producer (`tollgate
/// publish`) from fields that are themselves validated newtypes, so the rest
/// of tollgate never sees an unchecked field.
#[derive(Clone, Debug)]
pub struct Job {
    pub id: JobId,
    pub tenant: TenantId,
    pub kind: Kind,
    pub due_at: Option<UnixMillis>,
    pub expires_at: Option<UnixMillis>,
    pub idempotency_key: IdempotencyKey,
    /// Served in this order within the tenant's quota.
    pub priority: Priority,
    /// Opaque JSON forwarded byte for byte to the provider. Never logged.
    pub payload: Box<RawValue>,
}

/// A job's class within its tenant's quota: when the tenant has a line of
/// jobs waiting for permits, `high` goes before `normal`, and `normal`
/// before `low`. Between tenants it changes nothing.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Priority {
    Low,
    #[default]
    Normal,
    High,
}

impl Priority {
    pub const ALL: [Self; 3] = [Self::High, Self::Normal, Self::Low];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Low => "low",
            Self::Normal => "normal",
            Self::High => "high",
        }
    }

    pub fn parse(s: &str) -> Result<Self, Malformed> {
        Self::ALL
            .into_iter()
            .find(|p| p.as_str() == s)
            .ok_or_else(|| Malformed::Priority(s.chars().take(64).collect()))
    }
}

/// Limits applied before and while decoding a message body.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    pub max_body_bytes: usize,
    /// Deepest allowed nesting of JSON arrays/objects, counting the envelope.
    pub max_depth: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_body_bytes: 256 * 1024,
            max_depth: 32,
        }
    }
}

/// Why a message is not a job. Every variant ends as a `malformed` dead
/// letter; the message text becomes its `x-tollgate-detail` header.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum Malformed {
    #[error("body is {size} bytes, the limit is {max}")]
    TooLarge { size: usize, max: usize },
    #[error("JSON nests deeper than {max} levels")]
    TooDeep { max: usize },
    #[error("body is not a valid job: {0}")]
    Json(String),
    #[error("invalid {0}")]
    Id(#[from] IdError),
    #[error("invalid {field}: {reason}")]
    Time { field: &'static str, reason: String },
    #[error("unknown priority {0:?}: it is high, normal or low")]
    Priority(String),
    #[error("expires_at is before due_at")]
    ExpiresBeforeDue,
    #[error("unknown kind {0:?}: no provider route is configured for it")]
    UnknownKind(String),
    #[error("invalid tollgate header {name}: {reason}")]
    Header { name: &'static str, reason: String },
    #[error(
        "published with routing key {routing_key:?}, not the job's tenant {tenant:?} (the routing \
         key must be the tenant: it picks the tenant's work queue)"
    )]
    RoutingKey { routing_key: String, tenant: String },
}

#[derive(Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
struct Wire<'a> {
    #[serde(borrow)]
    id: std::borrow::Cow<'a, str>,
    #[serde(borrow)]
    tenant: std::borrow::Cow<'a, str>,
    #[serde(default, borrow, skip_serializing_if = "Option::is_none")]
    kind: Option<std::borrow::Cow<'a, str>>,
    #[serde(default, borrow, skip_serializing_if = "Option::is_none")]
    due_at: Option<std::borrow::Cow<'a, str>>,
    #[serde(default, borrow, skip_serializing_if = "Option::is_none")]
    expires_at: Option<std::borrow::Cow<'a, str>>,
    #[serde(default, borrow, skip_serializing_if = "Option::is_none")]
    idempotency_key: Option<std::borrow::Cow<'a, str>>,
    #[serde(default, borrow, skip_serializing_if = "Option::is_none")]
    priority: Option<std::borrow::Cow<'a, str>>,
    /// Absent: `{}`. Present, even `null`, it is forwarded as written.
    #[serde(
        default,
        borrow,
        deserialize_with = "present",
        skip_serializing_if = "Option::is_none"
    )]
    payload: Option<&'a RawValue>,
}

/// A field that is there, whatever its value: `null` too (serde's `Option`
/// would read `null` as absent).
fn present<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<&'de RawValue>, D::Error> {
    <&RawValue as Deserialize>::deserialize(d).map(Some)
}

/// Decodes and validates a message body into a [`Job`].
pub fn decode(body: &[u8], limits: &Limits) -> Result<Job, Malformed> {
    if body.len() > limits.max_body_bytes {
        return Err(Malformed::TooLarge {
            size: body.len(),
            max: limits.max_body_bytes,
        });
    }
    if nesting_depth(body) > limits.max_depth {
        return Err(Malformed::TooDeep {
            max: limits.max_depth,
        });
    }
    let wire: Wire<'_> =
        serde_json::from_slice(body).map_err(|e| Malformed::Json(e.to_string()))?;
    let id = JobId::parse(wire.id.as_ref())?;
    let tenant = TenantId::parse(wire.tenant.as_ref())?;
    let kind = match wire.kind {
        Some(k) => Kind::parse(k.as_ref())?,
        None => Kind::default_kind(),
    };
    let due_at = parse_time("due_at", wire.due_at.as_deref())?;
    let expires_at = parse_time("expires_at", wire.expires_at.as_deref())?;
    if let (Some(due), Some(exp)) = (due_at, expires_at)
        && exp < due
    {
        return Err(Malformed::ExpiresBeforeDue);
    }
    let idempotency_key = match wire.idempotency_key {
        Some(k) => IdempotencyKey::parse(k.as_ref())?,
        None => IdempotencyKey::from(&id),
    };
    let priority = match wire.priority {
        Some(p) => Priority::parse(p.as_ref())?,
        None => Priority::Normal,
    };
    let payload = match wire.payload {
        Some(raw) => raw.to_owned(),
        None => RawValue::from_string("{}".to_owned()).expect("literal is valid JSON"),
    };
    Ok(Job {
        id,
        tenant,
        kind,
        due_at,
        expires_at,
        idempotency_key,
        priority,
        payload,
    })
}

fn parse_time(field: &'static str, s: Option<&str>) -> Result<Option<UnixMillis>, Malformed> {
    s.map(|s| {
        UnixMillis::parse_rfc3339(s).map_err(|e| Malformed::Time {
            field,
            reason: e.to_string(),
        })
    })
    .transpose()
}

/// Deepest nesting of `[`/`{` outside strings. A cheap pre-scan, so a hostile
/// body cannot make the JSON parser recurse deeply.
fn nesting_depth(body: &[u8]) -> usize {
    let (mut depth, mut max, mut in_string, mut escaped) = (0usize, 0usize, false, false);
    for &b in body {
        if in_string {
            match (escaped, b) {
                (true, _) => escaped = false,
                (false, b'\\') => escaped = true,
                (false, b'"') => in_string = false,
                _ => {}
            }
            continue;
        }
        match b {
            b'"' => in_string = true,
            b'[' | b'{' => {
                depth += 1;
                max = max.max(depth);
            }
            b']' | b'}' => depth = depth.saturating_sub(1),
            _ => {}
        }
    }
    max
}

impl Job {
    /// Encodes the job in the wire format producers publish.
    pub fn to_json(&self) -> Vec<u8> {
        let due = self.due_at.map(UnixMillis::to_rfc3339);
        let exp = self.expires_at.map(UnixMillis::to_rfc3339);
        let wire = Wire {
            id: self.id.as_str().into(),
            tenant: self.tenant.as_str().into(),
            kind: Some(self.kind.as_str().into()),
            due_at: due.as_deref().map(Into::into),
            expires_at: exp.as_deref().map(Into::into),
            idempotency_key: (self.idempotency_key.as_str() != self.id.as_str())
                .then(|| self.idempotency_key.as_str().into()),
            priority: (self.priority != Priority::Normal).then(|| self.priority.as_str().into()),
            payload: Some(&self.payload),
        };
        serde_json::to_vec(&wire).expect("a job always serializes")
    }
}

/// What a job carries from one delivery to the next, in tollgate's own AMQP
/// headers. Attempts are counted here, never in `x-death` or
/// `x-delivery-count` (a round trip through a delay tier resets neither
/// reliably).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Progress {
    /// Provider attempts that counted against `max_attempts` (a 429 does not).
    pub attempt: u32,
    /// When a tollgate publisher or worker first saw the job.
    pub first_seen: Option<UnixMillis>,
    /// Intentional throttling so far (quota denials, reservations, 429 waits).
    pub quota_wait: Duration,
    /// The job must not be sent before this (retry backoff, 429, quota park).
    pub not_before: Option<UnixMillis>,
    /// Why `not_before` was set, so a re-park is counted under the same reason.
    pub park_reason: Option<ParkReason>,
    /// When this copy (re)entered the work queue, for `queue_age`.
    pub enqueued_at: Option<UnixMillis>,
    /// Spacing of the line the job's place (quota wait) is in.
    pub slot_interval: Option<Duration>,
    /// Its place on its tenant's share of a route, in the route's virtual
    /// time: opaque here, given back to the permit store as it came.
    pub share_place: Option<crate::ports::SharePlace>,
    /// Deliveries that never settled (the worker crashed, hung or panicked),
    /// summed over every copy: RabbitMQ's own delivery count starts again
    /// for a parked copy, so a job that keeps crashing workers between
    /// parks is only caught by this.
    pub redeliveries: u32,
    /// Times in a row the permit store or an eligibility webhook could not
    /// be reached for this job: its next wait doubles with each.
    pub unavailable: u32,
    /// 429s the provider answered this job with (they use no attempt): with
    /// `attempt`, whether a call is the job's first, which alone measures
    /// its due lag.
    pub throttled: u32,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits() -> Limits {
        Limits::default()
    }

    #[test]
    fn decodes_a_full_job() {
        let body = br#"{"id":"job-123","tenant":"acme","kind":"email",
            "due_at":"2026-12-01T09:00:00Z","expires_at":"2026-12-01T10:00:00Z",
            "idempotency_key":"renewal-acme-2026-12","priority":"high","payload":{"to":"x","n":[1,2]}}"#;
        let job = decode(body, &limits()).unwrap();
        assert_eq!(job.priority, Priority::High);
        assert_eq!(job.id.as_str(), "job-123");
        assert_eq!(job.tenant.as_str(), "acme");
        assert_eq!(job.kind.as_str(), "email");
        assert_eq!(job.due_at, Some(UnixMillis(1_796_115_600_000)));
        assert_eq!(job.expires_at, Some(UnixMillis(1_796_119_200_000)));
        assert_eq!(job.idempotency_key.as_str(), "renewal-acme-2026-12");
        assert_eq!(job.payload.get(), r#"{"to":"x","n":[1,2]}"#);
    }

    #[test]
    fn defaults_kind_key_and_payload() {
        let job = decode(br#"{"id":"j1","tenant":"acme"}"#, &limits()).unwrap();
        assert_eq!(job.kind.as_str(), "default");
        assert_eq!(job.idempotency_key.as_str(), "j1");
        assert_eq!(job.payload.get(), "{}");
        assert_eq!(job.due_at, None);
        assert_eq!(job.priority, Priority::Normal);
        // Forwarded as written: `null` is a payload, not a missing one.
        let job = decode(br#"{"id":"j1","tenant":"acme","payload":null}"#, &limits()).unwrap();
        assert_eq!(job.payload.get(), "null");
    }

    #[test]
    fn an_unknown_priority_is_malformed_and_every_class_round_trips() {
        for bad in [r#""urgent""#, r#""HIGH""#, "1", "[]"] {
            let body = format!(r#"{{"id":"j1","tenant":"acme","priority":{bad}}}"#);
            assert!(decode(body.as_bytes(), &limits()).is_err(), "{bad}");
        }
        let err = decode(
            br#"{"id":"j1","tenant":"acme","priority":"urgent"}"#,
            &limits(),
        )
        .unwrap_err();
        assert_eq!(
            err.to_string(),
            r#"unknown priority "urgent": it is high, normal or low"#
        );
        for p in Priority::ALL {
            let body = format!(
                r#"{{"id":"j1","tenant":"acme","priority":"{}"}}"#,
                p.as_str()
            );
            let job = decode(body.as_bytes(), &limits()).unwrap();
            assert_eq!(decode(&job.to_json(), &limits()).unwrap().priority, p);
        }
    }

    #[test]
    fn round_trips_through_to_json() {
        let body =
            br#"{"id":"j1","tenant":"acme","due_at":"2026-12-01T09:00:00.5Z","payload":[1]}"#;
        let job = decode(body, &limits()).unwrap();
        let again = decode(&job.to_json(), &limits()).unwrap();
        assert_eq!(again.id, job.id);
        assert_eq!(again.due_at, job.due_at);
        assert_eq!(again.idempotency_key, job.idempotency_key);
        assert_eq!(again.payload.get(), "[1]");
    }

    #[test]
    fn rejects_bad_input_with_a_precise_reason() {
        let cases: &[(&[u8], &str)] = &[
            (b"not json", "not a valid job"),
            (br#"{"id":"j1"}"#, "missing field `tenant`"),
            (br#"{"id":"j1","tenant":"a b"}"#, "invalid tenant"),
            (br#"{"id":"j1","tenant":7}"#, "invalid type"),
            (br#"{"id":"j1","tenant":"a","due_at":"soon"}"#, "invalid due_at"),
            (br#"{"id":"j1","tenant":"a","extra":1}"#, "unknown field `extra`"),
            (br#"{"id":"j1","id":"j2","tenant":"a"}"#, "duplicate field `id`"),
            (
                br#"{"id":"j1","tenant":"a","due_at":"2026-12-02T00:00:00Z","expires_at":"2026-12-01T00:00:00Z"}"#,
                "expires_at is before due_at",
            ),
            (br#"{"id":"","tenant":"a"}"#, "id is empty"),
        ];
        for (body, expected) in cases {
            let err = decode(body, &limits()).unwrap_err().to_string();
            assert!(
                err.contains(expected),
                "{:?}: got {err:?}, want {expected:?}",
                String::from_utf8_lossy(body)
            );
        }
    }

    #[test]
    fn enforces_size_and_depth_before_parsing() {
        let small = Limits {
            max_body_bytes: 10,
            max_depth: 3,
        };
        assert_eq!(
            decode(&[b' '; 11], &small).unwrap_err(),
            Malformed::TooLarge { size: 11, max: 10 }
        );
        let deep = br#"{"p":[[["x"]]]}"#;
        let limits = Limits {
            max_body_bytes: 1024,
            max_depth: 3,
        };
        assert_eq!(
            decode(deep, &limits).unwrap_err(),
            Malformed::TooDeep { max: 3 }
        );
        // Brackets inside strings do not count.
        assert_eq!(nesting_depth(br#"{"a":"[[[[\"[["}"#), 1);
    }
}
