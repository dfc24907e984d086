//! `kubectl-settle`, the kubectl plugin (kubectl runs it as `kubectl settle ...` when it is on
//! PATH): parses the command line and hands it to `kubectl_settle`, where everything else lives.

// No unwrap() on a path a user or a broker can reach (unit tests may: clippy.toml).
#![warn(clippy::unwrap_used)]

use std::process::ExitCode;

use clap::Parser;
use kubectl_settle::{Cli, exit, run};

fn main() -> ExitCode {
    let cli = Cli::parse();
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    exit(runtime.block_on(run(cli, &mut std::io::stdout().lock())))
}
