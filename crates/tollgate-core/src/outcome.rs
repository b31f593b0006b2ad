//! Closed sets of outcomes and reasons, and the classification of a provider
//! response. These enums are also metric label values, so the label sets are
//! closed by construction.

use std::time::{Duration, UNIX_EPOCH};

use crate::clock::UnixMillis;

/// Why a job ended in the dead-letter queue (`x-tollgate-reason`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DeadReason {
    Malformed,
    Expired,
    Rejected,
    Exhausted,
    Poison,
}

impl DeadReason {
    pub const ALL: [DeadReason; 5] = [
        Self::Malformed,
        Self::Expired,
        Self::Rejected,
        Self::Exhausted,
        Self::Poison,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Malformed => "malformed",
            Self::Expired => "expired",
            Self::Rejected => "rejected",
            Self::Exhausted => "exhausted",
            Self::Poison => "poison",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|r| r.as_str() == s)
    }
}

/// Why a job was parked (sent to a delay tier or held in-process).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ParkReason {
    /// `due_at` is in the future.
    NotDue,
    /// The tenant's quota denied a permit.
    Quota,
    /// Waiting before a retry (provider failure, or Redis unreachable).
    Backoff,
    /// The provider answered 429.
    Throttled,
    /// The tenant is paused.
    Paused,
}

impl ParkReason {
    pub const ALL: [ParkReason; 5] = [
        Self::NotDue,
        Self::Quota,
        Self::Backoff,
        Self::Throttled,
        Self::Paused,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::NotDue => "not_due",
            Self::Quota => "quota",
            Self::Backoff => "backoff",
            Self::Throttled => "throttled",
            Self::Paused => "paused",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|r| r.as_str() == s)
    }

    /// Waits that count as intentional throttling (`quota_wait`).
    pub fn is_quota_wait(self) -> bool {
        matches!(self, Self::Quota | Self::Throttled)
    }
}

/// What one provider call amounted to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ProviderOutcome {
    /// 2xx.
    Sent,
    /// 429; `retry_after` from the `Retry-After` header when it was valid.
    Throttled { retry_after: Option<Duration> },
    /// 408, 5xx, timeout or connection error: retried with backoff.
    Failed(Failure),
    /// A redirect (3xx), any other 4xx, and anything else unexpected: not
    /// retried. A redirect is never followed: it would turn the POST into a
    /// GET (losing the payload) or re-post the payload and its
    /// `Idempotency-Key` to whatever host the provider names.
    Rejected {
        status: u16,
        /// The `Location` a redirect named, for the dead letter's detail.
        location: Option<String>,
    },
}

impl ProviderOutcome {
    /// Label value for `tollgate_provider_requests_total{outcome}`.
    pub fn as_str(&self) -> &'static str {
        match self {
            Self::Sent => "sent",
            Self::Throttled { .. } => "throttled",
            Self::Failed(_) => "failed",
            Self::Rejected { .. } => "rejected",
        }
    }
}

/// What the HTTP adapter observed, before classification.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ProviderResponse {
    Status {
        status: u16,
        retry_after: Option<String>,
        /// The `Location` header, kept for redirects.
        location: Option<String>,
    },
    /// No answer within the provider timeout.
    Timeout,
    /// The connection broke after the request went out, before an answer.
    Broken,
    /// Could not connect: the request never left.
    Unreachable,
}

/// Why a provider call failed (and will be retried): said in the log and,
/// once the attempts are used up, in the dead letter's detail, so an
/// on-call engineer knows whether the provider may have done it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Failure {
    /// 408 or 5xx, with the `Retry-After` it carried: a 503's "down for
    /// this long", which the next attempt waits at least.
    Status {
        status: u16,
        retry_after: Option<Duration>,
    },
    Timeout,
    Broken,
    Unreachable,
}

impl Failure {
    /// Whether the provider may still be working on the call: no answer
    /// came (a timeout, a connection lost after the request went out), or a
    /// gateway gave up waiting for it (504). Such a call keeps its lease
    /// until the lease expires, so no copy with the same key calls
    /// meanwhile: retried at once, a provider that answers "key in use"
    /// (409) would have it dead-lettered while it finishes it.
    pub fn may_be_working(&self) -> bool {
        matches!(
            self,
            Self::Timeout | Self::Broken | Self::Status { status: 504, .. }
        )
    }

    /// The wait the provider asked for before the next attempt.
    pub fn retry_after(&self) -> Option<Duration> {
        match self {
            Self::Status { retry_after, .. } => *retry_after,
            _ => None,
        }
    }
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Status {
                status: 504,
                retry_after: _,
            } => f.write_str(
                "provider answered 504 (a gateway gave up waiting: it may have done it)",
            ),
            Self::Status {
                status,
                retry_after: None,
            } => write!(f, "provider answered {status}"),
            Self::Status {
                status,
                retry_after: Some(wait),
            } => write!(
                f,
                "provider answered {status} with Retry-After {} s",
                wait.as_secs_f64()
            ),
            Self::Timeout => {
                f.write_str("no answer within the provider timeout (it may have done it)")
            }
            Self::Broken => f.write_str(
                "the connection broke after the request went out (the provider may have done it)",
            ),
            Self::Unreachable => f.write_str("could not connect to the provider"),
        }
    }
}

/// Longest `Retry-After` honoured; a provider asking for more is capped so a
/// typo on its side cannot park a job for a year.
pub const MAX_RETRY_AFTER: Duration = Duration::from_secs(3600);

/// Classifies a provider response: 2xx `sent`; 429 `throttled`; 408, 5xx,
/// timeouts and transport errors `failed` (retried); anything else,
/// redirects included, `rejected`.
pub fn classify(response: &ProviderResponse, now: UnixMillis) -> ProviderOutcome {
    match response {
        ProviderResponse::Timeout => ProviderOutcome::Failed(Failure::Timeout),
        ProviderResponse::Broken => ProviderOutcome::Failed(Failure::Broken),
        ProviderResponse::Unreachable => ProviderOutcome::Failed(Failure::Unreachable),
        ProviderResponse::Status {
            status,
            retry_after,
            location,
        } => {
            let retry_after = || {
                retry_after
                    .as_deref()
                    .and_then(|v| parse_retry_after(v, now))
            };
            match *status {
                200..=299 => ProviderOutcome::Sent,
                429 => ProviderOutcome::Throttled {
                    retry_after: retry_after(),
                },
                408 | 500..=599 => ProviderOutcome::Failed(Failure::Status {
                    status: *status,
                    retry_after: retry_after(),
                }),
                status => ProviderOutcome::Rejected {
                    status,
                    location: location.as_deref().map(printable),
                },
            }
        }
    }
}

/// A value someone else chose (a provider's header, a producer's field
/// name quoted in an error) made safe for a log line, an AMQP header and a
/// terminal: control characters replaced, at most 256 characters.
pub fn printable(value: &str) -> String {
    let capped: String = value.chars().take(256).collect();
    without_controls(&capped)
}

/// `value` with each control character replaced by `?`, whole (a payload
/// shown on a terminal).
pub fn without_controls(value: &str) -> String {
    value
        .chars()
        .map(|c| if c.is_control() { '?' } else { c })
        .collect()
}

/// Parses `Retry-After` as delta-seconds or an HTTP date, relative to `now`.
/// Beyond the standard, as providers send it: fractional seconds (`1.5`,
/// rounded up to the millisecond, never shorter than asked), more digits
/// than a `u64` holds (the cap), and a list from repeated headers (`5, 30`,
/// or `2, Sun, 06 Dec 2026 15:05:57 GMT`: the longest of those that read,
/// an empty or garbled one among them passed over). Nothing that reads is
/// `None` (the caller's default wait).
pub fn parse_retry_after(value: &str, now: UnixMillis) -> Option<Duration> {
    let wait = list_items(value)
        .filter_map(|item| one_retry_after(&item, now))
        .max()?;
    Some(wait.min(MAX_RETRY_AFTER))
}

/// One value: delta-seconds or an HTTP date.
fn one_retry_after(value: &str, now: UnixMillis) -> Option<Duration> {
    delay_seconds(value).or_else(|| {
        let at = httpdate::parse_http_date(value).ok()?;
        let at_ms = at.duration_since(UNIX_EPOCH).ok()?.as_millis() as i64;
        Some(now.until(UnixMillis(at_ms)))
    })
}

/// The items of a comma-separated header list, trimmed. An HTTP date has a
/// comma of its own after its weekday (`Sun, 06 Dec 2026 …`, RFC 850's
/// `Sunday, 06-Dec-26 …`): a weekday is joined to the item after it.
fn list_items(value: &str) -> impl Iterator<Item = String> + '_ {
    const DAYS: [&str; 7] = ["mon", "tue", "wed", "thu", "fri", "sat", "sun"];
    let is_weekday = |item: &str| {
        let item = item.to_ascii_lowercase();
        DAYS.iter()
            .any(|d| item.starts_with(d) && item.bytes().all(|b| b.is_ascii_alphabetic()))
    };
    let mut parts = value.split(',').map(str::trim);
    std::iter::from_fn(move || {
        let part = parts.next()?;
        if is_weekday(part)
            && let Some(rest) = parts.next()
        {
            return Some(format!("{part}, {rest}"));
        }
        Some(part.to_owned())
    })
}

/// `Retry-After`'s delta-seconds, whole or fractional, with an optional `+`.
fn delay_seconds(value: &str) -> Option<Duration> {
    let digits = value.strip_prefix('+').unwrap_or(value);
    let (whole, fraction) = digits.split_once('.').unwrap_or((digits, ""));
    let all_digits = |s: &str| s.bytes().all(|b| b.is_ascii_digit());
    if whole.is_empty() || !all_digits(whole) || !all_digits(fraction) {
        return None;
    }
    let Ok(secs) = whole.parse::<u64>() else {
        // Only digits, and too many of them for a u64: far past the cap.
        return Some(MAX_RETRY_AFTER);
    };
    // Rounded up to the millisecond: never earlier than asked.
    let millis = fraction
        .bytes()
        .chain(std::iter::repeat(b'0'))
        .take(3)
        .fold(0u64, |ms, b| ms * 10 + u64::from(b - b'0'));
    let rounds_up = fraction.bytes().skip(3).any(|b| b != b'0');
    Some(
        Duration::from_secs(secs.min(MAX_RETRY_AFTER.as_secs() + 1))
            + Duration::from_millis(millis + u64::from(rounds_up)),
    )
}

/// Formats an instant as an HTTP date (used by test providers).
pub fn http_date(at: UnixMillis) -> String {
    httpdate::fmt_http_date(UNIX_EPOCH + Duration::from_millis(at.0.max(0) as u64))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn status(status: u16) -> ProviderResponse {
        ProviderResponse::Status {
            status,
            retry_after: None,
            location: None,
        }
    }

    #[test]
    fn classifies_as_the_design_says() {
        let now = UnixMillis(0);
        assert_eq!(classify(&status(200), now), ProviderOutcome::Sent);
        assert_eq!(classify(&status(204), now), ProviderOutcome::Sent);
        assert_eq!(
            classify(&status(429), now),
            ProviderOutcome::Throttled { retry_after: None }
        );
        for code in [408, 500, 503, 504] {
            assert_eq!(
                classify(&status(code), now),
                ProviderOutcome::Failed(Failure::Status {
                    status: code,
                    retry_after: None
                })
            );
        }
        let unavailable = ProviderResponse::Status {
            status: 503,
            retry_after: Some("120".into()),
            location: None,
        };
        assert_eq!(
            classify(&unavailable, now),
            ProviderOutcome::Failed(Failure::Status {
                status: 503,
                retry_after: Some(Duration::from_secs(120))
            }),
            "a 503's Retry-After is kept for the next attempt's wait"
        );
        for (response, failure) in [
            (ProviderResponse::Timeout, Failure::Timeout),
            (ProviderResponse::Broken, Failure::Broken),
            (ProviderResponse::Unreachable, Failure::Unreachable),
        ] {
            assert_eq!(classify(&response, now), ProviderOutcome::Failed(failure));
        }
        for code in [400, 404, 302] {
            assert_eq!(
                classify(&status(code), now),
                ProviderOutcome::Rejected {
                    status: code,
                    location: None
                }
            );
        }
        let redirect = ProviderResponse::Status {
            status: 307,
            retry_after: None,
            location: Some("https://elsewhere.example/\u{7}send".into()),
        };
        assert_eq!(
            classify(&redirect, now),
            ProviderOutcome::Rejected {
                status: 307,
                location: Some("https://elsewhere.example/?send".into())
            },
            "a redirect is rejected, its Location kept (printable) for the detail"
        );
    }

    #[test]
    fn retry_after_accepts_seconds_and_http_dates() {
        let now = UnixMillis(1_796_115_600_000);
        assert_eq!(parse_retry_after("3", now), Some(Duration::from_secs(3)));
        let later = now.saturating_add(Duration::from_secs(7));
        assert_eq!(
            parse_retry_after(&http_date(later), now),
            Some(Duration::from_secs(7))
        );
        assert_eq!(parse_retry_after("soon", now), None);
        assert_eq!(parse_retry_after("999999", now), Some(MAX_RETRY_AFTER));
        // A date in the past means "now".
        assert_eq!(
            parse_retry_after(&http_date(UnixMillis(0)), now),
            Some(Duration::ZERO)
        );
    }

    /// What providers send beside the standard: each was once read as no
    /// `Retry-After` at all, and the job came back after the 1 s default,
    /// earlier than the provider asked.
    #[test]
    fn retry_after_as_providers_write_it() {
        let now = UnixMillis(1_796_115_600_000);
        let ms = Duration::from_millis;
        assert_eq!(parse_retry_after("1.5", now), Some(ms(1_500)));
        assert_eq!(parse_retry_after("0.5", now), Some(ms(500)));
        assert_eq!(
            parse_retry_after("2.0001", now),
            Some(ms(2_001)),
            "rounded up"
        );
        assert_eq!(parse_retry_after(" +5 ", now), Some(ms(5_000)));
        assert_eq!(
            parse_retry_after("99999999999999999999", now),
            Some(MAX_RETRY_AFTER)
        );
        assert_eq!(parse_retry_after("5, 30", now), Some(ms(30_000)));
        assert_eq!(parse_retry_after("5,1.25", now), Some(ms(5_000)));
        let later = now.saturating_add(Duration::from_secs(7));
        assert_eq!(
            parse_retry_after(&http_date(later), now),
            Some(ms(7_000)),
            "a date's own comma is not a list"
        );
        for odd in ["", "-1", "1e3", ".5", ",", "soon, later", "1.2.3", "NaN"] {
            assert_eq!(parse_retry_after(odd, now), None, "{odd:?}");
        }
    }

    /// Repeated headers, each value kept whole and joined as a list: a
    /// date among them, or an empty one, used to throw the whole list away
    /// (the 1 s default, up to 5 s earlier than the provider asked).
    #[test]
    fn a_list_of_retry_afters_waits_for_the_longest_that_reads() {
        let now = UnixMillis(1_796_115_600_000);
        let at = |secs| http_date(now.saturating_add(Duration::from_secs(secs)));
        let wait = |v: &str| parse_retry_after(v, now);
        assert_eq!(wait(&format!("2, {}", at(6))), Some(Duration::from_secs(6)));
        assert_eq!(wait(&format!("{}, 2", at(6))), Some(Duration::from_secs(6)));
        assert_eq!(
            wait(&format!("{}, {}", at(4), at(6))),
            Some(Duration::from_secs(6))
        );
        assert_eq!(wait("6, "), Some(Duration::from_secs(6)));
        assert_eq!(wait("5, soon"), Some(Duration::from_secs(5)));
        assert_eq!(
            wait("Tuesday, 01-Dec-26 09:00:09 GMT, 3"),
            Some(Duration::from_secs(9)),
            "RFC 850's date"
        );
    }

    #[test]
    fn a_call_the_provider_may_still_be_working_on_is_told_apart() {
        let now = UnixMillis(0);
        let may_be_working = |response: ProviderResponse| match classify(&response, now) {
            ProviderOutcome::Failed(failure) => failure.may_be_working(),
            other => panic!("{response:?} is not a failure: {other:?}"),
        };
        assert!(may_be_working(ProviderResponse::Timeout));
        assert!(may_be_working(ProviderResponse::Broken));
        assert!(may_be_working(status(504)));
        assert!(!may_be_working(ProviderResponse::Unreachable));
        assert!(!may_be_working(status(503)));
        assert!(!may_be_working(status(500)));
    }
}
