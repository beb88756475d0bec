//! Decode pages and retraction: every decoding request gets the page its next token needs;
//! when the pools have none, the scheduler's victim goes back to the queue.

use super::executor::End;
use super::scheduler::Waiting;
use super::worker::Worker;
use crate::backend::Backend;
use crate::error::{Error, ErrorKind};

impl<B: Backend> Worker<B> {
    /// Every decoding request gets the page its next token needs, oldest first; when none can
    /// be freed, the scheduler's retraction victim is requeued and the search starts over.
    pub(super) fn make_room_for_decode(&mut self) {
        'search: loop {
            for i in self.sched.needing_pages(&self.cache) {
                let r = &mut self.sched.running[i];
                let want = r.req.position() + 1;
                if self.cache.reserve(&mut r.req, want).is_ok() {
                    continue;
                }
                let Some(victim) = self.sched.retraction_victim() else {
                    return;
                };
                if self.sched.running.len() == 1 {
                    // Alone and still short: the pools cannot hold it (the context limit
                    // should have prevented this).
                    let message = format!(
                        "request {}: no KV page for token {want} with nothing else running: \
                         raise kv.device_memory_bytes or lower kv.max_context_tokens",
                        self.sched.running[victim].id
                    );
                    log::error!("{message}");
                    let e = Error::new(ErrorKind::Capacity, message);
                    self.end_running(victim, End::Failed(e), true);
                    return;
                }
                self.sched.note_retraction();
                self.shared.metrics.update(|m| m.retractions += 1);
                self.requeue(victim, true);
                continue 'search;
            }
            return;
        }
    }

    /// Moves running request `i` back to the front of the queue: what it computed goes into
    /// the prefix cache (so the recompute may hit it), its pages and slot are freed.
    pub(super) fn requeue(&mut self, i: usize, retracted: bool) {
        let r = self.sched.running.swap_remove(i);
        let counted = r.queued_tokens as u64;
        let id = r.id;
        let (pending, p, phase, req) = r.into_parts();
        let position = req.position();
        self.cache.finish(req, &p.tokens[..position]);
        {
            let mut a = self.shared.admission();
            a.queued_requests += 1;
            a.queued_tokens -= counted;
            a.queued_tokens += p.tokens.len() as u64;
        }
        if retracted {
            log::info!(
                "request {id} retracted after {} generated tokens: the KV pools ran out \
                 (new_token_ratio now {:.2})",
                p.generated,
                self.sched.new_token_ratio()
            );
        }
        // One that never ran waits again as it was submitted (its queue timeout applies, its
        // seed is drawn when it starts).
        self.sched
            .waiting
            .push(Waiting::requeued(pending, p, phase));
    }
}
