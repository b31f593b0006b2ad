//! The worker runtime: [`Worker::run`] consumes every work queue and drives
//! each delivery through the core's state machine (`tollgate_core::JobRun`),
//! carrying out its actions against RabbitMQ, Redis and the provider; the
//! metrics operators watch; the quota baseline a worker keeps seeded.
//!
//! Where to change how a job waits: the decision is the core's
//! (`tollgate_core::run`); carrying it out — holding in-process, parking in
//! a delay tier, the per-tenant hold cap — is [`worker`] and [`holds`].

pub mod baseline;
pub mod commit;
pub mod health;
pub mod holds;
pub mod lookahead;
pub mod metrics;
pub mod settings;
pub mod system_clock;
pub mod tally;
pub mod throttles;
pub mod topology;
pub mod worker;

pub use metrics::Metrics;
pub use settings::{BaselineSettings, WorkerSettings};
pub use worker::{LiveWorker, Readiness, Settled, Worker};
