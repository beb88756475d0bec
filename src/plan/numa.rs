//! Where host memory would come from, and how much of it is free: the NUMA node of the GPU (or,
//! without one, of the process) found with hwloc, and the cgroup limit (`memory.max`, or v1's
//! `memory.limit_in_bytes`), which containers hit long before the node runs out.

use std::path::{Path, PathBuf};

use hwlocality::cpu::binding::CpuBindingFlags;
use hwlocality::object::types::ObjectType;
use hwlocality::Topology;

use crate::config::params::NumaNode;

/// One NUMA node as the planner sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeMemory {
    pub index: u32,
    pub total_bytes: u64,
    pub free_bytes: u64,
}

/// What the machine says about its memory; a trait so tests can describe any machine.
pub trait MemoryProbe {
    /// Every NUMA node, in index order (at least one).
    fn nodes(&self) -> Vec<NodeMemory>;
    /// The node the calling process runs on, if it can be told.
    fn process_node(&self) -> Option<u32>;
    /// `(limit, usage)` of the process's memory cgroup, when a limit is set.
    fn cgroup(&self) -> Option<(u64, u64)>;
    /// Free memory of the first GPU in `devices` (empty: GPU 0) and a description of it, or
    /// why it cannot be read (no driver, no device).
    fn gpu_free(&self, _devices: &[u32]) -> std::result::Result<(u64, String), String> {
        Err("this probe reads no GPU".into())
    }
}

/// Reads this machine: hwloc for the topology, /sys and /proc for free memory.
pub struct SystemProbe {
    topology: &'static Option<Topology>,
}

/// The machine's topology, discovered once per process: discovery walks /sys (tens of
/// milliseconds, seconds under valgrind) and the answer does not change while we run. Free
/// memory is still read fresh on every probe.
static TOPOLOGY: std::sync::OnceLock<Option<Topology>> = std::sync::OnceLock::new();

impl SystemProbe {
    pub fn new() -> Self {
        let topology = TOPOLOGY.get_or_init(|| {
            Topology::new()
                .map_err(|e| {
                    log::warn!("hwloc could not read the topology ({e}); assuming one node")
                })
                .ok()
        });
        Self { topology }
    }
}

impl Default for SystemProbe {
    fn default() -> Self {
        Self::new()
    }
}

impl MemoryProbe for SystemProbe {
    fn gpu_free(&self, devices: &[u32]) -> std::result::Result<(u64, String), String> {
        let gpus =
            crate::backend::cuda::probe::gpus(devices).map_err(|e| e.message().to_string())?;
        let g = &gpus[0];
        Ok((
            g.free_bytes,
            format!(
                "free memory of GPU {} ({}, {})",
                g.ordinal,
                g.name,
                g.arch()
            ),
        ))
    }

    fn nodes(&self) -> Vec<NodeMemory> {
        let meminfo = read_kib_fields(Path::new("/proc/meminfo"), "");
        let system_total = meminfo.get("MemTotal").copied();
        let system_available = meminfo.get("MemAvailable").copied();
        let indices: Vec<(u32, u64)> = self
            .topology
            .as_ref()
            .map(|t| {
                t.objects_with_type(ObjectType::NUMANode)
                    .filter_map(|n| Some((n.os_index()? as u32, n.total_memory())))
                    .collect()
            })
            .unwrap_or_default();
        if indices.len() <= 1 {
            // One node: the whole machine. /proc/meminfo's MemAvailable counts reclaimable
            // page cache, which per-node counters do not.
            let index = indices.first().map_or(0, |&(i, _)| i);
            let total = system_total
                .or(indices.first().map(|&(_, t)| t))
                .unwrap_or(0);
            return vec![NodeMemory {
                index,
                total_bytes: total,
                free_bytes: system_available.unwrap_or(total),
            }];
        }
        indices
            .into_iter()
            .map(|(index, hwloc_total)| {
                let path = PathBuf::from(format!("/sys/devices/system/node/node{index}/meminfo"));
                let fields = read_kib_fields(&path, &format!("Node {index} "));
                let free = fields.get("MemFree").copied().unwrap_or(0)
                    + fields.get("Inactive(file)").copied().unwrap_or(0);
                NodeMemory {
                    index,
                    total_bytes: fields.get("MemTotal").copied().unwrap_or(hwloc_total),
                    free_bytes: free,
                }
            })
            .collect()
    }

    fn process_node(&self) -> Option<u32> {
        let topology = self.topology.as_ref()?;
        let cpus = topology.cpu_binding(CpuBindingFlags::PROCESS).ok()?;
        topology
            .objects_with_type(ObjectType::NUMANode)
            .find(|node| node.cpuset().is_some_and(|set| set.intersects(&cpus)))
            .and_then(|node| node.os_index())
            .map(|i| i as u32)
    }

    fn cgroup(&self) -> Option<(u64, u64)> {
        cgroup_memory(Path::new("/proc/self/cgroup"), Path::new("/sys/fs/cgroup"))
    }
}

/// `key: N kB` lines (with an optional per-node prefix) → bytes.
fn read_kib_fields(path: &Path, prefix: &str) -> std::collections::HashMap<String, u64> {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    text.lines()
        .filter_map(|line| {
            let line = line.strip_prefix(prefix)?;
            let (key, rest) = line.split_once(':')?;
            let kib: u64 = rest.split_whitespace().next()?.parse().ok()?;
            Some((key.trim().to_string(), kib * 1024))
        })
        .collect()
}

/// `(limit, usage)` of the tightest memory limit on the process's cgroup path, v2 or v1.
fn cgroup_memory(proc_cgroup: &Path, root: &Path) -> Option<(u64, u64)> {
    let text = std::fs::read_to_string(proc_cgroup).ok()?;
    for line in text.lines() {
        let mut parts = line.splitn(3, ':');
        let (id, controllers, path) = (parts.next()?, parts.next()?, parts.next()?);
        let rel = path.trim_start_matches('/');
        let (dir, limit_file, usage_file) = if id == "0" && controllers.is_empty() {
            (root.to_path_buf(), "memory.max", "memory.current")
        } else if controllers.split(',').any(|c| c == "memory") {
            (
                root.join("memory"),
                "memory.limit_in_bytes",
                "memory.usage_in_bytes",
            )
        } else {
            continue;
        };
        // Inside a container the cgroup namespace root is mounted at `dir`, so the path from
        // /proc/self/cgroup may not exist below it: walk up until a directory has the files.
        let mut candidate = dir.join(rel);
        let found = loop {
            if candidate.join(limit_file).is_file() {
                break Some(candidate.clone());
            }
            if candidate == dir || !candidate.pop() {
                break None;
            }
        };
        let Some(found) = found else { continue };
        let read = |file: &str| -> Option<u64> {
            std::fs::read_to_string(found.join(file))
                .ok()?
                .trim()
                .parse()
                .ok()
        };
        let limit = read(limit_file);
        let usage = read(usage_file).unwrap_or(0);
        // "max" (v2) does not parse; v1 reports "unlimited" as a number near 2^63.
        if let Some(limit) = limit.filter(|&l| l < (1 << 60)) {
            return Some((limit, usage));
        }
    }
    None
}

/// Which node HiCache memory would be placed on, and why.
pub fn choose_node(
    probe: &dyn MemoryProbe,
    wanted: NumaNode,
    gpu_visible: bool,
) -> Result<(NodeMemory, &'static str), String> {
    let nodes = probe.nodes();
    let listed = || {
        nodes
            .iter()
            .map(|n| n.index.to_string())
            .collect::<Vec<_>>()
            .join(", ")
    };
    match wanted {
        NumaNode::Index(i) => nodes
            .iter()
            .find(|n| n.index == i)
            .cloned()
            .map(|n| (n, "hicache.numa_node"))
            .ok_or_else(|| {
                format!(
                    "hicache.numa_node = {i} does not exist on this machine (nodes: {}): set it \
                     to one of them or to \"auto\"",
                    listed()
                )
            }),
        NumaNode::Auto => {
            let source = if gpu_visible { "gpu" } else { "process" };
            let node = probe
                .process_node()
                .and_then(|i| nodes.iter().find(|n| n.index == i))
                .or(nodes.first())
                .cloned()
                .ok_or_else(|| "this machine reports no memory at all".to_string())?;
            Ok((node, source))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_system_probe_reads_this_machine() {
        let probe = SystemProbe::new();
        let nodes = probe.nodes();
        assert!(!nodes.is_empty());
        assert!(nodes
            .iter()
            .all(|n| n.total_bytes > 0 && n.free_bytes <= n.total_bytes));
    }

    #[test]
    fn cgroup_v2_and_v1_limits_are_found_above_a_namespaced_path() {
        let dir = std::env::temp_dir().join(format!("dsv4-cgroup-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        // v2: the cgroup path does not exist under the mount (namespace root); its parent has
        // the limit.
        std::fs::create_dir_all(dir.join("fs")).unwrap();
        std::fs::write(dir.join("fs/memory.max"), "17179869184\n").unwrap();
        std::fs::write(dir.join("fs/memory.current"), "1073741824\n").unwrap();
        std::fs::write(dir.join("cgroup"), "0::/kubepods/pod1/ctr\n").unwrap();
        assert_eq!(
            cgroup_memory(&dir.join("cgroup"), &dir.join("fs")),
            Some((16 << 30, 1 << 30))
        );
        std::fs::write(dir.join("fs/memory.max"), "max\n").unwrap();
        assert_eq!(cgroup_memory(&dir.join("cgroup"), &dir.join("fs")), None);
        // v1 with an "unlimited" limit, then a real one.
        std::fs::create_dir_all(dir.join("fs/memory/docker/abc")).unwrap();
        std::fs::write(dir.join("cgroup"), "4:memory:/docker/abc\n").unwrap();
        std::fs::write(
            dir.join("fs/memory/docker/abc/memory.limit_in_bytes"),
            "9223372036854771712\n",
        )
        .unwrap();
        assert_eq!(cgroup_memory(&dir.join("cgroup"), &dir.join("fs")), None);
        std::fs::write(
            dir.join("fs/memory/docker/abc/memory.limit_in_bytes"),
            "8589934592\n",
        )
        .unwrap();
        std::fs::write(
            dir.join("fs/memory/docker/abc/memory.usage_in_bytes"),
            "100\n",
        )
        .unwrap();
        assert_eq!(
            cgroup_memory(&dir.join("cgroup"), &dir.join("fs")),
            Some((8 << 30, 100))
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
