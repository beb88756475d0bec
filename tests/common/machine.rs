//! A machine described by hand for the planner: NUMA nodes with their total and free memory,
//! the node the process runs on, and an optional cgroup limit.

use dsv4::plan::numa::{MemoryProbe, NodeMemory};

const GIB: u64 = 1 << 30;

pub struct Machine {
    /// (total, free) bytes per node.
    pub nodes: Vec<(u64, u64)>,
    pub process_node: u32,
    /// (limit, usage) bytes.
    pub cgroup: Option<(u64, u64)>,
}

impl Machine {
    /// These nodes, the process on node 0, no cgroup limit.
    pub fn with_nodes(nodes: Vec<(u64, u64)>) -> Self {
        Self {
            nodes,
            process_node: 0,
            cgroup: None,
        }
    }

    /// Two 1 TiB nodes (1000 and 900 GiB free), the process on node 1.
    pub fn big() -> Self {
        Self {
            nodes: vec![(1024 * GIB, 1000 * GIB), (1024 * GIB, 900 * GIB)],
            process_node: 1,
            cgroup: None,
        }
    }
}

impl MemoryProbe for Machine {
    fn nodes(&self) -> Vec<NodeMemory> {
        self.nodes
            .iter()
            .enumerate()
            .map(|(i, &(total, free))| NodeMemory {
                index: i as u32,
                total_bytes: total,
                free_bytes: free,
            })
            .collect()
    }
    fn process_node(&self) -> Option<u32> {
        Some(self.process_node)
    }
    fn cgroup(&self) -> Option<(u64, u64)> {
        self.cgroup
    }
}
