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

    /// How early a copy to recheck may come back, at most: a fifth of its
    /// tier, never more than this.
    pub const EARLY_MAX: Duration = Duration::from_secs(5);

    /// How long a copy parked in `tier` with `wait` left stays there (its
    /// message's expiration). A due copy stays the whole tier. A copy to
    /// recheck comes back up to a fifth of the tier early (at most
    /// [`Lane::EARLY_MAX`]), a whole number of those steps before its own
    /// place. Copies parked together (a backlog's first pass, in the same
    /// second) otherwise came back together forever, every tier being a
    /// multiple of 5 s: herds of hundreds that the broker dead-letters at
    /// once while a due copy waits behind them. Aligned to their places,
    /// which are spaced by the tenant's rate, they come back spread over
    /// the step instead. Early is safe: the copy only asks again.
    pub fn stay(self, wait: Duration, tier: Duration) -> Duration {
        let step = (tier / 5).min(Self::EARLY_MAX).as_millis();
        if self == Self::Due || step == 0 {
            return tier;
        }
        let (tier_ms, wait_ms) = (tier.as_millis(), wait.as_millis());
        // Back at `wait - k × step` before its place, for the smallest k
        // that leaves it within the tier.
        let early = (tier_ms + step - wait_ms % step) % step;
        tier - Duration::from_millis(early as u64)
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

    #[test]
    fn a_copy_to_recheck_comes_back_a_whole_number_of_steps_before_its_place() {
        let ms = Duration::from_millis;
        // Due: the whole tier, whatever its place.
        assert_eq!(Lane::Due.stay(ms(7_300), secs(5)), secs(5));
        // The 5 s tier steps by 1 s: 12.3 s to wait comes back at 4.3 s
        // (8 s before its place), 12 s to wait at exactly 5 s.
        assert_eq!(Lane::Recheck.stay(ms(12_300), secs(5)), ms(4_300));
        assert_eq!(Lane::Recheck.stay(secs(12), secs(5)), secs(5));
        // Longer tiers step by at most 5 s.
        assert_eq!(Lane::Recheck.stay(ms(97_500), secs(30)), ms(27_500));
        assert_eq!(Lane::Recheck.stay(ms(97_500), secs(3_600)), ms(3_597_500));
        // Never longer than the tier, never shorter than the tier less its
        // step, and back at a whole number of steps before its place: a
        // herd of copies spaced 126 ms apart spreads over the step.
        for tier in [secs(1), secs(5), secs(30), secs(120)] {
            let step = (tier / 5).min(Lane::EARLY_MAX);
            for wait_ms in
                (tier.as_millis() as u64 + 5_000..tier.as_millis() as u64 + 60_000).step_by(126)
            {
                let stay = Lane::Recheck.stay(ms(wait_ms), tier);
                assert!(
                    stay <= tier && stay + step > tier,
                    "{wait_ms} ms in {tier:?}"
                );
                assert_eq!(
                    (ms(wait_ms) - stay).as_millis() % step.as_millis(),
                    0,
                    "{wait_ms} ms in {tier:?}"
                );
            }
        }
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
