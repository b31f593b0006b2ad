//! The wall clock, the one place the runtime reads it.

use std::time::{SystemTime, UNIX_EPOCH};

use tollgate_core::{Clock, UnixMillis};

#[derive(Clone, Copy, Debug, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> UnixMillis {
        let since = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .expect("the clock is after 1970");
        UnixMillis(since.as_millis() as i64)
    }
}
