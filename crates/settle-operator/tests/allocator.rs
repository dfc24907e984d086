//! `settle_operator::operator::tune_allocator` fixes glibc's mmap threshold: a large block allocated after
//! a larger one was freed is still mapped on its own, so it goes back to the system when freed
//! (glibc's dynamic threshold would have risen to the freed block's size and served it from an
//! arena, resident for good).
//!
//! One test in a process of its own: glibc maps a block on its own only when its arena's free
//! space cannot serve it, so other tests' frees in the same process would decide the outcome.

#[test]
fn a_large_block_after_a_larger_one_freed_is_still_mapped_on_its_own() {
    settle_operator::operator::tune_allocator(2);
    drop(std::hint::black_box(vec![1u8; 4 << 20]));
    let held: Vec<Vec<u8>> = (0..8)
        .map(|i| std::hint::black_box(vec![i as u8; 300 << 10]))
        .collect();
    if cfg!(all(target_os = "linux", target_env = "gnu")) {
        let mapped = mapped_bytes();
        assert!(
            mapped >= 8 * (300 << 10),
            "{mapped} bytes mapped on their own, for 8 blocks of 300 KiB held"
        );
    }
    drop(held);
}

/// Bytes in blocks glibc mapped on their own (`mallinfo2().hblkhd`).
#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[allow(unsafe_code)]
fn mapped_bytes() -> usize {
    // SAFETY: mallinfo2 only reads the allocator's own bookkeeping and returns a plain struct.
    unsafe { libc::mallinfo2() }.hblkhd
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn mapped_bytes() -> usize {
    0
}
