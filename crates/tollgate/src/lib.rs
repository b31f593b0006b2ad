//! The `tollgate` binary's library: configuration, the CLI verbs, the admin
//! API and the HTTP server. The worker runtime is `tollgate-runtime`; the
//! demo, benchmarks and fake provider live in `tollgate-dev`, outside the
//! shipped binary. `main.rs` only parses arguments and maps failures to exit
//! codes.

pub mod admin;
pub mod cli;
pub mod config;
pub mod console;
pub mod http;
pub mod logging;

pub use config::Config;
