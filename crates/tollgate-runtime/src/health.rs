//! The state of each dependency (RabbitMQ, Redis), logged the same way for
//! both: one WARN when it goes down, with the cause and its address
//! (password redacted); a reminder at most once a minute while it stays
//! down; one INFO when it is back, with how long it was gone.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use tracing::{info, warn};

/// How often a dependency that stays down is logged again.
const REMIND_EVERY: Duration = Duration::from_secs(60);

pub struct Dependency {
    name: &'static str,
    /// Its address as shown in logs (no password).
    address: String,
    state: Mutex<State>,
}

#[derive(Clone, Copy)]
enum State {
    Unknown,
    Up,
    Down { since: Instant, logged: Instant },
}

impl Dependency {
    pub fn new(name: &'static str, address: String) -> Self {
        Self {
            name,
            address,
            state: Mutex::new(State::Unknown),
        }
    }

    /// It answered.
    pub fn up(&self) {
        let mut state = self.state.lock().expect("not poisoned");
        match *state {
            State::Down { since, .. } => info!(
                dependency = self.name,
                address = %self.address,
                down_for_ms = since.elapsed().as_millis() as u64,
                "{} is reachable again",
                self.name
            ),
            State::Unknown => info!(
                dependency = self.name,
                address = %self.address,
                "{} is reachable",
                self.name
            ),
            State::Up => {}
        }
        *state = State::Up;
    }

    /// It could not be reached, because of `cause`.
    pub fn down(&self, cause: &str) {
        let mut state = self.state.lock().expect("not poisoned");
        let now = Instant::now();
        match *state {
            State::Up | State::Unknown => {
                warn!(
                    dependency = self.name,
                    address = %self.address,
                    cause,
                    "{} is unreachable: waiting for it, no job is lost",
                    self.name
                );
                *state = State::Down {
                    since: now,
                    logged: now,
                };
            }
            State::Down { since, logged } if now.duration_since(logged) >= REMIND_EVERY => {
                warn!(
                    dependency = self.name,
                    address = %self.address,
                    cause,
                    down_for_s = since.elapsed().as_secs(),
                    "{} is still unreachable",
                    self.name
                );
                *state = State::Down { since, logged: now };
            }
            State::Down { .. } => {}
        }
    }
}
