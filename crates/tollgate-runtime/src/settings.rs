//! What a worker is built from: every knob already parsed and checked. The
//! binary builds it from its configuration (`Config::worker_settings`).

use std::sync::Arc;
use std::time::Duration;

use tollgate_amqp::{Nodes, Topology};
use tollgate_core::job::Limits;
use tollgate_core::{Policy, Rate};
use tollgate_provider::Route;
use tollgate_quota::{PermitSettings, RedisSettings};

use crate::baseline::Baseline;

/// No `Debug`: it holds connection URLs with their passwords.
#[derive(Clone)]
pub struct WorkerSettings {
    /// The broker's nodes (one, or a cluster's), shared by every session.
    pub amqp_nodes: Arc<Nodes>,
    /// PEM bundle trusted for `amqps://` instead of the system roots.
    pub tls_ca_pem: Option<String>,
    pub topology: Topology,
    /// Connection and consumer name.
    pub name: String,
    pub redis: RedisSettings,
    /// Shown in logs for Redis (no password).
    pub redis_url_shown: String,
    /// Names every Redis key.
    pub prefix: String,
    pub permits: PermitSettings,
    pub routes: Vec<Route>,
    pub provider_timeout: Duration,
    pub policy: Policy,
    pub limits: Limits,
    /// Provider calls made at once.
    pub concurrency: u16,
    /// Deliveries held at once (the AMQP prefetch).
    pub prefetch: u16,
    pub shutdown_grace: Duration,
    /// Longest one delivery may take before it is handed back as hung.
    pub delivery_timeout: Duration,
    /// Deliveries of one tenant held in-process at once.
    pub tenant_hold_max: usize,
    /// Optional local ceiling on this pod's provider calls.
    pub pod_max_rate: Option<Rate>,
    pub baseline: Option<BaselineSettings>,
}

/// The quota baseline a worker keeps seeded into Redis.
#[derive(Clone, Debug)]
pub struct BaselineSettings {
    /// The file, re-read at every pass.
    pub path: String,
    /// Its content when the worker started (it must parse then).
    pub baseline: Baseline,
    pub every: Duration,
}
