//! The permit path: decisions/s of the permit script against a trivial
//! `EVALSHA` on the same Redis, and Redis round trips per decision.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use serde_json::json;
use tollgate_core::ports::{PermitRequest, PermitStore};
use tollgate_core::{IdempotencyKey, JobId, Kind, Quota, TenantId};
use tollgate_quota::{Actor, Change, QuotaStore, Redis, RedisPermits, Target};

use super::throughput::client_round_trips;
use super::{BenchArgs, Figure, Scenario, progress};
use tollgate::cli;
use tollgate::config::Config;

const IN_FLIGHT: usize = 64;

/// Tenants of the Redis Cluster comparison: spread over the masters.
const SPREAD_TENANTS: usize = 8;

/// Who asks for permits in a measurement.
#[derive(Clone, Copy)]
struct Load {
    /// Tenants, each with a quota that never holds it back; jobs go to each
    /// in turn.
    tenants: usize,
    /// The route has a quota (never holding it back either): on a cluster
    /// each decision is a call to the route's slot and one to the
    /// tenant's.
    route_quota: bool,
}

const ONE_TENANT: Load = Load {
    tenants: 1,
    route_quota: false,
};
const SPREAD: Load = Load {
    tenants: SPREAD_TENANTS,
    route_quota: false,
};
const SPREAD_ON_A_ROUTE: Load = Load {
    tenants: SPREAD_TENANTS,
    route_quota: true,
};

pub async fn run(base: &Config, args: &BenchArgs) -> anyhow::Result<Scenario> {
    let (mut permit, mut trivial, mut trips) = (vec![], vec![], vec![]);
    let (mut spread, mut on_a_route) = (vec![], vec![]);
    for i in 1..=args.runs {
        progress(&format!(
            "permit path {i}/{}: permit script vs trivial EVALSHA",
            args.runs
        ));
        let window = Duration::from_secs(args.permit_seconds);
        let (rate, per_decision) = permit_script(base, window, ONE_TENANT).await?;
        permit.push(rate);
        trips.push(per_decision);
        trivial.push(trivial_script(base, window).await?);
        spread.push(permit_script(base, window, SPREAD).await?.0);
        on_a_route.push(permit_script(base, window, SPREAD_ON_A_ROUTE).await?.0);
    }
    let ratios = permit.iter().zip(&trivial).map(|(p, t)| p / t).collect();
    let (cluster_spread, cluster_on_a_route) = on_a_redis_cluster(base, args).await?;
    let ratio = |a: &[f64], b: &[f64]| a.iter().zip(b).map(|(a, b)| a / b).collect::<Vec<_>>();
    let spread_ratios = ratio(&cluster_spread, &spread);
    let on_a_route_ratios = ratio(&cluster_on_a_route, &on_a_route);
    Ok(Scenario {
        key: "permit_path",
        title: "Permit path",
        parameters: json!({
            "seconds": args.permit_seconds,
            "runs": args.runs,
            "in_flight": IN_FLIGHT,
            "cluster": "a private Redis Cluster of 3 masters and 3 replicas on this machine \
                (scripts/clusters.sh), on the same 2 cores as the single Redis",
            "spread": format!("{SPREAD_TENANTS} tenants in turn, each in its own slot"),
            "on a route": "the same, their route with a quota: on a cluster a call to the \
                route's slot and one to the tenant's per decision",
        }),
        figures: vec![
            Figure::new("permit script", "decisions/s", permit),
            Figure::new("trivial EVALSHA", "calls/s", trivial),
            Figure::new("permit / trivial", "ratio", ratios),
            Figure::new("Redis round trips per decision", "calls", trips).target("<= 1"),
            Figure::new("spread tenants, single Redis", "decisions/s", spread),
            Figure::new(
                "spread tenants, Redis Cluster",
                "decisions/s",
                cluster_spread,
            ),
            Figure::new(
                "spread tenants, Redis Cluster / single Redis",
                "ratio",
                spread_ratios,
            ),
            Figure::new(
                "on a route with a quota, single Redis",
                "decisions/s",
                on_a_route,
            ),
            Figure::new(
                "on a route with a quota, Redis Cluster",
                "decisions/s",
                cluster_on_a_route,
            ),
            Figure::new(
                "on a route with a quota, Redis Cluster / single Redis",
                "ratio",
                on_a_route_ratios,
            ),
        ],
    })
}

/// The permit script's decisions/s on a private Redis Cluster, started
/// for the measurement and stopped after it: tenants spread, then on a
/// route with a quota.
async fn on_a_redis_cluster(
    base: &Config,
    args: &BenchArgs,
) -> anyhow::Result<(Vec<f64>, Vec<f64>)> {
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/clusters.sh");
    let dir = std::env::temp_dir().join(format!(
        "tollgate-bench-cluster-{}",
        &uuid::Uuid::new_v4().simple().to_string()[..8]
    ));
    let clusters = |verb: &str| {
        let status = std::process::Command::new(&script)
            .arg(verb)
            .arg(&dir)
            .args((verb == "up").then_some("--redis-only"))
            .stdout(std::process::Stdio::null())
            .status();
        anyhow::ensure!(
            status.as_ref().is_ok_and(|s| s.success()),
            "{} {verb} {}: {status:?}",
            script.display(),
            dir.display()
        );
        Ok(())
    };
    progress("permit path: starting a private Redis Cluster");
    clusters("up")?;
    let measured = async {
        let env = std::fs::read_to_string(dir.join("env"))?;
        let nodes = env
            .lines()
            .find_map(|l| l.strip_prefix("REDIS_CLUSTER_NODES="))
            .ok_or_else(|| anyhow::anyhow!("clusters.sh wrote no REDIS_CLUSTER_NODES"))?;
        let urls: Vec<String> = nodes.split(',').map(|n| format!("redis://{n}")).collect();
        let config = Config {
            redis_url: tollgate_core::SecretUrl::new(urls.join(",")),
            ..base.clone()
        };
        let (mut spread, mut on_a_route) = (Vec::new(), Vec::new());
        for i in 1..=args.runs {
            progress(&format!("permit path on a Redis Cluster {i}/{}", args.runs));
            let window = Duration::from_secs(args.permit_seconds);
            spread.push(permit_script(&config, window, SPREAD).await?.0);
            on_a_route.push(permit_script(&config, window, SPREAD_ON_A_ROUTE).await?.0);
        }
        anyhow::Ok((spread, on_a_route))
    }
    .await;
    clusters("down")?;
    let _ = std::fs::remove_dir_all(&dir);
    measured
}

/// Permit and quota stores on a fresh random prefix of `base`'s Redis, with
/// `tenant` given a quota that never holds it back (1,000,000/s).
pub(super) async fn unlimited_tenant(
    base: &Config,
    tenant: &str,
) -> anyhow::Result<(Arc<Redis>, RedisPermits, QuotaStore)> {
    unlimited(base, &[tenant]).await
}

/// [`unlimited_tenant`] for each of `tenants`.
async fn unlimited(
    base: &Config,
    tenants: &[&str],
) -> anyhow::Result<(Arc<Redis>, RedisPermits, QuotaStore)> {
    let prefix = format!("bench-{}", &uuid::Uuid::new_v4().simple().to_string()[..8]);
    let config = Config {
        prefix: prefix.clone(),
        ..base.clone()
    };
    let redis = Arc::new(Redis::new(&config.redis_settings())?);
    let permits = RedisPermits::new(
        Arc::clone(&redis),
        redis.keys(&prefix),
        config.permit_settings()?,
    );
    let store = QuotaStore::new(Arc::clone(&redis), redis.keys(&prefix));
    for tenant in tenants {
        cli::set_tenant_quota(
            &store,
            tenant,
            Quota::new("1000000/s".parse()?, 1000)?,
            "bench",
        )
        .await?;
    }
    Ok((redis, permits, store))
}

async fn permit_script(base: &Config, window: Duration, load: Load) -> anyhow::Result<(f64, f64)> {
    let names: Vec<String> = (0..load.tenants).map(|t| format!("bench-{t}")).collect();
    let names: Vec<&str> = names.iter().map(String::as_str).collect();
    let (redis, permits, store) = unlimited(base, &names).await?;
    if load.route_quota {
        let actor = Actor {
            who: "bench".into(),
            source: "cli",
        };
        let change = Change::SetQuota {
            quota: Quota::new("1000000/s".parse()?, 1000)?,
            concurrency: None,
            weight: None,
            adaptive: None,
        };
        store
            .apply(&Target::Route(Kind::default_kind()), change, &actor)
            .await?;
    }
    let tenants: Arc<Vec<TenantId>> = Arc::new(
        names
            .iter()
            .map(|n| TenantId::parse(*n))
            .collect::<Result<_, _>>()?,
    );
    let permits = Arc::new(permits);
    let trips_before = client_round_trips(&redis).await?;
    let count = Arc::new(AtomicU64::new(0));
    let deadline = Instant::now() + window;
    let mut tasks = Vec::new();
    for worker in 0..IN_FLIGHT {
        let (permits, count) = (Arc::clone(&permits), Arc::clone(&count));
        let tenants = Arc::clone(&tenants);
        tasks.push(tokio::spawn(async move {
            let route = Kind::default_kind();
            let mut i = 0u64;
            while Instant::now() < deadline {
                i += 1;
                let tenant = &tenants[(worker + i as usize) % tenants.len()];
                let id = JobId::parse(format!("{worker}-{i}")).expect("valid id");
                let key = IdempotencyKey::from(&id);
                let request = PermitRequest {
                    tenant,
                    route: &route,
                    job_id: &id,
                    key: &key,
                    priority: tollgate_core::Priority::Normal,
                    lease_token: "t",
                    returning: None,
                    reserve_within: None,
                };
                if permits.acquire(request).await.is_ok() {
                    count.fetch_add(1, Ordering::Relaxed);
                }
            }
        }));
    }
    for t in tasks {
        t.await?;
    }
    let decisions = count.load(Ordering::Relaxed);
    let trips = client_round_trips(&redis).await? - trips_before;
    store.purge_prefix().await?;
    Ok((
        decisions as f64 / window.as_secs_f64(),
        trips as f64 / decisions as f64,
    ))
}

async fn trivial_script(base: &Config, window: Duration) -> anyhow::Result<f64> {
    let redis = Arc::new(Redis::new(&base.redis_settings())?);
    let trivial = Arc::new(tollgate_quota::Script::new("return 1"));
    let count = Arc::new(AtomicU64::new(0));
    let deadline = Instant::now() + window;
    let mut tasks = Vec::new();
    for _ in 0..IN_FLIGHT {
        let (redis, count, trivial) =
            (Arc::clone(&redis), Arc::clone(&count), Arc::clone(&trivial));
        tasks.push(tokio::spawn(async move {
            while Instant::now() < deadline {
                let Ok(mut conn) = redis.conn().await else {
                    continue;
                };
                let reply: Result<i64, _> = trivial.invoke_async(&mut conn).await;
                if reply.is_ok() {
                    count.fetch_add(1, Ordering::Relaxed);
                }
            }
        }));
    }
    for t in tasks {
        t.await?;
    }
    Ok(count.load(Ordering::Relaxed) as f64 / window.as_secs_f64())
}
