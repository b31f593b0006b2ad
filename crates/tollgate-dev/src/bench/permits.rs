//! The permit path: decisions/s of the permit script against a trivial
//! `EVALSHA` on the same Redis, and Redis round trips per decision.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use serde_json::json;
use tollgate_core::ports::{PermitRequest, PermitStore};
use tollgate_core::{IdempotencyKey, JobId, Kind, Quota, TenantId};
use tollgate_quota::{QuotaStore, Redis, RedisPermits};

use super::throughput::client_round_trips;
use super::{BenchArgs, Figure, Scenario, progress};
use tollgate::cli;
use tollgate::config::Config;

const IN_FLIGHT: usize = 64;

pub async fn run(base: &Config, args: &BenchArgs) -> anyhow::Result<Scenario> {
    let (mut permit, mut trivial, mut trips) = (vec![], vec![], vec![]);
    for i in 1..=args.runs {
        progress(&format!(
            "permit path {i}/{}: permit script vs trivial EVALSHA",
            args.runs
        ));
        let window = Duration::from_secs(args.permit_seconds);
        let (rate, per_decision) = permit_script(base, window).await?;
        permit.push(rate);
        trips.push(per_decision);
        trivial.push(trivial_script(base, window).await?);
    }
    let ratios = permit.iter().zip(&trivial).map(|(p, t)| p / t).collect();
    let on_cluster = on_a_redis_cluster(base, args).await?;
    let cluster_ratios = on_cluster.iter().zip(&permit).map(|(c, p)| c / p).collect();
    Ok(Scenario {
        key: "permit_path",
        title: "Permit path",
        parameters: json!({
            "seconds": args.permit_seconds,
            "runs": args.runs,
            "in_flight": IN_FLIGHT,
            "cluster": "a private Redis Cluster of 3 masters and 3 replicas on this machine \
                (scripts/clusters.sh), the installation's keys in one slot",
        }),
        figures: vec![
            Figure::new("permit script", "decisions/s", permit),
            Figure::new("trivial EVALSHA", "calls/s", trivial),
            Figure::new("permit / trivial", "ratio", ratios),
            Figure::new("Redis round trips per decision", "calls", trips).target("<= 1"),
            Figure::new(
                "permit script on a Redis Cluster",
                "decisions/s",
                on_cluster,
            ),
            Figure::new("Redis Cluster / single Redis", "ratio", cluster_ratios),
        ],
    })
}

/// The permit script's decisions/s on a private Redis Cluster, started
/// for the measurement and stopped after it.
async fn on_a_redis_cluster(base: &Config, args: &BenchArgs) -> anyhow::Result<Vec<f64>> {
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
        let mut rates = Vec::new();
        for i in 1..=args.runs {
            progress(&format!("permit path on a Redis Cluster {i}/{}", args.runs));
            let window = Duration::from_secs(args.permit_seconds);
            rates.push(permit_script(&config, window).await?.0);
        }
        anyhow::Ok(rates)
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
    cli::set_tenant_quota(
        &store,
        tenant,
        Quota::new("1000000/s".parse()?, 1000)?,
        "bench",
    )
    .await?;
    Ok((redis, permits, store))
}

async fn permit_script(base: &Config, window: Duration) -> anyhow::Result<(f64, f64)> {
    let (redis, permits, store) = unlimited_tenant(base, "bench").await?;
    let permits = Arc::new(permits);
    let trips_before = client_round_trips(&redis).await?;
    let count = Arc::new(AtomicU64::new(0));
    let deadline = Instant::now() + window;
    let mut tasks = Vec::new();
    for worker in 0..IN_FLIGHT {
        let (permits, count) = (Arc::clone(&permits), Arc::clone(&count));
        tasks.push(tokio::spawn(async move {
            let (tenant, route) = (
                TenantId::parse("bench").expect("valid"),
                Kind::default_kind(),
            );
            let mut i = 0u64;
            while Instant::now() < deadline {
                i += 1;
                let id = JobId::parse(format!("{worker}-{i}")).expect("valid id");
                let key = IdempotencyKey::from(&id);
                let request = PermitRequest {
                    tenant: &tenant,
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
