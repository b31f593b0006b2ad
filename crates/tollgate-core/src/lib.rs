//! The pure heart of tollgate: the job model, its validation, the quota model and
//! the per-job decision state machine (due-check → permit → provider outcome →
//! ack / park / retry / dead-letter).
//!
//! Architecture invariant: this crate does no IO and never reads the wall clock.
//! Every function that needs the time takes `now` as an argument, so the whole
//! decision logic is tested as a state machine with injected time. Adapters
//! (AMQP, Redis, HTTP) implement the small traits in [`ports`].

pub mod adaptive;
pub mod backoff;
pub mod clock;
pub mod cross_slot;
pub mod ids;
pub mod job;
pub mod outcome;
pub mod ports;
pub mod quota;
pub mod run;
pub mod secret;
pub mod tiers;

pub use adaptive::{Adaptive, Learning, Tuning};
pub use clock::{Clock, UnixMillis};
pub use ids::{IdempotencyKey, JobId, Kind, TenantId};
pub use job::{Job, Malformed, Priority, Progress};
pub use outcome::{DeadReason, Failure, ParkReason, ProviderOutcome};
pub use quota::{MAX_WEIGHT, Quota, Rate, concurrency, default_burst, weight};
pub use run::{Action, Completion, Eligibility, JobRun, PermitDecision, Policy, Shadow};
pub use secret::{Secret, SecretUrl, redact_url};
pub use tiers::{DelayTiers, Lane};
