//! The C ABI: the only module with `extern "C"`. Thin by design: check arguments, call into the
//! crate, convert results. Every entry point runs inside `boundary::guard` (panics become
//! `DSV4_ERR_INTERNAL`), checks its pointers, and leaves a message in `dsv4_last_error()` on
//! failure. `include/dsv4.h` is generated from this module by cbindgen (see build.rs).

mod boundary;
mod cache;
mod engine;
mod log_bridge;
mod metrics;
mod pd;
mod planning;
mod requests;
mod status;
mod text;
mod version;
mod versioned;

pub use boundary::dsv4_last_error;
pub use cache::{dsv4_cache_flush, dsv4_cache_stats};
pub use engine::{
    dsv4_engine, dsv4_engine_create, dsv4_engine_destroy, dsv4_engine_state, dsv4_model_info,
    dsv4_params_resolved, dsv4_score, DSV4_STATE_DRAINING, DSV4_STATE_FAILED, DSV4_STATE_LOADING,
    DSV4_STATE_READY, DSV4_STATE_STOPPED,
};
pub use log_bridge::{dsv4_log_fn, dsv4_set_log_callback};
pub use metrics::{dsv4_metrics, dsv4_metrics_get, dsv4_metrics_prometheus, dsv4_units};
pub use pd::dsv4_pd_endpoint;
pub use planning::{dsv4_params_default, dsv4_params_validate, dsv4_plan, dsv4_plan_text};
pub use requests::*;
pub use status::*;
pub use text::{
    dsv4_chat_apply, dsv4_detokenize, dsv4_detokenizer, dsv4_detokenizer_create,
    dsv4_detokenizer_destroy, dsv4_detokenizer_feed, dsv4_tokenize,
};
pub use version::dsv4_version;

#[cfg(test)]
mod tests {
    /// include/dsv4.h is committed; it must be exactly what build.rs generates from this module.
    #[test]
    fn committed_header_is_fresh() {
        let generated = include_str!(concat!(env!("OUT_DIR"), "/dsv4.h"));
        let committed_path = concat!(env!("CARGO_MANIFEST_DIR"), "/include/dsv4.h");
        let committed = std::fs::read_to_string(committed_path).unwrap_or_default();
        assert!(
            generated == committed,
            "include/dsv4.h is stale: src/ffi changed without regenerating it. Run `make header` \
             and commit include/dsv4.h."
        );
    }
}
