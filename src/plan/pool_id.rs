//! The one vocabulary for KV pools. The planner sizes them, `kv` lays bytes out in them, reports
//! and sequence states name them; all of it goes through [`PoolId`], whose [`PoolId::name`] is
//! the serialized name (`"c4_kv"`, …) every JSON output uses.

use serde::{Deserialize, Serialize};

/// A KV pool, in the plan's report order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PoolId {
    /// CSA compressed K=V rows (paged).
    C4Kv,
    /// CSA indexer key rows (paged).
    C4Indexer,
    /// HCA compressed rows (paged).
    C128Kv,
    /// Window rings of every layer and MTP block (one slot per running request).
    Swa,
    /// CSA compressor frontiers (per slot).
    C4State,
    /// CSA indexer compressor frontiers (per slot).
    C4IndexerState,
    /// HCA compressor frontiers (per slot).
    C128State,
    /// Fixed state at page boundaries (prefix-cache snapshots).
    Snapshots,
}

impl PoolId {
    /// Every pool, in report order (`index()` order).
    pub const ALL: [PoolId; 8] = [
        Self::C4Kv,
        Self::C4Indexer,
        Self::C128Kv,
        Self::Swa,
        Self::C4State,
        Self::C4IndexerState,
        Self::C128State,
        Self::Snapshots,
    ];

    /// The pool's name in every report and serialized form.
    pub fn name(self) -> &'static str {
        match self {
            Self::C4Kv => "c4_kv",
            Self::C4Indexer => "c4_indexer",
            Self::C128Kv => "c128_kv",
            Self::Swa => "swa",
            Self::C4State => "c4_state",
            Self::C4IndexerState => "c4_indexer_state",
            Self::C128State => "c128_state",
            Self::Snapshots => "snapshots",
        }
    }

    /// The pool called `name` ([`Self::name`]), if any.
    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|id| id.name() == name)
    }

    /// Position in report order (`ALL[id.index()] == id`).
    pub fn index(self) -> usize {
        self as usize
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_index_and_serde_agree() {
        for (i, id) in PoolId::ALL.into_iter().enumerate() {
            assert_eq!(id.index(), i);
            assert_eq!(PoolId::from_name(id.name()), Some(id));
            assert_eq!(
                serde_json::to_value(id).unwrap(),
                serde_json::json!(id.name())
            );
        }
        assert_eq!(PoolId::from_name("c4"), None);
    }
}
