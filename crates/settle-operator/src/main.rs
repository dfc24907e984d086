//! The `settle` command: `settle operator` runs the operator, `settle crds` prints the CRDs, `settle check` applies the admission
//! rules to manifests offline (same code as the webhook), `settle import nack` turns NACK's Consumers into Subscriptions.

// No unwrap() on a path a user or a broker can reach (unit tests may: clippy.toml).
#![warn(clippy::unwrap_used)]

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use settle::policy::BackendKind;
use settle_operator::admission::offline;

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
    /// Run the operator: the admission webhook and the metrics/health server.
    Operator(Box<settle_operator::operator::OperatorArgs>),
    /// Print the CustomResourceDefinitions as YAML (what `crds/` holds).
    Crds,
    /// Check Subscription manifests against the admission rules, offline. Exits 0 when all are
    /// admitted, 1 when any is refused (a field that does not fit the schema included), 2 when
    /// the input cannot be read (a missing path, no YAML files, a file that is not valid YAML).
    Check {
        /// A manifest file, or a directory searched for *.yaml and *.yml.
        #[arg(short = 'f', long = "filename", required = true)]
        files: Vec<PathBuf>,
        /// Check every Subscription against this backend kind (nats, memory, sqs, rabbitmq)
        /// instead of the Backend named in the input.
        #[arg(long, env = "SETTLE_BACKEND_KIND")]
        backend_kind: Option<BackendKind>,
    },
    /// Turn another controller's resources into Settle's manifests (stdout, or -o DIR).
    #[command(subcommand)]
    Import(Import),
}

#[derive(Subcommand)]
enum Import {
    /// NACK's `Consumer` resources (jetstream.nats.io) as Subscriptions with `adopt:
    /// IfCompatible`, and Backends for their servers and Accounts. Findings (NACK's unsafe
    /// defaults, what Settle refuses or cannot express) go to stderr and into the YAML as
    /// comments. Exits 0 when everything was written, 1 when something was refused or would
    /// change behaviour (written only with --allow-changes), 2 when the input cannot be read.
    Nack {
        #[command(flatten)]
        args: settle_import::NackArgs,
        #[command(flatten)]
        cluster: settle_import::ClusterFlags,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Operator(args) => operator(*args),
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
        Command::Check {
            files,
            backend_kind,
        } => check(&files, backend_kind),
        Command::Import(Import::Nack { args, cluster }) => import_nack(&args, &cluster),
    }
}

fn import_nack(args: &settle_import::NackArgs, cluster: &settle_import::ClusterFlags) -> ExitCode {
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("settle import nack: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let code = runtime.block_on(settle_import::run_nack(
        args,
        cluster.namespace.clone(),
        || settle_import::connect(cluster),
        &mut std::io::stdout().lock(),
        &mut std::io::stderr().lock(),
    ));
    ExitCode::from(code)
}

fn operator(args: settle_operator::operator::OperatorArgs) -> ExitCode {
    settle_operator::operator::init_logging(args.log_format);
    // Before the runtime's threads start: an arena is made for a thread the first time it
    // allocates.
    settle_operator::operator::tune_allocator(args.allocator_arenas);
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("settle operator: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(settle_operator::operator::run(args)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!(error = %e, "settle operator stopped");
            eprintln!("settle operator: {e}");
            ExitCode::FAILURE
        }
    }
}

fn check(paths: &[PathBuf], backend_kind: Option<BackendKind>) -> ExitCode {
    let mut inputs = Vec::new();
    for path in paths {
        let files = match offline::collect_files(path) {
            Ok(f) => f,
            Err(e) => {
                eprintln!("settle check: {e}");
                return ExitCode::from(2);
            }
        };
        for file in files {
            match std::fs::read_to_string(&file) {
                Ok(text) => inputs.push((file.display().to_string(), text)),
                Err(e) => {
                    eprintln!("settle check: {}: {e}", file.display());
                    return ExitCode::from(2);
                }
            }
        }
    }
    let report = offline::check(&inputs, backend_kind);
    let refused = report
        .findings
        .iter()
        .filter(|f| !f.errors.is_empty())
        .count();
    // Write through a locked stdout and stop quietly if the reader went away (`| head`).
    let mut out = std::io::stdout().lock();
    let _ = (|| -> std::io::Result<()> {
        if report.findings.is_empty() {
            writeln!(out, "no Settle resources found")?;
        }
        for finding in &report.findings {
            writeln!(out, "{finding}")?;
        }
        writeln!(out, "{} checked, {refused} refused", report.findings.len())
    })();
    if report.unreadable > 0 {
        ExitCode::from(2)
    } else if report.has_errors() {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}
