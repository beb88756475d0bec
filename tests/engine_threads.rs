//! Destroy joins every thread the engine started (issue "Hardening": it returned before the
//! CPU backend's worker threads had exited, so a host unloading the library right after could
//! still have dsv4 code running). One test in its own process, so no other test's threads
//! blur the count.

mod common;

use common::books::{fds_now, threads_now};
use common::requests::*;
use dsv4::kv::cache::Tier;
use serde_json::json;

#[test]
fn destroy_returns_only_after_every_engine_thread_has_exited() {
    let prompt = common::ids("flash-like")[..200].to_vec();
    let before = (threads_now(), fds_now());
    for cycle in 0..10 {
        // HiCache on, so the tier copy thread starts too (the flush backs pages up).
        let engine = engine_with(json!({
            "threads": 2,
            "hicache": {"enabled": true, "ratio": 2.0, "write_policy": "write_through"}
        }));
        let id = engine.submit(greedy(&prompt, 2)).unwrap();
        collect(&engine, &[id]);
        engine.flush_cache(Tier::Device).unwrap();
        assert!(threads_now() > before.0, "the engine started threads");
        drop(engine);
        assert_eq!(
            (threads_now(), fds_now()),
            before,
            "cycle {cycle}: (threads, fds) right after destroy returned"
        );
    }
}
