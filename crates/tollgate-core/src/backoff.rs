//! Retry backoff: bounded exponential with full jitter.

use std::time::Duration;

/// `delay(n) = jitter × min(max, base × 2^(n-1))` for the n-th failure, with
/// `jitter` uniform in [0, 1). Full jitter spreads a burst of failures over
/// the whole window instead of retrying them in lockstep.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Backoff {
    pub base: Duration,
    pub max: Duration,
}

impl Backoff {
    /// The ceiling of the wait after the `failures`-th failure (1-based).
    pub fn ceiling(&self, failures: u32) -> Duration {
        let exp = failures.saturating_sub(1).min(32);
        self.base.saturating_mul(1u32 << exp.min(31)).min(self.max)
    }

    /// The wait after the `failures`-th failure; `jitter` is drawn by the
    /// caller from [0, 1), so this stays deterministic under test.
    pub fn delay(&self, failures: u32, jitter: f64) -> Duration {
        self.ceiling(failures).mul_f64(jitter.clamp(0.0, 1.0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const POLICY: Backoff = Backoff {
        base: Duration::from_millis(100),
        max: Duration::from_secs(10),
    };

    #[test]
    fn ceiling_doubles_then_caps() {
        assert_eq!(POLICY.ceiling(1), Duration::from_millis(100));
        assert_eq!(POLICY.ceiling(2), Duration::from_millis(200));
        assert_eq!(POLICY.ceiling(4), Duration::from_millis(800));
        assert_eq!(POLICY.ceiling(8), Duration::from_secs(10));
        assert_eq!(POLICY.ceiling(1000), Duration::from_secs(10));
    }

    proptest! {
        #[test]
        fn delay_is_within_zero_and_ceiling(failures in 0u32..10_000, jitter in 0.0f64..1.0) {
            let d = POLICY.delay(failures, jitter);
            prop_assert!(d <= POLICY.ceiling(failures));
            prop_assert!(d <= POLICY.max);
        }

        #[test]
        fn ceiling_never_decreases(failures in 1u32..10_000) {
            prop_assert!(POLICY.ceiling(failures + 1) >= POLICY.ceiling(failures));
        }
    }
}
