//! The client's side of the stress tests: random requests, the books a client keeps of what it
//! submitted and what came back, and every way those books disagree with the engine's metrics;
//! the process's threads and open file descriptors.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use dsv4::engine::{
    Engine, Event, MetricsSnapshot, Outcome, Rejection, RequestSpec, SamplingParams,
};
use dsv4::error::Result;

/// Threads of this process now that can still run code: a thread already in the kernel's
/// exit path (PF_EXITING) is not counted. A joined thread stays listed in /proc for a moment
/// after `pthread_join` returned (the kernel wakes the joiner before it finishes the exit), and
/// CI saw one such straggler right after a destroy that joins every thread it started.
pub fn threads_now() -> usize {
    const PF_EXITING: u64 = 0x4;
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return 0;
    };
    tasks
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("stat")).ok())
        .filter(|stat| {
            // After the name's closing parenthesis: state, ppid, pgrp, session, tty_nr, tpgid,
            // then the flags (proc(5)).
            let flags = stat
                .rsplit_once(')')
                .and_then(|(_, rest)| rest.split_whitespace().nth(6))
                .and_then(|f| f.parse::<u64>().ok());
            // A task gone between the listing and the read, or unreadable: not running.
            flags.is_some_and(|f| f & PF_EXITING == 0)
        })
        .count()
}

/// Open file descriptors of this process now (the one used to list them is counted every
/// time alike).
pub fn fds_now() -> usize {
    std::fs::read_dir("/proc/self/fd").map_or(0, |d| d.count())
}

/// A short random request over `ids` (prompt 1..200 tokens, 1..40 new tokens, greedy or
/// sampled, some with a cache salt, a priority or a 300 ms deadline). `shared_prefixes`: the
/// prompts start at one of three points, so prefixes hit the cache.
pub fn random_spec(rng: &mut fastrand::Rng, ids: &[u32], shared_prefixes: bool) -> RequestSpec {
    let start = if shared_prefixes {
        rng.usize(0..3) * 7
    } else {
        rng.usize(0..100)
    };
    let len = rng.usize(1..200);
    RequestSpec {
        prompt: ids[start..start + len].to_vec(),
        max_new_tokens: rng.u32(1..40),
        sampling: SamplingParams {
            temperature: if rng.bool() { 0.0 } else { 0.8 },
            top_k: rng.u32(0..20),
            ..SamplingParams::default()
        },
        cache_salt: rng.bool().then(|| "t".to_string()),
        priority: rng.i32(-1..2),
        deadline_ms: if rng.u32(0..5) == 0 { 300 } else { 0 },
        ..RequestSpec::default()
    }
}

/// What a client saw of one engine.
#[derive(Default)]
pub struct Books {
    pub accepted: Vec<u64>,
    /// Terminal events per id.
    pub terminals: HashMap<u64, usize>,
    /// TOKEN events per id.
    pub tokens: HashMap<u64, usize>,
    /// `generated_tokens` of each terminal event.
    pub reported: HashMap<u64, u32>,
    /// Refused submits, indexed by `Rejection as usize` (the engine's own classification).
    pub refused: [u64; Rejection::ALL.len()],
    /// Terminal events, indexed by `Outcome as usize`.
    pub outcomes: [u64; Outcome::ALL.len()],
}

impl Books {
    /// Records a submit's result; the id when it was accepted.
    pub fn submitted(&mut self, result: &Result<u64>) -> Option<u64> {
        match result {
            Ok(id) => {
                self.accepted.push(*id);
                Some(*id)
            }
            Err(e) => {
                self.refused[Rejection::of(e.kind()) as usize] += 1;
                None
            }
        }
    }

    pub fn event(&mut self, e: &Event) {
        if e.is_terminal() {
            *self.terminals.entry(e.request_id()).or_default() += 1;
            let outcome = e.finish_reason().map_or(Outcome::Error, Outcome::of);
            self.outcomes[outcome as usize] += 1;
            self.reported
                .insert(e.request_id(), e.stats().generated_tokens);
        } else {
            *self.tokens.entry(e.request_id()).or_default() += 1;
        }
    }

    /// Accepted requests without a terminal event yet.
    pub fn pending(&self) -> usize {
        self.accepted
            .iter()
            .filter(|id| !self.terminals.contains_key(id))
            .count()
    }

    pub fn refusals(&self) -> u64 {
        self.refused.iter().sum()
    }

    pub fn tokens_total(&self) -> u64 {
        self.tokens.values().sum::<usize>() as u64
    }

    /// Every way these books and the engine's metrics `m` disagree, once every request has
    /// ended: each accepted id has exactly one terminal event (and no id that was not accepted
    /// has one) whose `generated_tokens` is the number of its TOKEN events; the counters of
    /// requests, outcomes, refusals by reason and generated tokens are the client's counts; the
    /// admission and running gauges are back to zero. Empty when the books balance.
    pub fn problems(&self, m: &MetricsSnapshot) -> Vec<String> {
        let mut out = Vec::new();
        let mut list = |what: &str, ids: Vec<u64>| {
            if !ids.is_empty() {
                let shown: Vec<String> = ids.iter().take(8).map(u64::to_string).collect();
                out.push(format!("{} {what}: {}", ids.len(), shown.join(", ")));
            }
        };
        let accepted: std::collections::HashSet<u64> = self.accepted.iter().copied().collect();
        let mut sorted: Vec<u64> = self.accepted.clone();
        sorted.sort_unstable();
        list(
            "accepted requests without a terminal event",
            sorted
                .iter()
                .copied()
                .filter(|id| !self.terminals.contains_key(id))
                .collect(),
        );
        list(
            "requests with more than one terminal event",
            sorted
                .iter()
                .copied()
                .filter(|id| self.terminals.get(id).is_some_and(|&n| n > 1))
                .collect(),
        );
        let mut unknown: Vec<u64> = self
            .terminals
            .keys()
            .chain(self.tokens.keys())
            .copied()
            .filter(|id| !accepted.contains(id))
            .collect();
        unknown.sort_unstable();
        unknown.dedup();
        list("ids with events that submit never returned", unknown);
        list(
            "requests whose terminal generated_tokens is not their TOKEN events",
            sorted
                .iter()
                .copied()
                .filter(|id| {
                    self.reported.get(id).is_some_and(|&n| {
                        n as usize != self.tokens.get(id).copied().unwrap_or_default()
                    })
                })
                .collect(),
        );
        let mut differ = |what: String, engine: u64, client: u64| {
            if engine != client {
                out.push(format!(
                    "metrics {what} = {engine}, the client counted {client}"
                ));
            }
        };
        differ("requests".into(), m.requests, self.accepted.len() as u64);
        for o in Outcome::ALL {
            differ(
                format!("finished[{}]", o.label()),
                m.finished(o),
                self.outcomes[o as usize],
            );
        }
        for r in Rejection::ALL {
            differ(
                format!("rejected[{}]", r.label()),
                m.rejected(r),
                self.refused[r as usize],
            );
        }
        differ(
            "generation_tokens".into(),
            m.generation_tokens,
            self.tokens_total(),
        );
        if (m.queued, m.queued_tokens, m.running, m.loading) != (0, 0, 0, 0) {
            out.push(format!(
                "gauges not back to zero with every request ended: queued {}, queued_tokens {}, \
                 running {}, loading {}",
                m.queued, m.queued_tokens, m.running, m.loading
            ));
        }
        out
    }
}

/// Polls `engine` into `books` until every accepted request has its terminal event; false if
/// that takes longer than `limit`.
pub fn drain(engine: &Engine, books: &Mutex<Books>, limit: Duration) -> bool {
    let started = Instant::now();
    while books.lock().unwrap().pending() > 0 {
        if started.elapsed() > limit {
            return false;
        }
        let events = engine.poll(256, Some(Duration::from_millis(100))).unwrap();
        let mut b = books.lock().unwrap();
        for e in &events {
            b.event(e);
        }
    }
    true
}
