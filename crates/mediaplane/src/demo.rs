//! `mediaplane demo` (being built).
#[derive(clap::Args)]
pub struct DemoArgs {}
pub fn run(_: DemoArgs) -> anyhow::Result<()> {
    anyhow::bail!("demo: not built yet")
}
