//! The agentic workload of `make demo` and `bench_prefix`: a long system prompt shared by every
//! user, many users, multi-turn conversations whose next turn extends the previous one (prompt +
//! the model's answer + a new user message). Turns of one user are sequential, users run
//! concurrently; refused submits are retried, as a real front end would.

use std::collections::HashMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use dsv4::engine::{Engine, Event, EventKind, RequestSpec, SamplingParams};
use dsv4::error::ErrorKind;

/// What `replay` drives: one engine, or a router in front of a prefill + decode pair
/// (`common/pd.rs`), so both modes replay the same conversations with the same client logic.
pub trait Serve {
    fn vocab_size(&self) -> usize;
    fn submit(&self, spec: RequestSpec) -> dsv4::error::Result<u64>;
    /// The events of submitted requests (waits up to `timeout` for the first).
    fn poll_events(&self, timeout: Duration) -> Vec<Event>;
}

impl Serve for Engine {
    fn vocab_size(&self) -> usize {
        Engine::vocab_size(self)
    }

    fn submit(&self, spec: RequestSpec) -> dsv4::error::Result<u64> {
        Engine::submit(self, spec)
    }

    fn poll_events(&self, timeout: Duration) -> Vec<Event> {
        self.poll(512, Some(timeout)).expect("poll")
    }
}

/// The shape of the conversation set.
#[derive(Debug, Clone)]
pub struct Workload {
    pub system_tokens: usize,
    pub users: usize,
    pub turns: usize,
    /// Tokens of each new user message.
    pub message_tokens: usize,
    pub max_new_tokens: u32,
    pub seed: u64,
}

impl Workload {
    /// The demo's conversations: 32 users × 4 turns over a 1024-token system prompt, 256-token
    /// messages, 48-token answers (`--users`, `--turns`, `--system`, `--message`, `--max-new`
    /// override them). By the last turn each user has ~1200 tokens of their own: more than the
    /// demo's device pool holds for 32 users.
    pub fn demo() -> Self {
        Self {
            system_tokens: arg("--system", 1024.0) as usize,
            users: arg("--users", 32.0) as usize,
            turns: arg("--turns", 4.0) as usize,
            message_tokens: arg("--message", 256.0) as usize,
            max_new_tokens: arg("--max-new", 48.0) as u32,
            seed: 7,
        }
    }

    pub fn requests(&self) -> usize {
        self.users * self.turns
    }

    fn tokens(&self, vocab: usize, stream: u64, n: usize) -> Vec<u32> {
        let mut rng =
            fastrand::Rng::with_seed(self.seed ^ stream.wrapping_mul(0x9e37_79b9_7f4a_7c15));
        // Ids 0..16 hold special tokens (EOS among them) in real vocabularies: skip them.
        (0..n).map(|_| rng.u32(16..vocab as u32)).collect()
    }
}

/// `--name value` from the command line, or `default`. A flag without a number after it ends
/// the program with a message (rather than running with the default unnoticed).
pub fn arg(name: &str, default: f64) -> f64 {
    let args: Vec<String> = std::env::args().collect();
    let Some(i) = args.iter().position(|a| a == name) else {
        return default;
    };
    match args.get(i + 1).map(|v| (v, v.parse::<f64>())) {
        Some((_, Ok(v))) => v,
        Some((v, Err(_))) => {
            eprintln!("{name} {v}: not a number (default {default})");
            std::process::exit(2)
        }
        None => {
            eprintln!("{name} needs a number after it (default {default})");
            std::process::exit(2)
        }
    }
}

/// With `--help` or `-h` on the command line: prints `text` and exits.
#[allow(dead_code)] // the demo and bench_prefix take no flags of their own
pub fn help(text: &str) {
    if std::env::args().skip(1).any(|a| a == "--help" || a == "-h") {
        println!("{}", text.trim());
        std::process::exit(0);
    }
}

/// Where the built-in tiny checkpoint is kept: $DSV4_DEMO_MODEL_DIR, else
/// $XDG_CACHE_HOME/dsv4/tiny-model, else ~/.cache/dsv4/tiny-model. Written there once (and
/// rewritten only if its bytes differ from what this build writes).
pub fn tiny_model() -> dsv4::error::Result<(PathBuf, bool)> {
    let dir = match std::env::var_os("DSV4_DEMO_MODEL_DIR") {
        Some(d) => PathBuf::from(d),
        None => std::env::var_os("XDG_CACHE_HOME")
            .map(PathBuf::from)
            .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
            .unwrap_or_else(|| PathBuf::from("target"))
            .join("dsv4")
            .join("tiny-model"),
    };
    let wrote = dsv4::model::tiny::write_checkpoint(&dir)?;
    Ok((dir, wrote))
}

/// What the client saw.
#[derive(Debug, Default)]
pub struct Report {
    pub wall: Duration,
    pub requests: usize,
    pub errors: usize,
    /// Submits refused with QUEUE_FULL (then retried).
    pub refused: usize,
    pub prompt_tokens: u64,
    pub generated_tokens: u64,
    pub cached_device: u64,
    pub cached_host: u64,
    pub ttft_us: Vec<u64>,
    pub itl_us: Vec<u64>,
}

impl Report {
    pub fn tokens_per_s(&self) -> f64 {
        self.generated_tokens as f64 / self.wall.as_secs_f64()
    }

    /// Prompt tokens processed (computed or taken from the cache) per second.
    pub fn prompt_tokens_per_s(&self) -> f64 {
        self.prompt_tokens as f64 / self.wall.as_secs_f64()
    }
}

/// The `q` quantile (0..=1) of `v` in milliseconds (nearest rank).
pub fn quantile_ms(v: &[u64], q: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    let mut ms: Vec<f64> = v.iter().map(|&us| us as f64 / 1000.0).collect();
    quantile(&mut ms, q)
}

/// The `q` quantile (0..=1) of `v` (nearest rank; sorts `v`); NaN when empty.
pub fn quantile(v: &mut [f64], q: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    v[((q * v.len() as f64).ceil() as usize).clamp(1, v.len()) - 1]
}

struct User {
    history: Vec<u32>,
    turn: usize,
    in_flight: Option<u64>,
    retry_at: Instant,
    prompt_len: usize,
    answer: Vec<u32>,
    last_token_us: u64,
}

/// Replays `w` against `engine`; `progress(done, total)` after each finished request.
pub fn replay(engine: &impl Serve, w: &Workload, mut progress: impl FnMut(usize, usize)) -> Report {
    let vocab = engine.vocab_size();
    let system = w.tokens(vocab, u64::MAX, w.system_tokens);
    let mut users: Vec<User> = (0..w.users)
        .map(|_| User {
            history: system.clone(),
            turn: 0,
            in_flight: None,
            retry_at: Instant::now(),
            prompt_len: 0,
            answer: Vec::new(),
            last_token_us: 0,
        })
        .collect();
    let mut owner: HashMap<u64, usize> = HashMap::new();
    let mut report = Report::default();
    let total = w.requests();
    let start = Instant::now();
    while report.requests < total {
        let now = Instant::now();
        for (u, user) in users.iter_mut().enumerate() {
            if user.in_flight.is_some() || user.turn == w.turns || now < user.retry_at {
                continue;
            }
            let stream = (u * w.turns + user.turn) as u64;
            let mut prompt = user.history.clone();
            prompt.extend(w.tokens(vocab, stream, w.message_tokens));
            let spec = RequestSpec {
                prompt: prompt.clone(),
                max_new_tokens: w.max_new_tokens,
                sampling: SamplingParams {
                    temperature: 0.8,
                    top_p: 0.95,
                    ..SamplingParams::default()
                },
                seed: stream + 1,
                ..RequestSpec::default()
            };
            match engine.submit(spec) {
                Ok(id) => {
                    owner.insert(id, u);
                    user.in_flight = Some(id);
                    user.history = prompt;
                    user.prompt_len = user.history.len();
                    user.answer.clear();
                    user.last_token_us = 0;
                }
                Err(e) if e.kind() == ErrorKind::QueueFull => {
                    report.refused += 1;
                    user.retry_at = now + Duration::from_millis(50);
                }
                Err(e) => panic!("submit failed: {e}"),
            }
        }
        let events = engine.poll_events(Duration::from_millis(5));
        for e in events {
            let Some(&u) = owner.get(&e.request_id()) else {
                continue;
            };
            let user = &mut users[u];
            match e.kind() {
                EventKind::Token => {
                    if user.answer.is_empty() {
                        report.ttft_us.push(e.stats().ttft_us);
                    } else {
                        report
                            .itl_us
                            .push(e.stats().elapsed_us - user.last_token_us);
                    }
                    user.last_token_us = e.stats().elapsed_us;
                    user.answer.extend(e.token_id());
                }
                EventKind::Finished | EventKind::Error => {
                    if e.kind() == EventKind::Error {
                        report.errors += 1;
                    }
                    report.requests += 1;
                    report.prompt_tokens += u64::from(e.stats().prompt_tokens);
                    report.generated_tokens += u64::from(e.stats().generated_tokens);
                    report.cached_device += u64::from(e.stats().cached_tokens_device);
                    report.cached_host += u64::from(e.stats().cached_tokens_host);
                    let answer = std::mem::take(&mut user.answer);
                    user.history.extend(answer);
                    user.in_flight = None;
                    user.turn += 1;
                    owner.remove(&e.request_id());
                    progress(report.requests, total);
                }
            }
        }
    }
    report.wall = start.elapsed();
    report
}
