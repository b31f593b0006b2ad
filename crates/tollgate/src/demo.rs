//! Placeholder replaced below.
use clap::Args;
#[derive(Debug, Args)]
pub struct DemoArgs {}
pub async fn run(_: &crate::Config, _: &DemoArgs) -> anyhow::Result<()> { anyhow::bail!("todo") }
