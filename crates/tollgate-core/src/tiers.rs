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
/// together (a backlog's first pass) come back close together (within the
/// few seconds [`Lane::stay`] spreads them over), and each takes a
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

    /// How early a copy to recheck may come back, at most: half its tier,
    /// never more than this.
    pub const EARLY_MAX: Duration = Duration::from_secs(5);

    /// How long a copy parked in `tier` with `wait` left stays there (its
    /// message's expiration). A due copy stays the whole tier. A copy to
    /// recheck comes back early by up to half the tier (at most
    /// [`Lane::EARLY_MAX`]), the less the more it still has to wait.
    ///
    /// Copies parked in the same second otherwise came back in the same
    /// second, forever (every tier from 5 s up is a multiple of 5 s): a
    /// backlog's first pass stayed one herd of hundreds that the broker
    /// dead-lettered at once while due copies waited behind it. A herd is
    /// parked in the order of its places, and a queue expires messages
    /// from its head only (one behind a longer-lived message waits for
    /// it), so a stay that grows with the wait spreads the herd over the
    /// step, where one aligned to each copy's place did not (its sawtooth
    /// held every copy behind its first peak). Early is safe: the copy
    /// only asks again, and never comes back later than its tier.
    pub fn stay(self, wait: Duration, tier: Duration) -> Duration {
        let step = (tier / 2).min(Self::EARLY_MAX);
        if self == Self::Due || wait.is_zero() {
            return tier;
        }
        let early = step.mul_f64((tier.as_secs_f64() / wait.as_secs_f64()).min(1.0));
        tier - early
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
    fn a_copy_to_recheck_comes_back_earlier_the_nearer_its_place() {
        let ms = Duration::from_millis;
        // Due: the whole tier, whatever its wait.
        assert_eq!(Lane::Due.stay(ms(7_300), secs(5)), secs(5));
        // The 5 s tier comes back up to 2.5 s early: 10 s to wait, 1.25 s.
        assert_eq!(Lane::Recheck.stay(secs(10), secs(5)), ms(3_750));
        // Longer tiers at most 5 s: 60 s to wait in the 30 s tier, 2.5 s.
        assert_eq!(Lane::Recheck.stay(secs(60), secs(30)), ms(27_500));
        // Within a tier the stay grows with the wait: a herd parked in the
        // order of its places expires in that order (a queue expires from
        // its head), spread over up to the step.
        for tier in [secs(1), secs(5), secs(30), secs(120), secs(3_600)] {
            let step = (tier / 2).min(Lane::EARLY_MAX);
            let mut last = Duration::ZERO;
            for wait_ms in
                (tier.as_millis() as u64 + 5_000..tier.as_millis() as u64 + 300_000).step_by(126)
            {
                let stay = Lane::Recheck.stay(ms(wait_ms), tier);
                assert!(
                    stay <= tier && stay >= tier - step,
                    "{wait_ms} ms in {tier:?}"
                );
                assert!(
                    stay >= last,
                    "{wait_ms} ms in {tier:?}: {stay:?} < {last:?}"
                );
                last = stay;
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
