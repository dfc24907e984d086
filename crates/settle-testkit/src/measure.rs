//! Shared by the benchmarks: percentiles, a process's memory and CPU from `/proc`, the machine's
//! busy CPU and load, and the positional numbers after `cargo bench --bench NAME --`. Reads only; a bench
//! prints what these return and asserts nothing on them.

use std::time::Duration;

/// The `p` quantile (0..=1) of `sorted` (nearest rank); zero for none.
pub fn pct(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let i = ((sorted.len() as f64 * p).ceil() as usize).clamp(1, sorted.len()) - 1;
    sorted[i]
}

/// A `kB` line of `/proc/PID/status` (`VmRSS`, `VmHWM`) in MiB; NaN when unreadable.
fn status_mib(pid: u32, field: &str) -> f64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with(field))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<f64>().ok())
        })
        .map_or(f64::NAN, |kb| kb / 1024.0)
}

/// The process's peak resident memory so far, MiB.
pub fn peak_rss_mib(pid: u32) -> f64 {
    status_mib(pid, "VmHWM:")
}

/// The process's resident memory now, MiB.
pub fn rss_mib(pid: u32) -> f64 {
    status_mib(pid, "VmRSS:")
}

/// The process's resident memory now, split as the kernel counts it: `(anonymous, file-backed)`
/// MiB (`RssAnon`, `RssFile` + `RssShmem`). File-backed pages are the binary's code and data as
/// mapped, which the kernel can drop and read again; anonymous pages are heap and stacks.
pub fn rss_parts_mib(pid: u32) -> (f64, f64) {
    (
        status_mib(pid, "RssAnon:"),
        status_mib(pid, "RssFile:") + status_mib(pid, "RssShmem:"),
    )
}

/// CPU seconds (user + system) the process has used so far, from `/proc/PID/stat` (fields 14
/// and 15, in clock ticks of 1/100 s on Linux); NaN when unreadable.
pub fn cpu_seconds(pid: u32) -> f64 {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| {
            // The command name, in parentheses, may hold spaces: count fields after it.
            let rest = s.rsplit_once(')')?.1;
            let f: Vec<&str> = rest.split_whitespace().collect();
            let utime: f64 = f.get(11)?.parse().ok()?;
            let stime: f64 = f.get(12)?.parse().ok()?;
            Some((utime + stime) / 100.0)
        })
        .unwrap_or(f64::NAN)
}

/// CPU seconds the machine has been busy so far, every core and process: `/proc/stat`'s `cpu`
/// line, every field but idle and iowait (clock ticks of 1/100 s); NaN when unreadable.
pub fn machine_busy_seconds() -> f64 {
    std::fs::read_to_string("/proc/stat")
        .ok()
        .and_then(|s| {
            let line = s.lines().find(|l| l.starts_with("cpu "))?;
            // user nice system idle iowait irq softirq steal
            let f: Vec<f64> = line
                .split_whitespace()
                .skip(1)
                .take(8)
                .map(|v| v.parse().ok())
                .collect::<Option<_>>()?;
            Some(
                f.iter()
                    .enumerate()
                    .filter(|(i, _)| *i != 3 && *i != 4)
                    .map(|(_, v)| v)
                    .sum::<f64>()
                    / 100.0,
            )
        })
        .unwrap_or(f64::NAN)
}

/// The machine's one-minute load average, as `/proc/loadavg` says it.
pub fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|s| s.split_whitespace().next().map(str::to_string))
        .unwrap_or_else(|| "?".into())
}

/// The numbers after `--` (cargo adds `--bench` and other flags, which are skipped), in order.
pub fn numbers() -> Vec<u64> {
    std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with('-'))
        .filter_map(|a| a.parse().ok())
        .collect()
}
