//! `tollgate-dev`: the demo and the benchmarks, on the local RabbitMQ and
//! Redis. Not shipped: the container image builds only `tollgate`.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use tollgate::config::Config;
use tollgate::logging;
use tollgate_dev::bench::BenchArgs;
use tollgate_dev::demo::DemoArgs;

/// The product's allocator (see `tollgate`'s `main.rs`): the benchmarks'
/// in-process pods and their minimal pipeline run on what production runs.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Debug, Parser)]
#[command(
    name = "tollgate-dev",
    about = "tollgate's development tools: a live demo and the benchmarks"
)]
struct Cli {
    /// TOML config file; every key can be overridden by TOLLGATE_<KEY>.
    #[arg(long, global = true, env = "TOLLGATE_CONFIG")]
    config: Option<PathBuf>,

    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// A self-contained live demonstration on the local RabbitMQ and Redis.
    #[command(after_help = "Example: tollgate-dev demo --duration 30s --workers 3")]
    Demo(DemoArgs),
    /// Measure throughput, pacing, fairness and two peers; writes target/bench/report.{json,md}.
    #[command(
        after_help = "Example: tollgate-dev bench --jobs 10000 --runs 3\n\nBENCH_WORKER_LOG=DIR: the worker processes log at debug level to DIR/worker-<port>.log (a per-decision trace of a run)."
    )]
    Bench(BenchArgs),
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = Cli::parse();
    let config = match Config::load(args.config.as_deref()) {
        Ok(config) => config,
        Err(e) => {
            eprintln!("tollgate-dev: bad configuration: {e:#}");
            return ExitCode::from(64);
        }
    };
    logging::init(config.log_format, "warn");
    let result = match &args.command {
        Command::Demo(demo) => tollgate_dev::demo::run(&config, demo).await,
        Command::Bench(bench) => tollgate_dev::bench::run(&config, bench).await,
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("tollgate-dev: {e:#}");
            ExitCode::FAILURE
        }
    }
}
