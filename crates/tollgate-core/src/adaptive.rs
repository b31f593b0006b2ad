//! Adaptive quotas: a provider's real limit, learned from its 429s.
//!
//! The configured rate is a ceiling; the *effective* rate moves within
//! [min, ceiling]. Every pod learns as one: the state lives in Redis and is
//! updated by the completion script, in the call that already records each
//! send, so learning adds no round trip. This module is the algorithm's
//! specification, pure and tested as a state machine with injected time;
//! `adapt.lua` in `tollgate-quota` runs the same steps inside Redis, and a
//! test drives both with the same events and checks they agree to the bit.
//!
//! The steps:
//! - a 429 while the rate is above the last rate that held (a probe up
//!   failed): back to that rate, and stay there for `probe` before trying
//!   higher again (twice that when the probe before failed too), or one
//!   window when a climb's later step failed (below);
//! - a lone 429 at a rate that held: that rate sits on the provider's edge,
//!   where send jitter alone crosses it: one step (`increase`) back (the
//!   rate ÷ (1 + `increase`), the inverse of a step up), and stay there the
//!   same way;
//! - any other 429 (a second one within 6 s, or before a window has held
//!   since the last, at a rate that held, a failed probe's not counted: the
//!   limit fell; or nothing has held yet): multiplicative decrease, rate ×
//!   `decrease`, and climb back from there;
//! - the 429s that answer sends made before a change are one burst: after
//!   a change, 429s are ignored for one window;
//! - a window (2 s) that passes without a 429, with the tenant sending at
//!   least 80 % of the effective rate, marks that rate as holding (a
//!   probe's first step above a settled rate: two such windows). Climbing,
//!   the rate then grows by `increase` of itself, and the step doubles with
//!   every window that holds (5 %, 10 %, 20 % …), so a raised limit is found
//!   in a few windows and a failed probe overshoots by one step only. A
//!   climb's failed step that was not its first leaves the limit between
//!   two rates more than a step apart: the probe begins again after one
//!   window, from the rate that held, its first step proven by one window.
//!   That resumed climb stops short of the rate that failed: a step that
//!   would reach it settles where the last one held, as a failed probe
//!   does, instead of crossing the limit again for a 429 and a Retry-After.
//!   A rate the tenant does not use is never raised.

use std::fmt;
use std::time::Duration;

use crate::quota::{QuotaError, Rate};

/// Microseconds a rate must hold, exercised and without a 429, before it
/// counts as holding (and the next step up may follow).
pub const WINDOW_MICROS: u64 = 2_000_000;

/// A 429 within this many microseconds of the last one handled (a failed
/// probe's aside) is a storm (the provider's limit fell): multiplicative
/// decrease, even at a rate that held.
pub const STORM_MICROS: u64 = 3 * WINDOW_MICROS;

/// A window counts only when the tenant sent at least this fraction of the
/// effective rate in it: a limit that is not exercised is never raised.
pub const EXERCISED: f64 = 0.8;

/// An adjustment reaches the audit stream when the rate moved at least this
/// fraction since the last entry...
pub const AUDIT_CHANGE: f64 = 0.1;

/// ...and at most once per this many microseconds per tenant or route, so a
/// storm of 429s does not flood the stream.
pub const AUDIT_EVERY_MICROS: u64 = 10_000_000;

/// Why the default quota cannot adapt.
pub const NOT_FOR_DEFAULT: &str = "adaptive applies to a tenant's or a route's quota: the default \
    is shared by tenants whose providers' limits differ, and each would learn alone";

/// How a quota adapts: its configured rate is the ceiling.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Adaptive {
    /// The effective rate never falls below this.
    pub min: Rate,
    /// Multiplicative decrease on a 429 (the new rate is this × the old).
    pub decrease: f64,
    /// The first step of a probe up, as a fraction of the rate; it doubles
    /// with each window that holds.
    pub increase: f64,
    /// How long a rate that a failed probe fell back to is kept before
    /// probing above it again.
    pub probe: Duration,
}

impl Adaptive {
    pub const DEFAULT_DECREASE: f64 = 0.7;
    pub const DEFAULT_INCREASE: f64 = 0.05;
    pub const DEFAULT_PROBE: Duration = Duration::from_secs(8);
    /// The minimum when none is given: this fraction of the ceiling.
    pub const DEFAULT_MIN_FRACTION: f64 = 0.05;

    /// Checks the parameters against the ceiling; `None` takes the default.
    pub fn new(
        ceiling: Rate,
        min: Option<Rate>,
        decrease: Option<f64>,
        increase: Option<f64>,
        probe: Option<Duration>,
    ) -> Result<Self, QuotaError> {
        let min = min.unwrap_or_else(|| default_min(ceiling));
        if min.per_second() > ceiling.per_second() {
            return Err(QuotaError::Adaptive(format!(
                "--min {min} is above the rate {ceiling}"
            )));
        }
        let decrease = decrease.unwrap_or(Self::DEFAULT_DECREASE);
        if !(0.1..=0.95).contains(&decrease) {
            return Err(QuotaError::Adaptive(format!(
                "--decrease {decrease} is not between 0.1 and 0.95"
            )));
        }
        let increase = increase.unwrap_or(Self::DEFAULT_INCREASE);
        if !(0.01..=1.0).contains(&increase) {
            return Err(QuotaError::Adaptive(format!(
                "--increase {increase} is not between 0.01 and 1"
            )));
        }
        let probe = probe.unwrap_or(Self::DEFAULT_PROBE);
        if !(Duration::from_secs(1)..=Duration::from_secs(3600)).contains(&probe) {
            return Err(QuotaError::Adaptive(format!(
                "--probe {} s is not between 1 s and 1 h",
                probe.as_secs_f64()
            )));
        }
        Ok(Self {
            min,
            decrease,
            increase,
            probe,
        })
    }

    /// As people write it (`--min 1/s --decrease 0.7 --increase 0.05
    /// --probe 15`): what the CLI, the admin API and the quota baseline all
    /// accept. `None` takes the default.
    pub fn parse(
        ceiling: Rate,
        min: Option<&str>,
        decrease: Option<f64>,
        increase: Option<f64>,
        probe_secs: Option<f64>,
    ) -> Result<Self, QuotaError> {
        let min = min.map(str::parse).transpose()?;
        let probe = probe_secs
            .map(|s| {
                // `try_`: a number past what a Duration holds (1e300) is
                // refused like any other probe out of range, not a panic.
                Duration::try_from_secs_f64(s).map_err(|_| {
                    let shown = if s.abs() < 1e9 {
                        s.to_string()
                    } else {
                        format!("{s:e}")
                    };
                    QuotaError::Adaptive(format!("--probe {shown} s is not between 1 s and 1 h"))
                })
            })
            .transpose()?;
        Self::new(ceiling, min, decrease, increase, probe)
    }

    /// The bounds and steps, in the units the algorithm works in.
    pub fn tuning(&self, ceiling: Rate) -> Tuning {
        Tuning {
            ceiling: ceiling.per_second(),
            min: self.min.per_second(),
            decrease: self.decrease,
            increase: self.increase,
            probe_micros: self.probe.as_micros() as u64,
        }
    }
}

/// [`Adaptive::DEFAULT_MIN_FRACTION`] of the ceiling, in the largest unit
/// that keeps it a whole count (at least 1/h).
pub fn default_min(ceiling: Rate) -> Rate {
    let per_hour = (ceiling.per_second() * 3600.0 * Adaptive::DEFAULT_MIN_FRACTION)
        .ceil()
        .max(1.0) as u32;
    let (count, secs) = if per_hour.is_multiple_of(3600) {
        (per_hour / 3600, 1)
    } else if per_hour.is_multiple_of(60) {
        (per_hour / 60, 60)
    } else {
        (per_hour, 3600)
    };
    Rate {
        count,
        period: Duration::from_secs(secs),
    }
}

impl fmt::Display for Adaptive {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "adaptive (min {}, decrease {}, increase {}, probe {} s)",
            self.min,
            self.decrease,
            self.increase,
            self.probe.as_secs_f64()
        )
    }
}

/// [`Adaptive`] in the algorithm's units: rates per second, time in µs.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Tuning {
    pub ceiling: f64,
    pub min: f64,
    pub decrease: f64,
    pub increase: f64,
    pub probe_micros: u64,
}

impl Tuning {
    fn clamp(&self, rate: f64) -> f64 {
        rate.min(self.ceiling).max(self.min)
    }
}

/// The fleet's learning for one tenant or route. Times are microseconds of
/// the store's clock.
#[derive(Clone, Debug, PartialEq)]
pub struct Learning {
    /// The effective rate, per second.
    pub rate: f64,
    /// The last rate that held a whole window, exercised, without a 429.
    pub good: Option<f64>,
    /// The step of the probe under way, as a fraction of the rate (0 = none).
    pub step: f64,
    /// The rate is a probe's first step above a settled rate, which holds
    /// after two windows, not one: a step of a few percent over the
    /// provider's edge passed one window on send jitter alone (the sends
    /// decided before it and the provider's own window leave little of one
    /// window to judge it by), and the failure that followed fell back to it.
    pub trial: bool,
    /// The next probe resumes a climb whose later step failed, from the
    /// rate its last step held a window ago: its first step is no trial.
    pub resume: bool,
    /// The lowest rate a step of the climb under way failed at: its later
    /// steps stop short of it (one that would reach it settles instead).
    pub failed: Option<f64>,
    /// No probe up before this: a failed probe (or a lone 429 at a rate
    /// that held) settles the rate for a while.
    pub probe_at: u64,
    /// How long the last settling lasted: `probe`, doubled (once) while
    /// probes keep failing, so a steady limit is crossed less often.
    pub probe_wait: u64,
    /// 429s before this answer sends made before the last change.
    pub cool_until: u64,
    /// When the last 429 that changed the rate came.
    pub throttled_at: Option<u64>,
    /// No window has held since that 429: the rate it stepped back to is
    /// not known to hold, so a 429 now is a storm however long after (a
    /// Retry-After of 6 s or more, or a slow quota's spacing, puts every
    /// 429 of a falling limit more than [`STORM_MICROS`] apart).
    pub unproven: bool,
    /// The window under way: when it began and the sends since.
    pub window: Option<(u64, u32)>,
    /// When the rate last changed (places in line are re-spaced around it).
    pub changed_at: u64,
    /// The rate the audit stream last showed, and when.
    pub audited: Option<(f64, u64)>,
}

impl Learning {
    /// Nothing learned yet: the configured rate, until the provider says
    /// otherwise.
    pub fn new(limits: &Tuning) -> Self {
        Self {
            rate: limits.ceiling,
            good: None,
            step: 0.0,
            trial: false,
            resume: false,
            failed: None,
            probe_at: 0,
            probe_wait: 0,
            cool_until: 0,
            throttled_at: None,
            unproven: false,
            window: None,
            changed_at: 0,
            audited: None,
        }
    }

    /// The rate the quota enforces now (the ceiling and minimum may have
    /// changed since it was learned).
    pub fn effective(&self, limits: &Tuning) -> f64 {
        limits.clamp(self.rate)
    }

    /// A 429. Returns whether the rate changed.
    pub fn throttled(&mut self, limits: &Tuning, now: u64) -> bool {
        if now < self.cool_until {
            return false;
        }
        self.trial = false;
        self.resume = false;
        let rate = self.effective(limits);
        let storm = self.unproven || self.throttled_at.is_some_and(|t| now < t + STORM_MICROS);
        let new = match self.good {
            Some(good) if good < rate => {
                // A probe above what held failed: back to it. Its 429 says
                // nothing of the rate that held, so it does not start a
                // storm: a lone 429 at that rate soon after is the edge's.
                // A climb's later step (one held since the last settling)
                // leaves the limit between two rates more than a step
                // apart: probe again from the one that held after a window.
                // The settling still counts, so a failure of that probe
                // waits the doubled time.
                let resume = self.probe_wait == 0 && rate > good * (1.0 + limits.increase);
                self.settle(limits, now);
                if resume {
                    self.resume = true;
                    self.probe_at = now + WINDOW_MICROS;
                    // Below any rate that failed before it in this climb:
                    // its steps stop short of those.
                    self.failed = Some(rate);
                }
                self.cool_until = now + WINDOW_MICROS;
                self.window = Some((now, 0));
                return self.set(limits.clamp(good), rate, now);
            }
            Some(_) if !storm => {
                // A lone 429 at a rate that held: it sits at the provider's
                // edge, where send jitter alone crosses it. One step back:
                // the inverse of a step up, so a large `increase` never cuts
                // deeper than a storm would.
                let back = limits.clamp(rate / (1.0 + limits.increase));
                self.good = Some(back);
                self.settle(limits, now);
                back
            }
            _ => {
                self.good = None;
                self.failed = None;
                self.step = limits.increase;
                self.probe_wait = 0;
                rate * limits.decrease
            }
        };
        self.throttled_at = Some(now);
        self.unproven = true;
        self.cool_until = now + WINDOW_MICROS;
        self.window = Some((now, 0));
        self.set(limits.clamp(new), rate, now)
    }

    /// A send the provider accepted. Returns whether the rate changed.
    pub fn sent(&mut self, limits: &Tuning, now: u64) -> bool {
        let Some((start, sent)) = self.window else {
            self.window = Some((now, 0));
            return false;
        };
        let sent = sent + 1;
        let elapsed = now.saturating_sub(start);
        if elapsed < WINDOW_MICROS {
            self.window = Some((start, sent));
            return false;
        }
        self.window = Some((now, 0));
        let rate = self.effective(limits);
        let used = f64::from(sent) * 1e6 / elapsed as f64;
        if now < self.cool_until || used < EXERCISED * rate {
            return false;
        }
        self.unproven = false;
        if self.trial {
            // Its first window held: one more before it counts.
            self.trial = false;
            return false;
        }
        self.good = Some(rate);
        if self.step == 0.0 {
            if now < self.probe_at {
                return false;
            }
            self.step = limits.increase;
            // Above a settled rate the first step is a trial; above a rate
            // a climb held a window ago (its next step failed), not.
            self.trial = !std::mem::take(&mut self.resume);
        } else {
            // The last step up held: a later failure waits `probe` afresh.
            self.probe_wait = 0;
        }
        let new = limits.clamp(rate * (1.0 + self.step));
        if self.failed.is_some_and(|failed| new >= failed) {
            // The limit lies between this rate, which held, and one that
            // failed in this climb: stepping there again would only cross
            // it again. Settle here, as after a failed probe.
            self.settle(limits, now);
            return false;
        }
        self.step = (self.step * 2.0).min(1.0);
        self.set(new, rate, now)
    }

    /// No probe up for a while: `probe`, or twice that after a failure
    /// that followed a failure.
    fn settle(&mut self, limits: &Tuning, now: u64) {
        self.step = 0.0;
        self.failed = None;
        self.probe_wait = (self.probe_wait * 2).clamp(limits.probe_micros, 2 * limits.probe_micros);
        self.probe_at = now + self.probe_wait;
    }

    fn set(&mut self, new: f64, old: f64, now: u64) -> bool {
        self.rate = new;
        if new == old {
            return false;
        }
        self.changed_at = now;
        true
    }

    /// Whether the current rate should reach the audit stream now: it moved
    /// [`AUDIT_CHANGE`] since the last entry, which is
    /// [`AUDIT_EVERY_MICROS`] old. Marks it audited when so.
    pub fn audit(&mut self, limits: &Tuning, now: u64) -> Option<(f64, f64)> {
        let rate = self.effective(limits);
        let (last, at) = self.audited.unwrap_or((limits.ceiling, 0));
        if (rate - last).abs() < AUDIT_CHANGE * last || now < at + AUDIT_EVERY_MICROS {
            return None;
        }
        self.audited = Some((rate, now));
        Some((last, rate))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn rate(s: &str) -> Rate {
        s.parse().unwrap()
    }

    fn limits(ceiling: f64, min: f64) -> Tuning {
        Tuning {
            ceiling,
            min,
            decrease: Adaptive::DEFAULT_DECREASE,
            increase: Adaptive::DEFAULT_INCREASE,
            probe_micros: Adaptive::DEFAULT_PROBE.as_micros() as u64,
        }
    }

    #[test]
    fn parameters_are_checked_against_the_ceiling() {
        let ceiling = rate("20/s");
        let a = Adaptive::new(ceiling, None, None, None, None).unwrap();
        assert_eq!(a.min, rate("1/s"));
        assert_eq!(default_min(rate("10/m")).to_string(), "30/h");
        assert_eq!(default_min(rate("1/h")).to_string(), "1/h");
        assert!(Adaptive::new(ceiling, Some(rate("30/s")), None, None, None).is_err());
        assert!(Adaptive::new(ceiling, None, Some(1.0), None, None).is_err());
        assert!(Adaptive::new(ceiling, None, None, Some(0.0), None).is_err());
        assert!(Adaptive::new(ceiling, None, None, None, Some(Duration::ZERO)).is_err());
        // As typed: past what a Duration holds is an error too, not a panic.
        for probe in [1e300, 3e19, -1.0, f64::NAN, f64::INFINITY] {
            let refused = Adaptive::parse(ceiling, None, None, None, Some(probe)).unwrap_err();
            assert!(
                refused.to_string().contains("--probe"),
                "{probe}: {refused}"
            );
        }
        assert!(Adaptive::parse(ceiling, None, None, None, Some(15.0)).is_ok());
    }

    #[test]
    fn a_429_lowers_the_rate_and_the_rest_of_its_burst_does_not() {
        let l = limits(20.0, 1.0);
        let mut s = Learning::new(&l);
        assert!(s.throttled(&l, 1_000_000));
        assert_eq!(s.rate, 14.0);
        assert!(!s.throttled(&l, 1_500_000), "same burst");
        assert!(s.throttled(&l, 3_100_000));
        assert!((s.rate - 9.8).abs() < 1e-9);
    }

    #[test]
    fn a_failed_probe_falls_back_to_the_rate_that_held_and_waits() {
        let l = limits(20.0, 1.0);
        let mut s = Learning::new(&l);
        s.throttled(&l, 0);
        let mut now = 0;
        // 14/s holds for a window (sends at 14/s): the climb begins.
        while s.rate == 14.0 {
            now += 1_000_000 / 14;
            s.sent(&l, now);
        }
        assert_eq!(s.good, Some(14.0));
        assert!(s.rate > 14.0);
        now += 100_000;
        assert!(s.throttled(&l, now));
        assert_eq!(s.rate, 14.0, "back to the rate that held");
        assert_eq!(s.probe_at, now + l.probe_micros);
        // Windows at 14/s hold, but the rate stays until `probe` has passed.
        while now < s.probe_at - WINDOW_MICROS {
            now += 1_000_000 / 14;
            s.sent(&l, now);
            assert_eq!(s.rate, 14.0);
        }
        for _ in 0..100 {
            now += 1_000_000 / 14;
            s.sent(&l, now);
        }
        assert!(s.rate > 14.0, "probes again after {} µs", l.probe_micros);
    }

    /// Sends at `rate` for `micros` from `now`; returns the time after.
    fn paced(l: &Tuning, s: &mut Learning, mut now: u64, rate: f64, micros: u64) -> u64 {
        let until = now + micros;
        while now < until {
            now += (1e6 / rate) as u64;
            s.sent(l, now);
        }
        now
    }

    #[test]
    fn a_falling_limit_is_cut_however_far_apart_its_429s_come() {
        // A provider answering 429 with Retry-After 10: each 429 pauses the
        // tenant for longer than the 6 s that makes two 429s a storm.
        let l = limits(20.0, 1.0);
        let mut s = Learning::new(&l);
        let mut now = paced(&l, &mut s, 1_000_000, 20.0, 5_000_000);
        assert_eq!(s.good, Some(20.0), "20/s held");
        assert!(s.throttled(&l, now));
        let lone = s.effective(&l);
        assert!(
            (lone - 20.0 / 1.05).abs() < 1e-9,
            "a lone 429: one step back, {lone}"
        );
        // Paused 10 s, then a few sends (not a window held at that rate)
        // and a 429 again: the rate stepped back to does not hold either.
        now += 10_000_000;
        now = paced(&l, &mut s, now, 20.0, 500_000);
        assert!(s.throttled(&l, now));
        assert!(
            (s.effective(&l) - lone * l.decrease).abs() < 1e-9,
            "cut to {} from {lone}",
            s.effective(&l)
        );
        // Once a window has held, a 429 that long after is not a storm:
        // the climb under way falls back to the rate that held.
        now += 10_000_000;
        let cut = s.effective(&l);
        now = paced(&l, &mut s, now, cut, 4_500_000);
        let (rate, good) = (s.effective(&l), s.good.expect("a window held"));
        assert!(!s.unproven);
        now += 10_000_000;
        assert!(s.throttled(&l, now));
        assert_eq!(s.effective(&l), good, "from {rate}");
    }

    #[test]
    fn a_lone_429_never_cuts_deeper_than_a_storm() {
        // At the largest step up (`--increase 1`, doubling), one step back
        // halves the rate; `rate × (1 − increase)` took it to the minimum.
        let l = Tuning {
            increase: 1.0,
            ..limits(20.0, 1.0)
        };
        let mut s = Learning::new(&l);
        let now = paced(&l, &mut s, 1_000_000, 20.0, 5_000_000);
        assert_eq!(s.good, Some(20.0));
        assert!(s.throttled(&l, now));
        assert_eq!(s.effective(&l), 10.0);
    }

    /// Sends at 14/s for `micros`; returns the time of the last.
    fn send_for(l: &Tuning, s: &mut Learning, now: &mut u64, micros: u64) -> u64 {
        let until = *now + micros;
        while *now < until {
            *now += 1_000_000 / 14;
            s.sent(l, *now);
        }
        *now
    }

    /// A learning settled at 14/s after a failed probe, and its first step
    /// up (a trial) begun at the returned time.
    fn probing_above_14() -> (Tuning, Learning, u64) {
        let l = limits(20.0, 1.0);
        let mut s = Learning::new(&l);
        s.throttled(&l, 0);
        let mut now = 0;
        // 14/s holds; a 429 at its next step settles it back at 14/s.
        send_for(&l, &mut s, &mut now, WINDOW_MICROS + 200_000);
        assert!(s.rate > 14.0);
        now += 100_000;
        s.throttled(&l, now);
        assert_eq!((s.rate, s.good), (14.0, Some(14.0)));
        // After `probe`, the first step up: 14.7/s.
        let until = s.probe_at + WINDOW_MICROS;
        while s.rate == 14.0 && now < until {
            send_for(&l, &mut s, &mut now, 1);
        }
        assert!(
            (s.rate - 14.0 * (1.0 + l.increase)).abs() < 1e-9,
            "{}",
            s.rate
        );
        assert!(s.trial);
        (l, s, now)
    }

    #[test]
    fn a_probes_first_step_counts_only_after_two_windows() {
        let (l, mut s, mut now) = probing_above_14();
        let first = s.rate;
        // One window at it passes: not yet good, no second step.
        let one = send_for(&l, &mut s, &mut now, WINDOW_MICROS + 200_000);
        assert_eq!(s.rate, first);
        assert_eq!(s.good, Some(14.0));
        // A 429 now falls back to 14/s, the rate that held.
        let mut failing = s.clone();
        failing.throttled(&l, one + 1);
        assert_eq!(failing.rate, 14.0);
        // A second window passes: it holds, and the climb goes on.
        send_for(&l, &mut s, &mut now, WINDOW_MICROS + 200_000);
        assert_eq!(s.good, Some(first));
        assert!(s.rate > first && !s.trial);
    }

    #[test]
    fn a_climbs_later_step_that_fails_probes_again_after_a_window() {
        let (l, mut s, mut now) = probing_above_14();
        // The trial's two windows and the second step's hold: the third
        // step (20 % up) is under way.
        send_for(&l, &mut s, &mut now, 3 * WINDOW_MICROS + 600_000);
        let held = s.good.unwrap();
        assert!(held > 14.0 * (1.0 + l.increase));
        assert!(s.rate > held * (1.0 + l.increase));
        // It fails: back to the rate that held, and probing goes on after
        // one window, not `probe`, its first step without a trial.
        now += 1;
        s.throttled(&l, now);
        assert_eq!(s.rate, held);
        assert_eq!(s.probe_at, now + WINDOW_MICROS);
        send_for(&l, &mut s, &mut now, WINDOW_MICROS + 200_000);
        assert!(
            (s.rate - held * (1.0 + l.increase)).abs() < 1e-9,
            "{}",
            s.rate
        );
        assert!(!s.trial);
        // That first step fails too: the limit lies within a step, and the
        // rate settles for twice `probe` (a failure after a failure).
        now += 1;
        s.throttled(&l, now);
        assert_eq!(s.rate, held);
        assert_eq!(s.probe_at, now + 2 * l.probe_micros);
    }

    #[test]
    fn a_climb_never_steps_to_a_rate_that_failed_in_it() {
        let (l, mut s, mut now) = probing_above_14();
        // The trial's two windows and the second step's hold; the third step
        // (20 % up) fails: back to the rate that held, resuming after a window.
        send_for(&l, &mut s, &mut now, 3 * WINDOW_MICROS + 600_000);
        let held = s.good.unwrap();
        let failed = s.rate;
        now += 1;
        s.throttled(&l, now);
        assert_eq!((s.rate, s.failed), (held, Some(failed)));
        // The resumed climb's steps hold, and each would double: it stops
        // short of the rate that failed, settled where its last step held.
        let mut highest = held;
        let at_its_rate = |s: &mut Learning, now: &mut u64, micros: u64| {
            let until = *now + micros;
            while *now < until {
                *now += (1e6 / s.effective(&l)) as u64;
                s.sent(&l, *now);
            }
        };
        for _ in 0..6 {
            at_its_rate(&mut s, &mut now, WINDOW_MICROS + 200_000);
            highest = highest.max(s.rate);
            if s.step == 0.0 {
                break;
            }
        }
        assert!(highest > held, "the climb resumed");
        assert!(
            highest < failed,
            "{highest} reached the rate that failed, {failed}"
        );
        assert_eq!((s.step, s.failed), (0.0, None), "settled");
        // Settled as after a probe whose steps held: the next one comes after
        // `probe`, and it may go anywhere (the limit may have risen since).
        assert!(s.probe_at > now && s.probe_at <= now + l.probe_micros);
        at_its_rate(&mut s, &mut now, l.probe_micros + 2 * WINDOW_MICROS);
        assert!(s.rate > highest, "probes above it again after `probe`");
    }

    #[test]
    fn an_unused_rate_is_never_raised() {
        let l = limits(20.0, 1.0);
        let mut s = Learning::new(&l);
        s.throttled(&l, 0);
        let mut now = 0;
        for _ in 0..200 {
            now += 1_000_000 / 5; // 5/s on a rate of 14/s
            assert!(!s.sent(&l, now));
        }
        assert_eq!(s.rate, 14.0);
    }

    #[test]
    fn audit_entries_are_rate_limited() {
        let l = limits(20.0, 1.0);
        let mut s = Learning::new(&l);
        s.throttled(&l, 0);
        assert_eq!(s.audit(&l, 0), None, "the first entry waits its 10 s");
        assert_eq!(s.audit(&l, AUDIT_EVERY_MICROS), Some((20.0, 14.0)));
        s.throttled(&l, AUDIT_EVERY_MICROS + 1);
        assert_eq!(s.audit(&l, AUDIT_EVERY_MICROS + 2), None);
        assert!(s.audit(&l, 2 * AUDIT_EVERY_MICROS).is_some());
    }

    /// A provider that accepts at most `limit` sends in any sliding second.
    #[derive(Clone)]
    struct Provider {
        limit: usize,
        accepted: std::collections::VecDeque<u64>,
    }

    impl Provider {
        fn call(&mut self, now: u64) -> bool {
            while self.accepted.front().is_some_and(|&t| now - t >= 1_000_000) {
                self.accepted.pop_front();
            }
            if self.accepted.len() >= self.limit {
                return false;
            }
            self.accepted.push_back(now);
            true
        }
    }

    /// Sends paced at the effective rate (2 % wider, as the permit script
    /// does), each learned from; a 429 pauses 1 s (its Retry-After).
    /// Returns (sends, 429s) per second of simulated time.
    fn simulate(
        l: &Tuning,
        s: &mut Learning,
        p: &mut Provider,
        from: u64,
        secs: u64,
    ) -> Vec<(u32, u32)> {
        let mut per_second = vec![(0, 0); secs as usize];
        let mut now = from;
        while now < from + secs * 1_000_000 {
            let i = ((now - from) / 1_000_000) as usize;
            if p.call(now) {
                per_second[i].0 += 1;
                s.sent(l, now);
                now += (1e6 / s.effective(l) * 1.02).ceil() as u64;
            } else {
                per_second[i].1 += 1;
                s.throttled(l, now);
                now += 1_000_000;
            }
        }
        per_second
    }

    #[test]
    fn converges_on_a_fixed_limit_and_follows_it_up_and_down() {
        let l = limits(20.0, 1.0);
        let mut s = Learning::new(&l);
        let mut p = Provider {
            limit: 8,
            accepted: Default::default(),
        };
        let warmup = simulate(&l, &mut s, &mut p, 0, 30);
        let steady = simulate(&l, &mut s, &mut p, 30_000_000, 120);
        let sends: u32 = steady.iter().map(|s| s.0).sum();
        let throttled: u32 = steady.iter().map(|s| s.1).sum();
        assert!(warmup.iter().map(|s| s.1).sum::<u32>() > 0);
        assert!(
            f64::from(sends) >= 0.9 * 8.0 * 120.0,
            "{sends} sends in 120 s at a limit of 8/s"
        );
        assert!(
            f64::from(throttled) < 0.01 * f64::from(sends),
            "{throttled} × 429 in {sends} sends"
        );
        // A settled rate is probed above within 2 × probe, wherever in its
        // settled period the limit rises: raises at each of 30 seconds.
        let mut late = Vec::new();
        for offset in 0..30 {
            let (mut s, mut p) = (s.clone(), p.clone());
            simulate(&l, &mut s, &mut p, 150_000_000, offset);
            p.limit = 12;
            let raised = simulate(&l, &mut s, &mut p, (150 + offset) * 1_000_000, 75);
            late.push(raised[45..].iter().map(|s| s.0).sum::<u32>());
        }
        let mean = f64::from(late.iter().sum::<u32>()) / late.len() as f64;
        assert!(
            mean >= 0.9 * 12.0 * 30.0,
            "{mean} sends on average in the last 30 s at 12/s: {late:?}"
        );
        assert!(
            late.iter().all(|&n| f64::from(n) >= 0.85 * 12.0 * 30.0),
            "a raise not followed: {late:?}"
        );
        p.limit = 12;
        simulate(&l, &mut s, &mut p, 150_000_000, 75);
        p.limit = 4;
        simulate(&l, &mut s, &mut p, 225_000_000, 30);
        assert!(
            s.effective(&l) < 4.0 * 1.1,
            "rate {} after the limit fell to 4/s",
            s.rate
        );
    }

    fn event() -> impl Strategy<Value = (bool, u64)> {
        let gap = prop_oneof![20 => 1u64..400_000, 1 => 1_000_000u64..15_000_000];
        (prop::bool::weighted(0.1), gap)
    }

    proptest! {
        #[test]
        fn the_rate_stays_within_its_bounds_and_falls_on_every_new_burst(
            ceiling in 1.0f64..1000.0,
            min_fraction in 0.01f64..1.0,
            decrease in 0.1f64..0.95,
            increase in prop_oneof![0.01f64..1.0, Just(1.0)],
            events in prop::collection::vec(event(), 1..300),
        ) {
            let l = Tuning { ceiling, min: ceiling * min_fraction, decrease, increase, probe_micros: 3_000_000 };
            let mut s = Learning::new(&l);
            let mut now = 1_000_000;
            for (throttled, gap) in events {
                now += gap;
                let before = s.effective(&l);
                let cooling = now < s.cool_until;
                let good = s.good;
                let changed = if throttled { s.throttled(&l, now) } else { s.sent(&l, now) };
                let after = s.effective(&l);
                prop_assert!(after <= l.ceiling && after >= l.min);
                prop_assert_eq!(changed, after != before);
                if throttled {
                    prop_assert!(after <= before);
                    // No 429 cuts deeper than a storm's decrease or one
                    // step back, whichever is deeper, but a failed probe's
                    // fall back to the rate that held.
                    let deepest = before * decrease.min(1.0 / (1.0 + increase));
                    prop_assert!(
                        after >= deepest.max(l.min) - 1e-9 || good.map(|g| l.clamp(g)) == Some(after),
                        "{before} → {after}"
                    );
                    if !cooling && before > l.min {
                        prop_assert!(after < before, "a new 429 burst lowers the rate");
                    }
                } else {
                    prop_assert!(after >= before, "a send never lowers it");
                }
            }
        }
    }
}
