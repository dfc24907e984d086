//! The `settle operator` flags ([`OperatorArgs`], each with its environment fallback, which the
//! chart sets), checked as they are parsed so a bad one stops the operator at start, and the
//! settings the webhook, the metrics and probe ports and the Backend rules take from them.
//!
//! It must not start anything (that is [`super::run`]).

use std::net::{IpAddr, SocketAddr};
use std::num::NonZeroUsize;
use std::path::PathBuf;
use std::time::Duration;

use super::health;
use crate::admission::webhook::WebhookConfig;
use settle::policy::{BackendRules, HostPattern};

/// How `settle operator` runs. Every flag has an environment fallback (the chart sets those).
#[derive(clap::Args, Clone, Debug)]
pub struct OperatorArgs {
    /// Where the admission webhook listens (HTTPS).
    #[arg(long, env = "SETTLE_WEBHOOK_ADDR", default_value = "0.0.0.0:8443")]
    pub webhook_addr: SocketAddr,
    /// Where /metrics is served (HTTP; HTTPS with --metrics-auth), and /healthz, /readyz too.
    #[arg(long, env = "SETTLE_METRICS_ADDR", default_value = "0.0.0.0:8080")]
    pub metrics_addr: SocketAddr,
    /// The operator's namespace: where it keeps the webhook certificate Secret.
    #[arg(long, env = "SETTLE_NAMESPACE", default_value = "settle-system")]
    pub namespace: String,
    /// The Secret holding the operator's own webhook CA and serving certificate.
    #[arg(
        long,
        env = "SETTLE_WEBHOOK_SECRET",
        default_value = "settle-webhook-tls"
    )]
    pub webhook_secret: String,
    /// The ValidatingWebhookConfiguration whose caBundle the operator keeps current. Empty: none.
    #[arg(long, env = "SETTLE_WEBHOOK_CONFIGURATION", default_value = "settle")]
    pub webhook_configuration: String,
    /// DNS names for the self-managed serving certificate (comma-separated).
    #[arg(
        long,
        env = "SETTLE_WEBHOOK_DNS_NAMES",
        value_delimiter = ',',
        default_value = "settle-webhook.settle-system.svc"
    )]
    pub webhook_dns_names: Vec<String>,
    /// IP addresses for the self-managed serving certificate (comma-separated), e.g. 127.0.0.1
    /// when the API server reaches the webhook by a `url:` clientConfig.
    #[arg(long, env = "SETTLE_WEBHOOK_IPS", value_delimiter = ',')]
    pub webhook_ips: Vec<IpAddr>,
    /// Serve this certificate (PEM, e.g. mounted from cert-manager) instead of a self-managed
    /// one; reloaded when it changes. Requires --tls-key-file.
    #[arg(long, env = "SETTLE_TLS_CERT_FILE", requires = "tls_key_file")]
    pub tls_cert_file: Option<PathBuf>,
    /// The private key for --tls-cert-file.
    #[arg(long, env = "SETTLE_TLS_KEY_FILE", requires = "tls_cert_file")]
    pub tls_key_file: Option<PathBuf>,
    /// Contend for the leader Lease: only its holder reconciles, every replica serves the
    /// webhook. Turn off only when exactly one replica runs.
    #[arg(
        long,
        env = "SETTLE_LEADER_ELECTION",
        default_value_t = true,
        num_args = 0..=1,
        default_missing_value = "true",
        action = clap::ArgAction::Set
    )]
    pub leader_election: bool,
    /// The Lease (in --namespace) the replicas contend for. The holder identity is POD_NAME, else
    /// <hostname>-<pid>.
    #[arg(long, env = "SETTLE_LEASE_NAME", default_value = "settle-operator")]
    pub lease_name: String,
    /// Namespaces whose Backends and Subscriptions are reconciled (comma-separated); empty: all.
    /// Secrets are read only there (the chart grants that access per namespace).
    #[arg(long, env = "SETTLE_WATCH_NAMESPACES", value_delimiter = ',')]
    pub watch_namespaces: Vec<String>,
    /// How often every consumer and connection is re-checked against its resource, besides the
    /// broker's advisories (a Kubernetes duration: 30s, 5m, 1h).
    #[arg(long, env = "SETTLE_RESYNC_INTERVAL", default_value = "5m", value_parser = positive_duration)]
    pub resync_interval: Duration,
    /// At most one status write per Subscription this often, and only when its account changed
    /// (Prometheus metrics carry the full resolution).
    #[arg(long, env = "SETTLE_STATS_INTERVAL", default_value = "10s", value_parser = positive_duration)]
    pub stats_interval: Duration,
    /// The account's status writes across all Subscriptions, at most, per second (a token
    /// bucket with a burst of a fifth of it). A change that matters (Exhausted or Stranded grew,
    /// a condition flipped) goes first, and once per interval even before it is due; the rest
    /// wait in turn, the newest patch per Subscription replacing the one that waited. The
    /// default, 20, is the client rate controller-runtime and kube-controller-manager default
    /// to (QPS 20), the rate an API server is sized to take from one controller: under API
    /// Priority and Fairness, well under one seat of the shared workload-low level. 200
    /// Subscriptions changing within every 10 s interval are written at full freshness;
    /// beyond, each waits its turn (5,000 changing: about every 250 s), while the metrics keep
    /// full resolution.
    #[arg(long, env = "SETTLE_STATUS_WRITES_PER_SECOND", default_value_t = 20, value_parser = clap::value_parser!(u32).range(1..=10_000))]
    pub status_writes_per_second: u32,
    /// After SIGTERM or SIGINT, how long this replica keeps answering admission reviews before
    /// it closes its ports (a Kubernetes duration; 0s closes at once). Its Lease is released
    /// and its controllers stop at once, and the probe port's `/readyz` answers 503, so the
    /// endpoints controller and kube-proxy stop routing reviews to it meanwhile: a review sent
    /// to a closed port fails, and with `failurePolicy: Fail` so does the `kubectl apply`
    /// behind it. Meanwhile each HTTP/1.1 answer closes its connection (`Connection: close`),
    /// so the API server, which keeps webhook connections alive, does not pick one at the
    /// moment the port closes. A second signal closes at once. Keep the pod's
    /// terminationGracePeriodSeconds above it (the chart does).
    #[arg(long, env = "SETTLE_SHUTDOWN_DELAY", default_value = "5s")]
    pub shutdown_delay: settle::api::Duration,
    /// How often the allocator gives the memory it holds free back to the system (glibc's
    /// malloc_trim; 0s never): after a mass apply the caches are small again, but the pages
    /// the apply's requests and responses took stay resident until then.
    #[arg(long, env = "SETTLE_RELEASE_MEMORY_INTERVAL", default_value = "30s")]
    pub release_memory_interval: settle::api::Duration,
    /// How many arenas glibc's allocator may keep (0: glibc's default, eight a core). Each
    /// keeps its own free pages and fragments: two keep an idle operator's resident memory low
    /// (with the fixed mmap threshold, 4.3 MiB less than glibc's defaults at 1,000
    /// Subscriptions), more let threads that allocate at once wait less for each other.
    #[arg(long, env = "SETTLE_ALLOCATOR_ARENAS", default_value_t = 2)]
    pub allocator_arenas: u16,
    /// The Exhausting condition is True while Exhausted grew within this window.
    #[arg(long, env = "SETTLE_LOSS_WINDOW", default_value = "15m", value_parser = positive_duration)]
    pub loss_window: Duration,
    /// The floor of the stall window: the Stalled condition is True while messages are pending
    /// (or delivered and not settled) and no handler returned for the larger of this and three
    /// of the Subscription's ackWaits past its longest decline delay (semantics C22).
    #[arg(long, env = "SETTLE_STALL_WINDOW", default_value = "5m", value_parser = positive_duration)]
    pub stall_window: Duration,
    /// An application instance that has not reported for this long is folded: its last counts
    /// kept, its unfinished attempts counted given up (live ones re-report every 5 minutes).
    #[arg(long, env = "SETTLE_FOLD_AFTER", default_value = "1h", value_parser = positive_duration)]
    pub fold_after: Duration,
    /// How long a NATS keeper holds a loss advisory whose consumer no Subscription's status
    /// names yet (its status may not have reached the operator: a last attempt can run out
    /// within seconds of the consumer's making); past it the advisory counts for nobody and the
    /// Subscription that names the consumer later says so in Accounted (CaptureGap). Below
    /// 30s, the capture reader's ack wait, so a held advisory is never delivered again.
    #[arg(long, env = "SETTLE_UNVERIFIED_ADVISORY_GRACE", default_value = "15s", value_parser = advisory_grace)]
    pub unverified_advisory_grace: Duration,
    /// The size limit, in bytes, of the stream in which each NATS server's delivery advisories
    /// are captured for the account (the oldest go first; a gap is said in status).
    #[arg(long, env = "SETTLE_CAPTURE_MAX_BYTES", default_value_t = 256 * 1024 * 1024)]
    pub capture_max_bytes: u64,
    /// The replicas of the streams the account keeps on each NATS server (the advisory capture
    /// and the buckets `settle-account` and `settle-stats`): 3 on a JetStream cluster of three
    /// or more servers, so a server lost loses no advisory, ledger or report; 1 on a single
    /// server. Streams made before are brought to it in place.
    #[arg(long, env = "SETTLE_ACCOUNT_REPLICAS", default_value_t = 1, value_parser = clap::value_parser!(u8).range(1..=5))]
    pub account_replicas: u8,
    /// A stats report larger than this many bytes is dropped unread (a real one is under 1 KiB).
    #[arg(long, env = "SETTLE_MAX_REPORT_BYTES", default_value_t = 65_536)]
    pub max_report_bytes: u64,
    /// A Subscription counts at most this many live application instances; a report of one
    /// more is dropped until an idle one is folded.
    #[arg(
        long,
        env = "SETTLE_MAX_INSTANCES_PER_SUBSCRIPTION",
        default_value_t = 1_000
    )]
    pub max_instances_per_subscription: u64,
    /// Reports held back for Subscriptions not in the cache yet take at most this many bytes,
    /// over every Backend's keeper of the process (a tenant who adds Backends does not add to
    /// it); beyond, they are dropped (the runtime's next report carries the same counts).
    #[arg(long, env = "SETTLE_MAX_EARLY_REPORT_BYTES", default_value_t = 16 * 1024 * 1024)]
    pub max_early_report_bytes: u64,
    /// A stats report whose sequence is past the last one counted for its instance by more than
    /// this is dropped (one report with a huge sequence would make every later one look old).
    #[arg(long, env = "SETTLE_MAX_SEQUENCE_JUMP", default_value_t = 100_000)]
    pub max_sequence_jump: u64,
    /// A stats report whose instance started, or that was made, later than now plus this is
    /// dropped (a Kubernetes duration).
    #[arg(long, env = "SETTLE_MAX_CLOCK_SKEW", default_value = "5m", value_parser = positive_duration)]
    pub max_clock_skew: Duration,
    /// The largest value the NATS report bucket (`settle-stats`) takes: the broker refuses a
    /// larger report before the operator reads it. Set on the bucket at start.
    #[arg(long, env = "SETTLE_REPORT_BUCKET_MAX_VALUE_BYTES", default_value_t = 65_536, value_parser = clap::value_parser!(i32).range(1024..))]
    pub report_bucket_max_value_bytes: i32,
    /// The most bytes the NATS report bucket holds (beyond, the broker refuses new reports
    /// until folded ones are purged). Set on the bucket at start.
    #[arg(long, env = "SETTLE_REPORT_BUCKET_MAX_BYTES", default_value_t = 1 << 30, value_parser = clap::value_parser!(i64).range(1_048_576..))]
    pub report_bucket_max_bytes: i64,
    /// Reports a RabbitMQ report queue hands the operator unacknowledged at most (they are
    /// acknowledged at each save): with the instance cap, it bounds what a flood of reports can
    /// hold in the operator's memory.
    #[arg(long, env = "SETTLE_REPORT_PREFETCH", default_value_t = 16, value_parser = clap::value_parser!(u16).range(1..))]
    pub report_prefetch: u16,
    /// Copies of dead letters a RabbitMQ Backend's copy queue hands the operator
    /// unacknowledged at most (acknowledged once the ledger counting them is saved).
    #[arg(long, env = "SETTLE_DEAD_LETTER_PREFETCH", default_value_t = 256, value_parser = clap::value_parser!(u16).range(1..))]
    pub dead_letter_prefetch: u16,
    /// Copies of dead letters a RabbitMQ Backend's copy queue (settle.deadletters.<ns>.<backend>)
    /// holds at most, set when it is made; beyond, the broker drops the oldest, and the
    /// Subscriptions' Accounted condition says Exhausted may be short.
    #[arg(long, env = "SETTLE_DEAD_LETTER_COPY_MAX_LENGTH", default_value_t = 100_000, value_parser = clap::value_parser!(i64).range(1..))]
    pub dead_letter_copy_max_length: i64,
    /// Namespaces whose Subscriptions may take over, with `spec.adopt: IfCompatible`, a
    /// consumer or queue Settle did not make, comma-separated; `*`: every namespace. Empty (the
    /// default): none, and such a Subscription stays ConsumerConflict saying so
    /// (docs/semantics.md J9).
    #[arg(long, env = "SETTLE_ADOPT_NAMESPACES", value_delimiter = ',')]
    pub adopt_namespaces: Vec<String>,
    /// Backends the operator connects in one namespace: the oldest this many (by creation time);
    /// a further one is Ready=False BackendLimit and makes no connection, keeper or memory, so a
    /// tenant cannot multiply Backends into the operator's memory (settle_backends_over_limit).
    #[arg(long, env = "SETTLE_MAX_BACKENDS_PER_NAMESPACE", default_value_t = 16, value_parser = clap::value_parser!(u16).range(1..))]
    pub max_backends_per_namespace: u16,
    /// A deleted Backend stays (its finalizer) while Subscriptions that name it still have
    /// consumers or queues to delete, for at most this long (a Kubernetes duration); then it goes,
    /// a Warning Event names the Subscriptions left, and each of those that can no longer delete
    /// its consumer says so (settle_consumers_left_total).
    #[arg(long, env = "SETTLE_BACKEND_DELETION_GRACE", default_value = "5m", value_parser = positive_duration)]
    pub backend_deletion_grace: Duration,
    /// Subscriptions on brokers without change events (RabbitMQ, SQS) are re-checked this
    /// often, so a queue deleted or changed on the broker is made again (a Kubernetes duration).
    #[arg(long, env = "SETTLE_DRIFT_INTERVAL", default_value = "30s", value_parser = positive_duration)]
    pub drift_interval: Duration,
    /// Subscriptions reconciled at once.
    #[arg(long, env = "SETTLE_CONCURRENCY", default_value_t = 4, value_parser = clap::value_parser!(u16).range(1..))]
    pub concurrency: u16,
    /// Log format: json (in a cluster), text (a terminal), or auto (json when running in a pod).
    #[arg(long, env = "SETTLE_LOG_FORMAT", default_value = "auto")]
    pub log_format: LogFormat,
    /// Webhook connections open at most; one more is closed as soon as it is accepted (and
    /// counted in settle_webhook_connections_refused_total).
    #[arg(long, env = "SETTLE_WEBHOOK_MAX_CONNECTIONS", default_value = "512")]
    pub webhook_max_connections: NonZeroUsize,
    /// Review bodies read and parsed at once; the others wait their turn (within
    /// --webhook-body-timeout). Peak memory for bodies is about this times
    /// --webhook-max-body-bytes.
    #[arg(
        long,
        env = "SETTLE_WEBHOOK_MAX_CONCURRENT_REVIEWS",
        default_value = "4"
    )]
    pub webhook_max_concurrent_reviews: NonZeroUsize,
    /// The largest review body accepted, in bytes. 7 MiB: an UPDATE carries two objects, each at
    /// most the API server's 3 MiB request limit, plus the envelope.
    #[arg(long, env = "SETTLE_WEBHOOK_MAX_BODY_BYTES", default_value = "7340032")]
    pub webhook_max_body_bytes: NonZeroUsize,
    /// Deadline of the TLS handshake.
    #[arg(long, env = "SETTLE_WEBHOOK_TLS_HANDSHAKE_TIMEOUT", default_value = "5s", value_parser = positive_duration)]
    pub webhook_tls_handshake_timeout: Duration,
    /// Deadline from the end of the TLS handshake to the first request's headers (protocol
    /// detection, the HTTP/2 preface, HTTP/1.1 headers).
    #[arg(long, env = "SETTLE_WEBHOOK_FIRST_REQUEST_TIMEOUT", default_value = "5s", value_parser = positive_duration)]
    pub webhook_first_request_timeout: Duration,
    /// Deadline of each later HTTP/1.1 request's headers.
    #[arg(long, env = "SETTLE_WEBHOOK_HEADER_READ_TIMEOUT", default_value = "5s", value_parser = positive_duration)]
    pub webhook_header_read_timeout: Duration,
    /// Deadline of waiting for a turn to read a body and reading it.
    #[arg(long, env = "SETTLE_WEBHOOK_BODY_TIMEOUT", default_value = "5s", value_parser = positive_duration)]
    pub webhook_body_timeout: Duration,
    // The metrics and probe ports.
    /// Where the kubelet's /healthz and /readyz are served (HTTP), apart from the metrics port so
    /// that scrapes and idle connections there can never fail a probe.
    #[arg(long, env = "SETTLE_PROBE_ADDR", default_value = "0.0.0.0:8081")]
    pub probe_addr: SocketAddr,
    /// Metrics-port connections open at most; one more is closed as soon as it is accepted (and
    /// counted in settle_metrics_connections_refused_total).
    #[arg(long, env = "SETTLE_METRICS_MAX_CONNECTIONS", default_value = "64")]
    pub metrics_max_connections: NonZeroUsize,
    /// Probe-port connections open at most (settle_probe_connections_refused_total).
    #[arg(long, env = "SETTLE_PROBE_MAX_CONNECTIONS", default_value = "16")]
    pub probe_max_connections: NonZeroUsize,
    /// On the metrics and probe ports: deadline from accept to the first request's headers (the
    /// TLS handshake included under --metrics-auth), and of each later request's headers.
    #[arg(long, env = "SETTLE_METRICS_FIRST_REQUEST_TIMEOUT", default_value = "5s", value_parser = positive_duration)]
    pub metrics_first_request_timeout: Duration,
    /// On the metrics and probe ports: a connection with no request in flight for this long is
    /// closed.
    #[arg(long, env = "SETTLE_METRICS_IDLE_TIMEOUT", default_value = "60s", value_parser = positive_duration)]
    pub metrics_idle_timeout: Duration,
    /// Serve /metrics over HTTPS (the webhook's certificate) and only to a bearer token the API
    /// server authenticates (TokenReview) and allows to get /metrics (SubjectAccessReview).
    #[arg(
        long,
        env = "SETTLE_METRICS_AUTH",
        default_value_t = false,
        num_args = 0..=1,
        default_missing_value = "true",
        action = clap::ArgAction::Set
    )]
    pub metrics_auth: bool,
    /// How long a token's verdict is remembered under --metrics-auth.
    #[arg(long, env = "SETTLE_METRICS_AUTH_CACHE_TTL", default_value = "10s", value_parser = positive_duration)]
    pub metrics_auth_cache_ttl: Duration,
    /// Tokens whose verdicts are remembered at most; one more evicts the one closest to expiry
    /// (counted in settle_metrics_auth_cache_evicted_total).
    #[arg(long, env = "SETTLE_METRICS_AUTH_CACHE_SIZE", default_value = "256")]
    pub metrics_auth_cache_size: NonZeroUsize,
    /// An HTTP/2 connection silent for this long is pinged.
    #[arg(long, env = "SETTLE_WEBHOOK_H2_KEEPALIVE_INTERVAL", default_value = "20s", value_parser = positive_duration)]
    pub webhook_h2_keepalive_interval: Duration,
    /// An unanswered HTTP/2 ping closes the connection after this long.
    #[arg(long, env = "SETTLE_WEBHOOK_H2_KEEPALIVE_TIMEOUT", default_value = "10s", value_parser = positive_duration)]
    pub webhook_h2_keepalive_timeout: Duration,
    /// A connection with no request in flight for this long is closed (HTTP/2 with a GOAWAY).
    #[arg(long, env = "SETTLE_WEBHOOK_IDLE_TIMEOUT", default_value = "60s", value_parser = positive_duration)]
    pub webhook_idle_timeout: Duration,
    /// Broker hosts a Backend may point at, comma-separated: a host (`nats.messaging.svc`,
    /// `10.0.0.7`) or `*.` and a domain (`*.messaging.svc`). Empty: any host. Checked at
    /// admission and by the controller before it connects (docs/semantics.md A19).
    #[arg(long, env = "SETTLE_ALLOWED_BROKER_HOSTS", value_delimiter = ',', value_parser = host_pattern)]
    pub allowed_broker_hosts: Vec<String>,
    /// Namespaces whose SQS Backends may run without a Secret, as the operator pod's own cloud
    /// identity, comma-separated. Empty (the default): none (docs/semantics.md A20).
    #[arg(
        long,
        env = "SETTLE_SQS_POD_IDENTITY_NAMESPACES",
        value_delimiter = ','
    )]
    pub sqs_pod_identity_namespaces: Vec<String>,
}

impl OperatorArgs {
    /// The metrics and probe ports' settings from these flags.
    pub fn health_config(&self) -> health::HealthConfig {
        health::HealthConfig {
            metrics_addr: self.metrics_addr,
            metrics_limits: health::limits(
                self.metrics_max_connections.get(),
                self.metrics_first_request_timeout,
                self.metrics_idle_timeout,
            ),
            probe_addr: self.probe_addr,
            probe_limits: health::limits(
                self.probe_max_connections.get(),
                self.metrics_first_request_timeout,
                self.metrics_idle_timeout,
            ),
        }
    }

    /// The webhook server's settings from these flags.
    pub fn webhook_config(&self) -> WebhookConfig {
        WebhookConfig {
            addr: self.webhook_addr,
            max_body_bytes: self.webhook_max_body_bytes.get(),
            max_concurrent_reviews: self.webhook_max_concurrent_reviews.get(),
            max_connections: self.webhook_max_connections.get(),
            tls_handshake_timeout: self.webhook_tls_handshake_timeout,
            first_request_timeout: self.webhook_first_request_timeout,
            header_read_timeout: self.webhook_header_read_timeout,
            body_timeout: self.webhook_body_timeout,
            h2_keepalive_interval: self.webhook_h2_keepalive_interval,
            h2_keepalive_timeout: self.webhook_h2_keepalive_timeout,
            idle_timeout: self.webhook_idle_timeout,
            backend_rules: self.backend_rules(),
        }
    }

    /// What Backends may name, from `--allowed-broker-hosts` and `--sqs-pod-identity-namespaces`.
    pub fn backend_rules(&self) -> BackendRules {
        BackendRules {
            allowed_hosts: self
                .allowed_broker_hosts
                .iter()
                .filter(|h| !h.trim().is_empty())
                .filter_map(|h| h.parse().ok())
                .collect(),
            pod_identity_namespaces: self
                .sqs_pod_identity_namespaces
                .iter()
                .map(|n| n.trim().to_string())
                .filter(|n| !n.is_empty())
                .collect(),
        }
    }
}

/// One `--allowed-broker-hosts` entry, checked here so a bad one stops the operator at start;
/// an empty one (a trailing comma, or an empty environment variable) is left out.
fn host_pattern(text: &str) -> Result<String, String> {
    if !text.trim().is_empty() {
        text.parse::<HostPattern>()?;
    }
    Ok(text.to_string())
}

/// A duration flag (`500ms`, `5s`, `1m`), above zero.
fn positive_duration(text: &str) -> Result<Duration, String> {
    let d: settle::api::Duration = text.parse().map_err(|e| format!("{e}"))?;
    if d.is_zero() {
        return Err(format!(
            "{text:?} is zero: give a duration above zero, e.g. 5s"
        ));
    }
    Ok(d.get())
}

/// A hold of loss advisories: above zero and below the capture reader's ack wait (30s), so
/// an advisory held is never delivered to the reader again meanwhile.
fn advisory_grace(text: &str) -> Result<Duration, String> {
    let d = positive_duration(text)?;
    let most = settle::backend::nats::capture::READER_ACK_WAIT;
    if d >= most {
        return Err(format!(
            "{text:?} is not below {most:?}, the capture reader's ack wait: a held advisory would be delivered again; give less, e.g. 25s"
        ));
    }
    Ok(d)
}

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogFormat {
    Auto,
    Json,
    Text,
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: OperatorArgs,
    }

    fn parse(flags: &[&str]) -> Result<OperatorArgs, clap::Error> {
        Cli::try_parse_from(std::iter::once("settle").chain(flags.iter().copied())).map(|c| c.args)
    }

    #[test]
    fn webhook_flag_defaults_are_the_webhook_defaults() {
        let args = parse(&[]).expect("no flags parse");
        assert_eq!(
            args.webhook_config(),
            WebhookConfig::new(args.webhook_addr),
            "the flags' defaults (and so the README's) must be WebhookConfig::new's"
        );
    }

    #[test]
    fn metrics_and_probe_flags_default_to_separate_bounded_ports_without_auth() {
        let args = parse(&[]).expect("no flags parse");
        let config = args.health_config();
        assert_eq!(config.metrics_addr.port(), 8080);
        assert_eq!(config.probe_addr.port(), 8081);
        assert_eq!(config.metrics_limits.max_connections, 64);
        assert_eq!(config.probe_limits.max_connections, 16);
        assert_eq!(
            config.metrics_limits.first_request_timeout,
            Duration::from_secs(5)
        );
        assert_eq!(config.metrics_limits.idle_timeout, Duration::from_secs(60));
        assert!(!args.metrics_auth);

        let args = parse(&["--metrics-auth", "--metrics-max-connections", "3"]).expect("parses");
        assert!(args.metrics_auth);
        assert_eq!(args.health_config().metrics_limits.max_connections, 3);
        let err = parse(&["--metrics-max-connections=0"])
            .err()
            .map(|e| e.to_string());
        assert!(
            err.as_deref()
                .is_some_and(|e| e.contains("--metrics-max-connections")),
            "{err:?}"
        );
    }

    #[test]
    fn backend_rule_flags_parse_and_a_bad_host_pattern_stops_the_operator() {
        let args = parse(&[]).expect("no flags parse");
        assert_eq!(args.backend_rules(), BackendRules::default());
        let args = parse(&[
            "--allowed-broker-hosts",
            "*.messaging.svc,10.0.0.7,",
            "--sqs-pod-identity-namespaces",
            "platform, ops",
        ])
        .expect("parses");
        let rules = args.backend_rules();
        assert_eq!(rules.allowed_hosts.len(), 2);
        assert!(rules.allowed_hosts[0].matches("nats.messaging.svc"));
        assert_eq!(rules.pod_identity_namespaces, ["platform", "ops"]);
        assert_eq!(args.webhook_config().backend_rules, rules);
        assert!(
            args.adopt_namespaces.is_empty(),
            "no namespace adopts unless listed"
        );
        let args = parse(&["--adopt-namespaces", "shop,ops"]).expect("parses");
        assert_eq!(args.adopt_namespaces, ["shop", "ops"]);
        let err = parse(&["--allowed-broker-hosts", "a/b"])
            .err()
            .map(|e| e.to_string());
        assert!(
            err.as_deref()
                .is_some_and(|e| e.contains("is not a host pattern")),
            "{err:?}"
        );
    }

    #[test]
    fn webhook_deadline_flags_take_durations_above_zero() {
        let args = parse(&[
            "--webhook-idle-timeout",
            "1m30s",
            "--webhook-first-request-timeout",
            "500ms",
            "--webhook-max-connections",
            "7",
        ])
        .expect("parses");
        let config = args.webhook_config();
        assert_eq!(config.idle_timeout, Duration::from_secs(90));
        assert_eq!(config.first_request_timeout, Duration::from_millis(500));
        assert_eq!(config.max_connections, 7);

        for (flag, value, says) in [
            ("--webhook-idle-timeout", "0", "is zero"),
            ("--webhook-body-timeout", "5", "is not a duration"),
            ("--webhook-tls-handshake-timeout", "-1s", "is negative"),
            ("--webhook-max-connections", "0", "zero"),
            ("--webhook-max-concurrent-reviews", "lots", "invalid digit"),
        ] {
            let err = parse(&[&format!("{flag}={value}")])
                .err()
                .map(|e| e.to_string());
            assert!(
                err.as_deref()
                    .is_some_and(|e| e.contains(says) && e.contains(flag)),
                "{flag} {value}: {err:?}"
            );
        }
    }
}
