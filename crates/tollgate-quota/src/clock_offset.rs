//! How far Redis's clock is from this pod's, learned from the pod's own
//! round trips (Cristian's method).
//!
//! A permit's send time is chosen on Redis's clock. The pod must know when
//! that is on its own clock to send on time, and to tell a permit it read
//! too late to use (a reply can wait tens of ms on a busy pod, in Redis's
//! socket or in the pod's runtime). Assuming the clocks agree sends early or
//! late by however far they do not, and would make every permit look late
//! on a pod whose clock runs ahead by more than a permit's leeway.
//!
//! Each round trip that returns Redis's time `remote` was sent at `sent`
//! and answered at `received` on the pod's clock; Redis read its clock
//! in between, so the offset is `remote − (sent + received) / 2`, within
//! half the round trip. The estimate is the sample with the shortest round
//! trip over the last window or so (a windowed minimum in two halves), so a
//! loaded moment's slow round trips never replace a quiet one's, and drift
//! is followed within two windows.
//!
//! Pure: times are microseconds passed in.

/// How long a sample is kept as the best: the estimate follows a drift of
/// the clocks within two of these.
const WINDOW_US: i64 = 30_000_000;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Sample {
    round_trip: i64,
    offset: i64,
}

/// The estimate of `Redis's clock − the pod's clock`, in microseconds.
#[derive(Clone, Debug, Default)]
pub(crate) struct ClockOffset {
    /// The best sample of the current window and of the one before.
    current: Option<Sample>,
    previous: Option<Sample>,
    window_began: i64,
}

impl ClockOffset {
    /// One round trip sent at `sent` and answered at `received` (the pod's
    /// clock) that read Redis's clock as `remote`.
    pub(crate) fn observe(&mut self, sent: i64, received: i64, remote: i64) {
        if received < sent {
            return; // the pod's clock stepped back: no bound on the offset
        }
        if received - self.window_began >= WINDOW_US {
            self.previous = self.current.take();
            self.window_began = received;
        }
        let sample = Sample {
            round_trip: received - sent,
            offset: remote - sent - (received - sent) / 2,
        };
        if self
            .current
            .is_none_or(|c| sample.round_trip <= c.round_trip)
        {
            self.current = Some(sample);
        }
    }

    /// Redis's clock minus the pod's, microseconds; `None` before the first
    /// sample.
    pub(crate) fn offset(&self) -> Option<i64> {
        [self.current, self.previous]
            .into_iter()
            .flatten()
            .min_by_key(|s| s.round_trip)
            .map(|s| s.offset)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_offset_is_taken_from_the_quickest_round_trip() {
        let mut clock = ClockOffset::default();
        assert_eq!(clock.offset(), None);
        // Redis runs 5 ms ahead. A quick round trip (200 µs) bounds it to
        // within 100 µs; a slow one (40 ms, a loaded pod) only to 20 ms.
        clock.observe(1_000_000, 1_000_200, 1_005_100);
        clock.observe(2_000_000, 2_040_000, 2_005_100);
        assert_eq!(clock.offset(), Some(5_000));
    }

    #[test]
    fn a_slow_moment_never_replaces_a_quick_sample_within_the_window() {
        let mut clock = ClockOffset::default();
        clock.observe(0, 300, -1_850); // Redis 2 ms behind
        for i in 1..100 {
            let sent = i * 200_000; // 20 s of loaded round trips
            clock.observe(sent, sent + 30_000, sent + 10_000);
        }
        assert_eq!(clock.offset(), Some(-2_000));
    }

    #[test]
    fn a_drift_is_followed_within_two_windows() {
        let mut clock = ClockOffset::default();
        clock.observe(0, 100, 1_050); // 1 ms ahead, a very quick round trip
        // The clocks drift to 3 ms apart; round trips are slower now.
        for i in 1..=140 {
            let sent = i * 500_000;
            clock.observe(sent, sent + 400, sent + 3_200);
        }
        assert_eq!(clock.offset(), Some(3_000));
    }

    #[test]
    fn a_clock_stepped_back_teaches_nothing() {
        let mut clock = ClockOffset::default();
        clock.observe(1_000, 500, 9_999);
        assert_eq!(clock.offset(), None);
    }
}
