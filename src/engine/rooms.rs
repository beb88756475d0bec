//! The engine thread's side of PD disaggregation. Prefill role: a request hands its state to
//! its room once its first token is sampled (`Transferring`), and finishes TRANSFERRED when
//! the decode acknowledges. Decode role: a request reserves its destination when admitted
//! (`Receiving`), claims its room, and on arrival writes the state into its pools, emits the
//! first token (sampled on the prefill) and decodes on. Every end of a PD request closes its
//! room, so the peer learns of aborts, timeouts and errors.

use super::event::FinishReason;
use super::executor::{End, Gap, HandOver};
use super::phase::Phase;
use super::sampling::Sampler;
use super::worker::Worker;
use crate::backend::Backend;
use crate::error::{Error, ErrorKind, Result};
use crate::kv::state;
use crate::pd::{Claim, Delivery, FailReason, Notice, Side, StateHeader, StateInfo};

impl<B: Backend> Worker<B> {
    /// Prefill: the requests that sampled their first token hand their state to their rooms.
    /// Returns the ones whose hand-over failed (by request id), to be ended by the caller.
    pub(super) fn hand_over(&mut self, handed: Vec<HandOver>) -> Vec<(u64, Error)> {
        let mut failed = Vec::new();
        for h in handed {
            let r = &mut self.sched.running[h.index];
            r.set_phase(Phase::Transferring);
            let (id, room) = (r.id, r.spec.pd_room);
            let result = (|| -> Result<()> {
                let node = self
                    .pd
                    .as_ref()
                    .ok_or_else(|| Error::internal("a PD request on an engine without a node"))?;
                let mut st = self.cache.export(&r.req)?;
                st.last_token = r.p.tokens.last().copied();
                st.rng = Some(r.p.sampler.rng_state());
                // A reused buffer: a fresh one per room faults in every page.
                let mut bytes = node.state_buffer(st.byte_len());
                state::read_into(self.cache.pools(), &st, &mut bytes)?;
                let header = StateHeader {
                    state: StateInfo::of(&st),
                    first_logprob: h.logprob,
                    cached_tokens_device: (r.p.cached - r.p.cached_host) as u32,
                    cached_tokens_host: r.p.cached_host as u32,
                };
                node.send(room, header, bytes)
            })();
            if let Err(e) = result {
                failed.push((id, e));
            }
        }
        failed
    }

    /// Prefill: requests still computing their prompt send the pages completed so far to
    /// their claimed rooms, so the transfer overlaps the rest of the compute (hand-over sends
    /// what is left). A room not claimed yet gets them all at hand-over.
    pub(super) fn send_complete_pages(&mut self) {
        let Some(node) = self.pd.as_ref().filter(|n| n.side() == Side::Prefill) else {
            return;
        };
        for r in self.sched.running.iter_mut() {
            let room = r.spec.pd_room;
            if r.phase() != Phase::Prefilling || room == 0 || !node.sends_early(room) {
                continue;
            }
            // A read that fails here fails again at hand-over, which ends the request.
            let Ok((pieces, done)) =
                self.cache
                    .complete_pages(&r.req, r.prefill_len, r.pages_sent_early)
            else {
                continue;
            };
            if done > r.pages_sent_early && node.send_early(room, pieces) {
                r.pages_sent_early = done;
            }
        }
    }

    /// Closes the room of a request that is ending with `end` (a no-op when the room already
    /// ended: transferred, landed or failed by the node).
    pub(super) fn close_room(&self, room: u64, end: &End) {
        let Some(node) = &self.pd else {
            return;
        };
        let why = match end {
            End::Finished(FinishReason::Transferred) => None,
            End::Finished(FinishReason::Aborted) => {
                Some((FailReason::Aborted, "the request was aborted".to_string()))
            }
            End::Finished(FinishReason::Timeout) => Some((
                FailReason::Timeout,
                "the request's deadline or queue timeout passed".to_string(),
            )),
            // Only a decode finishes a room's request by stop or length, after it landed.
            End::Finished(_) => None,
            End::Failed(e) => Some((FailReason::Aborted, format!("the request failed: {e}"))),
        };
        node.close(room, why);
    }

    /// Acts on what the node reported.
    pub(super) fn on_notice(&mut self, n: Notice) {
        match n {
            Notice::Transferred { room, request } => {
                if let Some(i) = self.running_in(request, room, Phase::Transferring) {
                    self.end_running(i, End::Finished(FinishReason::Transferred), true);
                }
            }
            Notice::Released { room } => {
                if let Some(req) = self.parked.remove(&room) {
                    self.cache.abort(req);
                    self.publish();
                }
            }
            Notice::Failed {
                room,
                request,
                error,
            } => {
                let s = &self.sched;
                if let Some(i) = s
                    .waiting
                    .iter()
                    .position(|w| w.pending.id == request && w.pending.spec.pd_room == room)
                {
                    self.end_waiting(i, End::Failed(error));
                } else if let Some(i) = s
                    .running
                    .iter()
                    .position(|r| r.id == request && r.spec.pd_room == room)
                {
                    // A prefill's computed prompt stays valid for the prefix cache; a decode's
                    // destination may hold part of a state.
                    let keep = s.running[i].phase() == Phase::Transferring;
                    self.end_running(i, End::Failed(error), keep);
                }
            }
            Notice::Received {
                room,
                request,
                delivery,
            } => {
                if let Some(i) = self.running_in(request, room, Phase::Receiving) {
                    self.land(i, *delivery);
                }
            }
        }
    }

    fn running_in(&self, request: u64, room: u64, phase: Phase) -> Option<usize> {
        self.sched
            .running
            .iter()
            .position(|r| r.id == request && r.spec.pd_room == room && r.phase() == phase)
    }

    /// Decode: running request `i` was just given its destination; claims its room.
    pub(super) fn claim_room(&mut self, i: usize) {
        let r = &self.sched.running[i];
        let Some(node) = &self.pd else {
            return;
        };
        let claim = Claim {
            // The node sends the digest the room was registered with (computed at submit).
            request_hash: 0,
            prompt_tokens: r.spec.prompt.len(),
            slot: r.req.kv().slot(),
            pages: r.req.kv().pages().iter().map(|p| p.0).collect(),
            // The node adds the destination's memory where the prefill may write it by RMA.
            rma_spans: Vec::new(),
        };
        let max_bytes = self.cache.import_bytes(r.spec.prompt.len());
        // Host-memory pools take the bytes straight from the link's reader; the request keeps
        // its pages until the node releases them (`release_landing`).
        let landing = self.cache.landing(&r.req);
        if let Err(e) = node.claim(r.spec.pd_room, claim, max_bytes, landing) {
            self.end_running(i, End::Failed(e), false);
        }
    }

    /// Decode: writes an arrived state into request `i`'s destination; it then decodes from
    /// the first token the prefill sampled.
    fn land(&mut self, i: usize, d: Delivery) {
        let vocab = self.exec.vocab_size();
        let r = &mut self.sched.running[i];
        let room = r.spec.pd_room;
        let st = &d.header.state;
        let checked = match st.last_token {
            Some(t) if (t as usize) < vocab && st.position == r.spec.prompt.len() => Ok(t),
            _ => Err(Error::invalid_argument(format!(
                "the state's first token {:?} and position {} do not continue a {}-token \
                 prompt in a vocabulary of {vocab}",
                st.last_token,
                st.position,
                r.spec.prompt.len()
            ))),
        };
        let landed = checked.and_then(|t| {
            match &d.bytes {
                Some(bytes) => self.cache.fill_import(&r.req, st.position, st.pages, bytes),
                None => self
                    .cache
                    .check_landed(&r.req, st.position, st.pages, st.bytes as usize),
            }
            .map(|()| t)
        });
        let first = match landed {
            Ok(t) => t,
            Err(e) => {
                let message = format!(
                    "room {room}: the state from the prefill does not fit this engine's \
                     destination: {}",
                    e.message()
                );
                if let Some(node) = &self.pd {
                    node.close(room, Some((FailReason::Mismatch, message.clone())));
                }
                self.end_running(
                    i,
                    End::Failed(Error::new(ErrorKind::KvTransfer, message)),
                    false,
                );
                return;
            }
        };
        if let Some(node) = &self.pd {
            node.landed(room);
        }
        r.p.sampler = Sampler::new(r.spec.sampling.clone(), st.rng.unwrap_or_default());
        r.p.cached = (d.header.cached_tokens_device + d.header.cached_tokens_host) as usize;
        r.p.cached_host = d.header.cached_tokens_host as usize;
        r.holds_queue_slot = false;
        self.shared.admission().queued_requests -= 1;
        let (end, gap) = self
            .exec
            .deliver(r, first, d.header.first_logprob, &self.shared);
        r.recount(&self.shared.admission);
        self.shared.metrics.update(|m| {
            m.generation_tokens += 1;
            if let Gap::First(t) = gap {
                m.ttft.observe_duration(t);
            }
        });
        if let Some(end) = end {
            self.end_running(i, end, true);
        }
    }
}
