//! Pool regions: where each pool's memory is, so a copy engine or a network transport can
//! register it once and then move any sequence's bytes by `(pool, offset, len)` alone.
//!
//! Every pool is one allocation (device pools: one backend buffer each; host pools: one host
//! allocation each), published as a [`PoolRegion`] `{pool, tier, addr, len}`. The byte regions
//! of a [`SequenceState`](super::state::SequenceState) are offsets into those:
//! [`Region::locate`] turns one into an absolute `(addr, len)`, bounds-checked.

use serde::{Deserialize, Serialize};

use crate::backend::cpu::CpuBackend;
use crate::backend::Backend;
use crate::error::{Error, Result};

use super::layout::PoolId;
use super::pools::KvPools;
use super::state::{Region, RegionTier};

/// One pool's whole memory on one tier: `len` bytes from address `addr`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct PoolRegion {
    pub pool: PoolId,
    pub tier: RegionTier,
    pub addr: u64,
    pub len: usize,
}

impl PoolRegion {
    /// Whether `len` bytes from `addr` lie inside this region.
    pub fn contains(&self, addr: u64, len: usize) -> bool {
        addr >= self.addr
            && (addr - self.addr)
                .checked_add(len as u64)
                .is_some_and(|end| end <= self.len as u64)
    }
}

impl Region {
    /// This region's absolute `(addr, len)`: its offset into the [`PoolRegion`] of the same pool
    /// and tier among `regions` (from [`KvPools::regions`] or `HostPools::regions`). Refused
    /// (`DSV4_ERR_INVALID_ARGUMENT`) when no such pool region is given or the bytes would run
    /// past its end.
    pub fn locate(&self, regions: &[PoolRegion]) -> Result<(u64, usize)> {
        let Some(pool) = regions
            .iter()
            .find(|r| r.pool == self.pool && r.tier == self.tier)
        else {
            return Err(Error::invalid_argument(format!(
                "no {:?} region of pool `{}` was given to locate a sequence-state region in",
                self.tier,
                self.pool.name()
            )));
        };
        if self
            .offset
            .checked_add(self.len)
            .is_none_or(|end| end > pool.len)
        {
            return Err(Error::invalid_argument(format!(
                "the region {} + {} bytes lies outside pool `{}` ({} bytes)",
                self.offset,
                self.len,
                self.pool.name(),
                pool.len
            )));
        }
        Ok((pool.addr + self.offset as u64, self.len))
    }
}

impl<B: Backend> KvPools<B> {
    /// Every device pool's memory, one region per pool in [`PoolId::ALL`] order.
    pub fn regions(&self) -> Vec<PoolRegion> {
        PoolId::ALL
            .iter()
            .map(|&pool| {
                let (addr, len) = self.backend().buffer_region(self.buffer(pool));
                PoolRegion {
                    pool,
                    tier: RegionTier::Device,
                    addr,
                    len,
                }
            })
            .collect()
    }
}

impl KvPools<CpuBackend> {
    /// Copies `out.len()` bytes at absolute address `addr` into `out`, reading through the
    /// address a transport would use rather than through the backend (so tests can check the
    /// published regions). Refused unless the bytes lie inside one of [`Self::regions`]; like
    /// `read_bytes`, the range must not be one a tier copy is writing meanwhile.
    pub fn read_mapped(&self, addr: u64, out: &mut [u8]) -> Result<()> {
        // SAFETY: CPU-backend pool buffers are host allocations owned by `self.buffers`, alive
        // and initialised (zeroed at allocation) while `&self` is held, and `&self` excludes
        // writes through `write_bytes` / `buffer_mut`; tier copies follow the pools' protocol.
        unsafe { read_in_regions(&self.regions(), addr, out) }
    }
}

/// Copies `out.len()` bytes at `addr` into `out` once they are checked to lie inside one of
/// `regions`.
///
/// # Safety
/// Every region must describe live, initialised host memory that nothing writes during the
/// call, and its address must carry exposed provenance (`expose_provenance`).
pub(crate) unsafe fn read_in_regions(
    regions: &[PoolRegion],
    addr: u64,
    out: &mut [u8],
) -> Result<()> {
    if !regions.iter().any(|r| r.contains(addr, out.len())) {
        return Err(Error::invalid_argument(format!(
            "{} bytes at {addr:#x} are not inside one pool region",
            out.len()
        )));
    }
    let Ok(addr) = usize::try_from(addr) else {
        return Err(Error::invalid_argument("address beyond this machine's"));
    };
    let src = std::ptr::with_exposed_provenance::<u8>(addr);
    // SAFETY: `[addr, addr + out.len())` lies inside one region (checked), which the caller
    // guarantees is live, initialised host memory nobody writes now; `out` is a distinct `&mut`
    // buffer, so the ranges do not overlap.
    unsafe { std::ptr::copy_nonoverlapping(src, out.as_mut_ptr(), out.len()) };
    Ok(())
}
