//! The command line: `tollgate <verb>`. Each verb's `--help` ends with an
//! example; the implementations are small functions over the adapters.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, bail};
use clap::{Args, Parser, Subcommand};
use futures::StreamExt;
use futures::stream::FuturesUnordered;
use serde_json::value::RawValue;
use tollgate_amqp::{Broker, ShardQueue, headers};
use tollgate_core::{
    Adaptive, Clock, DeadReason, IdempotencyKey, Job, JobId, Kind, Priority, Quota, TenantId,
    UnixMillis,
};
use tollgate_quota::{Actor, Cancel, Change, QuotaStore, Redis, Settings, Target};

use crate::config::Config;
use tollgate_runtime::system_clock::SystemClock;

#[derive(Debug, Parser)]
#[command(
    name = "tollgate",
    version,
    about = "A multi-tenant, quota-aware worker pool on RabbitMQ and Redis",
    after_help = "Configuration: --config FILE (TOML) and TOLLGATE_* environment variables.\n\
                  Example: TOLLGATE_PROVIDER_URL=http://provider.internal/send tollgate worker"
)]
pub struct Cli {
    /// TOML config file; every key can be overridden by TOLLGATE_<KEY>.
    #[arg(long, global = true, env = "TOLLGATE_CONFIG")]
    pub config: Option<PathBuf>,

    /// Who is acting, for the audit trail of quota, tenant and cancel
    /// changes and dead-letter replays and purges (default:
    /// $USER@hostname).
    #[arg(long, global = true, env = "TOLLGATE_ACTOR")]
    pub actor: Option<String>,

    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run a worker: consume jobs, take permits, call the provider.
    #[command(
        after_help = "Example: TOLLGATE_PROVIDER_URL=http://127.0.0.1:8080/send tollgate worker"
    )]
    Worker,
    /// Publish jobs to the jobs exchange (routing key = tenant).
    #[command(
        after_help = "Example: tollgate publish --tenant acme --count 100 --due-in 30s --payload '{\"to\":\"x\"}'"
    )]
    Publish(PublishArgs),
    /// Read and change quotas, live for the whole fleet; every change is audited.
    #[command(subcommand)]
    Quota(QuotaCommand),
    /// Pause or resume a tenant.
    #[command(subcommand)]
    Tenant(TenantCommand),
    /// Cancel a queued job: it is skipped at its turn, consuming no quota.
    #[command(
        after_help = "Examples:\n  tollgate cancel --tenant acme --job-id job-123\n  \
        tollgate cancel --tenant acme --idempotency-key renewal-acme-2026-12"
    )]
    Cancel(CancelArgs),
    /// Declare the RabbitMQ topology.
    #[command(subcommand)]
    Topology(TopologyCommand),
    /// Inspect the dead-letter queue.
    #[command(subcommand)]
    Dlq(DlqCommand),
}

#[derive(Debug, Args)]
pub struct PublishArgs {
    #[arg(long)]
    pub tenant: String,
    /// Selects the provider route.
    #[arg(long, default_value = "default")]
    pub kind: String,
    /// Due this long from now (e.g. 30s, 5m, 2h).
    #[arg(long, value_parser = humantime::parse_duration, conflicts_with = "due_at")]
    pub due_in: Option<Duration>,
    /// Due at this RFC 3339 instant.
    #[arg(long)]
    pub due_at: Option<String>,
    /// Dead-letter as `expired` if not sent within this long from now.
    #[arg(long, value_parser = humantime::parse_duration)]
    pub expires_in: Option<Duration>,
    #[arg(long, default_value_t = 1)]
    pub count: u32,
    /// JSON forwarded to the provider; `@FILE` reads it from a file, `@-`
    /// from stdin (a payload longer than a command line allows).
    #[arg(long, default_value = "{}", value_parser = read_payload)]
    pub payload: String,
    /// Job id (only with --count 1); default: a random id.
    #[arg(long)]
    pub id: Option<String>,
    /// Idempotency key for every published job; default: the job id.
    #[arg(long)]
    pub idempotency_key: Option<String>,
    /// high, normal or low: the order within the tenant's quota.
    #[arg(long, default_value = "normal", value_parser = parse_priority)]
    pub priority: Priority,
    /// While RabbitMQ is unreachable, keep retrying this long before failing.
    #[arg(long, default_value = "60s", value_parser = humantime::parse_duration)]
    pub retry_for: Duration,
}

/// `--payload` as given, or read from `@FILE` / `@-` (stdin). JSON never
/// begins with `@`, so the two cannot be confused.
fn read_payload(value: &str) -> Result<String, String> {
    use std::io::Read;
    let Some(path) = value.strip_prefix('@') else {
        return Ok(value.to_owned());
    };
    let mut payload = String::new();
    let read = if path == "-" {
        std::io::stdin().read_to_string(&mut payload)
    } else {
        std::fs::File::open(path).and_then(|mut f| f.read_to_string(&mut payload))
    };
    read.map_err(|e| format!("reading the payload from {value}: {e}"))?;
    Ok(payload)
}

/// Whose quota: a tenant, or with `--route` a provider route's shared bucket.
#[derive(Debug, Args)]
pub struct TargetArgs {
    /// The tenant (omit with --route).
    pub tenant: Option<String>,
    /// A provider route (job kind): its bucket is shared by every tenant.
    #[arg(long, conflicts_with = "tenant")]
    pub route: Option<String>,
}

#[derive(Debug, Subcommand)]
pub enum QuotaCommand {
    /// Set a quota; applies to the next decision of every pod.
    #[command(
        after_help = "Examples:\n  tollgate quota set acme --rate 20/s --burst 1 --concurrency 4\n  \
        tollgate quota set acme --rate 5/s --shadow      # computed and counted, not enforced\n  \
        tollgate quota set --route email --rate 100/s    # one provider account shared by all tenants\n  \
        tollgate quota set acme --weight 3               # 3 parts of a shared route's capacity to others' 1\n  \
        tollgate quota set acme --rate 20/s --adaptive --min 1/s   # 20/s is the ceiling; the rate is learned from 429s\n\n\
        With --rate, set replaces the tenant's enforced settings: a concurrency\n\
        or weight not given is cleared. --weight alone changes only the weight."
    )]
    Set {
        #[command(flatten)]
        target: TargetArgs,
        /// N/s, N/m or N/h (may be left out to change only --weight).
        #[arg(long)]
        rate: Option<String>,
        #[arg(long, default_value_t = 1)]
        burst: u32,
        /// Most provider calls of this tenant in flight across the fleet (at
        /// least 1; left out, no limit).
        #[arg(long, value_parser = parse_concurrency)]
        concurrency: Option<u32>,
        /// The tenant's weight on the routes it shares (1 to 1000, default 1):
        /// a route's capacity divides among the tenants with work by weight.
        #[arg(long, value_parser = parse_weight)]
        weight: Option<u32>,
        /// Set the tenant's shadow quota instead: decisions are computed,
        /// logged and counted (tollgate_shadow_decisions_total), never enforced.
        #[arg(long)]
        shadow: bool,
        /// Learn the provider's real limit from its 429s: --rate is the
        /// ceiling, the effective rate moves between --min and it.
        #[arg(long)]
        adaptive: bool,
        /// With --adaptive: the lowest effective rate (default 5 % of --rate).
        #[arg(long, requires = "adaptive")]
        min: Option<String>,
        /// With --adaptive: the factor a 429 cuts the rate by (default 0.7).
        #[arg(long, requires = "adaptive")]
        decrease: Option<f64>,
        /// With --adaptive: the first step of a probe up, as a fraction of the
        /// rate; it doubles while probes hold (default 0.05).
        #[arg(long, requires = "adaptive")]
        increase: Option<f64>,
        /// With --adaptive: seconds a rate that a failed probe fell back to is
        /// kept before probing above it again (default 8).
        #[arg(long, requires = "adaptive")]
        probe: Option<f64>,
    },
    /// Show a quota (or the default it falls back to).
    #[command(
        after_help = "Examples:\n  tollgate quota get acme\n  tollgate quota get --route email"
    )]
    Get {
        #[command(flatten)]
        target: TargetArgs,
    },
    /// List every tenant and route with stored settings, and the default.
    #[command(after_help = "Example: tollgate quota list")]
    List,
    /// Remove a quota: the default applies again (with --shadow: only the shadow quota).
    #[command(after_help = "Example: tollgate quota delete acme")]
    Delete {
        #[command(flatten)]
        target: TargetArgs,
        #[arg(long)]
        shadow: bool,
    },
    /// Show, or with --rate set, the quota of tenants with none.
    #[command(
        after_help = "Examples:\n  tollgate quota default\n  tollgate quota default --rate 5/s --burst 1"
    )]
    Default {
        #[arg(long)]
        rate: Option<String>,
        #[arg(long, default_value_t = 1)]
        burst: u32,
    },
    /// Write the baseline's quotas into Redis where they are missing (with
    /// --overwrite: all of them, undoing live changes).
    #[command(
        after_help = "Examples:\n  TOLLGATE_QUOTAS_FILE=quotas.toml tollgate quota seed\n  tollgate quota seed --file quotas.toml --overwrite"
    )]
    Seed {
        /// The baseline (default: TOLLGATE_QUOTAS_FILE).
        #[arg(long)]
        file: Option<String>,
        #[arg(long)]
        overwrite: bool,
    },
    /// Print the live quotas in the baseline's TOML format.
    #[command(after_help = "Example: tollgate quota export > quotas.toml")]
    Export,
    /// Every change, newest first: who, when, from where, old → new.
    #[command(
        after_help = "Examples:\n  tollgate quota history\n  tollgate quota history acme --limit 10"
    )]
    History {
        #[command(flatten)]
        target: TargetArgs,
        #[arg(long, default_value_t = 50)]
        limit: usize,
    },
}

#[derive(Debug, Subcommand)]
pub enum TenantCommand {
    /// Stop sending a tenant's jobs: they are parked, not failed, and use no quota.
    #[command(after_help = "Example: tollgate tenant pause acme")]
    Pause { tenant: String },
    /// Send a paused tenant's jobs again.
    #[command(after_help = "Example: tollgate tenant resume acme")]
    Resume { tenant: String },
}

#[derive(Debug, Args)]
#[command(group(clap::ArgGroup::new("what").required(true).args(["job_id", "idempotency_key"])))]
pub struct CancelArgs {
    /// The job's tenant (cancellations live with the tenant's keys).
    #[arg(long)]
    pub tenant: String,
    #[arg(long)]
    pub job_id: Option<String>,
    /// Cancels every queued job carrying this key.
    #[arg(long)]
    pub idempotency_key: Option<String>,
}

#[derive(Debug, Subcommand)]
pub enum TopologyCommand {
    /// Declare exchanges and queues (idempotent); work queues a larger
    /// `shards` left behind are unbound and drained by the workers.
    #[command(
        after_help = "Examples:\n  TOLLGATE_PREFIX=tollgate tollgate topology declare\n  \
        TOLLGATE_SHARDS=2 tollgate topology declare --drain-from 8   # shards was 8 and Redis lost its record"
    )]
    Declare {
        /// How many work queues there were before, when Redis no longer
        /// records it (it does from the first declaration on).
        #[arg(long)]
        drain_from: Option<u16>,
    },
}

#[derive(Debug, Subcommand)]
pub enum DlqCommand {
    /// Counts by reason and tenant, then the newest dead letters.
    #[command(after_help = "Example: tollgate dlq list --limit 20")]
    List {
        /// Newest dead letters to show.
        #[arg(long, default_value_t = 20)]
        limit: usize,
        /// Most messages read for the counts.
        #[arg(long, default_value_t = 10_000)]
        scan: usize,
        /// Also print each payload (hidden by default: it may hold personal data).
        #[arg(long)]
        show_payload: bool,
    },
    /// Send dead letters back to be processed again: attempts start over,
    /// the idempotency key is kept (a job already sent is not sent again).
    #[command(
        after_help = "Examples:\n  tollgate dlq replay --reason exhausted --tenant acme\n  tollgate dlq replay --limit 100"
    )]
    Replay {
        /// Only dead letters with this reason (malformed, expired, rejected, exhausted, poison).
        #[arg(long)]
        reason: Option<String>,
        #[arg(long)]
        tenant: Option<String>,
        /// Most dead letters to replay.
        #[arg(long, default_value_t = usize::MAX, hide_default_value = true)]
        limit: usize,
    },
    /// Delete every dead letter (asks for confirmation unless --yes).
    #[command(after_help = "Example: tollgate dlq purge --yes")]
    Purge {
        #[arg(long)]
        yes: bool,
    },
}

/// What a command needs to talk to RabbitMQ.
pub async fn connect_broker(config: &Config, role: &str) -> anyhow::Result<Broker> {
    let name = format!("{}-{role}", config.name());
    Ok(Broker::connect(
        &config.amqp_nodes()?,
        config.tls_ca_pem()?.as_deref(),
        &name,
        config.topology()?,
    )
    .await?)
}

pub fn quota_store(config: &Config) -> anyhow::Result<QuotaStore> {
    let redis = Arc::new(Redis::new(&config.redis_settings())?);
    let keys = redis.keys(&config.prefix);
    Ok(QuotaStore::new(redis, keys))
}

impl PublishArgs {
    /// `count` jobs for `tenant` with the command line's defaults.
    pub fn new(tenant: &str, count: u32) -> Self {
        Self {
            tenant: tenant.into(),
            kind: "default".into(),
            due_in: None,
            due_at: None,
            expires_in: None,
            count,
            payload: "{}".into(),
            id: None,
            idempotency_key: None,
            priority: Priority::Normal,
            retry_for: Duration::from_secs(60),
        }
    }
}

/// Builds the jobs `tollgate publish` would publish.
pub fn build_jobs(args: &PublishArgs, now: UnixMillis) -> anyhow::Result<Vec<Job>> {
    jobs_of(args, now, args.count)
}

/// `count` of the jobs `args` describe.
fn jobs_of(args: &PublishArgs, now: UnixMillis, count: u32) -> anyhow::Result<Vec<Job>> {
    if args.count == 0 {
        bail!("--count must be at least 1");
    }
    let tenant = TenantId::parse(args.tenant.as_str()).context("--tenant")?;
    let kind = Kind::parse(args.kind.as_str()).context("--kind")?;
    let payload = RawValue::from_string(args.payload.clone()).context("--payload is not JSON")?;
    // Checked here as the consumer checks them: a job published with an
    // instant past 2200 would only be dead-lettered as malformed.
    let due_at = match (&args.due_in, &args.due_at) {
        (Some(d), _) => Some(now.saturating_add(*d).in_job_range().context("--due-in")?),
        (None, Some(at)) => Some(UnixMillis::parse_rfc3339(at).context("--due-at")?),
        (None, None) => None,
    };
    let expires_at = args
        .expires_in
        .map(|d| now.saturating_add(d).in_job_range())
        .transpose()
        .context("--expires-in")?;
    if args.id.is_some() && args.count != 1 {
        bail!("--id needs --count 1 (job ids are unique)");
    }
    let key = args
        .idempotency_key
        .as_deref()
        .map(IdempotencyKey::parse)
        .transpose()
        .context("--idempotency-key")?;
    (0..count)
        .map(|_| {
            let id = match &args.id {
                Some(id) => JobId::parse(id.as_str()).context("--id")?,
                None => JobId::parse(format!("{tenant}-{}", uuid::Uuid::new_v4()))?,
            };
            Ok(Job {
                idempotency_key: key.clone().unwrap_or_else(|| IdempotencyKey::from(&id)),
                id,
                tenant: tenant.clone(),
                kind: kind.clone(),
                due_at,
                expires_at,
                priority: args.priority,
                payload: payload.clone(),
            })
        })
        .collect()
}

/// Publishes jobs with confirms, many in flight at once; returns the jobs
/// that were not confirmed, and the first error.
async fn publish_batch<'a>(
    broker: &Broker,
    jobs: &[&'a Job],
    now: UnixMillis,
) -> (Vec<&'a Job>, Option<tollgate_amqp::AmqpError>) {
    const IN_FLIGHT: usize = 256;
    let (mut failed, mut first_error) = (Vec::new(), None);
    let mut pending = FuturesUnordered::new();
    let mut settle = |(job, result): (&'a Job, Result<(), tollgate_amqp::AmqpError>)| {
        if let Err(e) = result {
            failed.push(job);
            first_error.get_or_insert(e);
        }
    };
    for &job in jobs {
        if pending.len() >= IN_FLIGHT
            && let Some(done) = pending.next().await
        {
            settle(done);
        }
        pending.push(async move { (job, broker.publish_job(job, now).await) });
    }
    while let Some(done) = pending.next().await {
        settle(done);
    }
    (failed, first_error)
}

/// Publishes jobs on one connection; any unconfirmed job is an error.
pub async fn publish_jobs(broker: &Broker, jobs: &[Job], now: UnixMillis) -> anyhow::Result<()> {
    let all: Vec<&Job> = jobs.iter().collect();
    match publish_batch(broker, &all, now).await {
        (failed, Some(e)) => {
            Err(anyhow::Error::new(e).context(format!("{} job(s) not confirmed", failed.len())))
        }
        (_, None) => Ok(()),
    }
}

/// Publishes every job, reconnecting and republishing whatever was not
/// confirmed when a publish fails (a broker restart, a dropped connection).
/// A job whose confirm was lost in flight may be published twice: its
/// idempotency key makes the second copy a `duplicate`, never a second send.
pub async fn publish_reliably(
    config: &Config,
    jobs: &[Job],
    now: UnixMillis,
    retry_for: Duration,
) -> anyhow::Result<()> {
    let deadline = std::time::Instant::now() + retry_for;
    let mut left: Vec<&Job> = jobs.iter().collect();
    for attempt in 1u32.. {
        let error: anyhow::Error = match connect_broker(config, "publish").await {
            Ok(broker) => {
                let installed = broker.check_installed().await;
                let (failed, error) = match installed {
                    Ok(()) => publish_batch(&broker, &left, now).await,
                    Err(e) => (left.clone(), Some(e)),
                };
                broker.close().await;
                let Some(e) = error else { return Ok(()) };
                left = failed;
                e.into()
            }
            Err(e) => e,
        };
        if refused_for_good(&error) {
            return Err(error.context(format!("{} job(s) not published", left.len())));
        }
        // 0.25 s doubling to 5 s, jittered, for as long as retry_for allows.
        let ceiling = Duration::from_millis(250 << attempt.min(5)).min(Duration::from_secs(5));
        let wait = ceiling.mul_f64(rand::random::<f64>().max(0.5));
        if std::time::Instant::now() + wait > deadline {
            return Err(error.context(format!(
                "{} job(s) not confirmed after retrying for {}",
                left.len(),
                humantime::format_duration(retry_for)
            )));
        }
        eprintln!(
            "tollgate: {} job(s) not confirmed ({error:#}); retrying in {} ms",
            left.len(),
            wait.as_millis()
        );
        tokio::time::sleep(wait).await;
    }
    unreachable!("the loop returns")
}

/// A refusal that retrying cannot change: no installation under this
/// prefix, the credentials or the vhost refused, a queue or exchange that
/// exists with other arguments. `publish` says so at once instead of
/// retrying for `--retry-for`.
fn refused_for_good(error: &anyhow::Error) -> bool {
    use tollgate_amqp::AmqpError;
    let settled = error.chain().any(|e| {
        matches!(
            e.downcast_ref::<AmqpError>(),
            Some(AmqpError::NotInstalled(_) | AmqpError::Inequivalent { .. })
        )
    });
    let text = format!("{error:#}");
    settled
        || ["ACCESS_REFUSED", "NOT_ALLOWED", "PRECONDITION_FAILED"]
            .iter()
            .any(|code| text.contains(code))
}

pub async fn publish(config: &Config, args: &PublishArgs) -> anyhow::Result<()> {
    /// Jobs built and published at a time: a `--count` of millions never
    /// holds them all in memory (about 300 bytes each).
    const CHUNK: u32 = 10_000;
    let now = SystemClock.now();
    let first = jobs_of(args, now, 1)?;
    // As the workers will read it (they differ only in their ids): what
    // they would dead-letter as malformed is refused here instead (an
    // expiry before the due time, a kind no route knows, a payload too
    // large or too deep).
    tollgate_core::job::decode(&first[0].to_json(), &config.limits())
        .map_err(|e| anyhow::anyhow!("workers would dead-letter this job as malformed: {e}"))?;
    if args.count == 1 {
        publish_reliably(config, &first, now, args.retry_for).await?;
        println!(
            "published job {} for tenant {}",
            first[0].id, first[0].tenant
        );
        return Ok(());
    }
    let mut published = 0;
    while published < args.count {
        let jobs = jobs_of(args, now, CHUNK.min(args.count - published))?;
        publish_reliably(config, &jobs, now, args.retry_for)
            .await
            .with_context(|| format!("{published} of {} jobs were published", args.count))?;
        published += jobs.len() as u32;
    }
    println!("published {published} jobs for tenant {}", args.tenant);
    Ok(())
}

/// Who a CLI change is recorded as: `cli:<--actor>`, else
/// `cli:$USER@hostname`, so the audit trail answers "who did this".
pub fn cli_actor(explicit: Option<&str>) -> anyhow::Result<Actor> {
    let name = match explicit {
        Some(name) => name.to_owned(),
        None => {
            let user = ["USER", "LOGNAME"]
                .iter()
                .find_map(|v| std::env::var(v).ok().filter(|u| !u.is_empty()))
                .unwrap_or_else(|| "unknown".into());
            let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
                .ok()
                .or_else(|| std::env::var("HOSTNAME").ok())
                .map(|h| h.trim().to_owned())
                .filter(|h| !h.is_empty())
                .unwrap_or_else(|| "unknown-host".into());
            // A pod's long name is cut, not refused.
            format!("{user}@{host}").chars().take(64).collect()
        }
    };
    Actor::named("cli", &name).map_err(|e| anyhow::anyhow!("--actor {e}"))
}

impl TargetArgs {
    pub fn target(&self) -> anyhow::Result<Target> {
        match (&self.tenant, &self.route) {
            (_, Some(route)) => Ok(Target::Route(
                Kind::parse(route.as_str()).context("--route")?,
            )),
            (Some(tenant), None) => Ok(Target::Tenant(
                TenantId::parse(tenant.as_str()).context("tenant")?,
            )),
            (None, None) => bail!("name a tenant, or a route with --route"),
        }
    }

    fn optional(&self) -> anyhow::Result<Option<Target>> {
        match (&self.tenant, &self.route) {
            (None, None) => Ok(None),
            _ => self.target().map(Some),
        }
    }
}

/// Sets a tenant's enforced quota (no concurrency limit) as `who`: the
/// shorthand the demo, the bench and the tests use.
pub async fn set_tenant_quota(
    store: &QuotaStore,
    tenant: &str,
    quota: Quota,
    who: &str,
) -> anyhow::Result<()> {
    let target = Target::Tenant(TenantId::parse(tenant).context("tenant")?);
    let change = Change::SetQuota {
        quota,
        concurrency: None,
        weight: None,
        adaptive: None,
    };
    let actor = Actor {
        who: who.to_owned(),
        source: "cli",
    };
    store.apply(&target, change, &actor).await?;
    Ok(())
}

/// What a delete of a target the quota baseline names means.
pub const BASELINE_DELETE_NOTE: &str = "{target} is in the quota baseline: this delete stands \
    (workers do not seed it back) until the baseline's entry for it changes, \
    or `tollgate quota seed --overwrite` resets to it";

/// Parses `--priority` (the same words, and the same error, as a message's
/// `priority` field).
fn parse_priority(s: &str) -> Result<Priority, String> {
    Priority::parse(s).map_err(|e| e.to_string())
}

/// Parses `--weight` (1 to 1000).
fn parse_weight(s: &str) -> Result<u32, String> {
    tollgate_core::weight(whole_number(s)?).map_err(|e| e.to_string())
}

fn whole_number(s: &str) -> Result<u32, String> {
    s.parse()
        .map_err(|_| format!("{s:?} is not a whole number"))
}

/// Parses `--concurrency` (at least 1).
fn parse_concurrency(s: &str) -> Result<u32, String> {
    tollgate_core::concurrency(whole_number(s)?).map_err(|e| e.to_string())
}

/// Parses `--rate` and `--burst` into a quota.
fn parse_quota(rate: &str, burst: u32) -> anyhow::Result<Quota> {
    Quota::parse(rate, burst).context("--rate/--burst")
}

fn print_change(target: &Target, old: &Settings, new: &Settings) {
    println!(
        "{}: {} → {}",
        target.label(),
        old.describe(),
        new.describe()
    );
}

fn show(target: &Target, settings: Option<&Settings>, default: &str) -> String {
    let name = target.label();
    match settings {
        Some(s) => format!(
            "{name}: {} (changed by {} at {})",
            s.describe(),
            s.updated_by.as_deref().unwrap_or("?"),
            s.updated_at_ms
                .map(|t| UnixMillis(t).to_string())
                .unwrap_or_else(|| "?".into()),
        ),
        None => format!("{name}: nothing stored; {default}"),
    }
}

/// The default quota as the permit script sees it: stored, else config.
async fn effective_default(store: &QuotaStore, config: &Config) -> anyhow::Result<String> {
    Ok(
        match store.get(&Target::Default).await?.and_then(|s| s.quota) {
            Some(q) => format!("{q} (stored)"),
            None => format!("{} (from config)", config.default_quota()?),
        },
    )
}

pub async fn quota(config: &Config, command: &QuotaCommand, actor: &Actor) -> anyhow::Result<()> {
    let store = quota_store(config)?;
    match command {
        QuotaCommand::Set {
            target,
            rate,
            burst,
            concurrency,
            weight,
            shadow,
            adaptive,
            min,
            decrease,
            increase,
            probe,
        } => {
            let target = target.target()?;
            if *adaptive && (*shadow || rate.is_none()) {
                bail!(
                    "--adaptive needs --rate (the ceiling) and applies to the enforced quota, not to --shadow"
                )
            }
            if weight.is_some() && !matches!(target, Target::Tenant(_)) {
                bail!(
                    "--weight applies to tenants: a route's capacity divides among them by weight"
                )
            }
            let change = match (rate, *weight) {
                (None, Some(w)) if !shadow && concurrency.is_none() => Change::SetWeight(w),
                (None, _) => {
                    bail!("--rate is required (it may be left out only to change --weight alone)")
                }
                (Some(rate), _) => {
                    let quota = parse_quota(rate, *burst)?;
                    match (shadow, &target) {
                        (true, Target::Tenant(_)) if weight.is_some() => {
                            bail!("--weight applies to the enforced quota, not to --shadow")
                        }
                        (true, Target::Tenant(_)) => Change::SetShadow(quota),
                        (true, _) => bail!("--shadow applies to tenants"),
                        (false, Target::Route(_)) if concurrency.is_some() => {
                            bail!("--concurrency applies to tenants")
                        }
                        (false, _) => Change::SetQuota {
                            quota,
                            concurrency: *concurrency,
                            weight: *weight,
                            adaptive: adaptive
                                .then(|| {
                                    Adaptive::parse(
                                        quota.rate,
                                        min.as_deref(),
                                        *decrease,
                                        *increase,
                                        *probe,
                                    )
                                })
                                .transpose()
                                .context("--adaptive")?,
                        },
                    }
                }
            };
            let (old, new) = store.apply(&target, change, actor).await?;
            print_change(&target, &old, &new);
        }
        QuotaCommand::Get { target } => {
            let target = target.target()?;
            let settings = store.get(&target).await?;
            let fallback = match target {
                Target::Route(_) => "the route has no shared bucket".to_owned(),
                _ => format!(
                    "the default {} applies",
                    effective_default(&store, config).await?
                ),
            };
            println!("{}", show(&target, settings.as_ref(), &fallback));
        }
        QuotaCommand::List => {
            println!("default: {}", effective_default(&store, config).await?);
            println!("\n{:<40} SETTINGS", "TENANT / ROUTE");
            for (tenant, s) in store.tenants().await? {
                println!("{:<40} {}", format!("tenant:{tenant}"), s.describe());
            }
            for (route, s) in store.routes().await? {
                println!("{:<40} {}", format!("route:{route}"), s.describe());
            }
        }
        QuotaCommand::Delete { target, shadow } => {
            let target = target.target()?;
            let change = if *shadow {
                Change::ClearShadow
            } else {
                Change::Delete
            };
            let (old, new) = store.apply(&target, change, actor).await?;
            print_change(&target, &old, &new);
            if !shadow && store.in_baseline(&target).await? {
                println!(
                    "{}",
                    BASELINE_DELETE_NOTE.replace("{target}", &target.label())
                );
            }
        }
        QuotaCommand::Default { rate, burst } => match rate {
            Some(rate) => {
                let change = Change::SetQuota {
                    quota: parse_quota(rate, *burst)?,
                    concurrency: None,
                    weight: None,
                    adaptive: None,
                };
                let (old, new) = store.apply(&Target::Default, change, actor).await?;
                print_change(&Target::Default, &old, &new);
            }
            None => println!("default: {}", effective_default(&store, config).await?),
        },
        QuotaCommand::Seed { file, overwrite } => {
            let baseline = match file.as_deref().or(config.quotas_file.as_deref()) {
                Some(path) => tollgate_runtime::baseline::Baseline::load(path)?,
                None => bail!("no baseline: pass --file or set TOLLGATE_QUOTAS_FILE"),
            };
            let written = baseline.seed(&store, *overwrite).await?;
            println!("seeded {} quota(s) from the baseline", written.len());
            for target in written {
                println!("  {}", target.label());
            }
        }
        QuotaCommand::Export => {
            let baseline = tollgate_runtime::baseline::Baseline::export(&store).await?;
            print!("{}", toml::to_string(&baseline)?);
        }
        QuotaCommand::History { target, limit } => {
            let target = target.optional()?;
            let entries = store.history(target.as_ref(), *limit).await?;
            if entries.is_empty() {
                println!("no changes recorded");
            }
            for e in entries {
                // A cancel, replay or purge changes no settings: what it
                // did is its detail.
                let what = match &e.detail {
                    Some(detail) => tollgate_core::outcome::printable(detail),
                    None => format!("{} → {}", e.old.describe(), e.new.describe()),
                };
                println!(
                    "{}  {:<28} {:<13} {:<24} {:<4} {what}",
                    UnixMillis(e.at_ms),
                    e.target,
                    e.action,
                    tollgate_core::outcome::printable(&e.who),
                    e.source,
                );
            }
        }
    }
    Ok(())
}

pub async fn tenant(config: &Config, command: &TenantCommand, actor: &Actor) -> anyhow::Result<()> {
    let store = quota_store(config)?;
    let (tenant, change) = match command {
        TenantCommand::Pause { tenant } => (tenant, Change::Pause),
        TenantCommand::Resume { tenant } => (tenant, Change::Resume),
    };
    let target = Target::Tenant(TenantId::parse(tenant.as_str()).context("tenant")?);
    let (_, new) = store.apply(&target, change, actor).await?;
    println!(
        "{}: {}",
        target.label(),
        if new.paused { "paused" } else { "running" }
    );
    Ok(())
}

pub async fn cancel(config: &Config, args: &CancelArgs, actor: &Actor) -> anyhow::Result<()> {
    let store = quota_store(config)?;
    let tenant = TenantId::parse(args.tenant.as_str()).context("--tenant")?;
    let by = match (&args.job_id, &args.idempotency_key) {
        (Some(id), _) => Cancel::JobId(JobId::parse(id.as_str()).context("--job-id")?),
        (None, Some(key)) => {
            Cancel::Key(IdempotencyKey::parse(key.as_str()).context("--idempotency-key")?)
        }
        (None, None) => bail!("give --job-id or --idempotency-key"),
    };
    store
        .cancel(
            &tenant,
            &by,
            Duration::from_secs(config.cancel_ttl_s),
            actor,
        )
        .await?;
    println!(
        "cancellation of {by} for tenant {tenant} recorded for {}: any copy not yet sent is \
         skipped at its turn, using no quota (a job already sent is not affected, nor one due \
         after then)",
        match config.cancel_ttl_s {
            s if s >= 86_400 => format!("{} days", s / 86_400),
            s => humantime::format_duration(Duration::from_secs(s)).to_string(),
        }
    );
    Ok(())
}

pub async fn topology(config: &Config, command: &TopologyCommand) -> anyhow::Result<()> {
    match command {
        TopologyCommand::Declare { drain_from } => {
            let broker = connect_broker(config, "topology").await?;
            let draining =
                tollgate_runtime::topology::declare(&broker, &quota_store(config)?, *drain_from)
                    .await?;
            let t = broker.topology();
            println!(
                "declared {} → {} work queue(s); {} delay tier(s) → {} → {} return and {} \
                 recheck queue(s); {}",
                t.jobs_exchange(),
                t.work_queues().len(),
                t.tier_queues().len(),
                t.expired_exchange(),
                t.queues(ShardQueue::Return).len(),
                t.queues(ShardQueue::Recheck).len(),
                t.dead_queue()
            );
            for queue in draining {
                let depth = broker.queue_depth(&queue).await?;
                println!(
                    "{}",
                    tollgate_runtime::topology::draining_note(&queue, depth)
                );
            }
            broker.close().await;
        }
    }
    Ok(())
}

/// One dead letter as `dlq list` shows it.
#[derive(Debug)]
pub struct DeadLetter {
    pub reason: String,
    pub tenant: String,
    pub detail: String,
    pub dead_at: Option<UnixMillis>,
    pub job_id: String,
    pub payload: String,
}

pub fn describe_dead_letter(delivery: &tollgate_amqp::lapin::message::Delivery) -> DeadLetter {
    let h = delivery.properties.headers().clone().unwrap_or_default();
    // Messages RabbitMQ itself dead-lettered carry no tollgate reason: past
    // the work queue's delivery limit, those are poison; a producer's own
    // AMQP `expiration` that ran out in a work queue, expired.
    let (reason, detail) = match (headers::text(&h, headers::REASON), headers::last_death(&h)) {
        (Some(reason), _) => (
            reason,
            headers::text(&h, headers::DETAIL).unwrap_or_default(),
        ),
        (None, Some((death, queue))) if death == "expired" => (
            DeadReason::Expired.as_str().into(),
            format!(
                "the AMQP expiration it was published with ran out in {queue} (give the job an \
                 expires_at instead)"
            ),
        ),
        (None, death) => (
            DeadReason::Poison.as_str().into(),
            death
                .map(|(death, queue)| format!("dead-lettered by RabbitMQ ({death}) from {queue}"))
                .unwrap_or_default(),
        ),
    };
    let dead_at = match h.inner().get(headers::DEAD_AT_MS) {
        Some(tollgate_amqp::lapin::types::AMQPValue::LongLongInt(ms)) => Some(UnixMillis(*ms)),
        _ => None,
    };
    let body: Option<serde_json::Value> = serde_json::from_slice(&delivery.data).ok();
    let field = |name: &str| {
        body.as_ref()
            .and_then(|b| b.get(name))
            .and_then(|v| v.as_str())
            .unwrap_or("?")
            .to_owned()
    };
    DeadLetter {
        reason,
        tenant: TenantId::parse(delivery.routing_key.as_str())
            .map(|t| t.to_string())
            .unwrap_or_else(|_| "?".into()),
        detail,
        dead_at,
        job_id: field("id"),
        payload: body
            .as_ref()
            .and_then(|b| b.get("payload"))
            .map(|p| p.to_string())
            .unwrap_or_else(|| String::from_utf8_lossy(&delivery.data).into_owned()),
    }
}

/// The dead-letter queue at a glance: its depth, counts by (reason, tenant)
/// over the first `scan` messages, and those messages newest first.
pub struct DlqSummary {
    pub queue: String,
    pub depth: u32,
    pub counts: std::collections::BTreeMap<(String, String), usize>,
    pub newest: Vec<DeadLetter>,
}

/// The installation's dead-letter lock, and how long one holder keeps it
/// without renewing and how long another waits for it.
const DLQ_LOCK: &str = "dlq";
const DLQ_LOCK_TTL: Duration = Duration::from_secs(30);
const DLQ_LOCK_WAIT: Duration = Duration::from_secs(20);

/// Runs a dead-letter read, replay or purge once no other one runs, from
/// any pod or CLI. A read takes each letter and puts a copy back, so two at
/// once would each see part of the queue, and a purge would miss the
/// letters a read holds. The lock is in Redis, renewed while `op` runs;
/// when Redis cannot be reached, `op` runs unguarded (the dead letters stay
/// readable while Redis is down) with a warning.
async fn one_at_a_time<T>(
    store: &QuotaStore,
    op: impl Future<Output = anyhow::Result<T>>,
) -> anyhow::Result<T> {
    let holder = format!(
        "{} (pid {}, {:08x})",
        std::env::var("HOSTNAME").unwrap_or_else(|_| "a host".into()),
        std::process::id(),
        rand::random::<u32>()
    );
    let give_up = tokio::time::Instant::now() + DLQ_LOCK_WAIT;
    let guarded = loop {
        match store.try_lock(DLQ_LOCK, &holder, DLQ_LOCK_TTL).await {
            Ok(Ok(())) => break true,
            Ok(Err(_)) if tokio::time::Instant::now() < give_up => {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Ok(Err(other)) => bail!(
                "the dead-letter queue is busy: another read, replay or purge, by {other}, has \
                 run for over {} s; try again when it ends",
                DLQ_LOCK_WAIT.as_secs()
            ),
            Err(e) => {
                tracing::warn!(
                    error = %e,
                    "could not take the dead-letter lock in Redis: going ahead unguarded"
                );
                break false;
            }
        }
    };
    tokio::pin!(op);
    let mut renewing = guarded;
    let result = loop {
        tokio::select! {
            result = &mut op => break result,
            () = tokio::time::sleep(DLQ_LOCK_TTL / 3), if renewing => {
                if let Ok(false) = store.renew_lock(DLQ_LOCK, &holder, DLQ_LOCK_TTL).await {
                    renewing = false;
                    tracing::warn!(
                        "the dead-letter lock lapsed (Redis lost it or could not be reached \
                         for {} s): another read, replay or purge may now run beside this one",
                        DLQ_LOCK_TTL.as_secs()
                    );
                }
            }
        }
    };
    if guarded {
        let _ = store.unlock(DLQ_LOCK, &holder).await;
    }
    result
}

/// Reads the dead-letter queue without taking anything out of it.
pub async fn dlq_summary(config: &Config, scan: usize) -> anyhow::Result<DlqSummary> {
    let (queue, depth, mut newest) = read_dlq(config, scan).await?;
    let mut counts = std::collections::BTreeMap::<(String, String), usize>::new();
    for l in &newest {
        *counts
            .entry((l.reason.clone(), l.tenant.clone()))
            .or_default() += 1;
    }
    newest.sort_by_key(|l| std::cmp::Reverse(l.dead_at));
    Ok(DlqSummary {
        queue,
        depth,
        counts,
        newest,
    })
}

/// The first `scan` dead letters in queue order, read as [`dlq_summary`]
/// reads them: one read, replay or purge at a time.
pub async fn dlq_letters(config: &Config, scan: usize) -> anyhow::Result<Vec<DeadLetter>> {
    Ok(read_dlq(config, scan).await?.2)
}

/// The dead-letter queue's name, its depth and its first `scan` letters.
async fn read_dlq(config: &Config, scan: usize) -> anyhow::Result<(String, u32, Vec<DeadLetter>)> {
    let (config, store) = (config.clone(), quota_store(config)?);
    to_the_end(async move {
        one_at_a_time(&store, async {
            let broker = connect_broker(&config, "dlq").await?;
            let queue = broker.topology().dead_queue();
            let read = async {
                let depth = broker.queue_depth(&queue).await?;
                let letters = broker.peek_dead_letters(scan).await?;
                anyhow::Ok((depth, letters.iter().map(describe_dead_letter).collect()))
            }
            .await;
            broker.close().await;
            let (depth, letters) = read?;
            Ok((queue, depth, letters))
        })
        .await
    })
    .await
}

/// What a dead-letter replay did.
#[derive(Debug)]
pub struct Replayed {
    pub queue: String,
    pub replayed: usize,
    /// Letters left in the queue (of those there when it began).
    pub left: usize,
    /// Why the audit stream has no entry for it, if it has none.
    pub unaudited: Option<String>,
}

/// Sends the dead letters matching `reason` and `tenant` (at most `limit`)
/// back to be processed again, and records it in the audit stream as done
/// by `actor`.
pub async fn dlq_replay(
    config: &Config,
    reason: Option<DeadReason>,
    tenant: Option<&str>,
    limit: usize,
    actor: &Actor,
) -> anyhow::Result<Replayed> {
    let (config, store) = (config.clone(), quota_store(config)?);
    let (tenant, actor) = (tenant.map(str::to_owned), actor.clone());
    to_the_end(async move {
        let tenant = tenant.as_deref();
        let (replayed, left, queue) =
            one_at_a_time(&store, replay_dlq(&config, reason, tenant, limit)).await?;
        let detail = format!(
            "replayed {replayed} (reason {}, tenant {}); {left} left",
            reason.map_or("any", |r| r.as_str()),
            tenant.unwrap_or("any"),
        );
        Ok(Replayed {
            queue,
            replayed,
            left,
            unaudited: audit(&store, "replay", &actor, &detail).await,
        })
    })
    .await
}

async fn replay_dlq(
    config: &Config,
    reason: Option<DeadReason>,
    tenant: Option<&str>,
    limit: usize,
) -> anyhow::Result<(usize, usize, String)> {
    let broker = connect_broker(config, "dlq").await?;
    let select = |d: &tollgate_amqp::lapin::message::Delivery| {
        let letter = describe_dead_letter(d);
        reason.is_none_or(|r| r.as_str() == letter.reason)
            && tenant.is_none_or(|t| t == letter.tenant)
    };
    let replayed = broker.replay_dead_letters(select, limit).await;
    broker.close().await;
    let (replayed, left) = replayed?;
    Ok((replayed, left, broker.topology().dead_queue()))
}

/// Records a dead-letter replay or purge, already done, in the audit
/// stream. A failure is logged with what was done (the log keeps the
/// record), and returned, not raised: answering "failed" for what was done
/// would have it done again.
async fn audit(store: &QuotaStore, action: &str, actor: &Actor, detail: &str) -> Option<String> {
    let e = store.record("dlq", action, actor, detail).await.err()?;
    tracing::warn!(
        error = %e,
        action,
        actor = %actor.who,
        detail,
        "a dead-letter {action} is done but could not be recorded in the audit stream"
    );
    Some(e.to_string())
}

/// Runs a dead-letter operation ([`one_at_a_time`], then its audit entry)
/// on a task of its own, so that it goes to its end even when its caller
/// stops waiting. An admin API request that timed out used to drop a read
/// midway: the letters already copied were then there twice, the lock
/// stayed held for its 30 s, and a replay went unaudited.
async fn to_the_end<T: Send + 'static>(
    op: impl Future<Output = anyhow::Result<T>> + Send + 'static,
) -> anyhow::Result<T> {
    tokio::spawn(op)
        .await
        .map_err(|e| anyhow::anyhow!("the dead-letter operation failed: {e}"))?
}

/// Says on stderr that a replay or purge that was done is not in the audit
/// stream, and why.
fn not_audited(why: Option<String>) {
    if let Some(why) = why {
        eprintln!("warning: done, but not recorded in the audit stream: {why}");
    }
}

/// A dead-letter reason as an operator typed it, or why it is not one.
pub fn dead_reason(r: &str) -> anyhow::Result<DeadReason> {
    DeadReason::parse(r).with_context(|| {
        format!("{r:?} is not one of malformed, expired, rejected, exhausted, poison")
    })
}

/// What a dead-letter purge did.
#[derive(Debug)]
pub struct Purged {
    pub queue: String,
    pub purged: u32,
    /// Why the audit stream has no entry for it, if it has none.
    pub unaudited: Option<String>,
}

/// Deletes every dead letter once `confirm` names the dead-letter queue (as
/// an operator types it), and records it in the audit stream as done by
/// `actor`.
pub async fn dlq_purge(
    config: &Config,
    confirm: impl FnOnce(&str, u32) -> anyhow::Result<bool>,
    actor: &Actor,
) -> anyhow::Result<Purged> {
    let broker = connect_broker(config, "dlq").await?;
    let queue = broker.topology().dead_queue();
    let depth = broker.queue_depth(&queue).await?;
    let confirmed = confirm(&queue, depth);
    if !matches!(confirmed, Ok(true)) {
        broker.close().await;
        confirmed?;
        bail!("not confirmed; nothing deleted");
    }
    let (store, actor) = (quota_store(config)?, actor.clone());
    to_the_end(async move {
        let purged = one_at_a_time(&store, async { Ok(broker.purge(&queue).await?) }).await;
        broker.close().await;
        let purged = purged?;
        let unaudited = audit(&store, "purge", &actor, &format!("purged {purged}")).await;
        Ok(Purged {
            queue,
            purged,
            unaudited,
        })
    })
    .await
}

pub async fn dlq(config: &Config, command: &DlqCommand, actor: &Actor) -> anyhow::Result<()> {
    match command {
        DlqCommand::List {
            limit,
            scan,
            show_payload,
        } => {
            let summary = dlq_summary(config, *scan).await?;
            println!("{}: {} dead letter(s)", summary.queue, summary.depth);
            if !summary.counts.is_empty() {
                println!("\n{:<12} {:<32} {:>8}", "REASON", "TENANT", "COUNT");
                for ((reason, tenant), n) in &summary.counts {
                    println!("{reason:<12} {tenant:<32} {n:>8}");
                }
            }
            if !summary.newest.is_empty() {
                println!("\nnewest {}:", limit.min(&summary.newest.len()));
            }
            // Letters carry what producers wrote (and letters from before
            // the worker cleaned its details): nothing reaches the terminal
            // as an escape sequence.
            let shown = tollgate_core::outcome::printable;
            for l in summary.newest.iter().take(*limit) {
                println!(
                    "{}  {:<10} {:<20} {:<40} {}",
                    l.dead_at
                        .map(|t| t.to_string())
                        .unwrap_or_else(|| "?".into()),
                    shown(&l.reason),
                    l.tenant,
                    shown(&l.job_id),
                    shown(&l.detail)
                );
                if *show_payload {
                    let payload = tollgate_core::outcome::without_controls(&l.payload);
                    println!("    payload: {payload}");
                }
            }
        }
        DlqCommand::Replay {
            reason,
            tenant,
            limit,
        } => {
            let reason = reason
                .as_deref()
                .map(dead_reason)
                .transpose()
                .map_err(|e| anyhow::anyhow!("--reason {e:#}"))?;
            let done = dlq_replay(config, reason, tenant.as_deref(), *limit, actor).await?;
            println!(
                "replayed {} dead letter(s); {} left in {}",
                done.replayed, done.left, done.queue
            );
            not_audited(done.unaudited);
        }
        DlqCommand::Purge { yes } => {
            let confirmed = |queue: &str, depth| {
                Ok(*yes
                    || confirm(
                        &format!(
                            "delete {depth} dead letter(s) from {queue}? type the queue name to confirm: "
                        ),
                        queue,
                    )?)
            };
            let done = dlq_purge(config, confirmed, actor).await?;
            println!("purged {} dead letter(s) from {}", done.purged, done.queue);
            not_audited(done.unaudited);
        }
    }
    Ok(())
}

/// Asks on the terminal; refuses when there is no terminal to ask.
fn confirm(question: &str, expected: &str) -> anyhow::Result<bool> {
    use std::io::{BufRead, IsTerminal, Write};
    if !std::io::stdin().is_terminal() {
        bail!("refusing to purge without a terminal to confirm on: pass --yes");
    }
    print!("{question}");
    std::io::stdout().flush()?;
    let mut answer = String::new();
    std::io::stdin().lock().read_line(&mut answer)?;
    Ok(answer.trim() == expected)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The consumer dead-letters a job whose instants lie past 2200 as
    /// malformed; `publish` refuses it up front instead of publishing it.
    #[test]
    fn publish_refuses_an_instant_the_consumer_would_not_accept() {
        let now = UnixMillis(1_796_115_600_000);
        let in_300_years = Duration::from_secs(300 * 366 * 24 * 3600);
        let far = PublishArgs {
            due_in: Some(in_300_years),
            ..PublishArgs::new("acme", 1)
        };
        let refused = format!("{:#}", build_jobs(&far, now).unwrap_err());
        assert!(refused.starts_with("--due-in: year"), "{refused}");
        let far = PublishArgs {
            expires_in: Some(in_300_years),
            ..PublishArgs::new("acme", 1)
        };
        let refused = format!("{:#}", build_jobs(&far, now).unwrap_err());
        assert!(refused.starts_with("--expires-in: year"), "{refused}");
        let near = PublishArgs {
            due_in: Some(Duration::from_secs(3600)),
            ..PublishArgs::new("acme", 1)
        };
        let jobs = build_jobs(&near, now).unwrap();
        assert_eq!(
            jobs[0].due_at,
            Some(now.saturating_add(Duration::from_secs(3600)))
        );
    }
}
