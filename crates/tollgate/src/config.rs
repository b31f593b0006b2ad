//! Every setting in one place: a TOML file (`--config`) overridden by
//! `TOLLGATE_*` environment variables (`TOLLGATE_AMQP_URL` sets `amqp_url`).
//! Units are in the names; secrets live in types whose `Debug` hides them.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, bail};
use figment::Figment;
use figment::providers::{Env, Format, Serialized, Toml};
use serde::{Deserialize, Serialize};
use tollgate_amqp::{Nodes, Topology};
use tollgate_core::backoff::Backoff;
use tollgate_core::job::Limits;
use tollgate_core::ports::ThrottleScope;
use tollgate_core::{DelayTiers, Policy, Quota, Rate};
use tollgate_core::{Secret, SecretUrl, redact_url};
use tollgate_provider::Route;
use tollgate_quota::{PermitSettings, RedisSettings};
use tollgate_runtime::baseline::Baseline;
use tollgate_runtime::{BaselineSettings, WorkerSettings};
use url::Url;

/// One provider route (`[routes.<kind>]`).
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RouteConfig {
    pub url: SecretUrl,
    /// Asked before each permit: 200 = send, 410 = skip (no quota used).
    #[serde(default)]
    pub eligibility_url: Option<SecretUrl>,
    /// Whom a 429 from this route pauses: `tenant` (default) or `route`.
    #[serde(default)]
    pub throttle_scope: ThrottleScope,
}

#[derive(Clone, Copy, Debug, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    Json,
    Pretty,
}

#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    pub amqp_url: SecretUrl,
    pub redis_url: SecretUrl,
    /// PEM bundle of the CAs trusted for `amqps://` and `rediss://`
    /// (instead of the system roots), e.g. a private CA.
    pub tls_ca_file: Option<String>,
    /// Names every queue, exchange and Redis key; one installation per prefix.
    pub prefix: String,
    /// Route for kind `default`.
    pub provider_url: Option<SecretUrl>,
    /// Eligibility webhook of the `default` route (200 = send, 410 = skip).
    pub eligibility_url: Option<SecretUrl>,
    /// More routes, by kind: `[routes.email] url = "…"`.
    pub routes: BTreeMap<String, RouteConfig>,
    /// Provider calls one pod makes at once (1 for a provider that wants one
    /// call at a time).
    pub concurrency: u16,
    /// Fresh deliveries one pod holds unacked at once, waiting or in
    /// progress (the AMQP prefetch, split over the work queues; each return
    /// and recheck queue gets a work queue's share again, for copies back
    /// from a wait). Unset: the larger of `concurrency` and 64, so a small
    /// `concurrency` never leaves a pod too few deliveries to look past one
    /// tenant's backlog.
    pub prefetch: Option<u16>,
    /// Threads the process's async runtime works on. Not one per core of
    /// the node, tokio's default: with no CPU limit that is every core of
    /// the machine, and each thread beyond what a pod uses costs CPU and
    /// memory per job (threads waking each other to share the pod's
    /// tasks). One costs least per job; two is the default so that a pod
    /// with two cores can take a quiet tenant's job on one thread while the
    /// other parks a burst (ARCHITECTURE, "Defaults and why", has both
    /// measured). Raise it for a pod that must use more than two cores.
    pub runtime_threads: u16,
    /// Failed provider attempts (408/5xx/timeout) before `exhausted`.
    pub max_attempts: u32,
    pub http_addr: SocketAddr,
    /// Connections the HTTP port serves at once; more are closed on arrival.
    pub http_max_connections: usize,
    /// Longest an HTTP request may take (408 after); a connection idle
    /// longer is closed.
    pub http_request_timeout_ms: u64,
    pub admin_token: Option<Secret>,
    pub log_format: LogFormat,
    pub provider_timeout_ms: u64,
    /// Shortest pause after a 429, whatever its `Retry-After` says (`0` or a
    /// date in the past would retry at once, forever).
    pub min_retry_after_ms: u64,
    /// Whom a 429 from the `default` route pauses: `tenant` (the provider
    /// limits each customer) or `route` (one provider account shared by
    /// every tenant). Other routes set it under `[routes.<kind>]`.
    pub throttle_scope: ThrottleScope,
    pub backoff_base_ms: u64,
    pub backoff_max_ms: u64,
    /// Waits up to this long are held in-process; longer ones are parked.
    pub hold_max_ms: u64,
    /// How far ahead a permit may be reserved (held in-process until then).
    pub permit_horizon_ms: u64,
    /// Sends are spaced this many percent wider than the quota, so send
    /// jitter never pushes a strict provider over it.
    pub pacing_margin_pct: f64,
    /// First wait when Redis (or an eligibility webhook) cannot be reached;
    /// it doubles for each failure of the same job in a row, jittered, up
    /// to `unavailable_retry_max_ms`. Low, so work resumes within seconds
    /// of the dependency's return.
    pub unavailable_retry_ms: u64,
    pub unavailable_retry_max_ms: u64,
    /// How often a paused tenant's jobs come back to look again.
    pub pause_recheck_ms: u64,
    /// Shortest hop of a quota wait (a wait hops at most half its remaining
    /// time at once); at each hop a job asks again, so a raised quota
    /// reaches parked jobs.
    pub quota_recheck_ms: u64,
    /// Wait before asking again when a tenant is at its concurrency limit.
    pub concurrency_retry_ms: u64,
    /// Virtual slots a pod takes from Redis per denial and hands out locally
    /// (1 = ask Redis for every delivery of a waiting tenant).
    pub denial_block: u32,
    /// How long those slots (and a "paused" answer) may be used locally.
    pub denial_cache_ms: u64,
    /// Optional ceiling on this pod's provider calls (e.g. "500/s"),
    /// enforced locally on top of the fleet-wide quotas.
    pub pod_max_rate: Option<String>,
    /// How long a cancellation waits for its job to come up. Once the job
    /// is seen (and skipped), the cancellation is kept `sent_ttl_s` longer,
    /// for other copies of it. Longer than any schedule you use: a job due
    /// after its cancellation was forgotten is sent.
    pub cancel_ttl_s: u64,
    /// The quota baseline (TOML) seeded into Redis when quotas are missing.
    pub quotas_file: Option<String>,
    /// How often a worker checks that the baseline's quotas are in Redis.
    pub quota_seed_interval_ms: u64,
    /// Deliveries of one tenant a pod holds in-process at once; beyond it,
    /// short waits are parked too and reservations are taken only when
    /// imminent, so one tenant cannot fill the prefetch. Unset: half of one
    /// work queue's share of the prefetch, rounded down (0 when a queue has
    /// a single delivery: then only waits shorter than the smallest tier
    /// are held).
    pub tenant_hold_max: Option<usize>,
    /// Number of work queues tenants are hashed over.
    pub shards: u16,
    pub delay_tiers_ms: Vec<u64>,
    /// Deliveries of one message before RabbitMQ dead-letters it as poison.
    pub delivery_limit: u32,
    /// How long a sent idempotency key is remembered.
    pub sent_ttl_s: u64,
    /// Quota for tenants with none stored. Never unlimited.
    pub default_rate: String,
    pub default_burst: u32,
    pub max_body_bytes: usize,
    pub max_json_depth: usize,
    /// Tenants reported by name in metrics; the rest are `other`.
    pub tenant_label_limit: usize,
    /// A list, or (as an environment variable) names separated by commas.
    #[serde(deserialize_with = "names")]
    pub tenant_label_allowlist: Vec<String>,
    pub redis_timeout_ms: u64,
    /// SIGTERM → stop consuming, finish in-flight work, exit within this.
    pub shutdown_grace_ms: u64,
    /// Longest one delivery may take (holds, provider calls, retries held
    /// in-process) before it is handed back to its queue as hung.
    pub delivery_timeout_ms: u64,
    /// Connection and consumer name; defaults to the host name.
    pub name: Option<String>,
}

/// The smallest `pacing_margin_pct`: half of it is how late a call may
/// begin after its slot (5 ms of a per-second quota at 1 %).
const MIN_PACING_MARGIN_PCT: f64 = 1.0;

/// The longest prefix: the names built on it must stay within AMQP's 255
/// bytes (`<prefix>.recheck.65535`, `<prefix>.park.<tier>`).
const MAX_PREFIX_LEN: usize = 200;

/// A list of names, or one string of them separated by commas
/// (`TOLLGATE_TENANT_LABEL_ALLOWLIST=acme,globex`).
fn names<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Vec<String>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Names {
        List(Vec<String>),
        Text(String),
        // `TOLLGATE_…=42` reads as a number.
        Number(u64),
    }
    Ok(match Names::deserialize(d)? {
        Names::List(list) => list,
        Names::Number(n) => vec![n.to_string()],
        Names::Text(text) => text
            .split(',')
            .map(str::trim)
            .filter(|name| !name.is_empty())
            .map(str::to_owned)
            .collect(),
    })
}

/// The smallest `max_body_bytes` that still admits an ordinary job.
const MIN_BODY_BYTES: usize = 1024;

/// The longest `sent_ttl_s` or `cancel_ttl_s`: 100 years, well inside what
/// Redis accepts as an expiry.
const MAX_TTL_S: u64 = 100 * 365 * 24 * 3600;

impl Default for Config {
    fn default() -> Self {
        Self {
            amqp_url: SecretUrl::new("amqp://guest:guest@127.0.0.1:5672/%2f"),
            redis_url: SecretUrl::new("redis://127.0.0.1:6379"),
            tls_ca_file: None,
            prefix: "tollgate".into(),
            provider_url: None,
            eligibility_url: None,
            routes: BTreeMap::new(),
            concurrency: 64,
            prefetch: None,
            runtime_threads: 2,
            max_attempts: 8,
            http_addr: ([0, 0, 0, 0], 9090).into(),
            http_max_connections: 64,
            http_request_timeout_ms: 10_000,
            admin_token: None,
            log_format: LogFormat::Pretty,
            provider_timeout_ms: 10_000,
            min_retry_after_ms: 1_000,
            throttle_scope: ThrottleScope::Tenant,
            backoff_base_ms: 1_000,
            backoff_max_ms: 300_000,
            hold_max_ms: 1_000,
            permit_horizon_ms: 500,
            tenant_hold_max: None,
            pacing_margin_pct: 2.0,
            pause_recheck_ms: 5_000,
            unavailable_retry_ms: 1_000,
            unavailable_retry_max_ms: 5_000,
            quota_recheck_ms: 2_000,
            concurrency_retry_ms: 100,
            denial_block: 8,
            denial_cache_ms: 1_000,
            pod_max_rate: None,
            cancel_ttl_s: 400 * 24 * 3600,
            quotas_file: None,
            quota_seed_interval_ms: 30_000,
            shards: 4,
            delay_tiers_ms: vec![
                100, 250, 500, 1_000, 2_000, 5_000, 10_000, 20_000, 30_000, 60_000, 120_000,
                600_000, 3_600_000,
            ],
            delivery_limit: 5,
            sent_ttl_s: 7 * 24 * 3600,
            default_rate: "10/s".into(),
            default_burst: 1,
            max_body_bytes: 256 * 1024,
            max_json_depth: 32,
            tenant_label_limit: 50,
            tenant_label_allowlist: Vec::new(),
            redis_timeout_ms: 1_000,
            shutdown_grace_ms: 25_000,
            delivery_timeout_ms: 300_000,
            name: None,
        }
    }
}

/// Kubernetes injects `<SERVICE>_SERVICE_HOST`, `<SERVICE>_PORT`,
/// `<SERVICE>_PORT_9090_TCP…` for every Service in the namespace (unless
/// `enableServiceLinks: false`): a Service named `tollgate` would otherwise
/// look like unknown settings and stop the worker. No setting of ours is
/// named like these. `key` is without the prefix, in any case.
fn kubernetes_service_link(key: &str) -> bool {
    let key = key.to_ascii_lowercase();
    key == "port" || key.starts_with("port_") || key.starts_with("service_")
}

/// The settings that may come from a file (`TOLLGATE_<KEY>_FILE`), because
/// they hold credentials.
const SECRET_KEYS: [&str; 4] = ["amqp_url", "redis_url", "provider_url", "admin_token"];

/// `TOLLGATE_<SECRET KEY>_FILE` names a file holding a secret (see
/// [`Config::with_secret_files`]), not a setting of its own. Settings that
/// are paths themselves (`tls_ca_file`, `quotas_file`) are not such keys.
fn is_file_key(key: &str) -> bool {
    let key = key.to_ascii_lowercase();
    SECRET_KEYS
        .iter()
        .any(|s| key.strip_suffix("_file") == Some(s))
}

impl Config {
    /// Defaults, then the TOML file (if given), then `TOLLGATE_*` env vars.
    pub fn load(file: Option<&Path>) -> anyhow::Result<Self> {
        let mut figment = Figment::from(Serialized::defaults(Config::default()));
        if let Some(path) = file {
            if !path.exists() {
                bail!("config file {} does not exist", path.display());
            }
            figment = figment.merge(Toml::file(path));
        }
        let config: Config = figment
            .merge(
                Env::prefixed("TOLLGATE_")
                    .filter(|key| {
                        !kubernetes_service_link(key.as_str()) && !is_file_key(key.as_str())
                    })
                    // The CLI's own settings (clap reads them), and the
                    // scripts' (`TOLLGATE_SKIP_SERVICES=1 make demo`, the
                    // binary ops-check runs).
                    .ignore(&["config", "actor", "skip_services", "bin"])
                    .split("__"),
            )
            .extract()
            .context("reading configuration")?;
        let config = config.with_secret_files(|name| std::env::var(name).ok())?;
        config.validate()?;
        Ok(config)
    }

    /// `TOLLGATE_<KEY>_FILE=/path` sets a secret from a file's content (as
    /// Kubernetes mounts a Secret), for the settings that hold credentials.
    /// It wins over `TOLLGATE_<KEY>`; trailing whitespace is trimmed.
    pub fn with_secret_files(
        mut self,
        env: impl Fn(&str) -> Option<String>,
    ) -> anyhow::Result<Self> {
        let read = |key: &str| -> anyhow::Result<Option<String>> {
            let var = format!("TOLLGATE_{}_FILE", key.to_ascii_uppercase());
            let Some(path) = env(&var) else {
                return Ok(None);
            };
            let text =
                std::fs::read_to_string(&path).with_context(|| format!("{var}: reading {path}"))?;
            Ok(Some(text.trim_end().to_owned()))
        };
        let [amqp, redis, provider, admin] = SECRET_KEYS;
        if let Some(v) = read(amqp)? {
            self.amqp_url = SecretUrl::new(v);
        }
        if let Some(v) = read(redis)? {
            self.redis_url = SecretUrl::new(v);
        }
        if let Some(v) = read(provider)? {
            self.provider_url = Some(SecretUrl::new(v));
        }
        if let Some(v) = read(admin)? {
            crate::admin::AdminToken::new(Secret::new(v.clone()))
                .map_err(|e| anyhow::anyhow!("TOLLGATE_ADMIN_TOKEN_FILE: {e}"))?;
            self.admin_token = Some(Secret::new(v));
        }
        Ok(self)
    }

    pub fn validate(&self) -> anyhow::Result<()> {
        if self.prefix.is_empty()
            || !self
                .prefix
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        {
            bail!("prefix {:?} must be non-empty [A-Za-z0-9._-]", self.prefix);
        }
        if self.prefix.len() > MAX_PREFIX_LEN {
            bail!(
                "prefix is {} characters long, the limit is {MAX_PREFIX_LEN}: queue and exchange \
                 names add to it, and RabbitMQ refuses a name over 255 bytes",
                self.prefix.len()
            );
        }
        if self.prefix == "amq" || self.prefix.starts_with("amq.") {
            bail!(
                "prefix {:?}: RabbitMQ reserves exchange names starting with \"amq.\"",
                self.prefix
            );
        }
        for name in &self.tenant_label_allowlist {
            tollgate_core::TenantId::parse(name.as_str()).with_context(|| {
                format!("tenant_label_allowlist: {name:?} can never match a tenant")
            })?;
        }
        if self.max_json_depth < 2 {
            bail!(
                "max_json_depth must be at least 2: a job is an object holding a payload object, \
                 and every job would be dead-lettered as malformed"
            );
        }
        if self.max_body_bytes < MIN_BODY_BYTES {
            bail!(
                "max_body_bytes must be at least {MIN_BODY_BYTES}: a job's id, tenant, kind and \
                 key alone may take a few hundred bytes, and a smaller limit dead-letters them"
            );
        }
        if self.concurrency == 0 {
            bail!("concurrency must be at least 1");
        }
        if self.runtime_threads == 0 {
            bail!("runtime_threads must be at least 1");
        }
        if self.max_attempts == 0 {
            bail!("max_attempts must be at least 1");
        }
        if !(MIN_PACING_MARGIN_PCT..=50.0).contains(&self.pacing_margin_pct) {
            bail!(
                "pacing_margin_pct must be between {MIN_PACING_MARGIN_PCT} and 50: a granted call \
                 may begin up to half the margin of the quota's period after its slot (10 ms of a \
                 per-second quota at 2 %), and below {MIN_PACING_MARGIN_PCT} % a busy pod lets \
                 most permits go unused as late"
            );
        }
        self.check_durations()?;
        if self.prefetch == Some(0) {
            bail!("prefetch must be at least 1");
        }
        if self.http_max_connections == 0 || self.http_request_timeout_ms == 0 {
            bail!("http_max_connections and http_request_timeout_ms must be at least 1");
        }
        if self.shards == 0 {
            bail!("shards must be at least 1");
        }
        if self.permit_horizon_ms > self.hold_max_ms {
            bail!(
                "permit_horizon_ms ({}) must not exceed hold_max_ms ({}): a reserved job is held in-process",
                self.permit_horizon_ms,
                self.hold_max_ms
            );
        }
        self.amqp_nodes()?;
        let redis_url = self.redis_url.expose();
        RedisSettings::check_url(redis_url)
            .map_err(|e| anyhow::anyhow!("redis_url: {} {e}", redact_url(redis_url)))?;
        self.admin_token()?;
        self.policy()?;
        self.default_quota()?;
        self.routes()?;
        self.pod_max_rate()?;
        self.tls_ca_pem()?;
        self.baseline()?;
        Ok(())
    }

    /// Durations and counts that zero (or an absurd size) would turn into a
    /// loop, a lost guarantee or a Redis error: each named, with why.
    fn check_durations(&self) -> anyhow::Result<()> {
        let at_least_one: [(&str, u64, &str); 10] = [
            (
                "provider_timeout_ms",
                self.provider_timeout_ms,
                "every call would time out",
            ),
            (
                "min_retry_after_ms",
                self.min_retry_after_ms,
                "a 429 with `Retry-After: 0` (or a date in the past) would be retried at once, forever",
            ),
            (
                "delivery_timeout_ms",
                self.delivery_timeout_ms,
                "every delivery would be handed back as hung",
            ),
            (
                "pause_recheck_ms",
                self.pause_recheck_ms,
                "a paused tenant's jobs would ask again in a busy loop",
            ),
            (
                "concurrency_retry_ms",
                self.concurrency_retry_ms,
                "a job at its tenant's concurrency limit would ask again in a busy loop",
            ),
            (
                "unavailable_retry_ms",
                self.unavailable_retry_ms,
                "jobs would ask an unreachable Redis again in a busy loop",
            ),
            (
                "quota_seed_interval_ms",
                self.quota_seed_interval_ms,
                "the baseline would be checked in a busy loop",
            ),
            (
                "redis_timeout_ms",
                self.redis_timeout_ms,
                "every Redis call would time out",
            ),
            (
                "sent_ttl_s",
                self.sent_ttl_s,
                "no sent record would be kept, and a redelivered copy would be sent again",
            ),
            (
                "cancel_ttl_s",
                self.cancel_ttl_s,
                "no cancellation would be kept",
            ),
        ];
        for (key, value, why) in at_least_one {
            if value == 0 {
                bail!("{key} must be at least 1: at 0 {why}");
            }
        }
        for (key, value) in [
            ("sent_ttl_s", self.sent_ttl_s),
            ("cancel_ttl_s", self.cancel_ttl_s),
        ] {
            if value > MAX_TTL_S {
                bail!("{key} must be at most {MAX_TTL_S} (100 years), not {value}");
            }
        }
        if self.delivery_limit == 0 {
            bail!(
                "delivery_limit must be at least 1: at 0 every job would be dead-lettered as poison on its first delivery"
            );
        }
        if self.hold_max_ms >= self.delivery_timeout_ms {
            bail!(
                "hold_max_ms ({}) must be less than delivery_timeout_ms ({}): a job held that long \
                 would be handed back as hung",
                self.hold_max_ms,
                self.delivery_timeout_ms
            );
        }
        Ok(())
    }

    /// The admin API's token, if set; a set but empty or short one is an
    /// error, never an open API.
    pub fn admin_token(&self) -> anyhow::Result<Option<crate::admin::AdminToken>> {
        self.admin_token
            .clone()
            .map(crate::admin::AdminToken::new)
            .transpose()
            .map_err(|e| anyhow::anyhow!("admin_token (TOLLGATE_ADMIN_TOKEN): {e}"))
    }

    pub fn tiers(&self) -> anyhow::Result<DelayTiers> {
        DelayTiers::new(
            self.delay_tiers_ms
                .iter()
                .map(|&ms| Duration::from_millis(ms))
                .collect(),
            Duration::from_millis(self.hold_max_ms),
        )
        .context("delay_tiers_ms")
    }

    pub fn policy(&self) -> anyhow::Result<Policy> {
        Ok(Policy {
            hold_max: Duration::from_millis(self.hold_max_ms),
            max_attempts: self.max_attempts,
            max_redeliveries: self.delivery_limit,
            backoff: Backoff {
                base: Duration::from_millis(self.backoff_base_ms),
                max: Duration::from_millis(self.backoff_max_ms),
            },
            tiers: self.tiers()?,
            unavailable_retry: Duration::from_millis(self.unavailable_retry_ms),
            unavailable_retry_max: Duration::from_millis(self.unavailable_retry_max_ms),
            quota_recheck: Duration::from_millis(self.quota_recheck_ms),
            default_retry_after: Duration::from_secs(1),
            min_retry_after: Duration::from_millis(self.min_retry_after_ms),
        })
    }

    pub fn server_limits(&self) -> crate::http::ServerLimits {
        crate::http::ServerLimits {
            max_connections: self.http_max_connections,
            request_timeout: Duration::from_millis(self.http_request_timeout_ms),
        }
    }

    /// Fresh deliveries a pod holds at once: `prefetch`, else the larger of
    /// `concurrency` and 64.
    pub fn prefetch(&self) -> u16 {
        self.prefetch.unwrap_or(self.concurrency.max(64))
    }

    /// Deliveries of one tenant a pod holds in-process: `tenant_hold_max`,
    /// else half of one work queue's share of the prefetch, so one tenant's
    /// waits always leave room on its queue for the others.
    pub fn tenant_hold_max(&self) -> usize {
        self.tenant_hold_max.unwrap_or_else(|| {
            let share = usize::from(self.prefetch()).div_ceil(usize::from(self.shards.max(1)));
            share / 2
        })
    }

    pub fn limits(&self) -> Limits {
        Limits {
            max_body_bytes: self.max_body_bytes,
            max_depth: self.max_json_depth,
        }
    }

    pub fn default_quota(&self) -> anyhow::Result<Quota> {
        let rate: Rate = self.default_rate.parse().context("default_rate")?;
        Quota::new(rate, self.default_burst).context("default_burst")
    }

    pub fn topology(&self) -> anyhow::Result<Topology> {
        Ok(Topology::new(
            &self.prefix,
            self.shards,
            &self.tiers()?,
            self.delivery_limit,
        ))
    }

    pub fn permit_settings(&self) -> anyhow::Result<PermitSettings> {
        Ok(PermitSettings {
            default_quota: self.default_quota()?,
            horizon: Duration::from_millis(self.permit_horizon_ms),
            lease_ttl: Duration::from_millis(self.provider_timeout_ms) + Duration::from_secs(5),
            sent_ttl: Duration::from_secs(self.sent_ttl_s),
            pacing_margin: self.pacing_margin_pct / 100.0,
            pause_recheck: Duration::from_millis(self.pause_recheck_ms),
            concurrency_retry: Duration::from_millis(self.concurrency_retry_ms),
            denial_block: self.denial_block.max(1),
            denial_cache_ttl: Duration::from_millis(self.denial_cache_ms),
            account_wide: self
                .routes()?
                .into_iter()
                .filter(|r| r.throttle_scope == ThrottleScope::Route)
                .map(|r| tollgate_core::Kind::parse(&r.kind))
                .collect::<Result<_, _>>()?,
        })
    }

    /// The quota baseline, if `quotas_file` is set.
    pub fn baseline(&self) -> anyhow::Result<Option<Baseline>> {
        self.quotas_file.as_deref().map(Baseline::load).transpose()
    }

    /// Routes the quota baseline sets a quota for that no provider route of
    /// this configuration has (`[routes.emial]`): most likely a typo, and
    /// seeded all the same.
    pub fn baseline_routes_unknown(&self) -> anyhow::Result<Vec<String>> {
        let Some(baseline) = self.baseline()? else {
            return Ok(Vec::new());
        };
        let routes = self.routes()?;
        Ok(baseline
            .routes
            .keys()
            .filter(|name| !routes.iter().any(|r| &r.kind == *name))
            .cloned()
            .collect())
    }

    /// How long a stop may take, when a provider call begun just before it
    /// outlasts `shutdown_grace_ms` (the worker waits for it rather than
    /// abandon a send); `None` when the grace period covers it.
    pub fn stop_overrun(&self) -> Option<Duration> {
        let call =
            tollgate_runtime::worker::longest_call(Duration::from_millis(self.provider_timeout_ms));
        (call > Duration::from_millis(self.shutdown_grace_ms)).then_some(call)
    }

    /// Everything a worker is built from, checked.
    pub fn worker_settings(&self) -> anyhow::Result<WorkerSettings> {
        Ok(WorkerSettings {
            amqp_nodes: Arc::new(self.amqp_nodes()?),
            tls_ca_pem: self.tls_ca_pem()?,
            topology: self.topology()?,
            name: self.name(),
            redis: self.redis_settings(),
            redis_url_shown: self.redis_url.redacted(),
            prefix: self.prefix.clone(),
            permits: self.permit_settings()?,
            routes: self.routes()?,
            provider_timeout: Duration::from_millis(self.provider_timeout_ms),
            policy: self.policy()?,
            limits: self.limits(),
            concurrency: self.concurrency,
            prefetch: self.prefetch(),
            shutdown_grace: Duration::from_millis(self.shutdown_grace_ms),
            delivery_timeout: Duration::from_millis(self.delivery_timeout_ms),
            tenant_hold_max: self.tenant_hold_max(),
            pod_max_rate: self.pod_max_rate()?,
            baseline: match (&self.quotas_file, self.baseline()?) {
                (Some(path), Some(baseline)) => Some(BaselineSettings {
                    path: path.clone(),
                    baseline,
                    every: Duration::from_millis(self.quota_seed_interval_ms),
                }),
                _ => None,
            },
        })
    }

    /// `amqp_url` as the broker's nodes: one URL, or the nodes of a cluster
    /// separated by commas. Each process starts at a node picked at random,
    /// so a fleet spreads over the cluster.
    pub fn amqp_nodes(&self) -> anyhow::Result<Nodes> {
        let nodes = Nodes::parse(&self.amqp_url).map_err(|e| anyhow::anyhow!("amqp_url: {e}"))?;
        let first = rand::random_range(0..nodes.len());
        Ok(nodes.starting_at(first))
    }

    /// The contents of `tls_ca_file`, if set: PEM holding at least one
    /// certificate (a TLS library skips what is not one, so an empty or
    /// wrong file would otherwise surface only as a failed handshake).
    pub fn tls_ca_pem(&self) -> anyhow::Result<Option<String>> {
        self.tls_ca_file
            .as_deref()
            .map(|path| {
                let pem = std::fs::read_to_string(path)
                    .with_context(|| format!("tls_ca_file: reading {path}"))?;
                if !pem.contains("-----BEGIN CERTIFICATE-----") {
                    bail!("tls_ca_file: {path} holds no PEM certificate");
                }
                Ok(pem)
            })
            .transpose()
    }

    pub fn redis_settings(&self) -> RedisSettings {
        RedisSettings {
            url: self.redis_url.expose().to_owned(),
            // validate() read it already; a file that vanished since is
            // reported when the connection fails verification.
            ca_pem: self.tls_ca_pem().ok().flatten().map(String::into_bytes),
            response_timeout: Duration::from_millis(self.redis_timeout_ms),
            connect_timeout: Duration::from_millis(self.redis_timeout_ms.max(1_000)),
        }
    }

    /// Provider routes: `provider_url` as kind `default`, plus `routes`.
    pub fn routes(&self) -> anyhow::Result<Vec<Route>> {
        let mut all: BTreeMap<&str, RouteConfig> = self
            .routes
            .iter()
            .map(|(k, v)| (k.as_str(), v.clone()))
            .collect();
        match &self.provider_url {
            Some(_) if self.routes.contains_key("default") => bail!(
                "provider_url and [routes.default] both set the default route: keep one (the \
                 table's throttle_scope and eligibility_url would be dropped)"
            ),
            None if self.eligibility_url.is_some() => bail!(
                "eligibility_url belongs to provider_url's route, which is not set: set \
                 provider_url, or the route's eligibility_url in [routes.<kind>]"
            ),
            None if self.throttle_scope != ThrottleScope::Tenant => bail!(
                "throttle_scope belongs to provider_url's route, which is not set: set \
                 provider_url, or the route's throttle_scope in [routes.<kind>]"
            ),
            _ => {}
        }
        if let Some(url) = &self.provider_url {
            let route = RouteConfig {
                url: url.clone(),
                eligibility_url: self.eligibility_url.clone(),
                throttle_scope: self.throttle_scope,
            };
            all.insert("default", route);
        }
        let parse = |kind: &str, url: &SecretUrl| {
            Url::parse(url.expose())
                .with_context(|| format!("route {kind:?}: {} is not a URL", url.redacted()))
        };
        all.into_iter()
            .map(|(kind, route)| {
                tollgate_core::Kind::parse(kind).with_context(|| format!("route kind {kind:?}"))?;
                let url = parse(kind, &route.url)?;
                let eligibility = route
                    .eligibility_url
                    .as_ref()
                    .map(|u| parse(kind, u))
                    .transpose()?;
                Route::new(kind, url, eligibility, route.throttle_scope).map_err(Into::into)
            })
            .collect()
    }

    /// The optional per-pod ceiling on provider calls.
    pub fn pod_max_rate(&self) -> anyhow::Result<Option<Rate>> {
        self.pod_max_rate
            .as_deref()
            .map(|r| r.parse::<Rate>().context("pod_max_rate"))
            .transpose()
    }

    pub fn name(&self) -> String {
        self.name.clone().unwrap_or_else(|| {
            std::env::var("HOSTNAME")
                .ok()
                .filter(|h| !h.is_empty())
                .unwrap_or_else(|| format!("tollgate-{}", std::process::id()))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[allow(clippy::result_large_err)] // figment's Jail API returns figment::Error
    fn env_overrides_file_overrides_defaults() {
        figment::Jail::expect_with(|jail| {
            jail.create_file(
                "tollgate.toml",
                r#"
                prefix = "from-file"
                concurrency = 8
                [routes.sms]
                url = "http://sms.internal/send"
                "#,
            )?;
            jail.set_env("TOLLGATE_CONCURRENCY", "16");
            // What Kubernetes injects for a Service named `tollgate`.
            jail.set_env("TOLLGATE_SERVICE_HOST", "10.0.0.7");
            jail.set_env("TOLLGATE_PORT", "tcp://10.0.0.7:9090");
            jail.set_env("TOLLGATE_PORT_9090_TCP_PROTO", "tcp");
            // The scripts' own, as the README gives them.
            jail.set_env("TOLLGATE_SKIP_SERVICES", "1");
            jail.set_env("TOLLGATE_BIN", "target/release/tollgate");
            jail.set_env(
                "TOLLGATE_PROVIDER_URL",
                "http://user:pw@provider.internal/send",
            );
            jail.set_env(
                "TOLLGATE_ROUTES__SMS__ELIGIBILITY_URL",
                "http://crm.internal/still-true",
            );
            let config = Config::load(Some(Path::new("tollgate.toml"))).expect("loads");
            assert_eq!(config.prefix, "from-file");
            assert_eq!(config.concurrency, 16);
            let routes = config.routes().unwrap();
            let kinds: Vec<_> = routes.iter().map(|r| r.kind.as_str()).collect();
            assert_eq!(kinds, ["default", "sms"]);
            assert_eq!(
                routes[1].eligibility_url.as_ref().map(|u| u.as_str()),
                Some("http://crm.internal/still-true")
            );
            Ok(())
        });
    }

    #[test]
    #[allow(clippy::result_large_err)] // figment's Jail API returns figment::Error
    fn the_label_allowlist_is_a_list_or_names_with_commas_and_each_a_tenant() {
        figment::Jail::expect_with(|jail| {
            jail.set_env("TOLLGATE_TENANT_LABEL_ALLOWLIST", "acme, globex");
            let config = Config::load(None).expect("loads");
            assert_eq!(config.tenant_label_allowlist, ["acme", "globex"]);
            jail.set_env("TOLLGATE_TENANT_LABEL_ALLOWLIST", "[acme, initech]");
            let config = Config::load(None).expect("loads");
            assert_eq!(config.tenant_label_allowlist, ["acme", "initech"]);
            jail.set_env("TOLLGATE_TENANT_LABEL_ALLOWLIST", "42");
            let config = Config::load(None).expect("loads");
            assert_eq!(config.tenant_label_allowlist, ["42"]);
            jail.set_env("TOLLGATE_TENANT_LABEL_ALLOWLIST", "acme,bad tenant");
            let error = format!("{:#}", Config::load(None).unwrap_err());
            assert!(
                error.starts_with("tenant_label_allowlist: \"bad tenant\" can never match"),
                "{error}"
            );
            Ok(())
        });
    }

    #[test]
    #[allow(clippy::result_large_err)] // figment's Jail API returns figment::Error
    fn a_baseline_route_no_provider_route_has_is_named() {
        figment::Jail::expect_with(|jail| {
            jail.create_file(
                "quotas.toml",
                "[routes.email]\nrate = \"100/s\"\n\n[routes.emial]\nrate = \"5/s\"\n",
            )?;
            jail.set_env("TOLLGATE_QUOTAS_FILE", "quotas.toml");
            jail.set_env("TOLLGATE_ROUTES__EMAIL__URL", "http://provider/email");
            let config = Config::load(None).expect("loads");
            assert_eq!(config.baseline_routes_unknown().unwrap(), ["emial"]);
            Ok(())
        });
    }

    #[test]
    #[allow(clippy::result_large_err)] // figment's Jail API returns figment::Error
    fn secrets_can_come_from_mounted_files() {
        figment::Jail::expect_with(|jail| {
            jail.create_file("amqp-url", "amqp://app:from-file@rabbit:5672/%2f\n")?;
            jail.create_file("admin-token", "t0ken-of-32-bytes-from-a-secret\n")?;
            jail.set_env("TOLLGATE_AMQP_URL", "amqp://app:from-env@rabbit:5672/%2f");
            jail.set_env("TOLLGATE_AMQP_URL_FILE", "amqp-url");
            jail.set_env("TOLLGATE_ADMIN_TOKEN_FILE", "admin-token");
            // Settings that are paths are plain settings, not secret files.
            jail.create_file(
                "ca.pem",
                "-----BEGIN CERTIFICATE-----\nnot parsed here\n-----END CERTIFICATE-----\n",
            )?;
            // The CLI's own settings are left to clap.
            jail.set_env("TOLLGATE_ACTOR", "alice");
            jail.set_env("TOLLGATE_TLS_CA_FILE", "ca.pem");
            let config = Config::load(None).expect("loads");
            assert_eq!(config.tls_ca_file.as_deref(), Some("ca.pem"));
            assert_eq!(
                config.amqp_url.expose(),
                "amqp://app:from-file@rabbit:5672/%2f"
            );
            assert_eq!(
                config.admin_token.as_ref().map(Secret::expose),
                Some("t0ken-of-32-bytes-from-a-secret")
            );
            jail.set_env("TOLLGATE_REDIS_URL_FILE", "missing");
            let err = Config::load(None).unwrap_err();
            assert!(format!("{err:#}").contains("TOLLGATE_REDIS_URL_FILE: reading missing"));
            Ok(())
        });
    }

    #[test]
    #[allow(clippy::result_large_err)] // figment's Jail API returns figment::Error
    fn a_route_says_whom_its_429s_pause() {
        figment::Jail::expect_with(|jail| {
            jail.create_file(
                "tollgate.toml",
                r#"
                provider_url = "http://provider.internal/send"
                [routes.email]
                url = "http://email.internal/send"
                throttle_scope = "route"
                "#,
            )?;
            let config = Config::load(Some(Path::new("tollgate.toml"))).expect("loads");
            let scopes: Vec<_> = config
                .routes()
                .unwrap()
                .iter()
                .map(|r| (r.kind.clone(), r.throttle_scope))
                .collect();
            assert_eq!(
                scopes,
                [
                    ("default".to_owned(), ThrottleScope::Tenant),
                    ("email".to_owned(), ThrottleScope::Route)
                ]
            );
            jail.set_env("TOLLGATE_THROTTLE_SCOPE", "everyone");
            let err = format!("{:#}", Config::load(None).unwrap_err());
            assert!(
                err.contains("throttle_scope") || err.contains("everyone"),
                "{err}"
            );
            Ok(())
        });
    }

    #[test]
    fn debug_output_never_shows_passwords() {
        let config = Config {
            amqp_url: SecretUrl::new("amqp://guest:canary-amqp@rabbit:5672/%2f"),
            redis_url: SecretUrl::new("redis://:canary-redis@redis:6379"),
            admin_token: Some(Secret::new("canary-token")),
            ..Config::default()
        };
        let shown = format!("{config:?}");
        for canary in ["canary-amqp", "canary-redis", "canary-token"] {
            assert!(!shown.contains(canary), "{canary} leaked: {shown}");
        }
        assert!(shown.contains("REDACTED"));
    }

    #[test]
    fn the_prefetch_and_the_hold_cap_follow_concurrency_and_shards() {
        let one_call = Config {
            concurrency: 1,
            ..Config::default()
        };
        assert_eq!(
            one_call.prefetch(),
            64,
            "one call at a time keeps a useful prefetch"
        );
        assert_eq!(one_call.tenant_hold_max(), 8, "64 / 4 shards / 2");
        let wide = Config {
            concurrency: 256,
            shards: 8,
            ..Config::default()
        };
        assert_eq!((wide.prefetch(), wide.tenant_hold_max()), (256, 16));
        let tiny = Config {
            prefetch: Some(4),
            ..Config::default()
        };
        assert_eq!(
            tiny.tenant_hold_max(),
            0,
            "one delivery per work queue: a tenant holds only imminent waits"
        );
        let set = Config {
            tenant_hold_max: Some(3),
            ..Config::default()
        };
        assert_eq!(set.tenant_hold_max(), 3);
    }

    #[test]
    fn rejects_inconsistent_settings() {
        let bad = Config {
            permit_horizon_ms: 2_000,
            ..Config::default()
        };
        assert!(
            bad.validate()
                .unwrap_err()
                .to_string()
                .contains("permit_horizon_ms")
        );
        let bad = Config {
            default_rate: "lots".into(),
            ..Config::default()
        };
        assert!(format!("{:#}", bad.validate().unwrap_err()).contains("default_rate"));
        let bad = Config {
            delay_tiers_ms: vec![5_000],
            ..Config::default()
        };
        assert!(format!("{:#}", bad.validate().unwrap_err()).contains("hold limit"));
    }

    /// Each of these was accepted once and then broke a promise at run
    /// time (a busy loop, a send twice, every job dead-lettered).
    #[test]
    fn a_grace_period_a_call_outlasts_is_named() {
        let defaults = Config::default();
        assert_eq!(defaults.stop_overrun(), None, "10 s calls in a 25 s grace");
        let slow = Config {
            provider_timeout_ms: 40_000,
            ..Config::default()
        };
        assert_eq!(slow.stop_overrun(), Some(Duration::from_secs(45)));
    }

    #[test]
    fn a_setting_that_would_break_a_promise_is_refused_by_name() {
        let refused = |change: fn(&mut Config), key: &str| {
            let mut bad = Config::default();
            change(&mut bad);
            let error = format!("{:#}", bad.validate().unwrap_err());
            assert!(error.starts_with(key), "{key}: {error}");
        };
        refused(|c| c.runtime_threads = 0, "runtime_threads");
        refused(|c| c.pacing_margin_pct = 0.0, "pacing_margin_pct");
        refused(|c| c.pacing_margin_pct = 0.5, "pacing_margin_pct");
        refused(|c| c.sent_ttl_s = 0, "sent_ttl_s");
        refused(|c| c.sent_ttl_s = u64::MAX / 1000, "sent_ttl_s");
        refused(|c| c.cancel_ttl_s = 0, "cancel_ttl_s");
        refused(|c| c.pause_recheck_ms = 0, "pause_recheck_ms");
        refused(|c| c.concurrency_retry_ms = 0, "concurrency_retry_ms");
        refused(|c| c.unavailable_retry_ms = 0, "unavailable_retry_ms");
        refused(|c| c.provider_timeout_ms = 0, "provider_timeout_ms");
        refused(|c| c.min_retry_after_ms = 0, "min_retry_after_ms");
        refused(|c| c.delivery_timeout_ms = 0, "delivery_timeout_ms");
        refused(|c| c.delivery_limit = 0, "delivery_limit");
        refused(|c| c.redis_timeout_ms = 0, "redis_timeout_ms");
        refused(|c| c.quota_seed_interval_ms = 0, "quota_seed_interval_ms");
        refused(|c| c.hold_max_ms = c.delivery_timeout_ms, "hold_max_ms");
        refused(|c| c.prefix = "p".repeat(MAX_PREFIX_LEN + 1), "prefix");
        refused(|c| c.prefix = "amq".into(), "prefix");
        refused(|c| c.prefix = "amq.tollgate".into(), "prefix");
        refused(|c| c.max_json_depth = 1, "max_json_depth");
        refused(|c| c.max_body_bytes = 0, "max_body_bytes");
        refused(
            |c| {
                c.provider_url = Some(SecretUrl::new("http://provider/send"));
                c.routes.insert(
                    "default".into(),
                    RouteConfig {
                        url: SecretUrl::new("http://provider/other"),
                        eligibility_url: None,
                        throttle_scope: ThrottleScope::Route,
                    },
                );
            },
            "provider_url and [routes.default]",
        );
        refused(
            |c| c.eligibility_url = Some(SecretUrl::new("http://provider/ok")),
            "eligibility_url",
        );
        refused(
            |c| c.throttle_scope = ThrottleScope::Route,
            "throttle_scope",
        );
        refused(
            |c| c.tls_ca_file = Some("/dev/null".into()),
            "tls_ca_file: /dev/null holds no PEM certificate",
        );
        let edge = Config {
            pacing_margin_pct: 1.0,
            sent_ttl_s: 1,
            delivery_limit: 1,
            prefix: "p".repeat(MAX_PREFIX_LEN),
            max_json_depth: 2,
            max_body_bytes: MIN_BODY_BYTES,
            ..Config::default()
        };
        edge.validate().unwrap();
    }

    #[test]
    fn a_redis_url_that_names_no_redis_is_refused_without_its_password() {
        let refused = |url: &str| {
            let bad = Config {
                redis_url: SecretUrl::new(url),
                ..Config::default()
            };
            let error = format!("{:#}", bad.validate().unwrap_err());
            assert!(error.starts_with("redis_url: "), "{error}");
            assert!(!error.contains("s3cret"), "{error}");
            error
        };
        let scheme = refused("http://:s3cret@a:6379");
        assert!(scheme.contains("is not a Redis URL"), "{scheme}");
        let node = refused("redis://:s3cret@a:6379,http://:s3cret@b:6379");
        assert!(node.contains("is not a Redis URL (node 2 of 2)"), "{node}");
        let socket = refused("redis://:s3cret@a:6379,redis+unix:///tmp/r.sock");
        assert!(socket.contains("unix socket"), "{socket}");
        let mixed = refused("redis://:s3cret@a:6379,redis://:other-s3cret@b:6379");
        assert!(mixed.contains("nodes disagree"), "{mixed}");
        for fine in [
            "redis://127.0.0.1:6379/2",
            "rediss://u:p@h:6380",
            "redis+unix:///tmp/r.sock",
            "redis://:p@a:7000,redis://:p@b:7001",
        ] {
            let good = Config {
                redis_url: SecretUrl::new(fine),
                ..Config::default()
            };
            good.validate().unwrap();
        }
    }
}
