//! What a job costs Redis, in instructions: a private `redis-server` run
//! under valgrind's callgrind, counting what it executes for a permit
//! decision and for a completion, beside a `GET` and a trivial `EVALSHA`.
//! Wall-clock figures on this shared machine move by a third from run to
//! run; an instruction count moves by well under 1 %, so a change to the
//! scripts can be judged by one run.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::Context;
use serde_json::json;
use tollgate_core::ports::{PermitRequest, PermitStore, PermitUse};
use tollgate_core::{
    Clock, IdempotencyKey, JobId, Kind, Priority, ProviderOutcome, Quota, TenantId,
};
use tollgate_quota::{CallCount, Calls, Script, Tallied, redis_cmd};
use tollgate_runtime::system_clock::SystemClock;

use super::permits::unlimited_tenant;
use super::{Figure, Scenario, progress};
use tollgate::cli;
use tollgate::config::Config;

/// Calls counted per figure (after as many to warm up).
const CALLS: u64 = 500;

/// Tenants in the larger of the two tallies measured.
const TALLY_TENANTS: usize = 100;

/// `None` when valgrind is not installed (the scenario is skipped).
pub async fn run(base: &Config) -> anyhow::Result<Option<Scenario>> {
    if Command::new("valgrind").arg("--version").output().is_err() {
        progress("redis cost: valgrind is not installed (apt-get install valgrind); skipped");
        return Ok(None);
    }
    progress("redis cost: a private redis-server under callgrind");
    let server = Callgrind::start()?;
    let measured = measure(base, &server).await;
    drop(server);
    let [permit, denied, complete, added, added_many, get, trivial] = measured?;
    Ok(Some(Scenario {
        key: "redis_cost",
        title: "What a job costs Redis, in instructions",
        parameters: json!({
            "calls": CALLS,
            "redis": "a private redis-server under valgrind --tool=callgrind, one call at a time",
            "permit": "a fresh job of a tenant with a quota of 1,000,000/s, granted; no route quota",
            "denied": "a fresh job of a tenant with a quota of 1/s and a backlog: given a place in line",
            "completion": "that job sent",
            "tally": "a pod's tally of each tenant's calls (one send, its due lag) added to its stats, twice a second whatever the number of calls: for one tenant, and per tenant for 100",
        }),
        figures: vec![
            Figure::new("permit decision", "instructions", vec![permit]),
            Figure::new("permit decision, denied", "instructions", vec![denied]),
            Figure::new("completion of a sent job", "instructions", vec![complete]),
            Figure::new(
                "a pod's tally of one tenant's calls, added",
                "instructions",
                vec![added],
            ),
            Figure::new(
                "the same for 100 tenants, per tenant",
                "instructions",
                vec![added_many],
            ),
            Figure::new("GET (for scale)", "instructions", vec![get]),
            Figure::new(
                "EVALSHA of `return 1` (for scale)",
                "instructions",
                vec![trivial],
            ),
        ],
    }))
}

async fn measure(base: &Config, server: &Callgrind) -> anyhow::Result<[f64; 7]> {
    let config = Config {
        redis_url: tollgate_core::SecretUrl::new(format!("redis://127.0.0.1:{}", server.port)),
        ..base.clone()
    };
    let (redis, permits, store) = unlimited_tenant(&config, "acme").await?;
    let (tenant, paced) = (TenantId::parse("acme")?, TenantId::parse("paced")?);
    let route = Kind::default_kind();
    cli::set_tenant_quota(&store, "paced", Quota::new("1/s".parse()?, 1)?, "bench").await?;

    let ids: Vec<JobId> = (0..2 * CALLS)
        .map(|i| JobId::parse(format!("job-{i}")))
        .collect::<Result<_, _>>()?;
    let keys: Vec<IdempotencyKey> = ids.iter().map(IdempotencyKey::from).collect();
    let request_of = |tenant, i: usize| PermitRequest {
        tenant,
        route: &route,
        job_id: &ids[i],
        key: &keys[i],
        priority: Priority::Normal,
        lease_token: "token",
        returning: None,
        reserve_within: None,
    };
    let request = |i: usize| request_of(&tenant, i);
    let (warm, counted) = (0..CALLS as usize, CALLS as usize..2 * CALLS as usize);

    for i in warm.clone() {
        permits.acquire(request(i)).await?;
    }
    let permit = server
        .count(async {
            for i in counted.clone() {
                permits.acquire(request(i)).await?;
            }
            anyhow::Ok(())
        })
        .await?;
    for i in warm.clone() {
        permits.complete(request(i), PermitUse::Sent, None).await?;
    }
    let complete = server
        .count(async {
            for i in counted.clone() {
                permits.complete(request(i), PermitUse::Sent, None).await?;
            }
            anyhow::Ok(())
        })
        .await?;

    // Asked of Redis one at a time: `acquire` would hand most of a
    // backlog's places out of the pod's own copy of a denial's block.
    for i in warm.clone() {
        permits.decide(request_of(&paced, i), 1, None).await?;
    }
    let denied = server
        .count(async {
            for i in counted.clone() {
                permits.decide(request_of(&paced, i), 1, None).await?;
            }
            anyhow::Ok(())
        })
        .await?;

    // A pod adds its tally of each tenant's calls twice a second, whatever
    // their number: its cost is per tenant and flush, not per job.
    let mut calls = Calls::default();
    calls.count(&ProviderOutcome::Sent, Some(Duration::from_millis(20)));
    let now_ms = || SystemClock.now().0;
    let mut added = [0.0; 2];
    for (figure, tenants) in added.iter_mut().zip([1, TALLY_TENANTS]) {
        let tally = (0..tenants)
            .map(|i| {
                Ok(CallCount {
                    tenant: TenantId::parse(format!("tallied-{i}"))?,
                    calls: calls.clone(),
                })
            })
            .collect::<anyhow::Result<Vec<_>>>()?;
        let tally = Tallied {
            parked: Vec::new(),
            calls: tally,
        };
        store.count_activity(&tally, now_ms()).await?;
        let per_call = server
            .count(async {
                for _ in counted.clone() {
                    store.count_activity(&tally, now_ms()).await?;
                }
                anyhow::Ok(())
            })
            .await?;
        *figure = per_call / tenants as f64;
    }

    let mut conn = redis.conn().await?;
    let get = server
        .count(async {
            for _ in counted.clone() {
                let _: Option<String> = redis_cmd("GET")
                    .arg("cost-get")
                    .query_async(&mut conn)
                    .await?;
            }
            anyhow::Ok(())
        })
        .await?;
    let one = Script::new("return 1");
    let _: i64 = one.invoke_async(&mut conn).await?;
    let trivial = server
        .count(async {
            for _ in counted.clone() {
                let _: i64 = one.invoke_async(&mut conn).await?;
            }
            anyhow::Ok(())
        })
        .await?;
    store.purge_prefix().await?;
    Ok([permit, denied, complete, added[0], added[1], get, trivial])
}

/// A `redis-server` under callgrind on a free port, stopped when dropped.
struct Callgrind {
    child: Child,
    port: u16,
    dir: PathBuf,
}

impl Callgrind {
    fn start() -> anyhow::Result<Self> {
        let port = std::net::TcpListener::bind("127.0.0.1:0")?
            .local_addr()?
            .port();
        let dir = std::env::temp_dir().join(format!("tollgate-redis-cost-{port}"));
        std::fs::create_dir_all(&dir)?;
        let child = Command::new("valgrind")
            .arg("--tool=callgrind")
            .arg(format!(
                "--callgrind-out-file={}/callgrind.%p",
                dir.display()
            ))
            .args([
                "redis-server",
                "--port",
                &port.to_string(),
                "--save",
                "",
                "--appendonly",
                "no",
            ])
            .current_dir(&dir)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("valgrind redis-server")?;
        let server = Self { child, port, dir };
        for _ in 0..200 {
            if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
                return Ok(server);
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        anyhow::bail!("redis-server under callgrind did not listen on {port} within 20 s")
    }

    /// Instructions the server executed per call while `calls` ran
    /// (`CALLS` of them).
    async fn count(&self, calls: impl Future<Output = anyhow::Result<()>>) -> anyhow::Result<f64> {
        self.control("-z")?;
        calls.await?;
        let before = self.dumps()?;
        self.control("-d")?;
        // The dump is written by the server's thread, a moment later.
        for _ in 0..100 {
            let written = self.dumps()?.into_iter().find(|d| !before.contains(d));
            if let Some(total) = written.and_then(|d| totals(&d)) {
                return Ok(total / CALLS as f64);
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        anyhow::bail!("callgrind wrote no dump with totals within 10 s")
    }

    fn control(&self, verb: &str) -> anyhow::Result<()> {
        let status = Command::new("callgrind_control")
            .arg(verb)
            .arg(self.child.id().to_string())
            .stdout(Stdio::null())
            .status()?;
        anyhow::ensure!(status.success(), "callgrind_control {verb}: {status}");
        Ok(())
    }

    fn dumps(&self) -> anyhow::Result<Vec<PathBuf>> {
        Ok(std::fs::read_dir(&self.dir)?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| is_dump(p))
            .collect())
    }
}

/// The instructions a finished dump counts; `None` until it is complete.
fn totals(dump: &Path) -> Option<f64> {
    std::fs::read_to_string(dump)
        .ok()?
        .lines()
        .find_map(|l| {
            l.strip_prefix("totals:")
                .or_else(|| l.strip_prefix("summary:"))
        })
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
}

fn is_dump(path: &Path) -> bool {
    path.file_name()
        .and_then(|n| n.to_str())
        .is_some_and(|n| n.starts_with("callgrind."))
}

impl Drop for Callgrind {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
