//! The tollgate binary's library: configuration, metrics, the worker
//! runtime, the HTTP server, the CLI commands and the demo. `main.rs` only
//! parses arguments and maps failures to exit codes.

pub mod admin;
pub mod baseline;
pub mod bench;
pub mod cli;
pub mod commit;
pub mod config;
pub mod demo;
pub mod fake_provider;
pub mod health;
pub mod holds;
pub mod http;
pub mod logging;
pub mod metrics;
pub mod system_clock;
pub mod throttles;
pub mod worker;

pub use config::Config;
pub use metrics::Metrics;
pub use worker::{LiveWorker, Settled, Worker};
