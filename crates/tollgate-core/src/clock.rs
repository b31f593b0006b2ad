//! Time as the core sees it: milliseconds since the Unix epoch, always passed in.

use std::fmt;
use std::time::Duration;

use time::OffsetDateTime;
use time::format_description::well_known::Rfc3339;

/// A point in time, in milliseconds since the Unix epoch (UTC).
///
/// Milliseconds are the precision of every contract tollgate exposes
/// (`due_at`, headers, metrics); finer clocks add nothing a broker round trip
/// would not swallow.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct UnixMillis(pub i64);

/// Earliest and latest instants tollgate accepts in a job (`due_at`,
/// `expires_at`): anything outside is a producer bug, not a schedule.
const MIN_YEAR: i32 = 2000;
const MAX_YEAR: i32 = 2200;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum TimeError {
    #[error("not an RFC 3339 timestamp (expected e.g. 2026-12-01T09:00:00Z)")]
    Format,
    #[error("year {0} is outside {MIN_YEAR}..={MAX_YEAR}")]
    OutOfRange(i32),
}

impl UnixMillis {
    /// Parses an RFC 3339 timestamp such as `2026-12-01T09:00:00Z` or
    /// `2026-12-01T10:00:00.250+01:00`.
    pub fn parse_rfc3339(s: &str) -> Result<Self, TimeError> {
        let t = OffsetDateTime::parse(s, &Rfc3339).map_err(|_| TimeError::Format)?;
        if !(MIN_YEAR..=MAX_YEAR).contains(&t.year()) {
            return Err(TimeError::OutOfRange(t.year()));
        }
        Ok(Self((t.unix_timestamp_nanos() / 1_000_000) as i64))
    }

    /// Formats as RFC 3339 UTC with millisecond precision.
    pub fn to_rfc3339(self) -> String {
        let nanos = i128::from(self.0) * 1_000_000;
        match OffsetDateTime::from_unix_timestamp_nanos(nanos) {
            Ok(t) => t.format(&Rfc3339).unwrap_or_else(|_| self.0.to_string()),
            Err(_) => self.0.to_string(),
        }
    }

    /// `self`, if it lies in the years a job's instants may (2000–2200).
    pub fn in_job_range(self) -> Result<Self, TimeError> {
        let nanos = i128::from(self.0) * 1_000_000;
        let year = OffsetDateTime::from_unix_timestamp_nanos(nanos)
            .map(|t| t.year())
            .unwrap_or(if self.0 < 0 { i32::MIN } else { i32::MAX });
        if (MIN_YEAR..=MAX_YEAR).contains(&year) {
            Ok(self)
        } else {
            Err(TimeError::OutOfRange(year))
        }
    }

    pub fn saturating_add(self, d: Duration) -> Self {
        Self(self.0.saturating_add(duration_ms(d)))
    }

    /// Time from `self` until `later`; zero if `later` is not after `self`.
    pub fn until(self, later: UnixMillis) -> Duration {
        Duration::from_millis(later.0.saturating_sub(self.0).max(0) as u64)
    }
}

impl fmt::Display for UnixMillis {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_rfc3339())
    }
}

fn duration_ms(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

/// The one source of "now" for the runtime. The core never calls it itself:
/// the runtime reads it and passes the value in.
pub trait Clock: Send + Sync {
    fn now(&self) -> UnixMillis;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_formats_rfc3339() {
        let t = UnixMillis::parse_rfc3339("2026-12-01T09:00:00Z").unwrap();
        assert_eq!(t, UnixMillis(1_796_115_600_000));
        assert_eq!(t.to_rfc3339(), "2026-12-01T09:00:00Z");
        let with_offset = UnixMillis::parse_rfc3339("2026-12-01T10:00:00.250+01:00").unwrap();
        assert_eq!(with_offset.0 - t.0, 250);
    }

    #[test]
    fn rejects_nonsense_and_far_dates() {
        assert_eq!(
            UnixMillis::parse_rfc3339("tomorrow"),
            Err(TimeError::Format)
        );
        assert_eq!(
            UnixMillis::parse_rfc3339("2026-12-01"),
            Err(TimeError::Format)
        );
        assert_eq!(
            UnixMillis::parse_rfc3339("9999-12-31T23:59:59Z"),
            Err(TimeError::OutOfRange(9999))
        );
        let now = UnixMillis(1_796_115_600_000);
        assert_eq!(now.in_job_range(), Ok(now));
        let far = now.saturating_add(Duration::from_secs(300 * 366 * 24 * 3600));
        assert!(matches!(far.in_job_range(), Err(TimeError::OutOfRange(y)) if y > 2200));
        assert!(UnixMillis(i64::MAX).in_job_range().is_err());
        assert!(UnixMillis(i64::MIN).in_job_range().is_err());
    }

    #[test]
    fn until_saturates_at_zero() {
        assert_eq!(UnixMillis(10).until(UnixMillis(5)), Duration::ZERO);
        assert_eq!(
            UnixMillis(5).until(UnixMillis(10)),
            Duration::from_millis(5)
        );
    }
}
