//! Gives the memory the allocator holds free back to the system, every
//! `--release-memory-interval`: glibc keeps the pages of freed allocations resident (in each
//! thread's arena) until `malloc_trim` returns them, so a mass apply, whose requests, responses
//! and queues are gone a minute later, would otherwise set the operator's resident memory for
//! the rest of its life. What it released is counted in `settle_memory_released_bytes_total`,
//! and what the allocator holds, in use and free, is shown in `settle_memory_heap_bytes{part}`
//! after each release: resident memory far above the heap in use is the allocator's, not a leak.
//!
//! Before any thread starts, [`tune_allocator`] bounds glibc's arenas (`--allocator-arenas`;
//! glibc's default is eight a core, each keeping its own free pages and fragments) and fixes the
//! size from which a block is mapped on its own (when its arena has no free room for it) at
//! glibc's starting 128 KiB: glibc otherwise raises it to the largest such block freed (up to
//! 32 MiB), so after one large list response or scrape every buffer of that size stays in an
//! arena, resident, instead of going back when freed.
//!
//! It must not free or shrink anything the operator holds: it only returns pages no allocation
//! uses.

use std::time::Duration;

use prometheus::{IntCounter, IntGaugeVec, Opts, Registry};

/// Resident memory of this process now, in bytes (None where /proc says nothing).
pub fn resident_bytes() -> Option<u64> {
    let statm = std::fs::read_to_string("/proc/self/statm").ok()?;
    let pages: u64 = statm.split_whitespace().nth(1)?.parse().ok()?;
    Some(pages * 4096)
}

/// Large blocks from this size on are mapped on their own (glibc's starting threshold).
const MMAP_THRESHOLD: i32 = 128 * 1024;

/// Sets glibc's allocator up for a long-lived process: at most `arenas` arenas (0 leaves glibc's
/// default) and a fixed threshold for blocks mapped on their own. Call it before any thread
/// starts; off glibc it does nothing.
pub fn tune_allocator(arenas: u16) {
    if !cfg!(all(target_os = "linux", target_env = "gnu")) {
        return;
    }
    if arenas > 0 && !mallopt(Param::ArenaMax, i32::from(arenas)) {
        tracing::warn!(
            arenas,
            "glibc refused --allocator-arenas; its default stays"
        );
    }
    if !mallopt(Param::MmapThreshold, MMAP_THRESHOLD) {
        tracing::warn!("glibc refused a fixed mmap threshold; it stays dynamic");
    }
}

#[derive(Clone, Copy)]
enum Param {
    ArenaMax,
    MmapThreshold,
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[allow(unsafe_code)]
fn mallopt(param: Param, value: i32) -> bool {
    let param = match param {
        Param::ArenaMax => libc::M_ARENA_MAX,
        Param::MmapThreshold => libc::M_MMAP_THRESHOLD,
    };
    // SAFETY: mallopt only sets one of glibc's allocator parameters (under the main arena's
    // lock); it reads and writes no memory of ours. It returns 1 on success.
    unsafe { libc::mallopt(param, value) == 1 }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn mallopt(_: Param, _: i32) -> bool {
    true
}

/// Starts the release loop (nothing with an interval of zero, or off glibc).
pub fn spawn_release(interval: Duration, registry: &Registry) {
    let released = IntCounter::new(
        "settle_memory_released_bytes_total",
        "Resident memory the operator's allocator gave back to the system (--release-memory-interval)",
    )
    .expect("a valid metric");
    if let Err(e) = registry.register(Box::new(released.clone())) {
        tracing::warn!(error = %e, "cannot register settle_memory_released_bytes_total");
    }
    let heap = IntGaugeVec::new(
        Opts::new(
            "settle_memory_heap_bytes",
            "The allocator's heap after the last release (--release-memory-interval): in_use is held by the operator, free is kept by the allocator for reuse, mapped is in large blocks of their own",
        ),
        &["part"],
    )
    .expect("a valid metric");
    if let Err(e) = registry.register(Box::new(heap.clone())) {
        tracing::warn!(error = %e, "cannot register settle_memory_heap_bytes");
    }
    if interval.is_zero() || !cfg!(all(target_os = "linux", target_env = "gnu")) {
        return;
    }
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tick.tick().await;
        loop {
            tick.tick().await;
            // Off the runtime's threads: it walks every arena, holding each one's lock.
            let freed = tokio::task::spawn_blocking(|| {
                let before = resident_bytes();
                trim();
                let freed = before
                    .zip(resident_bytes())
                    .map(|(b, a)| b.saturating_sub(a));
                (freed, heap_parts())
            })
            .await;
            let Ok((freed, parts)) = freed else { continue };
            for (part, bytes) in parts {
                heap.with_label_values(&[part])
                    .set(i64::try_from(bytes).unwrap_or(i64::MAX));
            }
            if let Some(bytes) = freed {
                released.inc_by(bytes);
                if bytes > 1 << 20 {
                    tracing::debug!(mib = bytes >> 20, "gave free memory back to the system");
                }
            }
        }
    });
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[allow(unsafe_code)]
fn trim() {
    // SAFETY: malloc_trim only returns free pages of glibc's arenas to the kernel; it reads and
    // writes no memory of ours and is safe to call from any thread at any time.
    unsafe {
        libc::malloc_trim(0);
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn trim() {}

/// The heap's parts as glibc counts them over every arena: in use, free, and in blocks mapped
/// on their own.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[allow(unsafe_code)]
fn heap_parts() -> [(&'static str, usize); 3] {
    // SAFETY: mallinfo2 only reads the allocator's own bookkeeping (under each arena's lock)
    // and returns a plain struct by value.
    let m = unsafe { libc::mallinfo2() };
    [
        ("in_use", m.uordblks),
        ("free", m.fordblks),
        ("mapped", m.hblkhd),
    ]
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn heap_parts() -> [(&'static str, usize); 0] {
    []
}

#[cfg(test)]
mod tests {
    #[test]
    fn resident_memory_is_read_and_trimming_keeps_what_is_in_use() {
        let held: Vec<Vec<u8>> = (0..64).map(|i| vec![i as u8; 64 * 1024]).collect();
        let before = super::resident_bytes().expect("/proc/self/statm");
        assert!(before > 4 << 20, "{before}");
        super::trim();
        assert!(
            held.iter()
                .enumerate()
                .all(|(i, v)| v.iter().all(|&b| b == i as u8))
        );
        // What is held is counted in use, in arenas or in blocks of their own.
        let parts = super::heap_parts();
        let held_bytes: usize = parts
            .iter()
            .filter(|(p, _)| *p != "free")
            .map(|(_, b)| *b)
            .sum();
        if cfg!(all(target_os = "linux", target_env = "gnu")) {
            assert!(held_bytes >= 64 * 64 * 1024, "{parts:?}");
        }
    }
}
