//! tollgate on a RabbitMQ cluster of three nodes and on a Redis Cluster of
//! three masters with a replica each, started for the test by
//! `scripts/clusters.sh` from Debian's packages on private ports and torn
//! down after it (the shared servers are never touched). A RabbitMQ cluster
//! takes about 30 s to start on 2 cores, so these tests are `#[ignore]`d here;
//! `make test` runs them in its serial phase
//! (`cargo test --test clusters -- --ignored --test-threads=1`).

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::Value;
use tollgate_amqp::ShardQueue;
use tollgate_core::{Job, Kind, Quota, SecretUrl};
use tollgate_quota::{Change, Keys, Target};
use tollgate_tests::{
    FakeProvider, Received, TestEnv, WorkerHandle, effects, fake_provider, max_in_window, wait_for,
};

/// Each test's run: four tenants, 125 jobs each, at 10/s each.
const TENANTS: [&str; 4] = ["acme", "globex", "initech", "umbrella"];
const PER_TENANT: u32 = 125;
const RATE: u32 = 10;
/// The route's quota in the Redis Cluster's run: below the tenants' sum.
const ROUTE_RATE: u32 = 30;

/// Private clusters in a directory of their own, stopped when dropped.
struct Clusters {
    dir: PathBuf,
    settings: HashMap<String, String>,
}

impl Clusters {
    fn script() -> PathBuf {
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../scripts/clusters.sh")
    }

    /// `scripts/clusters.sh up DIR <which>`, and the settings it wrote.
    async fn up(which: &str) -> Self {
        let dir = std::env::temp_dir().join(format!(
            "tollgate-clusters-{}",
            &uuid::Uuid::new_v4().simple().to_string()[..8]
        ));
        let mut clusters = Self {
            dir,
            settings: HashMap::new(),
        };
        clusters.run(&["up", which]).await;
        let text =
            std::fs::read_to_string(clusters.dir.join("env")).expect("clusters.sh wrote env");
        clusters.settings = text
            .lines()
            .filter_map(|l| l.split_once('='))
            .map(|(k, v)| (k.to_owned(), v.to_owned()))
            .collect();
        clusters
    }

    fn get(&self, key: &str) -> &str {
        self.settings
            .get(key)
            .unwrap_or_else(|| panic!("clusters.sh set no {key}"))
    }

    /// A comma-separated setting, split.
    fn list(&self, key: &str) -> Vec<String> {
        self.get(key).split(',').map(str::to_owned).collect()
    }

    /// `scripts/clusters.sh <command> DIR <args>`; its stdout.
    async fn run(&self, command_and_args: &[&str]) -> String {
        let (command, args) = command_and_args.split_first().expect("a command");
        let mut cmd = Command::new(Self::script());
        cmd.arg(command).arg(&self.dir).args(args);
        let out = tokio::task::spawn_blocking(move || cmd.output())
            .await
            .unwrap()
            .expect("clusters.sh runs");
        assert!(
            out.status.success(),
            "clusters.sh {command_and_args:?} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// `rabbitmqctl -q list_queues <columns>` on node `node` (1..3), as JSON.
    async fn list_queues(&self, node: usize, columns: &[&str]) -> Vec<Value> {
        let node = node.to_string();
        let mut args = vec!["rabbitmqctl", &node, "-q", "list_queues"];
        args.extend(columns);
        args.extend(["--formatter", "json"]);
        let out = self.run(&args).await;
        serde_json::from_str(&out).unwrap_or_else(|e| panic!("list_queues gave {out:?}: {e}"))
    }
}

impl Drop for Clusters {
    fn drop(&mut self) {
        let _ = Command::new(Self::script())
            .arg("down")
            .arg(&self.dir)
            .status();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The most sends of one of `tenants` the provider saw in any second.
fn busiest_second(received: &[Received], tenants: &[&str]) -> usize {
    tenants
        .iter()
        .map(|t| {
            let times: Vec<Instant> = received
                .iter()
                .filter(|r| r.tenant == *t)
                .map(|r| r.instant)
                .collect();
            max_in_window(&times, Duration::from_secs(1))
        })
        .max()
        .unwrap_or(0)
}

/// Publishes each test's jobs and waits until the provider has seen 80.
async fn start_the_run(env: &TestEnv, provider: &FakeProvider) -> Vec<Job> {
    let mut jobs = Vec::new();
    for tenant in TENANTS {
        jobs.extend(env.publish(tenant, PER_TENANT, |_| {}).await);
    }
    wait_for("the run to start", Duration::from_secs(30), || async {
        provider.accepted() >= 80
    })
    .await;
    jobs
}

async fn every_worker_ready(workers: &[WorkerHandle]) {
    for w in workers {
        wait_for("every worker ready", Duration::from_secs(30), || async {
            w.worker.readiness().await.ready()
        })
        .await;
    }
}

/// This installation's queues (name → the row `list_queues` gave).
fn own_queues(rows: Vec<Value>, prefix: &str) -> HashMap<String, Value> {
    rows.into_iter()
        .filter_map(|row| {
            let name = row["name"].as_str()?.to_owned();
            name.starts_with(&format!("{prefix}."))
                .then_some((name, row))
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "starts a private 3-node RabbitMQ cluster: make test runs it in its serial phase"]
async fn a_rabbitmq_node_stopped_mid_run_loses_nothing_and_sends_nothing_twice() {
    let clusters = Clusters::up("--rabbit-only").await;
    let nodes: Vec<String> = clusters.list("RABBIT_NODES");
    // The provider accepts everything; the quota is checked on what it saw.
    let provider = FakeProvider::start_punctual(fake_provider::always_ok())
        .await
        .unwrap();
    let urls = clusters.get("RABBIT_AMQP_URLS").to_owned();
    let mut env = TestEnv::new_with(&provider.url(), |c| {
        c.amqp_url = SecretUrl::new(urls);
        // Three Erlang VMs beside a debug build on 2 cores delay some
        // requests tens of milliseconds between the worker and the
        // provider, more than the default 2 % margin (20 ms a second)
        // absorbs; an operator on such hosts widens it the same way.
        c.pacing_margin_pct = 10.0;
    })
    .await;
    let prefix = env.config.prefix.clone();
    for tenant in TENANTS {
        env.set_quota(tenant, &format!("{RATE}/s"), 1).await;
    }

    // Every queue of every shard, every delay and the dead queue is replicated on all three nodes.
    let queues = own_queues(clusters.list_queues(1, &["name", "members"]).await, &prefix);
    assert_eq!(
        queues.len(),
        env.broker.topology().all_queues().len(),
        "{queues:?}"
    );
    for (name, row) in &queues {
        let members: HashSet<&str> = row["members"]
            .as_array()
            .unwrap_or_else(|| panic!("{name}: {row}"))
            .iter()
            .filter_map(Value::as_str)
            .collect();
        assert_eq!(
            members,
            nodes.iter().map(String::as_str).collect(),
            "{name} has a member on every node"
        );
    }

    // One worker connected to each node first.
    let mut workers: Vec<WorkerHandle> = Vec::new();
    for node in 0..nodes.len() {
        workers.push(env.spawn_worker_at_node(node).await);
    }
    let jobs = start_the_run(&env, &provider).await;
    let published = jobs.len();

    // Stop the node that leads the most of this installation's queues: its
    // worker loses its connection and the queues elect new leaders.
    let leaders = own_queues(clusters.list_queues(1, &["name", "leader"]).await, &prefix);
    let busiest = (0..nodes.len())
        .max_by_key(|&i| {
            leaders
                .values()
                .filter(|row| row["leader"].as_str() == Some(nodes[i].as_str()))
                .count()
        })
        .expect("three nodes");
    let sent_before = provider.accepted();
    clusters
        .run(&["rabbit-stop", &(busiest + 1).to_string()])
        .await;
    let stopped = Instant::now();
    // The worker whose node went connects to another one: every worker
    // consumes again while the node is still down.
    let survivor = if busiest == 0 { 2 } else { 1 };
    for w in &workers {
        wait_for(
            "every worker consuming with a node down",
            Duration::from_secs(30),
            || async { w.worker.readiness().await.ready() },
        )
        .await;
    }
    // RabbitMQ's counts lag (a new leader reports them at its next tick).
    let all_consumed = async |node: usize| {
        let rows = own_queues(
            clusters.list_queues(node, &["name", "consumers"]).await,
            &prefix,
        );
        let topology = env.broker.topology();
        let mut lanes = ShardQueue::ALL.into_iter().flat_map(|k| topology.queues(k));
        lanes.all(|q| {
            rows.get(&q).and_then(|r| r["consumers"].as_u64()) == Some(workers.len() as u64)
        })
    };
    wait_for(
        "every queue of every shard with a consumer per worker, a node down",
        Duration::from_secs(30),
        || all_consumed(survivor),
    )
    .await;
    let back_in = stopped.elapsed();
    wait_for(
        "sends to go on with the node down",
        Duration::from_secs(30),
        || async { provider.accepted() >= sent_before + 40 },
    )
    .await;
    clusters
        .run(&["rabbit-start", &(busiest + 1).to_string()])
        .await;

    let deadline = Instant::now() + Duration::from_secs(120);
    while effects(&provider.received()).0.len() < published {
        if Instant::now() > deadline {
            let depths = clusters
                .list_queues(
                    1,
                    &["name", "messages", "messages_unacknowledged", "consumers"],
                )
                .await;
            panic!(
                "sent {} of {published} after 120 s; queues: {:?}",
                effects(&provider.received()).0.len(),
                own_queues(depths, &prefix)
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    every_worker_ready(&workers).await;
    let received = provider.received();
    let (sent, repeats) = effects(&received);
    let busiest_second = busiest_second(&received, &TENANTS);
    let dead = env.dead_letters().await.len();
    eprintln!(
        "rabbitmq node {} of 3 stopped: every work queue with its 3 consumers again {back_in:?} after; \
         published {published} = sent {} + dead-lettered {dead}; repeats {repeats}; \
         most sends of a tenant in any 1 s {busiest_second} (quota {RATE})",
        busiest + 1,
        sent.len()
    );
    let expected: HashSet<String> = jobs.iter().map(|j| j.idempotency_key.to_string()).collect();
    assert_eq!(sent, expected, "every job sent");
    assert_eq!(repeats, 0, "no job sent twice");
    assert_eq!(dead, 0, "no job dead-lettered");
    assert!(
        busiest_second <= RATE as usize,
        "the quota held: {busiest_second} sends of one tenant in 1 s"
    );

    // Every consumer is back once the node is: one per worker on every queue
    // of every shard, and every queue again has a member online on all
    // three nodes.
    wait_for(
        "every queue of every shard with a consumer per worker, the node back",
        Duration::from_secs(30),
        || all_consumed(busiest + 1),
    )
    .await;
    let online = own_queues(clusters.list_queues(1, &["name", "online"]).await, &prefix);
    for (name, row) in &online {
        assert_eq!(
            row["online"].as_array().map(Vec::len),
            Some(nodes.len()),
            "{name} online on every node again: {row}"
        );
    }
    // The test's own connection may have been to the stopped node.
    env.reconnect().await;
    env.stop_when_drained(workers).await;
}

/// `redis-cli -p PORT ARGS…` against a node of the private cluster.
fn redis_cli(addr: &str, args: &[&str]) -> String {
    let (host, port) = addr.rsplit_once(':').expect("host:port");
    let out = Command::new("redis-cli")
        .args(["-h", host, "-p", port])
        .args(args)
        .output()
        .expect("redis-cli runs");
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "starts a private 6-process Redis Cluster: make test runs it in its serial phase"]
async fn a_redis_master_killed_mid_run_loses_nothing_and_sends_nothing_twice() {
    let clusters = Clusters::up("--redis-only").await;
    let nodes: Vec<String> = clusters.list("REDIS_CLUSTER_NODES");
    let masters: Vec<String> = clusters.list("REDIS_CLUSTER_MASTERS");
    let provider = FakeProvider::start_punctual(fake_provider::always_ok())
        .await
        .unwrap();
    // Every node of the cluster, as an operator would list them.
    let urls: Vec<String> = nodes.iter().map(|n| format!("redis://{n}")).collect();
    let env = TestEnv::new_with(&provider.url(), |c| {
        c.redis_url = SecretUrl::new(urls.join(","));
        // As in the RabbitMQ test: six more processes beside a debug build
        // on 2 cores delay requests beyond the default 2 % margin.
        c.pacing_margin_pct = 10.0;
    })
    .await;
    for tenant in TENANTS {
        env.set_quota(tenant, &format!("{RATE}/s"), 1).await;
    }
    // One provider account for all: the route's quota is below the sum of
    // the tenants', so each job's permit is decided on the route's slot and
    // on its tenant's (`tollgate_core::cross_slot`).
    let route = Kind::default_kind();
    let quota = Quota::new(format!("{ROUTE_RATE}/s").parse().unwrap(), 1).unwrap();
    env.change(
        Target::Route(route.clone()),
        Change::SetQuota {
            quota,
            concurrency: None,
            weight: None,
            adaptive: None,
        },
    )
    .await;
    // The tenants' keys and the route's spread over the masters: the
    // route's on the one whose slot its tag names.
    let holding: Vec<&String> = masters
        .iter()
        .filter(|m| redis_cli(m, &["DBSIZE"]) != "0")
        .collect();
    assert!(
        holding.len() > 1,
        "an installation's tenants and routes spread over the masters: {holding:?}"
    );
    let route_key = Keys::new(&env.config.prefix).route_quota(&route);
    let master = masters
        .iter()
        .find(|m| redis_cli(m, &["EXISTS", &route_key]) == "1")
        .expect("a master holds the route's quota")
        .clone();

    let mut workers: Vec<WorkerHandle> = Vec::new();
    for _ in 0..3 {
        workers.push(env.spawn_worker().await);
    }
    let jobs = start_the_run(&env, &provider).await;
    let published = jobs.len();

    // Crash the master that holds the route's keys, which every permit
    // asks: its replica takes over.
    let sent_before = provider.accepted();
    let port = master.rsplit_once(':').expect("host:port").1.to_owned();
    clusters.run(&["redis-kill", &port]).await;
    let killed = Instant::now();
    wait_for(
        "sends to go on after the failover",
        Duration::from_secs(60),
        || async { provider.accepted() >= sent_before + 40 },
    )
    .await;
    let resumed = killed.elapsed();
    clusters.run(&["redis-start", &port]).await;
    // The crashed master came back as a replica: its replica had taken over.
    let role = redis_cli(&master, &["ROLE"]);
    assert!(
        role.starts_with("slave"),
        "the killed master rejoined as a replica: {role}"
    );

    let deadline = Instant::now() + Duration::from_secs(120);
    while effects(&provider.received()).0.len() < published {
        assert!(
            Instant::now() < deadline,
            "sent {} of {published} after 120 s",
            effects(&provider.received()).0.len()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    every_worker_ready(&workers).await;
    let received = provider.received();
    let (sent, repeats) = effects(&received);
    let busiest_second = busiest_second(&received, &TENANTS);
    let every_send: Vec<Instant> = received.iter().map(|r| r.instant).collect();
    let route_busiest = max_in_window(&every_send, Duration::from_secs(1));
    // The longest pause in sends around the crash: the failover as the
    // provider saw it.
    let mut around: Vec<Instant> = received
        .iter()
        .map(|r| r.instant)
        .filter(|&t| t + Duration::from_secs(2) > killed && t < killed + Duration::from_secs(15))
        .collect();
    around.sort();
    let pause = around
        .windows(2)
        .map(|w| w[1] - w[0])
        .max()
        .unwrap_or_default();
    let dead = env.dead_letters().await.len();
    eprintln!(
        "redis master {master} killed: longest pause in sends {pause:?}, 40 more sent \
         {resumed:?} after; published {published} = \
         sent {} + dead-lettered {dead}; repeats {repeats}; most sends of a tenant in any 1 s \
         {busiest_second} (quota {RATE}), of the route {route_busiest} (quota {ROUTE_RATE})",
        sent.len()
    );
    let expected: HashSet<String> = jobs.iter().map(|j| j.idempotency_key.to_string()).collect();
    assert_eq!(sent, expected, "every job sent");
    assert_eq!(repeats, 0, "no job sent twice");
    assert_eq!(dead, 0, "no job dead-lettered");
    assert!(
        busiest_second <= RATE as usize + 1,
        "the quota held, give or take the one send a lost write allows: \
         {busiest_second} sends of one tenant in 1 s"
    );
    assert!(
        route_busiest <= ROUTE_RATE as usize + 1,
        "the route's quota held, give or take the one send a lost write allows: \
         {route_busiest} sends in 1 s"
    );
    env.drain_and_stop(workers).await;
    // The console's counts, added from each pod's tally one tenant (one
    // slot) per call on a cluster, follow every tenant's sends. Not to the
    // send: a count written just before the failover may be lost with the
    // master, or counted twice when its reply was (at most a pod's half
    // second of counts, each way).
    for tenant in TENANTS {
        let sends = received
            .iter()
            .filter(|r| r.tenant == tenant && r.status == 200)
            .map(|r| r.idempotency_key.as_str())
            .collect::<HashSet<_>>()
            .len() as f64;
        let counted = (env.activity(tenant).await.sent_per_s_5m * 300.0).round();
        assert!(
            (counted - sends).abs() <= sends / 2.0,
            "{tenant}: {counted} sends counted, {sends} made"
        );
    }
    env.cleanup().await;
}
