//! `kubectl settle`, the kubectl plugin: `status` (the account of every Subscription as a table
//! or JSON), `explain SUB` (why a Subscription is not Ready or Accepted, and what to do), and
//! `pause SUB` / `resume SUB` (a merge patch of `spec.paused` and `spec.pausedUntil`), and
//! `import nack` (NACK's Consumers as Subscriptions: `migrate`'s command, with kubectl's flags).
//!
//! A crate of its own beside the operator: it reads Subscriptions and Backends with the
//! kubeconfig kubectl would use and renders what their status already says, through the same
//! condition constants the writers use (`settle-operator`'s) and the one capability table (`policy`). The one write
//! it makes is `pause`/`resume`'s patch of those two spec fields ([`pause`]), as `kubectl patch`
//! would (admission judges it as any edit). It must not write status, count anything (the
//! account does) nor decide a condition (the writers do); the rendering (`status`, `explain`)
//! is pure, the I/O is here.

// No unwrap() on a path a user or a broker can reach (unit tests may: clippy.toml).
#![warn(clippy::unwrap_used)]

mod conditions;
pub mod explain;
pub mod pause;
pub mod status;

use std::process::ExitCode;

use clap::{Args, Parser, Subcommand, ValueEnum};
use kube::api::ListParams;
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Api, Client, Config};

use settle::api::{Backend, Duration, Subscription};

/// The command line of `kubectl-settle` (kubectl runs it as `kubectl settle ...`).
#[derive(Parser, Debug)]
#[command(
    name = "kubectl-settle",
    bin_name = "kubectl settle",
    version,
    about = "Settle's Subscriptions from kubectl: their account and why they are not Ready"
)]
pub struct Cli {
    #[command(flatten)]
    pub cluster: ClusterArgs,
    #[command(subcommand)]
    pub command: Command,
}

/// Which cluster and namespace, as kubectl's own flags say them.
#[derive(Args, Debug)]
pub struct ClusterArgs {
    /// The namespace (default: the kubeconfig context's namespace, else `default`).
    #[arg(short = 'n', long, global = true, env = "KUBECTL_SETTLE_NAMESPACE")]
    pub namespace: Option<String>,
    /// The kubeconfig context to use (default: the current context).
    #[arg(long, global = true, env = "KUBECTL_SETTLE_CONTEXT")]
    pub context: Option<String>,
    /// The kubeconfig file (default: $KUBECONFIG, else ~/.kube/config, else in-cluster).
    #[arg(long, global = true, env = "KUBECTL_SETTLE_KUBECONFIG")]
    pub kubeconfig: Option<std::path::PathBuf>,
    /// How long one request to the API server may take (connect and read), e.g. 30s.
    #[arg(
        long,
        global = true,
        default_value = "30s",
        env = "KUBECTL_SETTLE_REQUEST_TIMEOUT"
    )]
    pub request_timeout: Duration,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// The account of every Subscription in the namespace (or all of them with -A): counters,
    /// gauges and the conditions that are not healthy.
    Status {
        /// Every namespace (adds a NAMESPACE column).
        #[arg(short = 'A', long)]
        all_namespaces: bool,
        /// Output format: the table (default), a wider table, or one JSON array.
        #[arg(short = 'o', long, value_enum)]
        output: Option<Output>,
    },
    /// Why one Subscription is not Ready or Accepted and what to do, from its status conditions,
    /// its account and its Backend's capabilities.
    Explain {
        /// The Subscription's name.
        name: String,
    },
    /// Pauses a Subscription's delivery without deleting anything (sets spec.paused, and
    /// spec.pausedUntil with --until or --for): nothing is offered until it is resumed; its
    /// `Paused` condition says when the broker holds the pause.
    Pause {
        /// The Subscription's name.
        name: String,
        /// Resume by itself at this time (RFC 3339, e.g. 2026-12-01T10:00:00Z).
        #[arg(long, conflicts_with = "for_")]
        until: Option<k8s_openapi::jiff::Timestamp>,
        /// Resume by itself after this long from now (e.g. 30m, 2h).
        #[arg(long = "for", id = "for_")]
        for_: Option<Duration>,
    },
    /// Resumes a paused Subscription (removes spec.paused and spec.pausedUntil): delivery picks
    /// up where it stopped.
    Resume {
        /// The Subscription's name.
        name: String,
    },
    /// Turn another controller's resources into Settle's manifests (`settle import`).
    #[command(subcommand)]
    Import(Import),
}

/// `kubectl settle import ...`.
#[derive(Subcommand, Debug)]
pub enum Import {
    /// NACK's `Consumer` resources as Subscriptions with `adopt: IfCompatible`, and Backends for
    /// their servers and Accounts (the same as `settle import nack`). Findings go to stderr and
    /// into the YAML as comments. Exits 0 when everything was written, 1 when something was
    /// refused or would change behaviour (written only with --allow-changes), 2 when the input
    /// cannot be read.
    Nack(settle_import::NackArgs),
}

/// `-o`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Output {
    /// More columns: offered, released, lost, refused, the Backend's kind, the conditions' reasons.
    Wide,
    /// One JSON array of objects (the fields of `status::Row`).
    Json,
}

/// What can go wrong; each says what to check.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(
        "cannot load the kubeconfig: {0} (set KUBECONFIG or --kubeconfig, as for kubectl; --context must name a context in it)"
    )]
    Kubeconfig(String),
    #[error("cannot build a client from the kubeconfig: {0}")]
    Client(#[source] kube::Error),
    #[error(
        "Subscription {name:?} not found in namespace {namespace:?} (`kubectl settle status -n {namespace}` lists them; -n picks the namespace)"
    )]
    NotFound { namespace: String, name: String },
    #[error(
        "cannot {what}: {source} (is the API server reachable, and are Settle's CRDs installed?)"
    )]
    Api {
        what: String,
        #[source]
        source: kube::Error,
    },
    #[error("cannot write JSON: {0}")]
    Json(#[from] serde_json::Error),
    #[error("{0}")]
    Usage(String),
    /// A command that said what went wrong itself, ending with this status.
    #[error("exit status {0}")]
    Exit(u8),
}

/// Runs the command and writes what it shows to `out`.
pub async fn run(cli: Cli, out: &mut impl std::io::Write) -> Result<(), Error> {
    if let Command::Import(Import::Nack(args)) = &cli.command {
        return import_nack(args, &cli.cluster, out).await;
    }
    let (client, default_namespace) = client(&cli.cluster).await?;
    let namespace = cli.cluster.namespace.clone().unwrap_or(default_namespace);
    let text = match cli.command {
        Command::Status {
            all_namespaces,
            output,
        } => status_text(client, &namespace, all_namespaces, output).await?,
        // Run above, before any client is made.
        Command::Import(_) => String::new(),
        Command::Explain { name } => explain_text(client, &namespace, &name).await?,
        Command::Pause { name, until, for_ } => {
            pause_text(client, &namespace, &name, until, for_).await?
        }
        Command::Resume { name } => {
            let subs = Api::<Subscription>::namespaced(client, &namespace);
            pause::patch(&subs, &namespace, &name, &pause::resume_body()).await?;
            format!("Subscription {namespace}/{name} resumed: delivery picks up where it stopped\n")
        }
    };
    // A reader that went away (`| head`) is not an error worth a message.
    let _ = out.write_all(text.as_bytes());
    Ok(())
}

/// `import nack`, which says itself what went wrong: its exit status as [`Error::Exit`].
async fn import_nack(
    args: &settle_import::NackArgs,
    cluster: &ClusterArgs,
    out: &mut impl std::io::Write,
) -> Result<(), Error> {
    // Files are converted offline: the cluster is read only with --from-cluster.
    let code = settle_import::run_nack(
        args,
        cluster.namespace.clone(),
        || async { client(cluster).await.map_err(|e| e.to_string()) },
        out,
        &mut std::io::stderr().lock(),
    )
    .await;
    match code {
        0 => Ok(()),
        code => Err(Error::Exit(code)),
    }
}

/// `status`: the Subscriptions and Backends of `namespace` (or all), as a table or JSON.
async fn status_text(
    client: Client,
    namespace: &str,
    all_namespaces: bool,
    output: Option<Output>,
) -> Result<String, Error> {
    let (subs, backends) = if all_namespaces {
        (
            list(
                Api::<Subscription>::all(client.clone()),
                "list Subscriptions",
            )
            .await?,
            list(Api::<Backend>::all(client), "list Backends").await?,
        )
    } else {
        (
            list(
                Api::<Subscription>::namespaced(client.clone(), namespace),
                "list Subscriptions",
            )
            .await?,
            list(
                Api::<Backend>::namespaced(client, namespace),
                "list Backends",
            )
            .await?,
        )
    };
    let rows = status::rows(&subs, &backends);
    Ok(match output {
        Some(Output::Json) => {
            let mut s = serde_json::to_string_pretty(&rows)?;
            s.push('\n');
            s
        }
        Some(Output::Wide) => status::table(&rows, all_namespaces, true),
        None if rows.is_empty() && !all_namespaces => {
            format!("No Subscriptions found in namespace {namespace}.\n")
        }
        None if rows.is_empty() => "No Subscriptions found.\n".to_string(),
        None => status::table(&rows, all_namespaces, false),
    })
}

/// `explain NAME`: the Subscription and its Backend read, then explained.
async fn explain_text(client: Client, namespace: &str, name: &str) -> Result<String, Error> {
    let subs = Api::<Subscription>::namespaced(client.clone(), namespace);
    let sub = subs
        .get_opt(name)
        .await
        .map_err(|source| Error::Api {
            what: format!("read Subscription {namespace}/{name}"),
            source,
        })?
        .ok_or_else(|| Error::NotFound {
            namespace: namespace.to_string(),
            name: name.to_string(),
        })?;
    let backend_name = &sub.spec.backend_ref.name;
    let backend = Api::<Backend>::namespaced(client, namespace)
        .get_opt(backend_name)
        .await
        .map_err(|source| Error::Api {
            what: format!("read Backend {namespace}/{backend_name}"),
            source,
        })?;
    Ok(explain::explain(&sub, backend.as_ref()))
}

/// `pause NAME`: `spec.paused` (and `spec.pausedUntil` from --until or --for) patched; a time
/// already past is a usage error.
async fn pause_text(
    client: Client,
    namespace: &str,
    name: &str,
    until: Option<k8s_openapi::jiff::Timestamp>,
    for_: Option<Duration>,
) -> Result<String, Error> {
    let now = k8s_openapi::jiff::Timestamp::now();
    let until = match (until, for_) {
        (Some(t), _) => Some(t),
        (None, Some(d)) => Some(pause::after(now, d.get())?),
        (None, None) => None,
    };
    if let Some(t) = until
        && t <= now
    {
        return Err(Error::Usage(format!(
            "--until {t} has passed already: a pause until then is no pause; give a later time, or --for"
        )));
    }
    let subs = Api::<Subscription>::namespaced(client, namespace);
    pause::patch(&subs, namespace, name, &pause::pause_body(until)).await?;
    Ok(pause::paused_text(namespace, name, until))
}

async fn list<K>(api: Api<K>, what: &str) -> Result<Vec<K>, Error>
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    api.list(&ListParams::default())
        .await
        .map(|l| l.items)
        .map_err(|source| Error::Api {
            what: what.to_string(),
            source,
        })
}

/// The client kubectl would make: `--kubeconfig`, else $KUBECONFIG, else ~/.kube/config, else
/// in-cluster; `--context` picks a context. Returns the context's namespace beside it.
async fn client(args: &ClusterArgs) -> Result<(Client, String), Error> {
    let options = KubeConfigOptions {
        context: args.context.clone(),
        ..KubeConfigOptions::default()
    };
    let mut config = match (&args.kubeconfig, &args.context) {
        (Some(path), _) => {
            let kubeconfig =
                Kubeconfig::read_from(path).map_err(|e| Error::Kubeconfig(e.to_string()))?;
            Config::from_custom_kubeconfig(kubeconfig, &options)
                .await
                .map_err(|e| Error::Kubeconfig(e.to_string()))?
        }
        (None, Some(_)) => Config::from_kubeconfig(&options)
            .await
            .map_err(|e| Error::Kubeconfig(e.to_string()))?,
        (None, None) => Config::infer()
            .await
            .map_err(|e| Error::Kubeconfig(e.to_string()))?,
    };
    config.connect_timeout = Some(args.request_timeout.get());
    config.read_timeout = Some(args.request_timeout.get());
    let namespace = config.default_namespace.clone();
    let client = Client::try_from(config).map_err(Error::Client)?;
    Ok((client, namespace))
}

/// The process's exit: 0 when it showed what was asked, 1 on an error (written to stderr);
/// `import nack` ends with its own status (0, 1 or 2), having said why.
pub fn exit(result: Result<(), Error>) -> ExitCode {
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(Error::Exit(code)) => ExitCode::from(code),
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
