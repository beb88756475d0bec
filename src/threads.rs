//! Which threads belong to dsv4. A host callback (event or log) runs on one of them; a call it
//! makes that waits for the engine thread would then wait, directly or through the backend's
//! workers, for the very thread it runs on. Entry points that block on the engine check
//! [`is_internal`] and refuse instead of deadlocking.

use std::cell::Cell;

thread_local! {
    static INTERNAL: Cell<bool> = const { Cell::new(false) };
}

/// Marks the calling thread as one of dsv4's own (engine, backend worker, copy thread).
pub fn mark_internal() {
    INTERNAL.with(|f| f.set(true));
}

/// Whether the calling thread is one of dsv4's own: code running here is a host callback, and
/// must not wait for an engine thread.
pub fn is_internal() -> bool {
    INTERNAL.with(Cell::get)
}

#[cfg(test)]
mod tests {
    #[test]
    fn only_marked_threads_are_internal() {
        assert!(!super::is_internal());
        std::thread::spawn(|| {
            super::mark_internal();
            assert!(super::is_internal());
        })
        .join()
        .unwrap();
        assert!(!super::is_internal(), "the mark is per thread");
    }
}
