//! The `tollgate` binary: parse arguments, load config, run the verb, map
//! failure to an exit code: 2 for arguments clap refuses (its usage error),
//! 64 for bad configuration (or an empty `--actor`), 1 for anything else,
//! arguments a verb refuses (`--rate 0/s`) included.

use std::process::ExitCode;
use std::sync::Arc;

use clap::Parser;
use tollgate::cli::{self, Cli, Command};
use tollgate::config::Config;
use tollgate::{http, logging};
use tollgate_quota::Actor;
use tollgate_runtime::{LiveWorker, Metrics};

const EXIT_CONFIG: u8 = 64;

/// glibc's allocator took a fifth of a busy worker's CPU (`perf`, 64 jobs in
/// flight): every job allocates its keys, its calls' arguments and its
/// replies, from every runtime thread. mimalloc's per-thread heaps make those
/// allocations cheap.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    let args = Cli::parse();
    let config = match Config::load(args.config.as_deref()) {
        Ok(config) => config,
        Err(e) => {
            eprintln!("tollgate: bad configuration: {e:#}");
            return ExitCode::from(EXIT_CONFIG);
        }
    };
    let default_level = match args.command {
        Command::Worker => "info",
        _ => "warn",
    };
    logging::init(config.log_format, default_level);
    let actor = match cli::cli_actor(args.actor.as_deref()) {
        Ok(actor) => actor,
        Err(e) => {
            eprintln!("tollgate: {e:#}");
            return ExitCode::from(EXIT_CONFIG);
        }
    };
    if matches!(args.command, Command::Worker) && config.routes().is_ok_and(|r| r.is_empty()) {
        eprintln!(
            "tollgate: bad configuration: no provider route: set TOLLGATE_PROVIDER_URL (or \
             [routes] in the config file)"
        );
        return ExitCode::from(EXIT_CONFIG);
    }
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(usize::from(config.runtime_threads))
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("tollgate: starting the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(args.command, &actor, config)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("tollgate: {e:#}");
            ExitCode::FAILURE
        }
    }
}

async fn run(command: Command, actor: &Actor, config: Config) -> anyhow::Result<()> {
    match command {
        Command::Worker => worker(config).await,
        Command::Publish(args) => cli::publish(&config, &args).await,
        Command::Quota(cmd) => cli::quota(&config, &cmd, actor).await,
        Command::Tenant(cmd) => cli::tenant(&config, &cmd, actor).await,
        Command::Cancel(args) => cli::cancel(&config, &args, actor).await,
        Command::Topology(cmd) => cli::topology(&config, &cmd).await,
        Command::Dlq(cmd) => cli::dlq(&config, &cmd, actor).await,
    }
}

async fn worker(config: Config) -> anyhow::Result<()> {
    let metrics = Metrics::new(config.tenant_label_limit, &config.tenant_label_allowlist);
    let worker = Arc::new(LiveWorker::new(
        &config.worker_settings()?,
        metrics.clone(),
    )?);
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let admin = tollgate::admin::AdminState {
        store: Arc::new(tollgate::cli::quota_store(&config)?),
        token: config.admin_token()?,
        config: Arc::new(config.clone()),
    };
    for route in config.baseline_routes_unknown()? {
        tracing::warn!(
            route,
            "the quota baseline sets a quota for route {route:?}, which no provider route of \
             this configuration has: a typo? It is seeded all the same"
        );
    }
    if let Some(stop) = config.stop_overrun() {
        tracing::warn!(
            "a provider call begun just before a stop may take {} s to settle \
             (provider_timeout_ms + 5 s), longer than shutdown_grace_ms ({} s): the worker waits \
             for it rather than abandon a send, so give it that long to stop (Kubernetes' \
             terminationGracePeriodSeconds), or a kill midway may send the job twice",
            stop.as_secs_f64(),
            config.shutdown_grace_ms as f64 / 1000.0
        );
    }
    if admin.token.is_none() {
        tracing::warn!(
            "TOLLGATE_ADMIN_TOKEN is not set: the admin API under /v1/ refuses every request"
        );
    }
    let router = http::router(metrics, worker.clone()).merge(tollgate::admin::router(admin));
    let mut http_stop = stop_rx.clone();
    let (addr, server) = http::serve(
        config.http_addr,
        router,
        config.server_limits(),
        async move {
            let _ = http_stop.wait_for(|&stop| stop).await;
        },
    )
    .await?;
    tracing::info!(%addr, "serving /metrics, /healthz, /readyz, the admin API under /v1/ and the console under /console/");
    let result = worker.run(shutdown_signal()).await;
    let _ = stop_tx.send(true);
    let _ = server.await;
    result
}

/// Resolves on SIGTERM (Kubernetes) or SIGINT (Ctrl-C).
async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .expect("installing the SIGTERM handler");
        tokio::select! {
            _ = ctrl_c => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    let _ = ctrl_c.await;
    tracing::info!("shutdown requested");
}
