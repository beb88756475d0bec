//! KV pool memory on the CPU backend: exact-size, 16-byte-aligned, zeroed host allocations,
//! and the row codecs applied while writing and gathering rows.

use std::alloc::{self, Layout};
use std::ops::Range;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crate::backend::{Placement, RowLayout, Rows};
use crate::error::{Error, ErrorKind, Result};
use crate::formats::rows::RowCodec;

/// Pool bytes are viewed as f32 in place. 16 is also the most the system allocator's
/// `calloc` path takes: a larger alignment makes `alloc_zeroed` write every byte, while
/// `calloc` maps zero pages lazily (a large pool costs nothing until used).
const ALIGN: usize = 16;

/// The system's page size.
fn page_size() -> usize {
    // SAFETY: sysconf has no preconditions.
    match unsafe { libc::sysconf(libc::_SC_PAGESIZE) } {
        p if p > 0 => p as usize,
        _ => 4096,
    }
}

/// One pool's bytes. Frees itself (and updates its backend's byte count) on drop.
pub struct CpuBuffer {
    ptr: NonNull<u8>,
    len: usize,
    allocated: Arc<AtomicU64>,
}

// SAFETY: the buffer exclusively owns its allocation (like a `Vec<u8>`); shared access only
// reads it and mutation needs `&mut`.
unsafe impl Send for CpuBuffer {}
// SAFETY: as above; `&CpuBuffer` only hands out shared slices.
unsafe impl Sync for CpuBuffer {}

impl CpuBuffer {
    pub(super) fn new(bytes: usize, allocated: Arc<AtomicU64>) -> Result<Self> {
        let layout = Layout::from_size_align(bytes.max(1), ALIGN).map_err(|_| too_big(bytes))?;
        // SAFETY: the layout has a non-zero size.
        let raw = unsafe { alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(raw).ok_or_else(|| too_big(bytes))?;
        allocated.fetch_add(bytes as u64, Ordering::Relaxed);
        Ok(Self {
            ptr,
            len: bytes,
            allocated,
        })
    }

    pub fn len(&self) -> usize {
        self.len
    }

    /// Backs every page of the buffer now: `calloc` maps large allocations lazily, and a
    /// first write then pays a page fault (in PD, while a room's bytes arrive).
    /// `MADV_POPULATE_WRITE` (Linux 5.14) does it in the kernel, in chunks spread over the
    /// calling rayon pool's threads (page allocation scales with them); older kernels get one
    /// write per page. Memory the machine cannot back shows here, at start: as an error from
    /// the kernel, or (with overcommit) as its OOM killer acting now rather than under load.
    pub(super) fn prefault(&mut self) -> Result<()> {
        use rayon::prelude::*;
        let page = page_size();
        const CHUNK: usize = 64 << 20;
        let base = self.ptr.as_ptr() as usize;
        // madvise takes page-aligned starts; the head before the first is touched.
        let start = base.next_multiple_of(page).min(base + self.len);
        let chunks: Vec<(usize, usize)> = (start..base + self.len)
            .step_by(CHUNK)
            .map(|from| (from, (from + CHUNK).min(base + self.len)))
            .collect();
        let populate = |&(from, to): &(usize, usize)| -> std::io::Result<()> {
            // SAFETY: `from..to` lies inside this buffer's allocation (both within
            // `base..base + len`), `from` is page-aligned; MADV_POPULATE_WRITE only faults
            // pages in (as a write of their current bytes would) and changes no byte.
            let rc = unsafe {
                libc::madvise(
                    from as *mut libc::c_void,
                    to - from,
                    libc::MADV_POPULATE_WRITE,
                )
            };
            if rc == 0 {
                Ok(())
            } else {
                Err(std::io::Error::last_os_error())
            }
        };
        match chunks.par_iter().try_for_each(populate) {
            Ok(()) => {
                self.touch(0, start - base);
                Ok(())
            }
            // A kernel without MADV_POPULATE_WRITE: touch each page instead. (Newer kernels
            // also answer EINVAL for a read-only or special mapping, which touching would
            // fault on; this buffer is the allocator's private read-write memory, never one.)
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                let len = self.len;
                self.touch(0, len);
                Ok(())
            }
            Err(e) => Err(Error::new(
                ErrorKind::Capacity,
                format!(
                    "kv.prefault: populating {} bytes of KV pool memory failed ({e}): lower \
                     kv.device_memory_bytes (or kv.device_memory_fraction), or set kv.prefault \
                     to false",
                    self.len
                ),
            )),
        }
    }

    /// Writes one byte of every page that bytes `from..to` lie on (the first of them, then
    /// each page start), each with its own value, spread over the calling rayon pool's
    /// threads.
    fn touch(&mut self, from: usize, to: usize) {
        use rayon::prelude::*;
        if from >= to {
            return;
        }
        let page = page_size();
        let base = self.ptr.as_ptr() as usize;
        // Page starts after `from`'s page (strictly: `from` itself may start a page), as
        // offsets into the buffer.
        let first_start = ((base + from) / page + 1) * page - base;
        let starts = (first_start..to).into_par_iter().step_by(page);
        rayon::iter::once(from).chain(starts).for_each(|at| {
            // SAFETY: `from <= at < to <= len`, inside the allocation; `&mut self` excludes
            // every other view, each page's byte is touched by one thread, and it is written
            // back unchanged.
            unsafe {
                let p = (base + at) as *mut u8;
                p.write_volatile(p.read_volatile());
            }
        });
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes `offset..offset + len`. Views are only ever taken of the range an access needs:
    /// the tier copy engine writes other ranges of the same buffer concurrently, through raw
    /// pointers, and a whole-buffer reference would overlap them.
    pub fn range(&self, offset: usize, len: usize) -> &[u8] {
        assert!(
            offset <= self.len && len <= self.len - offset,
            "pool access out of bounds"
        );
        // SAFETY: in bounds (checked); the bytes were initialised (zeroed) at allocation; by
        // the pools' protocol no copy is writing this range while it is read.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr().add(offset), len) }
    }

    /// Bytes `offset..offset + len`, writable.
    pub fn range_mut(&mut self, offset: usize, len: usize) -> &mut [u8] {
        assert!(
            offset <= self.len && len <= self.len - offset,
            "pool access out of bounds"
        );
        // SAFETY: in bounds (checked); `&mut self` excludes every other view taken through
        // this buffer, and by the pools' protocol no copy touches this range meanwhile.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr().add(offset), len) }
    }

    /// `range`, or an error naming the access when it falls outside the buffer.
    pub fn get(&self, offset: usize, len: usize) -> Result<&[u8]> {
        self.check(offset, len)?;
        Ok(self.range(offset, len))
    }

    /// `range_mut`, or an error naming the access when it falls outside the buffer.
    pub fn get_mut(&mut self, offset: usize, len: usize) -> Result<&mut [u8]> {
        self.check(offset, len)?;
        Ok(self.range_mut(offset, len))
    }

    /// Whether `offset..offset + len` lies inside the buffer.
    pub fn check(&self, offset: usize, len: usize) -> Result<()> {
        if offset <= self.len && len <= self.len - offset {
            Ok(())
        } else {
            Err(Error::internal(format!(
                "pool access of {len} bytes at offset {offset} is outside the {}-byte buffer",
                self.len
            )))
        }
    }

    /// The first byte, for asynchronous tier copies (see `range`).
    pub(super) fn base(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }
}

impl Drop for CpuBuffer {
    fn drop(&mut self) {
        let layout = Layout::from_size_align(self.len.max(1), ALIGN).expect("checked at alloc");
        // SAFETY: allocated in `new` with this same layout and not freed before.
        unsafe { alloc::dealloc(self.ptr.as_ptr(), layout) };
        self.allocated.fetch_sub(self.len as u64, Ordering::Relaxed);
    }
}

fn too_big(bytes: usize) -> Error {
    Error::new(
        ErrorKind::Capacity,
        format!(
            "cannot allocate a {bytes}-byte KV pool in host memory: lower kv.device_memory_bytes \
             or kv.max_running_requests"
        ),
    )
}

/// Encodes `rows` of `x` into rows `first..` of `layout`.
pub(super) fn write_rows(
    dst: &mut CpuBuffer,
    layout: &RowLayout<'_, super::CpuIndex>,
    first: usize,
    x: &[f32],
    rows: Range<usize>,
) {
    let (w, rb) = (layout.width, layout.row_bytes);
    for (i, r) in rows.enumerate() {
        let at = layout.row_offset(first + i);
        layout
            .codec
            .encode(&x[r * w..(r + 1) * w], dst.range_mut(at, rb));
    }
}

/// Appends the decoded row `r` to `out`.
pub(super) fn push_row(rows: &Rows<'_, super::CpuBackend>, r: usize, out: &mut Vec<f32>) {
    let l = &rows.layout;
    let at = l.row_offset(r);
    l.codec
        .decode_append(rows.buffer.range(at, l.row_bytes), l.width, out);
}

/// A ring of f32 rows as the values it holds, where they are (`[ring rows, width]` in slot
/// order), and its row count; `None` for any other format or placement (decode those rows).
pub(super) fn f32_ring<'a>(rows: &Rows<'a, super::CpuBackend>) -> Option<(&'a [f32], usize)> {
    let l = &rows.layout;
    let Placement::Ring { rows: n } = l.placement else {
        return None;
    };
    // Stored f32 rows are little-endian bytes: the same values in place only on such targets.
    if l.codec != RowCodec::F32 || l.row_bytes != 4 * l.width || cfg!(target_endian = "big") {
        return None;
    }
    let buffer: &'a CpuBuffer = rows.buffer;
    bytemuck::try_cast_slice(buffer.range(l.offset, n * l.row_bytes))
        .ok()
        .map(|v| (v, n))
}

/// Decodes rows `range` into a contiguous `[range.len(), width]` block.
pub(super) fn gather(rows: &Rows<'_, super::CpuBackend>, range: Range<usize>) -> Vec<f32> {
    let mut out = super::recycle::with_capacity(range.len() * rows.layout.width);
    for r in range {
        push_row(rows, r, &mut out);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Of the pages bytes `from..to` of `buf` lie on, those the kernel holds resident
    /// (`mincore`), and how many there are.
    fn resident(buf: &CpuBuffer, from: usize, to: usize) -> (usize, usize) {
        let page = page_size();
        let base = buf.ptr.as_ptr() as usize;
        let start = (base + from) / page * page;
        let pages = (base + to).div_ceil(page) - start / page;
        let mut vec = vec![0u8; pages];
        // SAFETY: the pages from `start` on are pages of the buffer's mapping (each holds at
        // least one of its bytes); `vec` has one byte per page, as mincore writes.
        let rc =
            unsafe { libc::mincore(start as *mut libc::c_void, pages * page, vec.as_mut_ptr()) };
        assert_eq!(rc, 0, "mincore: {}", std::io::Error::last_os_error());
        (vec.iter().filter(|&&v| v & 1 == 1).count(), pages)
    }

    #[test]
    fn touching_then_prefaulting_makes_every_page_resident_and_keeps_the_bytes() {
        // Large enough that the allocator maps it fresh (no free chunk of this process is as
        // big), so it starts out not resident: what makes the checks below able to fail.
        const LEN: usize = 512 << 20;
        let allocated = Arc::new(AtomicU64::new(0));
        let mut buf = CpuBuffer::new(LEN, allocated.clone()).unwrap();
        let (lazy, pages) = resident(&buf, 0, LEN);
        assert!(
            lazy < pages / 16,
            "{lazy} of {pages} pages resident at first"
        );
        // The fallback: from an unaligned offset, every page the range lies on, the last
        // partial one included.
        let (from, to) = (1000, (64 << 20) + 5);
        buf.touch(from, to);
        let (touched, n) = resident(&buf, from, to);
        assert_eq!(touched, n, "every page of the touched range");
        let (rest, _) = resident(&buf, 80 << 20, LEN);
        assert!(
            rest < pages / 16,
            "only the touched range: {rest} resident past it"
        );

        let marks = [0usize, 4095, 4096, 12345, (100 << 20) + 7, LEN - 1];
        for (i, &m) in marks.iter().enumerate() {
            buf.range_mut(m, 1)[0] = 0x5a + i as u8;
        }
        buf.prefault().unwrap();
        let (now, pages) = resident(&buf, 0, LEN);
        assert_eq!(now, pages, "every page resident after prefault");
        for (i, &m) in marks.iter().enumerate() {
            assert_eq!(buf.range(m, 1)[0], 0x5a + i as u8, "byte {m} kept");
        }
        // The rest still reads as zero (the pools' initial state).
        assert!(buf.range(200 << 20, 1 << 20).iter().all(|&b| b == 0));
        assert_eq!(allocated.load(Ordering::Relaxed), LEN as u64);
    }

    #[test]
    fn small_and_empty_buffers_prefault() {
        for len in [0, 1, 100, 4096, 70_000] {
            let mut buf = CpuBuffer::new(len, Arc::default()).unwrap();
            buf.prefault().unwrap();
            if len > 0 {
                let (now, pages) = resident(&buf, 0, len);
                assert_eq!(now, pages, "{len} bytes");
            }
        }
    }
}
