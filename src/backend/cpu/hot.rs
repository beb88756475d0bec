//! Keeping a step's workers awake between its products.
//!
//! A decode step is a chain of short parallel products (projections, experts) separated by
//! short serial stretches (norms, attention, routing: tens of microseconds). Rayon puts an
//! idle worker to sleep within microseconds, so each product paid a wake-up (futex, schedule:
//! ~14 % of a large-model decode profile). For the length of a step every other worker of the
//! pool spins in rayon's `yield_now` instead, taking each product's work as soon as it is
//! offered — but only while every pool thread of the process has a core of its own: spinning
//! on a shared core takes it from the thread that has work (another engine's step, a transfer).

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// Threads in the live CPU pools of this process.
static POOL_THREADS: AtomicUsize = AtomicUsize::new(0);

/// How long a spinner waits with nothing to run before it gives its worker back: longer than
/// the serial stretches of a decode step, short enough that a step with a long serial stretch
/// does not hold the cores. (It also bounds the one unlucky case, a spinner taken by a worker
/// waiting inside a join of the step, which rayon's steal order — the spinners are the oldest
/// jobs in the step's deque — keeps from happening.)
const IDLE_SPIN: Duration = Duration::from_micros(300);

/// One pool's share of the process's threads, counted while the pool lives.
#[derive(Debug)]
pub(super) struct PoolThreads(usize);

impl PoolThreads {
    pub(super) fn count(threads: usize) -> Self {
        POOL_THREADS.fetch_add(threads, Ordering::Relaxed);
        Self(threads)
    }
}

impl Drop for PoolThreads {
    fn drop(&mut self) {
        POOL_THREADS.fetch_sub(self.0, Ordering::Relaxed);
    }
}

/// Whether a pool of `threads` should keep its workers hot: it has more than one, and the
/// process's pools together fit on its cores.
fn worth_spinning(threads: usize) -> bool {
    static CORES: OnceLock<usize> = OnceLock::new();
    let cores = *CORES.get_or_init(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    threads > 1 && POOL_THREADS.load(Ordering::Relaxed) <= cores
}

/// Runs `f` on `pool` with the pool's other workers kept hot (see the module docs) while it runs.
pub(super) fn run_step<R: Send>(pool: &rayon::ThreadPool, f: impl FnOnce() -> R + Send) -> R {
    if !worth_spinning(pool.current_num_threads()) {
        return pool.install(f);
    }
    run_hot(pool, f)
}

/// Runs `f` on `pool` with the pool's other workers spinning until it ends.
fn run_hot<R: Send>(pool: &rayon::ThreadPool, f: impl FnOnce() -> R + Send) -> R {
    let threads = pool.current_num_threads();
    pool.install(|| {
        let owner = rayon::current_thread_index();
        let hot = AtomicBool::new(true);
        rayon::in_place_scope(|s| {
            for _ in 1..threads {
                s.spawn(|_| keep_hot(&hot, owner));
            }
            // Clears `hot` even when `f` panics, or the scope would wait on the spinners.
            let _cool = Cool(&hot);
            f()
        })
    })
}

/// Clears the flag a step's spinners watch when the step ends, panicking or not.
struct Cool<'a>(&'a AtomicBool);

impl Drop for Cool<'_> {
    fn drop(&mut self) {
        self.0.store(false, Ordering::Release);
    }
}

/// Runs the step's work offered to this worker until `hot` drops or nothing came for
/// `IDLE_SPIN`.
fn keep_hot(hot: &AtomicBool, owner: Option<usize>) {
    // The step's own thread may pick this up while it waits inside the step: it must not
    // spin there (what it waits for is below it on its stack).
    if rayon::current_thread_index() == owner {
        return;
    }
    let mut idle_since = Instant::now();
    let mut idle_rounds = 0u32;
    while hot.load(Ordering::Acquire) {
        if rayon::yield_now() == Some(rayon::Yield::Executed) {
            idle_since = Instant::now();
            idle_rounds = 0;
        } else if idle_since.elapsed() > IDLE_SPIN {
            return;
        } else {
            idle_rounds += 1;
            // A system call per idle round delays taking the next product's work; the
            // occasional one still lets a waiting thread of the process run.
            if idle_rounds.is_multiple_of(64) {
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rayon::prelude::*;

    fn pool(threads: usize) -> rayon::ThreadPool {
        rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap()
    }

    #[test]
    fn a_step_returns_its_value_with_nested_parallel_work_on_every_pool_size() {
        for threads in [1, 2, 3, 8] {
            let p = pool(threads);
            for round in 0..50u64 {
                // Nested joins inside products, and serial gaps between them: the shapes a
                // spinner can land on.
                let got = run_hot(&p, || {
                    let mut total = 0u64;
                    for k in 0..4u64 {
                        total += (0..2000u64)
                            .into_par_iter()
                            .map(|i| {
                                (0..(i % 7))
                                    .into_par_iter()
                                    .map(|j| j + k + round)
                                    .sum::<u64>()
                            })
                            .sum::<u64>();
                        std::thread::sleep(Duration::from_micros(if k % 2 == 0 {
                            20
                        } else {
                            400
                        }));
                    }
                    total
                });
                let want: u64 = (0..4u64)
                    .map(|k| {
                        (0..2000u64)
                            .map(|i| (0..(i % 7)).map(|j| j + k + round).sum::<u64>())
                            .sum::<u64>()
                    })
                    .sum();
                assert_eq!(got, want, "threads={threads} round={round}");
            }
        }
    }

    #[test]
    fn a_panicking_step_releases_its_spinners_and_the_pool_goes_on() {
        let p = pool(2);
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            run_hot(&p, || {
                let _: u64 = (0..1000u64).into_par_iter().sum();
                panic!("step failed")
            })
        }));
        assert!(r.is_err());
        assert_eq!(
            run_step(&p, || (0..1000u64).into_par_iter().sum::<u64>()),
            499_500
        );
    }

    #[test]
    fn pools_that_would_share_cores_do_not_spin() {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        assert!(!worth_spinning(1), "one thread has no one to keep hot");
        let _many = PoolThreads::count(cores + 1);
        assert!(
            !worth_spinning(2),
            "{} pool threads on {cores} cores",
            cores + 1
        );
    }
}
