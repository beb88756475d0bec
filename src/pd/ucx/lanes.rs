//! What an endpoint's configuration says about RMA: whether a put travels on a lane that
//! writes the peer's memory itself (rc, dc, shared memory, cma, ...) or is emulated with
//! active messages that the peer's worker answers (UCX's tcp transport).
//!
//! Emulated puts gain nothing over our own active messages, and libucp 1.13 aborts the
//! *target's* process when the answer to an emulated put cannot be sent because the origin's
//! endpoint already failed (`ucp_request.inl: Fatal: unexpected error: Endpoint timeout`,
//! from `ucp_put_handler`): a decode would die with its prefill. So a decode offers its
//! memory for RMA only over endpoints with a real RMA lane.

/// UCX transports that write a peer's memory themselves (InfiniBand/RoCE reliable and
/// dynamically connected, shared memory, cross-memory attach, GPU IPC).
const RMA_TRANSPORTS: &[&str] = &[
    "rc", "rc_verbs", "rc_mlx5", "dc", "dc_mlx5", "cma", "knem", "xpmem", "sysv", "posix", "self",
    "cuda_ipc", "rocm_ipc",
];

/// Whether the endpoint described by `ucp_ep_print_info`'s text has a real RMA lane: a put
/// protocol listed on some lane (`put[N]: ...`, which UCX 1.13 prints only for RMA lanes;
/// an endpoint whose puts are emulated by active messages has none), or, should a later
/// UCX print its protocols otherwise, a lane on a transport from [`RMA_TRANSPORTS`].
pub fn has_rma_lane(description: &str) -> bool {
    transports(description).iter().any(|t| {
        let name = t.split_once('/').map_or(t.as_str(), |(n, _)| n);
        RMA_TRANSPORTS.contains(&name)
    }) || description.lines().any(|line| {
        let line = line.trim_start_matches('#').trim_start();
        line.strip_prefix("put[").is_some_and(|rest| {
            rest.split_once("]:").is_some_and(|(lane, _)| {
                !lane.is_empty() && lane.bytes().all(|b| b.is_ascii_digit())
            })
        })
    })
}

/// The transports of the endpoint's lanes (`lane[1]:  0:tcp/lo.0 md[0] -> ...` gives
/// `tcp/lo.0`, a connection manager's `lane[0]: cm rdmacm` gives `cm rdmacm`), for messages.
pub fn transports(description: &str) -> Vec<String> {
    description
        .lines()
        .filter_map(|line| {
            let line = line.trim_start_matches('#').trim_start();
            let rest = line.strip_prefix("lane[")?.split_once("]:")?.1.trim();
            let rest = rest.split(" md[").next()?.split(" ->").next()?.trim();
            // The resource's index in front (`0:`).
            let rest = match rest.split_once(':') {
                Some((i, r)) if i.bytes().all(|b| b.is_ascii_digit()) => r,
                _ => rest,
            };
            (!rest.is_empty()).then(|| rest.to_string())
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    // `ucx_info -e -u r` (UCX 1.13.1) on this machine: the text ucp_ep_print_info prints.
    const TCP_ONLY: &str = "#\n# UCP endpoint \n#\n#               peer: <no debug data>\n\
        #                 lane[0]:  0:tcp/lo.0 md[0]                -> md[0]/tcp/sysdev[255] am am_bw#0 wireup\n\
        #\n#\n#                  rma_bw: mds #\n";
    const SHARED_MEMORY: &str = "#\n# UCP endpoint \n#\n#               peer: <no debug data>\n\
        #                 lane[0]:  0:self/memory0.0 md[0]          -> md[0]/self/sysdev[255] am am_bw#0\n\
        #                 lane[1]:  3:sysv/memory.0 md[2]           -> md[2]/sysv/sysdev[255]\n\
        #                 lane[2]:  4:posix/memory.0 md[3]          -> md[3]/posix/sysdev[255]\n\
        #\n#                  put[0]: 0..<short>..4294967296..<bcopy>..(inf)\n\
        #                  get[0]: 0..<bcopy>..(inf)\n\
        #                  put[1]: 0..<short>..4294967296..<bcopy>..(inf)\n\
        #\n#                  rma_bw: mds #\n";

    #[test]
    fn tcp_lanes_have_no_rma_and_shared_memory_lanes_do() {
        assert!(!has_rma_lane(TCP_ONLY));
        assert!(has_rma_lane(SHARED_MEMORY));
        assert!(!has_rma_lane(""));
        // "rma_bw: mds" is not a put protocol.
        assert!(!has_rma_lane("#  rma_bw: mds 0 #\n#  put[x]: nonsense\n"));
        assert_eq!(transports(TCP_ONLY), ["tcp/lo.0"]);
        // A decode's endpoint to its prefill here (UCX 1.13, client-server).
        let cm = "#   lane[0]: cm rdmacm\n\
                  #   lane[1]:  1:tcp/lo.0 md[1]   -> md[1]/tcp/sysdev[255] rma_bw#0 am am_bw#0 wireup\n\
                  #   lane[2]:  2:tcp/eth0.0 md[1] -> md[1]/tcp/sysdev[255] rma_bw#1\n\
                  #   am_send: 0..<egr/short>..8185..<egr/zcopy>..8192..<rndv>..(inf)\n\
                  #   rma_bw: mds [1] rndv_rkey_size 10\n";
        assert!(!has_rma_lane(cm));
        assert_eq!(transports(cm), ["cm rdmacm", "tcp/lo.0", "tcp/eth0.0"]);
        // An RDMA lane counts even where no put protocol is printed; ud alone does not.
        let rc = "#   lane[0]: cm rdmacm\n\
                  #   lane[1]:  3:rc_mlx5/mlx5_0:1 md[2] -> md[2]/ib/sysdev[255] rma_bw#0 am\n";
        assert!(has_rma_lane(rc));
        assert_eq!(transports(rc), ["cm rdmacm", "rc_mlx5/mlx5_0:1"]);
        let ud = "#   lane[0]:  3:ud_mlx5/mlx5_0:1 md[2] -> md[2]/ib/sysdev[255] am wireup\n";
        assert!(!has_rma_lane(ud));
        assert_eq!(
            transports(SHARED_MEMORY),
            ["self/memory0.0", "sysv/memory.0", "posix/memory.0"]
        );
    }
}
