//! The `settle` command: `settle crds` today; `settle operator` and `settle check` follow.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "settle",
    version,
    about = "Message subscriptions as Kubernetes resources"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Print the CustomResourceDefinitions as YAML (what `crds/` holds).
    Crds,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Crds => match settle::api::crds_yaml() {
            Ok(yaml) => {
                print!("{yaml}");
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("settle crds: {e}");
                ExitCode::FAILURE
            }
        },
    }
}
