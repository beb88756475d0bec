//! Host memory for the HiCache tier: one exact-size allocation per pool, bound to a NUMA node
//! with hwloc before it is touched, then pre-touched by several threads so the first backup
//! does not pay page faults (and the pages really land on that node).

use std::alloc::{self, Layout};
use std::mem::MaybeUninit;
use std::ptr::NonNull;
use std::time::Instant;

use hwlocality::memory::binding::{MemoryBindingFlags, MemoryBindingPolicy};
use hwlocality::memory::nodeset::NodeSet;
use hwlocality::object::types::ObjectType;
use hwlocality::Topology;

use crate::backend::HostPtr;
use crate::error::{Error, ErrorKind, Result};

/// Page-aligned so binding and pre-touching work on whole pages.
const ALIGN: usize = 4096;

/// How an allocation went (logged, and reported by the benchmark).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AllocReport {
    pub bytes: usize,
    /// The node the memory was bound to (None: single-node machine or binding unavailable).
    pub bound_node: Option<u32>,
    /// Allocation + binding + pre-touch.
    pub seconds: f64,
}

impl AllocReport {
    pub fn gib_per_s(&self) -> f64 {
        self.bytes as f64 / (1u64 << 30) as f64 / self.seconds.max(1e-9)
    }
}

/// An owned, NUMA-placed, pre-touched host allocation.
pub struct HostMemory {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the allocation is owned exclusively (like a Vec<u8>); shared access only reads
// ranges, and mutation goes through `&mut self` or the tier copy protocol.
unsafe impl Send for HostMemory {}
// SAFETY: as above.
unsafe impl Sync for HostMemory {}

impl HostMemory {
    /// `bytes` of host memory on `node` (when the machine has several), pre-touched by
    /// `threads` threads.
    pub fn allocate(
        bytes: usize,
        node: Option<u32>,
        threads: usize,
    ) -> Result<(Self, AllocReport)> {
        let started = Instant::now();
        let layout = Layout::from_size_align(bytes.max(1), ALIGN).map_err(|_| too_big(bytes))?;
        // SAFETY: non-zero size. Not zeroed: the pre-touch below writes every byte, from
        // threads on the chosen node's memory policy.
        let raw = unsafe { alloc::alloc(layout) };
        let ptr = NonNull::new(raw).ok_or_else(|| too_big(bytes))?;
        let bound_node = node.and_then(|n| bind(ptr, bytes, n));
        pre_touch(ptr, bytes, threads.max(1));
        let report = AllocReport {
            bytes,
            bound_node,
            seconds: started.elapsed().as_secs_f64(),
        };
        Ok((Self { ptr, len: bytes }, report))
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The address of byte `offset`, for asynchronous copies.
    pub fn ptr_at(&self, offset: usize) -> HostPtr {
        assert!(offset <= self.len, "host access out of bounds");
        // SAFETY: within the allocation (checked).
        HostPtr(unsafe { self.ptr.as_ptr().add(offset) })
    }

    /// Bytes `offset..offset + len` (only ranges no copy is writing).
    pub fn range(&self, offset: usize, len: usize) -> &[u8] {
        assert!(
            offset <= self.len && len <= self.len - offset,
            "host access out of bounds"
        );
        // SAFETY: in bounds; initialised by the pre-touch; no concurrent writer per the tier
        // copy protocol.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr().add(offset), len) }
    }

    /// Writable bytes `offset..offset + len`.
    pub fn range_mut(&mut self, offset: usize, len: usize) -> &mut [u8] {
        assert!(
            offset <= self.len && len <= self.len - offset,
            "host access out of bounds"
        );
        // SAFETY: in bounds; `&mut self` excludes other views; no copy touches this range.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr().add(offset), len) }
    }
}

impl Drop for HostMemory {
    fn drop(&mut self) {
        let layout = Layout::from_size_align(self.len.max(1), ALIGN).expect("checked at alloc");
        // SAFETY: allocated in `allocate` with this layout, freed once.
        unsafe { alloc::dealloc(self.ptr.as_ptr(), layout) };
    }
}

fn too_big(bytes: usize) -> Error {
    Error::new(
        ErrorKind::Capacity,
        format!(
            "cannot allocate {bytes} bytes of host memory for HiCache: lower hicache.size_bytes \
             or hicache.ratio"
        ),
    )
}

/// Binds the (untouched) range to `node`; None when there is nothing to bind to or hwloc
/// refuses (logged: the memory then follows the default first-touch policy).
fn bind(ptr: NonNull<u8>, len: usize, node: u32) -> Option<u32> {
    let topology = Topology::new().ok()?;
    if topology.objects_with_type(ObjectType::NUMANode).count() < 2 {
        return None;
    }
    // SAFETY: `len` bytes allocated by the caller; viewed as possibly-uninitialised bytes
    // (the target only provides the address range).
    let area: &[MaybeUninit<u8>] = unsafe { std::slice::from_raw_parts(ptr.as_ptr().cast(), len) };
    let set = NodeSet::from_range(node as usize..=node as usize);
    match topology.bind_memory_area(
        area,
        &set,
        MemoryBindingPolicy::Bind,
        MemoryBindingFlags::empty(),
    ) {
        Ok(()) => Some(node),
        Err(e) => {
            log::warn!(
                "HiCache: cannot bind host memory to NUMA node {node} ({e}); using first touch"
            );
            None
        }
    }
}

/// Writes every byte, `threads` chunks in parallel.
fn pre_touch(ptr: NonNull<u8>, len: usize, threads: usize) {
    let chunk = len.div_ceil(threads).next_multiple_of(ALIGN).max(ALIGN);
    let base = HostPtr(ptr.as_ptr());
    std::thread::scope(|s| {
        for start in (0..len).step_by(chunk) {
            let n = chunk.min(len - start);
            s.spawn(move || {
                let b = base;
                // SAFETY: each thread writes its own disjoint chunk of the allocation.
                unsafe { std::ptr::write_bytes(b.0.add(start), 0, n) };
            });
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Whether every page of `mem` is resident, as the kernel says (`mincore`).
    fn resident(mem: &HostMemory) -> bool {
        let page = 4096;
        let mut pages = vec![0u8; mem.len().div_ceil(page)];
        // SAFETY: the mapping's page-aligned start and length; `pages` holds one byte a page.
        let rc = unsafe { libc::mincore(mem.ptr.as_ptr().cast(), mem.len(), pages.as_mut_ptr()) };
        assert_eq!(rc, 0, "{}", std::io::Error::last_os_error());
        pages.iter().all(|&p| p & 1 == 1)
    }

    #[test]
    fn host_memory_is_resident_zeroed_and_writable_from_the_start() {
        let bytes = (24 << 20) + 100; // not a whole number of pages or chunks
        let (mut mem, report) = HostMemory::allocate(bytes, None, 3).unwrap();
        assert_eq!((mem.len(), report.bytes), (bytes, bytes));
        assert!(resident(&mem), "pages left to fault in later");
        assert!(mem.range(0, bytes).iter().all(|&b| b == 0));
        mem.range_mut(bytes - 7, 7).copy_from_slice(b"hicache");
        assert_eq!(mem.range(bytes - 7, 7), b"hicache");
    }
}
