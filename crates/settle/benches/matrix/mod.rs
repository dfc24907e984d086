//! The runtime against the bare client of each broker, as a matrix: payload
//! 16 B / 1 KiB / 64 KiB × maxInFlight 1 / 250 × 1 / 10 Subscriptions. Each cell: a short
//! warm-up of both sides sizes the rounds (so each round takes at least [`MIN_ROUND`] at the
//! faster side's rate), then [`ROUNDS`] rounds of each side, interleaved (bare, settle, settle,
//! bare, ...), and the medians. Prints a table per broker (cell, settle msg/s, bare msg/s, ratio,
//! the shortest round, and what a message cost in CPU: this process's, where both sides' clients
//! run, the broker's, and the whole machine's) with the load average before and after;
//! asserts nothing. On a machine whose cores the broker and the client share, a side that spends
//! more CPU a message leaves the broker less: the CPU columns tell such a gap from a wait.
//!
//! The scenario is written here once; each broker's file (`nats`, `rabbitmq`, `sqs`) only says
//! how to fill its queues, how its bare client consumes them, and how `settle::bus` does.

pub mod nats;
pub mod rabbitmq;
#[cfg(feature = "sqs")]
pub mod sqs;

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use settle::api::{DeliveryPolicy, Mode};
use settle::bus::{self, Bus, Subscriber, handler};
use tokio::sync::Notify;

/// Rounds of each side per cell; the figure is their median.
pub const ROUNDS: usize = 5;
/// The shortest a round should take: rounds are sized from the warm-up to last about
/// [`TARGET_ROUND`], and a round that came out shorter is reported.
pub const MIN_ROUND: Duration = Duration::from_secs(3);
const TARGET_ROUND: Duration = Duration::from_secs(4);
/// A warm-up round shorter than this is repeated with twice the messages.
const WARM_ENOUGH: Duration = Duration::from_millis(700);

pub const PAYLOADS: [usize; 3] = [16, 1024, 64 << 10];
pub const IN_FLIGHT: [u16; 2] = [1, 250];
pub const SUBSCRIPTIONS: [usize; 2] = [1, 10];

/// One cell of the matrix.
#[derive(Clone, Copy, Debug)]
pub struct Cell {
    pub payload: usize,
    pub in_flight: u16,
    pub subs: usize,
}

impl Cell {
    pub fn label(&self) -> String {
        let payload = match self.payload {
            p if p >= 1 << 10 => format!("{} KiB", p >> 10),
            p => format!("{p} B"),
        };
        format!(
            "{payload:>6} × inFlight {:>3} × {:>2} sub{}",
            self.in_flight,
            self.subs,
            if self.subs == 1 { " " } else { "s" }
        )
    }

    /// The name of queue/consumer `index` of `side` in this cell, unique within the run.
    pub fn name(&self, side: Side, index: usize) -> String {
        format!(
            "mx{}-p{}-f{}-s{}-{}{index}",
            std::process::id(),
            self.payload,
            self.in_flight,
            self.subs,
            side.tag()
        )
    }

    pub fn body(&self) -> bytes::Bytes {
        bytes::Bytes::from(vec![b'x'; self.payload])
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Side {
    Bare,
    Settle,
}

impl Side {
    fn tag(self) -> &'static str {
        match self {
            Side::Bare => "b",
            Side::Settle => "r",
        }
    }
}

/// The client CPU, in µs, the bare loops spend on each message before acking it while it is
/// set: 0, except for the second column of a calibration run with
/// `SETTLE_MATRIX_CALIBRATE_SPIN_US` (what extra client work alone costs a ratio here).
static HANDICAP_US: AtomicU64 = AtomicU64::new(0);

/// Spends [`HANDICAP_US`] of CPU (busy, as work would), if any: each bare loop calls it once a
/// message.
pub fn handicap() {
    let us = HANDICAP_US.load(Ordering::Relaxed);
    if us > 0 {
        let until = Instant::now() + Duration::from_micros(us);
        while Instant::now() < until {
            std::hint::spin_loop();
        }
    }
}

/// One broker's part of the scenario. `n_each` is the number of messages each of the cell's
/// Subscriptions consumes in one round (the round's total is `n_each × subs`).
pub trait Harness {
    /// "JetStream", "RabbitMQ", "SQS (ElasticMQ)".
    fn broker(&self) -> &'static str;
    /// The broker's pid file in the environment's directory, for its CPU.
    fn pid_file(&self) -> &'static str;
    /// What the bare side is, as the table's header says it.
    fn bare(&self) -> &'static str;
    /// How many messages (in all) the warm-up round of a cell consumes.
    fn warm_up(&self, cell: &Cell) -> u64;
    /// The most messages one Subscription may hold for a round (memory or the broker's limits).
    fn max_each(&self, cell: &Cell) -> u64;
    /// Makes what the cell needs, for rounds of `n_each` messages per Subscription.
    async fn prepare(&mut self, cell: &Cell, n_each: u64);
    /// One round of `side`: fills what must be filled (outside the clock), then consumes
    /// `n_each` messages from each of the cell's Subscriptions, acking each; what that took,
    /// from a [`Stopwatch`] started where the consuming starts. `round` differs between any
    /// two calls of one side in a cell (a calibration run calls the bare side twice a round):
    /// a harness whose consumers outlive a round names them by it.
    async fn round(&mut self, cell: &Cell, side: Side, round: usize, n_each: u64) -> Taken;
    /// Removes what the cell made.
    async fn finish(&mut self, cell: &Cell);
    /// What `side` asked of the broker while its clocks ran since the cell was prepared, per
    /// message of `consumed` (its rounds' total), where the harness counts it; then forgets it.
    fn requests(&mut self, _side: Side, _consumed: u64) -> Option<String> {
        None
    }
}

/// The policy both sides consume with: AtLeastOnce, the cell's maxInFlight.
pub fn policy(pattern: &str, durable: &str, cell: &Cell) -> DeliveryPolicy {
    DeliveryPolicy {
        pattern: pattern.into(),
        mode: Mode::AtLeastOnce,
        durable_name: Some(durable.into()),
        max_in_flight: Some(i32::from(cell.in_flight)),
        ..DeliveryPolicy::default()
    }
}

/// What a round took: wall time, and CPU time (user + system) of this process, of the broker and
/// of the whole machine, each from /proc in ticks of 10 ms, fine for rounds of seconds.
#[derive(Clone, Copy, Debug)]
pub struct Taken {
    pub wall: Duration,
    pub own_cpu: Duration,
    /// The broker's processes (the environment's pid file and its descendants), when known.
    pub broker_cpu: Duration,
    pub machine_cpu: Duration,
}

/// Started where a side's consuming starts; [`Stopwatch::stop`] says what it took since.
pub struct Stopwatch {
    wall: Instant,
    own_cpu: Duration,
    broker_cpu: Duration,
    machine_cpu: Duration,
}

impl Stopwatch {
    pub fn start() -> Stopwatch {
        Stopwatch {
            own_cpu: own_cpu(),
            broker_cpu: broker_cpu(),
            machine_cpu: machine_cpu(),
            wall: Instant::now(),
        }
    }

    pub fn stop(&self) -> Taken {
        Taken {
            wall: self.wall.elapsed(),
            own_cpu: own_cpu().saturating_sub(self.own_cpu),
            broker_cpu: broker_cpu().saturating_sub(self.broker_cpu),
            machine_cpu: machine_cpu().saturating_sub(self.machine_cpu),
        }
    }
}

/// The broker whose CPU the rows count (0: unknown): its pid file in the environment's
/// directory (`nats.pid`, `rabbitmq.pid`, `elasticmq.pid`), read by [`run`] for its broker.
static BROKER_PID: AtomicU32 = AtomicU32::new(0);

fn set_broker_pid(file: &str) {
    let pid = std::fs::read_to_string(env_dir().join(file))
        .ok()
        .and_then(|p| p.trim().parse().ok())
        .unwrap_or(0);
    BROKER_PID.store(pid, Ordering::Relaxed);
}

/// A process's user + system time so far (zero when unreadable).
fn process_cpu(pid: u32) -> Duration {
    seconds(crate::measure::cpu_seconds(pid))
}

fn seconds(s: f64) -> Duration {
    Duration::try_from_secs_f64(s).unwrap_or_default()
}

/// The broker's processes: the pid and its descendants (RabbitMQ's script starts beam.smp).
fn broker_cpu() -> Duration {
    let root = BROKER_PID.load(Ordering::Relaxed);
    if root == 0 {
        return Duration::ZERO;
    }
    let (mut total, mut todo) = (Duration::ZERO, vec![root]);
    while let Some(pid) = todo.pop() {
        total += process_cpu(pid);
        let children =
            std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children")).unwrap_or_default();
        todo.extend(
            children
                .split_whitespace()
                .filter_map(|c| c.parse::<u32>().ok()),
        );
    }
    total
}

/// This process's user + system time, every thread.
fn own_cpu() -> Duration {
    process_cpu(std::process::id())
}

/// The machine's busy time, every process.
fn machine_cpu() -> Duration {
    seconds(crate::measure::machine_busy_seconds())
}

/// The settle side of a round on any broker: one `Bus`, one Subscriber per `(pattern, durable)`,
/// each handler acking; returns once `total` messages were acked, and what that took from the
/// first subscribe.
pub async fn settle_round<B: bus::Broker>(
    broker: B,
    cell: &Cell,
    subs: Vec<(String, String)>,
    total: u64,
) -> Taken {
    let bus = Bus::builder(broker).without_reports().build();
    let acked = Arc::new(AtomicU64::new(0));
    let done = Arc::new(Notify::new());
    let clock = Stopwatch::start();
    for (pattern, durable) in subs {
        let (a, d) = (acked.clone(), done.clone());
        bus.subscribe(Subscriber::new(
            durable.as_str(),
            policy(&pattern, &durable, cell),
            handler(move |del| {
                let (a, d) = (a.clone(), d.clone());
                async move {
                    del.ack().await?;
                    if a.fetch_add(1, Ordering::Relaxed) + 1 == total {
                        d.notify_one();
                    }
                    Ok::<_, bus::HandlerError>(())
                }
            }),
        ))
        .await
        .expect("subscribe");
    }
    done.notified().await;
    let took = clock.stop();
    bus.close().await;
    took
}

/// The environment's directory: SETTLE_ENV_DIR, or `make env-up`'s target/env.
fn env_dir() -> PathBuf {
    std::env::var_os("SETTLE_ENV_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| settle_testkit::root().join("target/env"))
}

pub fn env_value(key: &str) -> Option<String> {
    if let Ok(v) = std::env::var(key) {
        return Some(v);
    }
    let text = std::fs::read_to_string(env_dir().join("settle.env")).ok()?;
    text.lines()
        .filter_map(|l| l.strip_prefix("export "))
        .filter_map(|l| l.split_once('='))
        .find(|(k, _)| *k == key)
        .map(|(_, v)| v.to_string())
}

pub fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .map(|l| l.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|| "unknown".into())
}

fn rate(n: u64, d: Duration) -> f64 {
    n as f64 / d.as_secs_f64()
}

/// Microseconds of `cpu` a message.
fn per_message(n: u64, cpu: Duration) -> f64 {
    cpu.as_secs_f64() * 1e6 / n as f64
}

/// The medians of one side's rounds.
#[derive(Default)]
struct Rounds {
    rate: Vec<f64>,
    own_us: Vec<f64>,
    broker_us: Vec<f64>,
    machine_us: Vec<f64>,
    cores: Vec<f64>,
}

impl Rounds {
    fn push(&mut self, n: u64, t: Taken) {
        self.rate.push(rate(n, t.wall));
        self.own_us.push(per_message(n, t.own_cpu));
        self.broker_us.push(per_message(n, t.broker_cpu));
        self.machine_us.push(per_message(n, t.machine_cpu));
        self.cores
            .push(t.machine_cpu.as_secs_f64() / t.wall.as_secs_f64());
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n == 0 {
        return 0.0;
    }
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// The cells, each of `PAYLOADS × IN_FLIGHT × SUBSCRIPTIONS`, optionally only those whose label
/// contains `only` (e.g. `SETTLE_MATRIX_ONLY="64 KiB"`).
pub fn cells() -> Vec<Cell> {
    let only = std::env::var("SETTLE_MATRIX_ONLY").ok();
    let mut out = Vec::new();
    for payload in PAYLOADS {
        for in_flight in IN_FLIGHT {
            for subs in SUBSCRIPTIONS {
                let cell = Cell {
                    payload,
                    in_flight,
                    subs,
                };
                if only.as_deref().is_none_or(|o| cell.label().contains(o)) {
                    out.push(cell);
                }
            }
        }
    }
    out
}

/// Runs every cell on `h` and prints the table.
/// One round of `side` with the bare loops spending `spin` µs a message ([`handicap`]).
async fn handicapped<H: Harness>(
    h: &mut H,
    cell: &Cell,
    side: Side,
    round: usize,
    n_each: u64,
    spin: u64,
) -> Taken {
    HANDICAP_US.store(spin, Ordering::Relaxed);
    let took = h.round(cell, side, round, n_each).await;
    HANDICAP_US.store(0, Ordering::Relaxed);
    took
}

pub async fn run<H: Harness>(h: &mut H) {
    let rounds = std::env::var("SETTLE_MATRIX_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(ROUNDS);
    set_broker_pid(h.pid_file());
    // SETTLE_MATRIX_CALIBRATE=1: the settle column runs the bare client as well (an A/A run, on
    // consumers of their own): how far two identical sides differ here, the spread a ratio must
    // leave before it says anything about the runtime.
    let calibrate = std::env::var("SETTLE_MATRIX_CALIBRATE").is_ok_and(|v| v == "1");
    let (second, offset) = if calibrate {
        (Side::Bare, 1000)
    } else {
        (Side::Settle, 0)
    };
    let spin: u64 = std::env::var("SETTLE_MATRIX_CALIBRATE_SPIN_US")
        .ok()
        .filter(|_| calibrate)
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);

    let before = load_average();
    println!(
        "{} matrix: {} vs {}, AtLeastOnce, every message acked; median of {rounds} rounds of each side (interleaved), each sized to last about {TARGET_ROUND:?}; load average {before} ({} CPUs)",
        h.broker(),
        if calibrate {
            "A/A calibration: the bare client in both columns (\"settle\" is the second bare, spending SETTLE_MATRIX_CALIBRATE_SPIN_US more a message)"
        } else {
            "settle::bus"
        },
        h.bare(),
        std::thread::available_parallelism().map_or(1, |n| n.get()),
    );
    println!(
        "| cell | settle msg/s | bare msg/s | ratio | shortest round | client CPU µs/msg settle / bare | broker CPU µs/msg settle / bare | machine CPU µs/msg settle / bare | machine busy (cores) settle / bare | load (1 min) |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    );
    let mut notes = Vec::new();
    for cell in cells() {
        // Warm-up: both sides, doubling until each round takes long enough to tell the rate
        // (a short one is mostly subscribing), to size the rounds.
        let mut warm_each = (h.warm_up(&cell) / cell.subs as u64).max(1);
        let n_each = loop {
            h.prepare(&cell, warm_each).await;
            let total = warm_each * cell.subs as u64;
            let tb = h.round(&cell, Side::Bare, 0, warm_each).await.wall;
            let ts = handicapped(h, &cell, second, offset, warm_each, spin)
                .await
                .wall;
            let faster = rate(total, tb).max(rate(total, ts));
            let want = (faster * TARGET_ROUND.as_secs_f64()) as u64 / cell.subs as u64;
            if tb.min(ts) >= WARM_ENOUGH || warm_each >= h.max_each(&cell) {
                break want.clamp(1, h.max_each(&cell));
            }
            warm_each = (warm_each * 2).min(want.max(1)).min(h.max_each(&cell));
            if warm_each <= 1 {
                break 1;
            }
        };
        h.prepare(&cell, n_each).await;
        let total = n_each * cell.subs as u64;
        let consumed = total * rounds as u64;
        let (mut bare, mut settle, mut shortest) =
            (Rounds::default(), Rounds::default(), Duration::MAX);
        for round in 1..=rounds {
            let order = if round % 2 == 1 {
                [false, true]
            } else {
                [true, false]
            };
            for is_second in order {
                let took = if is_second {
                    handicapped(h, &cell, second, round + offset, n_each, spin).await
                } else {
                    h.round(&cell, Side::Bare, round, n_each).await
                };
                shortest = shortest.min(took.wall);
                if is_second {
                    settle.push(total, took);
                } else {
                    bare.push(total, took);
                }
            }
        }
        h.finish(&cell).await;
        if calibrate {
            // Both columns counted as the bare side's.
            if let Some(b) = h.requests(Side::Bare, 2 * consumed) {
                notes.push(format!("{}: both columns {b}", cell.label().trim()));
            }
        } else if let (Some(s), Some(b)) = (
            h.requests(Side::Settle, consumed),
            h.requests(Side::Bare, consumed),
        ) {
            notes.push(format!("{}: settle {s}; bare {b}", cell.label().trim()));
        }
        let (b, s) = (median(bare.rate), median(settle.rate));
        println!(
            "| {} | {s:.0} | {b:.0} | {:.2} | {:.1} s{} | {:.1} / {:.1} | {:.1} / {:.1} | {:.1} / {:.1} | {:.2} / {:.2} | {} |",
            cell.label(),
            s / b,
            shortest.as_secs_f64(),
            if shortest < MIN_ROUND { " (short)" } else { "" },
            median(settle.own_us),
            median(bare.own_us),
            median(settle.broker_us),
            median(bare.broker_us),
            median(settle.machine_us),
            median(bare.machine_us),
            median(settle.cores),
            median(bare.cores),
            load_average().split(' ').next().unwrap_or("?"),
        );
    }
    if !notes.is_empty() {
        println!(
            "\nRequests a message, while each side's clock ran (its rounds, not the warm-up):"
        );
        for n in notes {
            println!("- {n}");
        }
    }
    println!("load average after: {}", load_average());
}
