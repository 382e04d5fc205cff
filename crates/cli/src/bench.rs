pub fn run(_s: Option<std::path::PathBuf>, _c: BenchCommand) -> anyhow::Result<()> {
    Ok(())
}
pub fn client(_s: Option<std::path::PathBuf>, _c: ClientArgs) -> anyhow::Result<()> {
    Ok(())
}
#[derive(clap::Subcommand, Debug)]
pub enum BenchCommand {
    Latency,
}
#[derive(clap::Args, Debug)]
pub struct ClientArgs {}
