//! Looking past a burst that is not due: extra consumers on a lane's queue
//! (work, return or recheck) while what it delivers is parked or held for
//! later.
//!
//! A work queue is FIFO, and a pod holds only its share of the prefetch
//! from it. A fresh backlog of a tenant held by its quota (2,000 jobs at
//! 10/s) is looked at once, job by job, and nearly every job is parked in a
//! delay tier; a quiet tenant's job published behind it waits until the
//! pods have moved the whole backlog out of the way, `share` deliveries at
//! a time per pod, each slot busy for a permit decision and a confirmed
//! publish. Those slots hold nothing another tenant's due work could use:
//! no job in them is going to the provider.
//!
//! The same holds for a backlog whose jobs are granted later slots and
//! held in the pod for them: a tenant alone on a shared route has the
//! whole route as its share, so nothing of its backlog parks, and at one
//! delivery per queue the tenants behind it on the route (or on no route
//! at all) were reached only once it had all gone out. A delivery held for
//! a later slot is not due either.
//!
//! The return and recheck queues are FIFO too, with the same share each.
//! A copy back for its place is held a few ms for its slot, and at one
//! delivery per queue the copies behind it, due as soon, waited for it,
//! came back late for their places and lost them: 200 tenants at 2/s each
//! (400/s in all) went out at 250–290/s at prefetch 4, the return queues'
//! 16 deliveries across 4 pods each held up to the smallest tier (100 ms,
//! about 50 on average), and drained in 15–17 s against an ideal of 10.
//! A recheck queue's copies only ever park again.
//!
//! So while a lane queue's consumer is full and what its queue delivers is
//! nearly all not due, the pod opens a look-ahead consumer on the same
//! queue, then another of twice the size as soon as that one is half full
//! the same way: the pod takes the burst in ahead of parking it, parks
//! it side by side, and a due job behind it reaches the provider without
//! waiting for every park before it. The look-ahead closes as soon as the
//! queue delivers due work (a pod must not take due work beyond its share:
//! other pods could send it) or goes quiet. What a pod may hold is bounded
//! by [`Lookahead::MAX_DEPTH`] consumers per queue and by the bytes it
//! holds.
//!
//! This is the decision only, with injected time; the worker carries it
//! out against the broker.

pub use tollgate_amqp::Via;

/// What a lane queue's traffic should do to its look-ahead.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Step {
    /// Open one more look-ahead consumer on `queue` with this prefetch.
    Open { queue: usize, prefetch: u16 },
    /// Cancel every look-ahead consumer of `queue`.
    Close { queue: usize },
}

/// The look-ahead decision for a pod's lane queues.
#[derive(Debug)]
pub struct Lookahead {
    /// Each lane queue's main consumer's prefetch.
    share: u16,
    /// No look-ahead opens while the pod holds this many bytes of
    /// deliveries or more.
    max_bytes: usize,
    held_bytes: usize,
    queues: Vec<QueueState>,
}

#[derive(Debug, Default)]
struct QueueState {
    /// Deliveries in hand from the main consumer.
    main: u16,
    /// Deliveries in hand from the look-ahead consumers.
    ahead: u32,
    /// The look-ahead consumers open, by prefetch.
    open: Vec<u16>,
    /// The last [`Lookahead::WINDOW`] settlements, newest in bit 0: 1 not
    /// due (parked, or held in the pod for a later slot).
    recent: u32,
    /// How many of `recent`'s bits are real (up to the window).
    seen: u32,
    last_delivery_ms: i64,
}

impl Lookahead {
    /// Settlements a queue's park ratio is judged over.
    pub const WINDOW: u32 = 32;
    /// Settlements needed before a ratio is judged (at one delivery per
    /// queue, each is a permit decision and a confirmed publish long).
    const MIN_SEEN: u32 = 2;
    /// Look-ahead consumers per lane queue at most; the `k`-th (from 0) has
    /// a prefetch of `FIRST << k`.
    pub const MAX_DEPTH: usize = 7;
    /// The first look-ahead consumer's prefetch.
    pub const FIRST: u16 = 16;
    /// A queue silent this long has nothing left to look past.
    pub const IDLE_MS: i64 = 1_000;

    pub fn new(lane_queues: usize, share: u16, max_bytes: usize) -> Self {
        Self {
            share: share.max(1),
            max_bytes,
            held_bytes: 0,
            queues: (0..lane_queues).map(|_| QueueState::default()).collect(),
        }
    }

    /// A delivery of `bytes` arrived from `queue` by `via`.
    pub fn delivered(&mut self, queue: usize, via: Via, bytes: usize, now_ms: i64) -> Option<Step> {
        self.held_bytes += bytes;
        let q = &mut self.queues[queue];
        q.last_delivery_ms = now_ms;
        match via {
            Via::Main => q.main += 1,
            Via::Ahead => q.ahead += 1,
        }
        self.open_if_backed_up(queue)
    }

    /// A delivery from `queue` by `via` was settled; `not_due`: it went to a
    /// delay tier, or it was held in the pod for a later slot before its
    /// call.
    pub fn settled(&mut self, queue: usize, via: Via, bytes: usize, not_due: bool) -> Option<Step> {
        self.held_bytes = self.held_bytes.saturating_sub(bytes);
        let q = &mut self.queues[queue];
        match via {
            Via::Main => q.main = q.main.saturating_sub(1),
            Via::Ahead => q.ahead = q.ahead.saturating_sub(1),
        }
        q.recent = (q.recent << 1) | u32::from(not_due);
        q.seen = (q.seen + 1).min(Self::WINDOW);
        if !q.open.is_empty() && q.seen >= Self::MIN_SEEN && q.not_due() * 2 < q.seen {
            // Due work is coming through: take no more than the share.
            q.open.clear();
            return Some(Step::Close { queue });
        }
        self.open_if_backed_up(queue)
    }

    /// Look-aheads on queues silent for [`Self::IDLE_MS`] close.
    pub fn tick(&mut self, now_ms: i64) -> Vec<Step> {
        let mut steps = Vec::new();
        for (queue, q) in self.queues.iter_mut().enumerate() {
            if !q.open.is_empty() && now_ms - q.last_delivery_ms >= Self::IDLE_MS {
                q.open.clear();
                steps.push(Step::Close { queue });
            }
        }
        steps
    }

    fn open_if_backed_up(&mut self, queue: usize) -> Option<Step> {
        let bytes_left = self.held_bytes < self.max_bytes;
        let q = &mut self.queues[queue];
        let capacity: u32 = q.open.iter().map(|&p| u32::from(p)).sum();
        // Half full: the next opens while the last still has room, so the
        // pod's deliveries in hand run ahead of its parking.
        let full = q.main >= self.share && q.ahead * 2 >= capacity;
        let passing = q.seen >= Self::MIN_SEEN && q.not_due() * 4 >= q.seen * 3;
        if !(full && passing && bytes_left && q.open.len() < Self::MAX_DEPTH) {
            return None;
        }
        let prefetch = Self::FIRST << q.open.len();
        q.open.push(prefetch);
        Some(Step::Open { queue, prefetch })
    }
}

impl QueueState {
    fn not_due(&self) -> u32 {
        let mask = if self.seen >= 32 {
            u32::MAX
        } else {
            (1u32 << self.seen) - 1
        };
        (self.recent & mask).count_ones()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A queue whose main consumer (share 4) is full and whose last `n`
    /// settlements were parks.
    fn backed_up(n: u32) -> (Lookahead, Vec<Step>) {
        let mut l = Lookahead::new(2, 4, 1 << 20);
        let mut steps = Vec::new();
        for _ in 0..4 {
            steps.extend(l.delivered(0, Via::Main, 100, 0));
        }
        for _ in 0..n {
            steps.extend(l.settled(0, Via::Main, 100, true));
            steps.extend(l.delivered(0, Via::Main, 100, 0));
        }
        (l, steps)
    }

    #[test]
    fn a_full_queue_that_only_parks_opens_a_look_ahead() {
        let (l, steps) = backed_up(Lookahead::MIN_SEEN);
        assert_eq!(
            steps,
            vec![Step::Open {
                queue: 0,
                prefetch: Lookahead::FIRST
            }]
        );
        assert_eq!(
            (l.queues[0].open.len(), l.queues[1].open.len()),
            (1, 0),
            "only the backed-up queue"
        );
    }

    #[test]
    fn too_few_settlements_to_judge_open_nothing() {
        let (_, steps) = backed_up(Lookahead::MIN_SEEN - 1);
        assert!(steps.is_empty(), "{steps:?}");
    }

    #[test]
    fn a_queue_with_room_opens_nothing_however_much_it_parks() {
        let mut l = Lookahead::new(1, 4, 1 << 20);
        for _ in 0..100 {
            assert_eq!(l.delivered(0, Via::Main, 100, 0), None);
            assert_eq!(l.settled(0, Via::Main, 100, true), None);
        }
    }

    #[test]
    fn due_work_opens_nothing() {
        let mut l = Lookahead::new(1, 4, 1 << 20);
        for _ in 0..4 {
            l.delivered(0, Via::Main, 100, 0);
        }
        for i in 0..100 {
            // Half parked, half sent: the queue carries due work.
            assert_eq!(l.settled(0, Via::Main, 100, i % 2 == 0), None);
            assert_eq!(l.delivered(0, Via::Main, 100, 0), None);
        }
    }

    #[test]
    fn a_filled_look_ahead_that_parks_too_opens_one_twice_its_size_up_to_the_depth() {
        let (mut l, _) = backed_up(Lookahead::MIN_SEEN);
        let mut opened = vec![Lookahead::FIRST];
        // Every delivery in hand is parked and replaced, so each look-ahead
        // fills as soon as it opens.
        for _ in 0..10_000 {
            match l.delivered(0, Via::Ahead, 10, 0) {
                Some(Step::Open { prefetch, .. }) => opened.push(prefetch),
                Some(step) => panic!("{step:?}"),
                None => {}
            }
        }
        let doubling: Vec<u16> = (0..Lookahead::MAX_DEPTH)
            .map(|k| Lookahead::FIRST << k)
            .collect();
        assert_eq!(opened, doubling);
    }

    #[test]
    fn the_next_look_ahead_opens_once_the_last_is_half_full() {
        let (mut l, _) = backed_up(Lookahead::MIN_SEEN);
        let half = u32::from(Lookahead::FIRST) / 2;
        for _ in 1..half {
            assert_eq!(l.delivered(0, Via::Ahead, 10, 0), None);
        }
        assert_eq!(
            l.delivered(0, Via::Ahead, 10, 0),
            Some(Step::Open {
                queue: 0,
                prefetch: 2 * Lookahead::FIRST
            })
        );
    }

    #[test]
    fn no_look_ahead_opens_past_the_bytes_held() {
        let mut l = Lookahead::new(1, 4, 1000);
        for _ in 0..4 {
            l.delivered(0, Via::Main, 300, 0);
        }
        for _ in 0..20 {
            // 4 × 300 bytes held: over the bound.
            assert_eq!(l.settled(0, Via::Main, 300, true), None);
            assert_eq!(l.delivered(0, Via::Main, 300, 0), None);
        }
    }

    #[test]
    fn due_work_behind_the_burst_closes_the_look_ahead() {
        let (mut l, _) = backed_up(Lookahead::MIN_SEEN);
        let mut closed = None;
        for _ in 0..Lookahead::WINDOW {
            if let Some(step) = l.settled(0, Via::Ahead, 100, false) {
                closed = Some(step);
                break;
            }
        }
        assert_eq!(closed, Some(Step::Close { queue: 0 }));
        assert!(l.queues[0].open.is_empty());
    }

    #[test]
    fn a_silent_queue_closes_its_look_ahead_and_only_it() {
        let (mut l, _) = backed_up(Lookahead::MIN_SEEN);
        assert_eq!(l.tick(Lookahead::IDLE_MS - 1), vec![]);
        assert_eq!(l.tick(Lookahead::IDLE_MS), vec![Step::Close { queue: 0 }]);
        assert_eq!(l.tick(10 * Lookahead::IDLE_MS), vec![], "closed once");
    }
}
