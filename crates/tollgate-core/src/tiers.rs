//! Delay tiers: fixed-TTL queues a parked job travels through.

use std::time::Duration;

/// The tier TTLs, ascending. A parked job goes to the largest tier not longer
/// than its remaining wait and comes back to be re-checked, so it is never
/// early; the remainder below the smallest tier is held in-process.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DelayTiers(Vec<Duration>);

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum TierError {
    #[error("at least one delay tier is required")]
    Empty,
    #[error("delay tiers must be at least 1 ms")]
    Zero,
    #[error(
        "the smallest delay tier ({smallest:?}) is longer than the in-process hold limit \
         ({hold_max:?}): a wait between the two would have nowhere to go"
    )]
    Gap {
        smallest: Duration,
        hold_max: Duration,
    },
}

impl DelayTiers {
    pub fn new(mut tiers: Vec<Duration>, hold_max: Duration) -> Result<Self, TierError> {
        tiers.sort();
        tiers.dedup();
        let smallest = *tiers.first().ok_or(TierError::Empty)?;
        if smallest < Duration::from_millis(1) {
            return Err(TierError::Zero);
        }
        if smallest > hold_max {
            return Err(TierError::Gap { smallest, hold_max });
        }
        Ok(Self(tiers))
    }

    pub fn all(&self) -> &[Duration] {
        &self.0
    }

    /// The smallest tier: a wait shorter than this cannot be parked without
    /// coming back late.
    pub fn shortest(&self) -> Duration {
        self.0[0]
    }

    /// The largest tier not longer than `remaining`.
    pub fn pick(&self, remaining: Duration) -> Option<Duration> {
        self.0.iter().rev().find(|&&t| t <= remaining).copied()
    }

    /// Queue-name suffix for a tier: `1s`, `30s`, `2m`, `1h`, `250ms`.
    pub fn name(tier: Duration) -> String {
        let ms = tier.as_millis();
        match ms {
            ms if ms % 3_600_000 == 0 => format!("{}h", ms / 3_600_000),
            ms if ms % 60_000 == 0 => format!("{}m", ms / 60_000),
            ms if ms % 1000 == 0 => format!("{}s", ms / 1000),
            ms => format!("{ms}ms"),
        }
    }
}

/// The way a parked copy comes back when its tier expires. Copies parked
/// together (a backlog's first pass) come back together, and each takes a
/// publish confirmed by the broker to park again: a herd of a few hundred
/// holds a FIFO queue for a few hundred ms at one delivery per queue. So a
/// copy that only comes back to be looked at again never queues ahead of
/// one whose time has come.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Lane {
    /// Its wait ends within [`Lane::RECHECK_LEFT`] of its return: it is
    /// sent, or held for its slot (the return queues).
    Due,
    /// It comes back with its wait going on, to ask again (its quota may
    /// have changed) and park once more (the recheck queues). Late by a
    /// herd, it is still early.
    Recheck,
}

impl Lane {
    /// What a copy must still have to wait when it comes back to take the
    /// recheck lane: room for a herd of a few thousand copies ahead of it
    /// at one delivery per queue (a 2,000-job first pass took 1.7–1.9 s
    /// with 4 pods at prefetch 4).
    pub const RECHECK_LEFT: Duration = Duration::from_secs(5);

    /// The lane of a copy parked in `tier` with `wait` left to wait.
    pub fn of(wait: Duration, tier: Duration) -> Self {
        if wait.saturating_sub(tier) >= Self::RECHECK_LEFT {
            Self::Recheck
        } else {
            Self::Due
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_copy_whose_wait_goes_on_after_its_tier_comes_back_to_be_rechecked() {
        assert_eq!(Lane::of(secs(1), secs(1)), Lane::Due, "due on return");
        assert_eq!(Lane::of(Duration::from_millis(5_999), secs(1)), Lane::Due);
        assert_eq!(Lane::of(secs(6), secs(1)), Lane::Recheck);
        assert_eq!(Lane::of(secs(25), secs(5)), Lane::Recheck, "a hop");
        assert_eq!(
            Lane::of(Duration::from_millis(100), secs(1)),
            Lane::Due,
            "a wait shorter than its tier is late on return, never rechecked"
        );
    }

    fn secs(s: u64) -> Duration {
        Duration::from_secs(s)
    }

    #[test]
    fn picks_the_largest_tier_that_fits() {
        let tiers = DelayTiers::new(vec![secs(30), secs(1), secs(5)], secs(1)).unwrap();
        assert_eq!(tiers.pick(Duration::from_millis(999)), None);
        assert_eq!(tiers.pick(secs(1)), Some(secs(1)));
        assert_eq!(tiers.pick(Duration::from_millis(4999)), Some(secs(1)));
        assert_eq!(tiers.pick(secs(29)), Some(secs(5)));
        assert_eq!(tiers.pick(secs(7200)), Some(secs(30)));
    }

    #[test]
    fn refuses_a_gap_between_hold_and_tiers() {
        assert_eq!(DelayTiers::new(vec![], secs(1)), Err(TierError::Empty));
        assert!(matches!(
            DelayTiers::new(vec![secs(5)], secs(1)),
            Err(TierError::Gap { .. })
        ));
    }

    #[test]
    fn names_read_like_durations() {
        assert_eq!(DelayTiers::name(Duration::from_millis(250)), "250ms");
        assert_eq!(DelayTiers::name(secs(1)), "1s");
        assert_eq!(DelayTiers::name(secs(120)), "2m");
        assert_eq!(DelayTiers::name(secs(3600)), "1h");
    }
}
