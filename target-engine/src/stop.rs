//! Cooperative stopping of model work. A caller that must be able to stop a long forward pass
//! (a request past its deadline, a client that went away) installs a stop condition for the
//! current thread with [`with_stop`]; every forward pass ([`crate::Model::forward`] and all
//! that build on it: prefill, blended prefill, probes, decode steps, the speculator's passes)
//! checks it before each layer and fails with [`EngineError::Stopped`]. A thread spawned for
//! the same request carries the condition over: take it with [`current`] before spawning and
//! install it inside with [`with_stop`].
//!
//! The check costs one closure call per layer; what it bounds is the time from the condition
//! turning true to the engine being free: one layer of the running pass.

use crate::error::{EngineError, Result};
use std::cell::RefCell;
use std::sync::Arc;

/// A stop condition: true means "stop now".
pub type StopFn = Arc<dyn Fn() -> bool + Send + Sync>;

thread_local! {
    static STOP: RefCell<Option<StopFn>> = const { RefCell::new(None) };
}

/// Puts the previous condition back when dropped (also when `f` panics).
struct Restore(Option<StopFn>);

impl Drop for Restore {
    fn drop(&mut self) {
        let prev = self.0.take();
        STOP.with(|s| *s.borrow_mut() = prev);
    }
}

/// Runs `f` with `stop` as this thread's stop condition (`None`: nothing stops it).
pub fn with_stop<R>(stop: Option<StopFn>, f: impl FnOnce() -> R) -> R {
    let _restore = Restore(STOP.with(|s| s.replace(stop)));
    f()
}

/// This thread's stop condition, to carry into a thread spawned for the same work.
pub fn current() -> Option<StopFn> {
    STOP.with(|s| s.borrow().clone())
}

/// [`EngineError::Stopped`] when this thread's stop condition says so.
pub fn check() -> Result<()> {
    let stop = STOP.with(|s| s.borrow().as_ref().is_some_and(|f| f()));
    if stop {
        Err(EngineError::Stopped)
    } else {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};

    #[test]
    fn the_condition_is_scoped_restored_and_carried() {
        assert!(check().is_ok(), "nothing installed: never stops");
        let flag = Arc::new(AtomicBool::new(false));
        let f = flag.clone();
        let stop: StopFn = Arc::new(move || f.load(Ordering::Relaxed));
        with_stop(Some(stop), || {
            assert!(check().is_ok());
            flag.store(true, Ordering::Relaxed);
            assert!(matches!(check(), Err(EngineError::Stopped)));
            let carried = current();
            let other = std::thread::spawn(move || {
                let unset = check().is_ok();
                (unset, with_stop(carried, check).is_err())
            });
            assert_eq!(other.join().ok(), Some((true, true)));
            // Nested: an inner scope may lift the condition; the outer one comes back.
            with_stop(None, || assert!(check().is_ok()));
            assert!(check().is_err());
        });
        assert!(check().is_ok(), "restored after the scope");
        let r = std::panic::catch_unwind(|| {
            with_stop(Some(Arc::new(|| true)), || panic!("inside"));
        });
        assert!(r.is_err());
        assert!(check().is_ok(), "restored after a panic");
    }
}
