//! Development tooling, kept out of the product binary: the live demo, the
//! benchmarks (with their Dramatiq and BullMQ peers), and the fake provider
//! they and the integration tests share. Its binary is `tollgate-dev`
//! (`make demo`, `make bench`).

pub mod bench;
pub mod demo;
pub mod fake_provider;

use std::path::PathBuf;

/// The product binary `tollgate`, built beside `tollgate-dev` (`make demo`
/// and `make bench` build both), for the scenarios that run real worker
/// processes.
pub fn tollgate_binary() -> anyhow::Result<PathBuf> {
    let exe = std::env::current_exe()?;
    let bin = exe
        .parent()
        .map(|dir| dir.join("tollgate"))
        .ok_or_else(|| anyhow::anyhow!("{} has no directory", exe.display()))?;
    anyhow::ensure!(
        bin.exists(),
        "{} is missing: build it first (`cargo build --release -p tollgate`; make does)",
        bin.display()
    );
    Ok(bin)
}
