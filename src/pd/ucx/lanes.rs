//! What an endpoint's configuration says about RMA: whether a put travels on a lane that
//! writes the peer's memory itself (rc, dc, shared memory, cma, ...) or is emulated with
//! active messages that the peer's worker answers (UCX's tcp transport).
//!
//! Emulated puts gain nothing over our own active messages, and libucp 1.13 aborts the
//! *target's* process when the answer to an emulated put cannot be sent because the origin's
//! endpoint already failed (`ucp_request.inl: Fatal: unexpected error: Endpoint timeout`,
//! from `ucp_put_handler`): a decode would die with its prefill. So a decode offers its
//! memory for RMA only over endpoints with a real RMA lane.

/// Whether `ucp_ep_print_info`'s text lists a put protocol on some lane (`put[N]: ...`).
/// UCX prints these only for the endpoint's RMA lanes; an endpoint whose puts are emulated
/// by active messages has none.
pub fn has_rma_lane(description: &str) -> bool {
    description.lines().any(|line| {
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
        assert_eq!(
            transports(SHARED_MEMORY),
            ["self/memory0.0", "sysv/memory.0", "posix/memory.0"]
        );
    }
}
