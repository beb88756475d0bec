//! Calls answered on the engine thread between steps: switching the event callback, scoring,
//! exporting a sequence, cache statistics and flushes.

use super::inbox::Control;
use super::shared::{ExportedSequence, PoolUsage};
use super::worker::Worker;
use crate::backend::Backend;
use crate::error::{Error, Result};

impl<B: Backend> Worker<B> {
    pub(super) fn control(&mut self, c: Control) {
        match c {
            Control::SetCallback(cb, done) => {
                for e in self.shared.sink.set_callback(cb) {
                    self.shared.sink.emit(e);
                }
                let _ = done.send(());
            }
            Control::Score(tokens, reply) => {
                let scores = self.exec.score(&mut self.cache, &tokens);
                // It may have evicted cached prefixes to make room: gauges before the answer,
                // as for a flush.
                self.publish();
                let _ = reply.send(scores);
            }
            #[cfg(test)]
            Control::Panic(message) => panic!("{message}"),
            Control::Export(id, reply) => {
                let _ = reply.send(self.export(id));
            }
            Control::CacheStats(reply) => {
                self.cache.poll();
                let _ = reply.send(self.cache.stats_json());
            }
            Control::FlushCache(tier, reply) => {
                self.cache.flush(tier);
                // Gauges before the reply: a caller that reads the metrics once the flush
                // returned sees what it freed (published after, they raced the caller).
                self.publish();
                let pools = self.cache.pools();
                let _ = reply.send(PoolUsage {
                    pages: pools.page_allocator().used_count(),
                    slots: pools.slot_allocator().used_count(),
                    snapshots: pools.snapshot_allocator().used_count(),
                });
            }
        }
    }

    /// The state of decoding request `id` as it stands between steps (it keeps running).
    fn export(&self, id: u64) -> Result<ExportedSequence> {
        let r = self
            .sched
            .running
            .iter()
            .find(|r| r.id == id)
            .filter(|r| r.decoding())
            .ok_or_else(|| {
                Error::invalid_argument(format!(
                    "request {id} is not decoding (unknown, ended, waiting, or still in its \
                     prefill): export a request after its first TOKEN event"
                ))
            })?;
        let mut state = self.cache.export(&r.req)?;
        state.last_token = r.p.tokens.last().copied();
        state.rng = Some(r.p.sampler.rng_state());
        let bytes = crate::kv::state::read(self.cache.pools(), &state)?;
        Ok(ExportedSequence {
            state,
            bytes,
            tokens: r.p.tokens.clone(),
            generated: r.p.generated,
        })
    }
}
