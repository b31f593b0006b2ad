//! The quota model: a rate (`20/s`, `300/m`, `10000/h`) and a burst.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

/// `count` permits per `period`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Rate {
    pub count: u32,
    pub period: Duration,
}

/// A tenant's (or route's) quota: sustained rate plus burst. `burst = 1`
/// spaces sends evenly: a 5/s quota never fires 5 in one millisecond.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Quota {
    pub rate: Rate,
    pub burst: u32,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum QuotaError {
    #[error("rate {0:?} is not of the form N/s, N/m or N/h (for example 20/s)")]
    Format(String),
    #[error("rate must allow at least one request per period")]
    Zero,
    #[error("burst must be at least 1")]
    ZeroBurst,
    #[error("rate {0} is above the limit of 1000000/s")]
    TooFast(String),
    #[error("weight {0} is not between 1 and {max}", max = MAX_WEIGHT)]
    Weight(u32),
    #[error("concurrency must be at least 1 (leave it out for no limit)")]
    ZeroConcurrency,
    #[error("{0}")]
    Adaptive(String),
}

/// The largest weight a tenant may have on a shared route.
pub const MAX_WEIGHT: u32 = 1000;

/// A tenant's weight on the routes it shares: its part of a route's
/// capacity among the tenants with work there is weight / (their weights).
pub fn weight(w: u32) -> Result<u32, QuotaError> {
    if (1..=MAX_WEIGHT).contains(&w) {
        Ok(w)
    } else {
        Err(QuotaError::Weight(w))
    }
}

/// A tenant's limit on its provider calls in flight across the fleet. 0 is
/// refused: the permit script reads it as no limit at all, the opposite of
/// what an operator who types it means.
pub fn concurrency(c: u32) -> Result<u32, QuotaError> {
    if c == 0 {
        Err(QuotaError::ZeroConcurrency)
    } else {
        Ok(c)
    }
}

impl Rate {
    /// Time between two permits at the sustained rate, in microseconds
    /// (the unit the Redis script works in).
    pub fn interval_micros(&self) -> u64 {
        (self.period.as_micros() as u64 / u64::from(self.count)).max(1)
    }

    pub fn per_second(&self) -> f64 {
        f64::from(self.count) / self.period.as_secs_f64()
    }

    fn unit(&self) -> &'static str {
        match self.period.as_secs() {
            3600 => "h",
            60 => "m",
            _ => "s",
        }
    }
}

impl FromStr for Rate {
    type Err = QuotaError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || QuotaError::Format(s.to_owned());
        let (count, unit) = s.trim().split_once('/').ok_or_else(bad)?;
        let count: u32 = count.trim().parse().map_err(|_| bad())?;
        let period = match unit.trim() {
            "s" | "sec" | "second" => Duration::from_secs(1),
            "m" | "min" | "minute" => Duration::from_secs(60),
            "h" | "hour" => Duration::from_secs(3600),
            _ => return Err(bad()),
        };
        if count == 0 {
            return Err(QuotaError::Zero);
        }
        let rate = Rate { count, period };
        if rate.per_second() > 1_000_000.0 {
            return Err(QuotaError::TooFast(s.to_owned()));
        }
        Ok(rate)
    }
}

impl fmt::Display for Rate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.count, self.unit())
    }
}

impl Quota {
    /// The burst when none is given: sends evenly spaced.
    pub const DEFAULT_BURST: u32 = 1;

    pub fn new(rate: Rate, burst: u32) -> Result<Self, QuotaError> {
        if burst == 0 {
            return Err(QuotaError::ZeroBurst);
        }
        Ok(Self { rate, burst })
    }

    /// A rate as written by people (`20/s`) and a burst: what the CLI, the
    /// admin API and the quota baseline all accept.
    pub fn parse(rate: &str, burst: u32) -> Result<Self, QuotaError> {
        Self::new(rate.parse()?, burst)
    }
}

/// [`Quota::DEFAULT_BURST`], for `#[serde(default = "…")]`.
pub fn default_burst() -> u32 {
    Quota::DEFAULT_BURST
}

impl fmt::Display for Quota {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} burst {}", self.rate, self.burst)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_rates_in_three_units() {
        let r: Rate = "20/s".parse().unwrap();
        assert_eq!(r.interval_micros(), 50_000);
        let r: Rate = "300/m".parse().unwrap();
        assert_eq!(r.interval_micros(), 200_000);
        assert_eq!(r.to_string(), "300/m");
        let r: Rate = "10000/h".parse().unwrap();
        assert_eq!(r.interval_micros(), 360_000);
        assert!((r.per_second() - 2.777).abs() < 0.01);
    }

    #[test]
    fn rejects_bad_rates() {
        assert!(matches!("20".parse::<Rate>(), Err(QuotaError::Format(_))));
        assert!(matches!("20/d".parse::<Rate>(), Err(QuotaError::Format(_))));
        assert!(matches!("-1/s".parse::<Rate>(), Err(QuotaError::Format(_))));
        assert_eq!("0/s".parse::<Rate>(), Err(QuotaError::Zero));
        assert!(matches!(
            "2000000/s".parse::<Rate>(),
            Err(QuotaError::TooFast(_))
        ));
        assert_eq!(
            Quota::new("1/s".parse().unwrap(), 0),
            Err(QuotaError::ZeroBurst)
        );
    }
}
