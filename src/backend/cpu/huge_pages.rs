//! Weights on 2 MiB pages (Linux transparent huge pages), so that streaming a step's weights
//! costs a TLB entry per 2 MiB rather than per 4 KiB.
//!
//! Why: a decode step reads every weight once, matrix after matrix, and with 4 KiB pages each
//! page is a TLB miss and a page walk (and the hardware prefetchers stop at 4 KiB page
//! boundaries). Most distributions leave THP to `madvise`, where a process's memory gets huge
//! pages only where it asks. On the 2-vCPU bench machine the whole process on huge pages (THP
//! `always`) decoded faster in 4 of 5 alternating runs (means 165 -> 185 tok/s); advising only
//! the weights was not separable from that machine's noise (stop 39), but costs nothing
//! measurable at load (no byte moves but the collapse's copy, same resident size).
//!
//! Best effort: a kernel without THP, with THP `never`, or without `MADV_COLLAPSE` (before
//! Linux 6.1) keeps 4 KiB pages and nothing else changes. No byte moves: both advices change
//! only how memory is mapped.

/// The huge page size these advices work in (x86-64 and aarch64 with 4 KiB base pages).
const HUGE: usize = 2 << 20;

/// An empty vector with room for `capacity` values whose memory is marked for huge pages
/// before anything is written: the page faults that fill it then take 2 MiB pages directly
/// (fewer faults than 4 KiB ones, and no copy later). For the large weight buffers.
///
/// The allocator may hand out memory it used before (a thread arena's heap keeps freed
/// blocks), whose 4 KiB pages are still mapped: the advice would not change them. So the
/// whole 2 MiB regions inside the buffer are first given back (`MADV_DONTNEED`): their next
/// touch faults in fresh, huge pages. (The CPU backend keeps its large tensors for reuse,
/// `recycle`, so less memory goes back to the kernel between loads and more is reused.)
pub(super) fn reserve<T>(capacity: usize) -> Vec<T> {
    let v: Vec<T> = Vec::with_capacity(capacity);
    let bytes = capacity * std::mem::size_of::<T>();
    let (start, end) = (
        (v.as_ptr() as usize).next_multiple_of(HUGE),
        (v.as_ptr() as usize + bytes) & !(HUGE - 1),
    );
    if start < end {
        // SAFETY: `start..end` lies inside the vector's allocation, which nothing else uses
        // while it lives, and holds no value yet (length 0): discarding its pages loses
        // nothing, and the next write faults in zeroed memory. Failure only leaves the pages
        // as they were.
        unsafe {
            libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_DONTNEED);
        }
    }
    mark(v.as_ptr().cast(), bytes, &[libc::MADV_HUGEPAGE]);
    v
}

/// Asks the kernel to map the 2 MiB regions that hold `data` with huge pages.
///
/// `MADV_HUGEPAGE` marks the regions for huge pages (faults and `khugepaged` use them). A
/// buffer smaller than a huge page (it lives among others in the allocator's heap) is also
/// collapsed into huge pages at once (`MADV_COLLAPSE`, copying its regions: at most two, and a
/// region already huge is skipped), instead of waiting for `khugepaged`'s slow scan. A larger
/// buffer is not collapsed: copying a whole checkpoint's weights would add seconds to a load
/// (~4 GB/s here, far less when memory must first be compacted); large buffers get their huge
/// pages by being [`reserve`]d. The regions are rounded out to 2 MiB, so they can include
/// neighbouring memory of the same mapping (other weights, the allocator's free space): its
/// bytes are kept as they are; at most it becomes resident. Regions not wholly mapped are
/// skipped by the kernel.
pub(super) fn advise<T>(data: &[T]) {
    let bytes = std::mem::size_of_val(data);
    if bytes < HUGE {
        mark(
            data.as_ptr().cast(),
            bytes,
            &[libc::MADV_HUGEPAGE, COLLAPSE],
        );
    } else {
        mark(data.as_ptr().cast(), bytes, &[libc::MADV_HUGEPAGE]);
    }
}

/// Gives each of `advices` for the 2 MiB regions around `bytes` bytes at `ptr`.
fn mark(ptr: *const u8, bytes: usize, advices: &[libc::c_int]) {
    if bytes == 0 {
        return;
    }
    let start = (ptr as usize) & !(HUGE - 1);
    let end = (ptr as usize + bytes).next_multiple_of(HUGE);
    for &advice in advices {
        // SAFETY: both advices change how pages are mapped, never their contents, and accept
        // any range (parts that are not mapped are reported as ENOMEM and skipped; parts the
        // kernel cannot collapse stay as they are). The result is ignored: this is a hint.
        unsafe {
            libc::madvise(start as *mut libc::c_void, end - start, advice);
        }
    }
}

/// `MADV_COLLAPSE` (Linux 6.1): not in every libc target's constants, same value on all.
const COLLAPSE: libc::c_int = 25;

#[cfg(test)]
mod tests {
    use super::*;

    /// Kilobytes of anonymous huge pages in the mapping that holds `addr` (`/proc/self/smaps`).
    fn huge_kb_at(addr: usize) -> Option<u64> {
        let smaps = std::fs::read_to_string("/proc/self/smaps").ok()?;
        let mut inside = false;
        for line in smaps.lines() {
            if let Some((range, _)) = line.split_once(' ') {
                if let Some((lo, hi)) = range.split_once('-') {
                    if let (Ok(lo), Ok(hi)) =
                        (usize::from_str_radix(lo, 16), usize::from_str_radix(hi, 16))
                    {
                        inside = (lo..hi).contains(&addr);
                        continue;
                    }
                }
            }
            if inside {
                if let Some(kb) = line.strip_prefix("AnonHugePages:") {
                    return kb.trim().trim_end_matches(" kB").trim().parse().ok();
                }
            }
        }
        None
    }

    #[test]
    fn reserved_weights_keep_their_bytes_and_sit_on_huge_pages_where_the_kernel_has_them() {
        let mut data: Vec<u32> = reserve((8 << 20) / 4);
        data.extend((0..(8u32 << 20) / 4).map(|i| i.wrapping_mul(2654435761)));
        advise(&data);
        // Not one value changed.
        for (i, &v) in data.iter().enumerate() {
            assert_eq!(v, (i as u32).wrapping_mul(2654435761), "value {i}");
        }
        let mode = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled")
            .unwrap_or_default();
        if !mode.contains("[always]") && !mode.contains("[madvise]") {
            eprintln!("SKIP huge page check: transparent huge pages are off here ({mode:?})");
            return;
        }
        let kb = huge_kb_at(data.as_ptr() as usize + (4 << 20)).expect("mapping in smaps");
        if kb < 6 * 1024 {
            let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
            let mut version = release
                .split(['.', '-'])
                .map(|p| p.parse::<u32>().unwrap_or(0));
            if (version.next().unwrap_or(0), version.next().unwrap_or(0)) < (6, 1) {
                eprintln!(
                    "SKIP huge page check: {kb} kB, and Linux {release:?} has no MADV_COLLAPSE \
                     (6.1) to tell whether a huge page was free"
                );
                return;
            }
            // Why not: collapsing one of the data's own whole regions (every page mapped) says
            // whether the kernel had no 2 MiB page to give just now (EAGAIN, ENOMEM: another
            // test holding memory), which is not this code's doing.
            let start = (data.as_ptr() as usize).next_multiple_of(HUGE);
            // SAFETY: `start..start + 2 MiB` lies inside `data`'s allocation (8 MiB); the
            // collapse keeps every byte.
            let rc = unsafe { libc::madvise(start as *mut libc::c_void, HUGE, COLLAPSE) };
            let err = std::io::Error::last_os_error();
            if rc != 0 && matches!(err.raw_os_error(), Some(libc::EAGAIN | libc::ENOMEM)) {
                eprintln!("SKIP huge page check: the kernel has no free huge page now ({err})");
                return;
            }
        }
        // 8 MiB of data hold at least three whole 2 MiB regions.
        assert!(
            kb >= 6 * 1024,
            "only {kb} kB of huge pages under 8 MiB of weights"
        );
    }
}
