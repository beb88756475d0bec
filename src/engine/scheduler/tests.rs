//! The scheduler's rules on plain numbers, without a model or pools: given these requests and
//! pool counts, this order, this admission decision, this batch. Expected values are worked
//! out by hand from the rules in the module docs.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use super::*;
use crate::config::params::SchedulerPolicy;
use crate::engine::phase::Phase;
use crate::engine::request::RequestSpec;
use crate::engine::sampling::{Sampler, SamplingParams};
use crate::engine::shared::{ExportedSequence, Pending};
use crate::kv::state::LayoutFingerprint;
use crate::kv::SequenceState;

/// Tokens per page in every table.
const PAGE: usize = 64;

struct Seq {
    position: usize,
    pages: usize,
    /// The prefill's end (the cache's `prompt_len`): the last chunk limit.
    prefill: usize,
}

impl SeqView for Seq {
    fn position(&self) -> usize {
        self.position
    }
    fn pages_held(&self) -> usize {
        self.pages
    }
}

/// Pools with `free` pages (plus `reclaimable` cached ones), cached prefixes by a prompt's
/// first token, and a snapshot point every `snapshot` tokens (0: none).
#[derive(Default)]
struct Kv {
    free: usize,
    reclaimable: usize,
    cached: HashMap<u32, usize>,
    snapshot: usize,
}

impl KvView<Seq> for Kv {
    fn pages_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(PAGE)
    }
    fn cached_prefix(&self, _salt: Option<&str>, tokens: &[u32]) -> usize {
        self.cached.get(&tokens[0]).copied().unwrap_or(0)
    }
    fn page_budget(&self, salt: Option<&str>, tokens: &[u32], target: usize) -> (usize, usize) {
        // Whole cached pages are shared, not needed.
        let shared = self.cached_prefix(salt, tokens) / PAGE;
        (
            self.pages_for(target).saturating_sub(shared),
            self.free + self.reclaimable,
        )
    }
    fn chunk_limit(&self, seq: &Seq) -> usize {
        if self.snapshot == 0 {
            return seq.prefill;
        }
        ((seq.position / self.snapshot + 1) * self.snapshot).min(seq.prefill)
    }
}

fn limits() -> Limits {
    Limits {
        max_running: 8,
        chunk_tokens: 128,
        batch_tokens: 512,
        queue_timeout: Some(Duration::from_secs(10)),
        policy: SchedulerPolicy::Fcfs,
        lpm_max_waiting: 128,
    }
}

/// A queued request: `id`, a prompt of `len` tokens all equal to `first`, `priority`.
fn queued(id: u64, len: usize, first: u32, priority: i32, max_gen: usize) -> Waiting {
    Waiting::new(Box::new(Pending {
        id,
        spec: RequestSpec {
            prompt: vec![first; len],
            priority,
            max_new_tokens: max_gen as u32,
            ..RequestSpec::default()
        },
        submitted: Instant::now(),
        max_gen,
        import: None,
    }))
}

fn progress(tokens: Vec<u32>, generated: usize) -> Progress {
    let mut p = Progress::new(
        Sampler::new(SamplingParams::default(), 1),
        tokens,
        generated,
    );
    p.counted = true;
    p
}

/// A queued request that was retracted after generating `generated` tokens.
fn retracted(id: u64, len: usize, first: u32, priority: i32, generated: usize) -> Waiting {
    let w = queued(id, len, first, priority, 100);
    let tokens = vec![first; len + generated];
    Waiting::requeued(w.pending, progress(tokens, generated), Phase::Decoding)
}

/// A queued import: a sequence exported after `generated` tokens of a `len`-token prompt.
fn imported(id: u64, len: usize, priority: i32, generated: usize) -> Waiting {
    let mut w = queued(id, len, 1, priority, 100);
    let tokens = vec![1; len + generated];
    let state = SequenceState {
        layout: LayoutFingerprint {
            model: "table".into(),
            layers: "SCH".into(),
            mtp_layers: 0,
            head_dim: 64,
            index_dim: 32,
            window: 128,
            csa_ratio: 4,
            hca_ratio: 128,
            page_size: PAGE,
            kv_rows: "f32".into(),
            index_rows: "f32".into(),
            unit_bytes: Vec::new(),
        },
        position: tokens.len() - 1,
        last_token: Some(1),
        rng: Some(7),
        pages: (tokens.len() - 1).div_ceil(PAGE),
        source_slot: 0,
        source_pages: Vec::new(),
        regions: Vec::new(),
    };
    w.pending.import = Some(Box::new(ExportedSequence {
        state,
        bytes: Vec::new(),
        tokens: tokens.clone(),
        generated,
    }));
    Waiting::imported(w.pending, Box::new(progress(tokens, generated)))
}

/// A running request in `phase` at `position` of a `prefill`-token prefill, holding `pages`.
struct R {
    id: u64,
    phase: Phase,
    position: usize,
    prefill: usize,
    pages: usize,
    generated: usize,
    max_gen: usize,
    priority: i32,
}

impl Default for R {
    fn default() -> Self {
        Self {
            id: 0,
            phase: Phase::Prefilling,
            position: 0,
            prefill: 0,
            pages: 0,
            generated: 0,
            max_gen: 100,
            priority: 0,
        }
    }
}

fn running(r: R) -> Running<Seq> {
    let w = queued(r.id, r.prefill, 1, r.priority, r.max_gen);
    let seq = Seq {
        position: r.position,
        pages: r.pages,
        prefill: r.prefill,
    };
    let tokens = vec![1; r.prefill + r.generated];
    let first = match r.phase {
        Phase::Decoding => Phase::Prefilling,
        p => p,
    };
    let mut run = Running::start(w, seq, r.prefill, first, progress(tokens, r.generated));
    if r.phase != first {
        run.set_phase(r.phase);
    }
    run
}

fn scheduler(limits: Limits, waiting: Vec<Waiting>, run: Vec<R>) -> Scheduler<Seq> {
    let mut s = Scheduler::new(limits);
    s.waiting = waiting;
    s.running = run.into_iter().map(running).collect();
    s
}

/// A step as (request id, positions, samples).
fn batch(s: &Scheduler<Seq>, plan: &StepPlan) -> Want {
    plan.items
        .iter()
        .map(|p| (s.running[p.index].id, p.tokens.clone(), p.sample))
        .collect()
}

fn decoding(id: u64, position: usize, pages: usize) -> R {
    R {
        id,
        phase: Phase::Decoding,
        position,
        prefill: 100,
        pages,
        generated: position + 1 - 100,
        ..R::default()
    }
}

fn prefilling(id: u64, position: usize, prefill: usize) -> R {
    R {
        id,
        phase: Phase::Prefilling,
        position,
        prefill,
        pages: prefill.div_ceil(PAGE),
        ..R::default()
    }
}

/// A step as (request id, positions, samples).
type Want = Vec<(u64, std::ops::Range<usize>, bool)>;
/// (what, batch_tokens, chunk_tokens, snapshot, running, paused ids, (the batch, its decodes))
type StepCase = (
    &'static str,
    usize,
    usize,
    usize,
    Vec<R>,
    Vec<u64>,
    Option<(Want, usize)>,
);
/// (what, policy, lpm_max_waiting, cached prefixes by first token, queue, the id started next)
type OrderCase = (
    &'static str,
    SchedulerPolicy,
    usize,
    Vec<(u32, usize)>,
    Vec<Waiting>,
    u64,
);
/// (what, running (id, priority, phase), the victim)
type VictimCase = (&'static str, Vec<(u64, i32, Phase)>, Option<u64>);

#[test]
fn step_plans() {
    // (what, batch_tokens, chunk_tokens, snapshot, running, paused, the batch)
    let cases: Vec<StepCase> = vec![
        (
            "decodes first (in running order), then a prefill chunk of chunked_prefill_tokens",
            512,
            128,
            0,
            vec![prefilling(1, 0, 300), decoding(2, 110, 2), decoding(3, 120, 2)],
            vec![],
            Some((vec![(2, 110..111, true), (3, 120..121, true), (1, 0..128, false)], 2)),
        ),
        (
            "the last chunk of a prefill samples",
            512,
            128,
            0,
            vec![prefilling(1, 256, 300)],
            vec![],
            Some((vec![(1, 256..300, true)], 0)),
        ),
        (
            "max_batch_tokens cuts the prefill after the decodes took theirs",
            100,
            128,
            0,
            vec![decoding(2, 110, 2), decoding(3, 120, 2), prefilling(1, 0, 300)],
            vec![],
            Some((vec![(2, 110..111, true), (3, 120..121, true), (1, 0..98, false)], 2)),
        ),
        (
            "two prefills share the budget; the second gets what is left",
            200,
            128,
            0,
            vec![prefilling(1, 0, 300), prefilling(2, 0, 300)],
            vec![],
            Some((vec![(1, 0..128, false), (2, 0..72, false)], 0)),
        ),
        (
            "a prefill chunk stops at the next snapshot point",
            512,
            128,
            64,
            vec![prefilling(1, 10, 300)],
            vec![],
            Some((vec![(1, 10..64, false)], 0)),
        ),
        (
            "a decode whose next token needs a page it does not hold waits (token 128 needs page 3)",
            512,
            128,
            0,
            vec![decoding(1, 128, 2), decoding(2, 127, 2)],
            vec![],
            Some((vec![(2, 127..128, true)], 1)),
        ),
        (
            "requests paused for unpolled events sit the step out",
            512,
            128,
            0,
            vec![decoding(1, 110, 2), prefilling(2, 0, 300), decoding(3, 110, 2)],
            vec![1, 2],
            Some((vec![(3, 110..111, true)], 1)),
        ),
        (
            "a request loading back does not run; nothing else can: no step",
            512,
            128,
            0,
            vec![R {
                id: 1,
                phase: Phase::LoadingBack,
                prefill: 300,
                ..R::default()
            }],
            vec![],
            None,
        ),
        (
            "a prefill that computed its last chunk but has not sampled is not planned again",
            512,
            128,
            0,
            vec![prefilling(1, 300, 300), decoding(2, 110, 2)],
            vec![],
            Some((vec![(2, 110..111, true)], 1)),
        ),
        (
            "a budget spent on decodes leaves no prefill",
            2,
            128,
            0,
            vec![decoding(1, 110, 2), decoding(2, 110, 2), prefilling(3, 0, 300)],
            vec![],
            Some((vec![(1, 110..111, true), (2, 110..111, true)], 2)),
        ),
    ];
    for (what, batch_tokens, chunk_tokens, snapshot, run, paused, want) in cases {
        let mut s = scheduler(
            Limits {
                batch_tokens,
                chunk_tokens,
                ..limits()
            },
            vec![],
            run,
        );
        let kv = Kv {
            snapshot,
            ..Kv::default()
        };
        let paused: HashSet<u64> = paused.into_iter().collect();
        let plan = s.plan_step(&kv, &paused);
        assert_eq!(
            plan.as_ref().map(|p| (batch(&s, p), p.decodes)),
            want,
            "{what}"
        );
    }
}

#[test]
fn queue_order() {
    // (what, policy, lpm_max_waiting, cached prefixes by first token, queue, the id started next)
    let cases: Vec<OrderCase> = vec![
        (
            "fcfs: arrival order",
            SchedulerPolicy::Fcfs,
            128,
            vec![(7, 512)],
            vec![queued(3, 100, 1, 0, 10), queued(4, 100, 7, 0, 10)],
            3,
        ),
        (
            "priority before arrival",
            SchedulerPolicy::Fcfs,
            128,
            vec![],
            vec![queued(3, 100, 1, 0, 10), queued(4, 100, 1, 5, 10)],
            4,
        ),
        (
            "a retracted request before any fresh one, whatever its priority",
            SchedulerPolicy::Fcfs,
            128,
            vec![],
            vec![queued(3, 100, 1, 9, 10), retracted(8, 100, 1, -1, 4)],
            8,
        ),
        (
            "an imported request before any fresh one",
            SchedulerPolicy::Fcfs,
            128,
            vec![],
            vec![queued(3, 100, 1, 9, 10), imported(8, 100, -1, 4)],
            8,
        ),
        (
            "lpm: the longest cached prefix first, before priority",
            SchedulerPolicy::Lpm,
            128,
            vec![(7, 512), (5, 64)],
            vec![
                queued(3, 100, 1, 9, 10),
                queued(4, 600, 5, 0, 10),
                queued(6, 600, 7, 0, 10),
            ],
            6,
        ),
        (
            "lpm with more queued than lpm_max_waiting falls back to priority and arrival",
            SchedulerPolicy::Lpm,
            2,
            vec![(7, 512)],
            vec![
                queued(3, 100, 1, 0, 10),
                queued(4, 100, 1, 0, 10),
                queued(6, 600, 7, 0, 10),
            ],
            3,
        ),
    ];
    for (what, policy, lpm_max_waiting, cached, waiting, want) in cases {
        let s = scheduler(
            Limits {
                policy,
                lpm_max_waiting,
                ..limits()
            },
            waiting,
            vec![],
        );
        let kv = Kv {
            cached: cached.into_iter().collect(),
            ..Kv::default()
        };
        let i = s.next_waiting(&kv).expect("a request to start");
        assert_eq!(s.waiting[i].pending.id, want, "{what}");
    }
    let empty = scheduler(limits(), vec![], vec![]);
    assert_eq!(empty.next_waiting(&Kv::default()), None);
}

#[test]
fn admission_against_pool_counts() {
    // One running request at position 100 of a 100-token prefill holding 2 pages, 100 more
    // tokens allowed: at ratio 0.7 it is expected to reach 100 + 70 = 170 tokens = 3 pages, so
    // it needs 1 more. A queued 100-token prompt with max_gen 100 expects 100 + 70 = 170
    // tokens = 3 pages of its own (fewer with a cached prefix). Fits when 1 + own <= free +
    // reclaimable.
    // (what, free, reclaimable, cached tokens of the candidate, fits)
    let cases = [
        ("4 pages needed, 4 free", 4, 0, 0, true),
        ("4 pages needed, 3 free", 3, 0, 0, false),
        ("3 free + 1 reclaimable cached page", 3, 1, 0, true),
        (
            "a 64-token cached prefix shares a page: 3 needed, 3 free",
            3,
            0,
            64,
            true,
        ),
    ];
    for (what, free, reclaimable, cached, want) in cases {
        let s = scheduler(
            limits(),
            vec![queued(9, 100, 5, 0, 100)],
            vec![R {
                id: 1,
                phase: Phase::Decoding,
                position: 100,
                prefill: 100,
                pages: 2,
                generated: 1,
                max_gen: 101,
                ..R::default()
            }],
        );
        let kv = Kv {
            free,
            reclaimable,
            cached: [(5, cached)].into_iter().collect(),
            ..Kv::default()
        };
        assert_eq!(s.fits(0, &kv), want, "{what}");
    }
    // Nothing running: any request may try (nothing else would free pages for it).
    let alone = scheduler(limits(), vec![queued(9, 10_000, 5, 0, 100)], vec![]);
    assert!(alone.fits(0, &Kv::default()));
}

#[test]
fn the_estimate_decays_with_decode_steps_and_jumps_on_retraction() {
    let mut s = scheduler(limits(), vec![], vec![decoding(1, 110, 2)]);
    let kv = Kv::default();
    assert_eq!(s.new_token_ratio(), RATIO_INIT);
    for _ in 0..100 {
        s.plan_step(&kv, &HashSet::new()).expect("a decode step");
    }
    assert!((s.new_token_ratio() - (RATIO_INIT - 100.0 * RATIO_DECAY)).abs() < 1e-9);
    for _ in 0..2000 {
        s.plan_step(&kv, &HashSet::new());
    }
    assert_eq!(s.new_token_ratio(), RATIO_MIN);
    // Prefill-only steps leave it alone.
    let mut p = scheduler(limits(), vec![], vec![prefilling(1, 0, 300)]);
    p.plan_step(&kv, &HashSet::new()).expect("a prefill step");
    assert_eq!(p.new_token_ratio(), RATIO_INIT);
    // A retraction: back to at least INIT (from MIN), then +BUMP, capped at 1; admission blocks.
    s.note_retraction();
    assert_eq!(s.new_token_ratio(), RATIO_INIT);
    assert!(s.blocked && !s.may_start());
    s.note_retraction();
    assert!((s.new_token_ratio() - (RATIO_INIT + RATIO_BUMP)).abs() < 1e-9);
    s.note_retraction();
    assert_eq!(s.new_token_ratio(), 1.0);
}

#[test]
fn retraction_picks_the_lowest_priority_then_the_newest() {
    // (what, running (id, priority, phase), victim)
    let cases: Vec<VictimCase> = vec![
        (
            "the newest",
            vec![
                (1, 0, Phase::Decoding),
                (5, 0, Phase::Decoding),
                (3, 0, Phase::Prefilling),
            ],
            Some(5),
        ),
        (
            "the lowest priority before the newest",
            vec![
                (1, -2, Phase::Decoding),
                (5, 0, Phase::Decoding),
                (3, 0, Phase::Decoding),
            ],
            Some(1),
        ),
        (
            "never one loading back (it holds no pages to give)",
            vec![(1, 0, Phase::Decoding), (9, 0, Phase::LoadingBack)],
            Some(1),
        ),
        (
            "none holding pages: none",
            vec![(9, 0, Phase::LoadingBack)],
            None,
        ),
    ];
    for (what, run, want) in cases {
        let run = run
            .into_iter()
            .map(|(id, priority, phase)| R {
                id,
                priority,
                phase,
                position: 100,
                prefill: 100,
                pages: 2,
                generated: 1,
                ..R::default()
            })
            .collect();
        let s = scheduler(limits(), vec![], run);
        let got = s.retraction_victim().map(|i| s.running[i].id);
        assert_eq!(got, want, "{what}");
    }
}

#[test]
fn decode_pages_are_handed_out_oldest_first() {
    // Requests 7 and 2 are at a page boundary (position 128 needs a third page); 4 is not.
    let s = scheduler(
        limits(),
        vec![],
        vec![
            decoding(7, 128, 2),
            decoding(4, 127, 2),
            decoding(2, 128, 2),
        ],
    );
    let order: Vec<u64> = s
        .needing_pages(&Kv::default())
        .into_iter()
        .map(|i| s.running[i].id)
        .collect();
    assert_eq!(order, [2, 7]);
}

#[test]
fn queue_timeouts_apply_to_fresh_requests_only() {
    let s = scheduler(
        limits(),
        vec![
            queued(1, 10, 1, 0, 10),
            retracted(2, 10, 1, 0, 3),
            imported(3, 10, 0, 3),
        ],
        vec![],
    );
    let later = Instant::now() + Duration::from_secs(11);
    assert!(s.waiting_expired(&s.waiting[0], later));
    assert!(!s.waiting_expired(&s.waiting[1], later));
    assert!(!s.waiting_expired(&s.waiting[2], later));
    assert_eq!(s.waiting[1].phase(), Phase::Retracted);
    assert_eq!(s.waiting[2].phase(), Phase::Imported);
    // The next deadline is the fresh one's queue timeout.
    let next = s.next_deadline().expect("a deadline");
    assert_eq!(
        next,
        s.waiting[0].pending.submitted + Duration::from_secs(10)
    );
}

#[test]
fn requeueing_keeps_what_a_request_did_only_once_it_ran() {
    let w = queued(1, 10, 1, 0, 10);
    let mut p = progress(vec![1; 12], 2);
    p.counted = false;
    let again = Waiting::requeued(w.pending, p, Phase::LoadingBack);
    assert_eq!(again.phase(), Phase::Waiting);
    assert!(again.progress.is_none());
    assert_eq!(again.tokens().len(), 10);
    // Retracted earlier, then requeued again while loading back: still retracted.
    let w = queued(4, 10, 1, 0, 10);
    let again = Waiting::requeued(w.pending, progress(vec![1; 12], 2), Phase::LoadingBack);
    assert_eq!(again.phase(), Phase::Retracted);
    assert_eq!((again.tokens().len(), again.generated()), (12, 2));
    let back = retracted(2, 10, 1, 0, 3);
    assert_eq!(back.phase(), Phase::Retracted);
    assert_eq!((back.tokens().len(), back.generated()), (13, 3));
}
