//! The command `settle import nack` and `kubectl settle import nack` both run: its flags, reading
//! the input (files, stdin, or the cluster), the conversion, and writing the manifests (stdout or
//! one file per namespace) and the findings (stderr).

use std::collections::BTreeMap;
use std::future::Future;
use std::io::Write;
use std::path::{Path, PathBuf};

use clap::Args;
use kube::Client;
use kube::config::{KubeConfigOptions, Kubeconfig};

use super::nack::{self, Input, Options};
use super::{cluster, render};

/// `import nack`'s own flags (the cluster's, `-n`, `--context`, `--kubeconfig`, are the caller's).
#[derive(Args, Debug, Clone)]
pub struct NackArgs {
    /// NACK manifests: a file, a directory searched for *.yaml and *.yml, or - for stdin (e.g.
    /// `kubectl get consumers.jetstream.nats.io,streams.jetstream.nats.io -o yaml`). Consumer,
    /// Stream and Account resources are read; anything else is skipped.
    #[arg(
        short = 'f',
        long = "filename",
        required_unless_present = "from_cluster",
        conflicts_with = "from_cluster"
    )]
    pub files: Vec<PathBuf>,
    /// Read NACK's Consumers, Streams and Accounts from the kubeconfig's cluster instead (the
    /// namespace of -n, or every one with -A).
    #[arg(long, env = "SETTLE_IMPORT_FROM_CLUSTER")]
    pub from_cluster: bool,
    /// With --from-cluster: every namespace.
    #[arg(short = 'A', long, requires = "from_cluster")]
    pub all_namespaces: bool,
    /// Write one file per namespace, DIR/<namespace>.yaml, instead of stdout.
    #[arg(
        short = 'o',
        long = "output-dir",
        value_name = "DIR",
        env = "SETTLE_IMPORT_OUTPUT_DIR"
    )]
    pub output_dir: Option<PathBuf>,
    /// Also write the Subscriptions that would not behave as their NACK consumer did (each
    /// change is said in a comment above it); without it they are written commented out and the
    /// exit status is 1.
    #[arg(long, env = "SETTLE_IMPORT_ALLOW_CHANGES")]
    pub allow_changes: bool,
    /// The NATS server URLs (comma-separated) of Consumers that name neither servers nor an
    /// account: the -s NACK's controller runs with.
    #[arg(
        long,
        value_delimiter = ',',
        value_name = "URLS",
        env = "SETTLE_IMPORT_SERVERS"
    )]
    pub servers: Vec<String>,
}

/// Which cluster `settle import nack` reads with --from-cluster (kubectl's flags).
#[derive(Args, Debug, Clone)]
pub struct ClusterFlags {
    /// The namespace (with --from-cluster: the one read; for files: of resources naming none).
    /// Default: the kubeconfig context's, else `default`.
    #[arg(short = 'n', long, env = "SETTLE_IMPORT_NAMESPACE")]
    pub namespace: Option<String>,
    /// The kubeconfig context (default: the current one).
    #[arg(long, env = "SETTLE_IMPORT_CONTEXT")]
    pub context: Option<String>,
    /// The kubeconfig file (default: $KUBECONFIG, else ~/.kube/config, else in-cluster).
    #[arg(long, env = "SETTLE_IMPORT_KUBECONFIG")]
    pub kubeconfig: Option<PathBuf>,
}

/// Exit status: everything written as asked.
pub const EXIT_OK: u8 = 0;
/// Something was not written: refused, or a change of behaviour without --allow-changes.
pub const EXIT_NOT_ALL: u8 = 1;
/// The input could not be read, or the output not written.
pub const EXIT_INPUT: u8 = 2;

/// A client for `flags`, as kubectl would make it, and the context's namespace.
pub async fn connect(flags: &ClusterFlags) -> Result<(Client, String), String> {
    let options = KubeConfigOptions {
        context: flags.context.clone(),
        ..KubeConfigOptions::default()
    };
    let config = match (&flags.kubeconfig, &flags.context) {
        (Some(path), _) => {
            let k = Kubeconfig::read_from(path).map_err(|e| e.to_string())?;
            kube::Config::from_custom_kubeconfig(k, &options)
                .await
                .map_err(|e| e.to_string())?
        }
        (None, Some(_)) => kube::Config::from_kubeconfig(&options)
            .await
            .map_err(|e| e.to_string())?,
        (None, None) => kube::Config::infer().await.map_err(|e| e.to_string())?,
    };
    let namespace = config.default_namespace.clone();
    Ok((
        Client::try_from(config).map_err(|e| e.to_string())?,
        namespace,
    ))
}

/// Runs `import nack`: `namespace` is -n; `connect` makes the client, and is called only with
/// --from-cluster (files are converted offline, without -n in namespace `default`). Returns the exit status ([`EXIT_OK`], [`EXIT_NOT_ALL`], [`EXIT_INPUT`]).
pub async fn run_nack<C, Fut>(
    args: &NackArgs,
    namespace: Option<String>,
    connect: C,
    out: &mut dyn Write,
    err: &mut dyn Write,
) -> u8
where
    C: FnOnce() -> Fut,
    Fut: Future<Output = Result<(Client, String), String>>,
{
    let (input, default_namespace) = match read_input(args, namespace, connect, err).await {
        Ok(read) => read,
        Err(code) => return code,
    };
    if input.consumers.is_empty() {
        let _ = writeln!(
            err,
            "no NACK Consumer resources found ({} other documents skipped)",
            input.skipped
        );
    }
    let migration = nack::convert(
        &input,
        &Options {
            namespace: default_namespace,
            servers: args.servers.clone(),
        },
    );
    let _ = err.write_all(render::report(&migration, args.allow_changes).as_bytes());
    let manifests = render::manifests(&migration, args.allow_changes);
    if let Err(code) = write_manifests(args.output_dir.as_deref(), &manifests, out, err) {
        return code;
    }
    if migration.clean(args.allow_changes) {
        EXIT_OK
    } else {
        EXIT_NOT_ALL
    }
}

/// The input, from the cluster (--from-cluster) or the files, and the namespace of resources
/// that name none; [`EXIT_INPUT`] when it cannot be read (said on `err`).
async fn read_input<C, Fut>(
    args: &NackArgs,
    namespace: Option<String>,
    connect: C,
    err: &mut dyn Write,
) -> Result<(Input, String), u8>
where
    C: FnOnce() -> Fut,
    Fut: Future<Output = Result<(Client, String), String>>,
{
    if args.from_cluster {
        let (client, context_ns) = match connect().await {
            Ok(c) => c,
            Err(e) => {
                let _ = writeln!(
                    err,
                    "error: cannot load the kubeconfig: {e} (set KUBECONFIG or --kubeconfig, as for kubectl)"
                );
                return Err(EXIT_INPUT);
            }
        };
        let ns = namespace.unwrap_or(context_ns);
        let read_ns = (!args.all_namespaces).then_some(ns.as_str());
        match cluster::read(&client, read_ns).await {
            Ok(i) => Ok((i, ns)),
            Err(e) => {
                let _ = writeln!(err, "error: {e}");
                Err(EXIT_INPUT)
            }
        }
    } else {
        match read_files(&args.files) {
            Ok(i) => Ok((i, namespace.unwrap_or_else(|| "default".to_string()))),
            Err(e) => {
                let _ = writeln!(err, "error: {e}");
                Err(EXIT_INPUT)
            }
        }
    }
}

/// The manifests to `out`, or one file per namespace in `output_dir` (each said on `err`);
/// [`EXIT_INPUT`] when one cannot be written.
fn write_manifests(
    output_dir: Option<&Path>,
    manifests: &BTreeMap<String, String>,
    out: &mut dyn Write,
    err: &mut dyn Write,
) -> Result<(), u8> {
    match output_dir {
        None => {
            for text in manifests.values() {
                let _ = out.write_all(text.as_bytes());
            }
        }
        Some(dir) => {
            if let Err(e) = std::fs::create_dir_all(dir) {
                let _ = writeln!(err, "error: cannot make {}: {e}", dir.display());
                return Err(EXIT_INPUT);
            }
            for (ns, text) in manifests {
                let path = dir.join(format!("{ns}.yaml"));
                if let Err(e) = std::fs::write(&path, text) {
                    let _ = writeln!(err, "error: cannot write {}: {e}", path.display());
                    return Err(EXIT_INPUT);
                }
                let _ = writeln!(err, "wrote {}", path.display());
            }
        }
    }
    Ok(())
}

/// Every document of `paths` (files, directories searched for *.yaml and *.yml, `-` for stdin).
fn read_files(paths: &[PathBuf]) -> Result<Input, String> {
    let mut input = Input::default();
    for path in paths {
        if path == Path::new("-") {
            let mut text = String::new();
            std::io::Read::read_to_string(&mut std::io::stdin(), &mut text)
                .map_err(|e| format!("stdin: {e}"))?;
            add_yaml(&mut input, "stdin", &text)?;
            continue;
        }
        let mut files = Vec::new();
        collect(path, &mut files).map_err(|e| format!("{}: {e}", path.display()))?;
        if files.is_empty() {
            return Err(format!("{}: no .yaml or .yml files found", path.display()));
        }
        for file in files {
            let text =
                std::fs::read_to_string(&file).map_err(|e| format!("{}: {e}", file.display()))?;
            add_yaml(&mut input, &file.display().to_string(), &text)?;
        }
    }
    Ok(input)
}

fn collect(path: &Path, files: &mut Vec<PathBuf>) -> std::io::Result<()> {
    if !path.is_dir() {
        std::fs::metadata(path)?;
        files.push(path.to_path_buf());
        return Ok(());
    }
    let mut entries: Vec<PathBuf> = std::fs::read_dir(path)?
        .map(|e| e.map(|e| e.path()))
        .collect::<Result<_, _>>()?;
    entries.sort();
    for p in entries {
        if p.is_dir() {
            collect(&p, files)?;
        } else if p.extension().is_some_and(|e| e == "yaml" || e == "yml") {
            files.push(p);
        }
    }
    Ok(())
}

fn add_yaml(input: &mut Input, source: &str, text: &str) -> Result<(), String> {
    use serde::Deserialize;
    for (i, doc) in serde_yaml::Deserializer::from_str(text).enumerate() {
        let value = serde_json::Value::deserialize(doc)
            .map_err(|e| format!("{source}#{}: not valid YAML: {e}", i + 1))?;
        if value.is_null() {
            continue;
        }
        input
            .add(value)
            .map_err(|e| format!("{source}#{}: {e}", i + 1))?;
    }
    Ok(())
}
