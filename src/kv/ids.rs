//! Typed unit ids. A device page, a host page, a device snapshot, a host snapshot and a tree node
//! are all small integers; giving each its own type makes passing one where another is meant
//! (a host page id into a device page table, a snapshot unit as a page) a compile error instead
//! of silent corruption of another request's KV.
//!
//! The backend sees page ids only as the raw indices of a sequence's page table, uploaded once
//! per step by `KvPools::page_table`: the one place they stop being typed.
//!
//! ```compile_fail
//! use dsv4::kv::{HostPageId, PageId};
//! fn device_page(_: PageId) {}
//! device_page(HostPageId(3)); // a host page is not a device page
//! ```
//!
//! ```compile_fail
//! use dsv4::kv::{PageId, SnapshotId};
//! let pages: Vec<PageId> = vec![SnapshotId(1)]; // nor is a snapshot
//! ```

use std::fmt;

use serde::{Deserialize, Serialize};

/// An id the [`UnitAllocator`](super::units::UnitAllocator) hands out: unit `i` of a pool.
pub trait UnitId: Copy + Eq + fmt::Debug + fmt::Display {
    fn from_index(index: usize) -> Self;
    fn index(self) -> usize;
}

macro_rules! unit_id {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        #[derive(
            Debug, Default, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize,
            Deserialize,
        )]
        #[serde(transparent)]
        #[repr(transparent)]
        pub struct $name(pub u32);

        impl $name {
            /// The raw unit number (for byte offsets: `index() × unit_bytes`).
            pub const fn get(self) -> u32 {
                self.0
            }
        }

        impl UnitId for $name {
            fn from_index(index: usize) -> Self {
                Self(u32::try_from(index).expect("unit index fits in u32"))
            }

            fn index(self) -> usize {
                self.0 as usize
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                self.0.fmt(f)
            }
        }
    };
}

unit_id!(
    /// A device KV page: one id addresses the same unit of the three paged pools.
    PageId
);
unit_id!(
    /// A host (HiCache) page: one id addresses the same unit of the three host paged pools.
    HostPageId
);
unit_id!(
    /// A device snapshot unit.
    SnapshotId
);
unit_id!(
    /// A host (HiCache) snapshot unit.
    HostSnapshotId
);
unit_id!(
    /// A node of the radix tree (an index into its node arena, reused after removal).
    NodeId
);

impl UnitId for u32 {
    fn from_index(index: usize) -> Self {
        u32::try_from(index).expect("unit index fits in u32")
    }

    fn index(self) -> usize {
        self as usize
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_serialize_as_plain_numbers() {
        assert_eq!(serde_json::to_string(&PageId(7)).unwrap(), "7");
        assert_eq!(
            serde_json::from_str::<SnapshotId>("3").unwrap(),
            SnapshotId(3)
        );
        assert_eq!(PageId::from_index(5).to_string(), "5");
    }
}
