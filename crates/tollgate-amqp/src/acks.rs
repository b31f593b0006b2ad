//! Acks of one consuming channel, coalesced with `multiple` where order
//! allows.
//!
//! A channel numbers its deliveries 1, 2, 3 … across all its consumers, and
//! `basic.ack` with `multiple` settles every delivery up to a tag at once.
//! Deliveries settle out of order (one job waits for its permit, the next
//! is sent at once), so a multiple ack may only cover a run of tags that
//! are all done: [`Acks`] keeps the tags settled so far as "everything up
//! to `acked_upto`" plus the ones settled singly beyond it, and acks a
//! delivery only once its job asked for it. One frame then settles every
//! delivery whose job finished while the previous frame was on its way
//! (the jobs of one Redis completion batch finish together); a delivery
//! done past a gap (a lower tag still in work) is acked on its own at
//! once, never held back, so it does not keep its prefetch slot.
//!
//! The frames are sent by a task of their own, so a job whose future is
//! dropped mid-ack cannot leave the others waiting.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};

use lapin::Acker;
use lapin::message::Delivery;
use lapin::options::{BasicAckOptions, BasicNackOptions};
use tokio::sync::oneshot;

use crate::{AmqpError, bounded};

/// Past this many tags settled singly beyond the run (one delivery never
/// settled while thousands after it were), coalescing stops for this
/// channel: every ack goes out on its own, and the set no longer grows.
const MAX_SINGLES: usize = 65_536;

type Done = oneshot::Sender<Result<(), String>>;

/// Settles the deliveries of one channel; cheap to clone.
#[derive(Clone, Default)]
pub struct Acks {
    state: Arc<Mutex<State>>,
}

impl Acks {
    /// Acks `delivery` once its job is done; returns when a frame that
    /// settles it has been handed to the connection.
    pub async fn ack(&self, delivery: &Delivery) -> Result<(), AmqpError> {
        let (done, settled) = oneshot::channel();
        let start = {
            let mut state = self.state.lock().expect("not poisoned");
            state
                .ready
                .insert(delivery.delivery_tag, (delivery.acker.clone(), done));
            !std::mem::replace(&mut state.flushing, true)
        };
        if start {
            tokio::spawn(State::flush(Arc::clone(&self.state)));
        }
        bounded("an ack", async {
            match settled.await {
                Ok(sent) => sent.map_err(AmqpError::Ack),
                Err(_) => Err(AmqpError::Unsettleable("ack")),
            }
        })
        .await
    }

    /// Hands a delivery back to its queue (a nack with requeue; its
    /// delivery count rises). Once the nack is out, its tag counts as
    /// settled, so the runs after it can pass it; a nack that failed leaves
    /// the tag in work, so no `multiple` ever covers (and loses) it. If the
    /// channel is gone the broker requeues it anyway.
    pub async fn requeue(&self, acker: &Acker, tag: u64) -> Result<(), AmqpError> {
        let options = BasicNackOptions {
            requeue: true,
            ..Default::default()
        };
        let nacked = bounded("a nack", async { Ok(acker.nack(options).await?) }).await?;
        if !nacked {
            return Err(AmqpError::Unsettleable("requeue"));
        }
        self.state
            .lock()
            .expect("not poisoned")
            .ledger
            .settled_alone([tag]);
        Ok(())
    }
}

#[derive(Default)]
struct State {
    ledger: Ledger,
    /// Done, waiting for a frame: tag → its acker and who waits for it.
    ready: BTreeMap<u64, (Acker, Done)>,
    /// A task is sending frames.
    flushing: bool,
}

impl State {
    /// Sends frames until nothing is left done and unacked.
    async fn flush(state: Arc<Mutex<Self>>) {
        loop {
            let (frames, mut ready) = {
                let mut s = state.lock().expect("not poisoned");
                if s.ready.is_empty() {
                    s.flushing = false;
                    return;
                }
                let ready = std::mem::take(&mut s.ready);
                (s.ledger.take(ready.keys().copied()), ready)
            };
            let mut frame = |tags: &[u64]| -> Vec<(Acker, Done)> {
                tags.iter().filter_map(|t| ready.remove(t)).collect()
            };
            // The run's last tag, with `multiple`, settles the whole run.
            let run = frame(&frames.run);
            if let Some((last, _)) = run.last() {
                let sent = send_ack(last, run.len() > 1).await;
                for (_, done) in run {
                    let _ = done.send(sent.clone());
                }
            }
            // The rest lie past a gap: one frame each.
            for (acker, done) in frame(&frames.singles) {
                let _ = done.send(send_ack(&acker, false).await);
            }
        }
    }
}

/// Which tags of a channel are settled: the pure part of [`Acks`].
#[derive(Debug, Default)]
struct Ledger {
    /// Every tag up to this one is settled (or in a frame being sent).
    acked_upto: u64,
    /// Settled on their own past `acked_upto` (acked alone, or handed back).
    singles: BTreeSet<u64>,
    /// Too many singles: no more multiple acks on this channel.
    single_only: bool,
}

/// The frames for the tags done since the last: the run that follows
/// `acked_upto` (one frame, `multiple` when it holds more than one done
/// tag), and the rest, past a gap, one frame each.
#[derive(Debug, PartialEq)]
struct Frames {
    run: Vec<u64>,
    singles: Vec<u64>,
}

impl Ledger {
    /// Takes the tags done (each once) and says which frames settle them.
    fn take(&mut self, done: impl IntoIterator<Item = u64>) -> Frames {
        let mut done: BTreeSet<u64> = done.into_iter().collect();
        let mut run = Vec::new();
        if !self.single_only {
            loop {
                let next = self.acked_upto + 1;
                if done.remove(&next) {
                    run.push(next);
                } else if !self.singles.remove(&next) {
                    break;
                }
                self.acked_upto = next;
            }
        }
        let singles: Vec<u64> = done.into_iter().collect();
        self.settled_alone(singles.iter().copied());
        Frames { run, singles }
    }

    /// Counts tags settled on their own (acked past a gap, handed back).
    fn settled_alone(&mut self, tags: impl IntoIterator<Item = u64>) {
        if self.single_only {
            return;
        }
        let upto = self.acked_upto;
        self.singles.extend(tags.into_iter().filter(|&t| t > upto));
        while self.singles.remove(&(self.acked_upto + 1)) {
            self.acked_upto += 1;
        }
        if self.singles.len() > MAX_SINGLES {
            self.single_only = true;
            self.singles.clear();
        }
    }
}

/// One ack frame; the error as text, for everyone the frame settles.
async fn send_ack(acker: &Acker, multiple: bool) -> Result<(), String> {
    let options = BasicAckOptions { multiple };
    match bounded("an ack", async { Ok(acker.ack(options).await?) }).await {
        Ok(true) => Ok(()),
        Ok(false) => Err(AmqpError::Unsettleable("ack").to_string()),
        Err(e) => Err(e.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frames(run: &[u64], singles: &[u64]) -> Frames {
        Frames {
            run: run.to_vec(),
            singles: singles.to_vec(),
        }
    }

    #[test]
    fn the_tags_done_in_a_row_go_in_one_frame_and_the_rest_alone() {
        let mut ledger = Ledger::default();
        // 1 and 2 done together: one frame with `multiple`.
        assert_eq!(ledger.take([2, 1]), frames(&[1, 2], &[]));
        // 3 still in work: 4 and 6 are acked alone, and never held back.
        assert_eq!(ledger.take([4, 6]), frames(&[], &[4, 6]));
        // 3 done: the run takes it and passes 4; 5 is not done yet.
        assert_eq!(ledger.take([3]), frames(&[3], &[]));
        assert_eq!(ledger.acked_upto, 4);
        // 5 done: passes 6, settled alone before.
        assert_eq!(ledger.take([5, 7]), frames(&[5, 7], &[]));
        assert_eq!(ledger.acked_upto, 7);
    }

    #[test]
    fn a_frame_never_covers_a_tag_still_in_work() {
        let mut ledger = Ledger::default();
        // Tags seen out of order (several consumers on one channel): 2 is
        // done before 1 was even handed out to its job.
        assert_eq!(ledger.take([2]), frames(&[], &[2]));
        assert_eq!(ledger.acked_upto, 0);
        assert_eq!(ledger.take([1, 3]), frames(&[1, 3], &[]));
    }

    #[test]
    fn a_delivery_handed_back_lets_the_run_pass_it() {
        let mut ledger = Ledger::default();
        assert_eq!(ledger.take([2, 3]), frames(&[], &[2, 3]));
        ledger.settled_alone([1]);
        assert_eq!(ledger.acked_upto, 3);
        assert_eq!(ledger.take([4, 5]), frames(&[4, 5], &[]));
    }

    #[test]
    fn a_tag_never_settled_stops_multiple_acks_before_the_set_grows_unbounded() {
        let mut ledger = Ledger::default();
        let many = MAX_SINGLES as u64 + 2;
        let taken = ledger.take(2..=many);
        assert!(taken.run.is_empty());
        assert!(ledger.single_only && ledger.singles.is_empty());
        // From then on every tag is acked alone, even 1.
        assert_eq!(ledger.take([1]), frames(&[], &[1]));
    }
}
