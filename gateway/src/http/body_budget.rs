//! One budget of request body bytes in flight across every connection
//! (`--max-body-bytes-in-flight`), so that many connections cannot together buffer more than
//! it even though each body is within its route's limit.
//!
//! A request is charged its `Content-Length` before its body is read, and a body of unknown
//! length as its bytes arrive; the charge goes back when the request has been answered (the
//! buffered body and what was parsed from it live until then). A request that does not fit
//! is answered 503 with `Retry-After`; one that could never fit, 413.

use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::task::{ready, Context, Poll};

use axum::body::{Body, Bytes};
use http_body::{Frame, SizeHint};

/// Bytes of request bodies the server holds at once, shared by every connection.
#[derive(Debug)]
pub(crate) struct BodyBudget {
    capacity: usize,
    used: AtomicUsize,
}

impl BodyBudget {
    pub(crate) fn new(capacity: usize) -> Self {
        Self {
            capacity,
            used: AtomicUsize::new(0),
        }
    }

    /// Bytes charged to requests now.
    pub(crate) fn in_flight(&self) -> usize {
        self.used.load(Ordering::Acquire)
    }

    fn take(&self, n: usize) -> bool {
        self.used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                used.checked_add(n).filter(|&total| total <= self.capacity)
            })
            .is_ok()
    }

    fn give(&self, n: usize) {
        self.used.fetch_sub(n, Ordering::AcqRel);
    }
}

/// Why a body was refused its bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub(crate) enum Refusal {
    /// Other requests' bodies hold the budget now: 503, retry later.
    #[error("the request bodies in flight hold the server's budget of {capacity} bytes")]
    Full { capacity: usize },
    /// This body alone is more than the whole budget: 413, it never fits.
    #[error("a body of {size} bytes or more is over the server's budget of {capacity} bytes")]
    TooLarge { size: usize, capacity: usize },
}

/// One request's bytes of the budget, given back when the last holder (the request's
/// middleware, its body) drops it.
#[derive(Debug)]
pub(crate) struct Charge {
    budget: Arc<BodyBudget>,
    held: AtomicUsize,
    refused: OnceLock<Refusal>,
}

impl Charge {
    pub(crate) fn new(budget: Arc<BodyBudget>) -> Self {
        Self {
            budget,
            held: AtomicUsize::new(0),
            refused: OnceLock::new(),
        }
    }

    /// Raises this request's charge to `total` bytes (a lower total keeps what is held).
    pub(crate) fn raise_to(&self, total: usize) -> Result<(), Refusal> {
        let held = self.held.load(Ordering::Acquire);
        let Some(more) = total.checked_sub(held).filter(|&n| n > 0) else {
            return Ok(());
        };
        let capacity = self.budget.capacity;
        let refusal = if total > capacity {
            Refusal::TooLarge {
                size: total,
                capacity,
            }
        } else if self.budget.take(more) {
            self.held.fetch_add(more, Ordering::AcqRel);
            return Ok(());
        } else {
            Refusal::Full { capacity }
        };
        let _ = self.refused.set(refusal);
        Err(refusal)
    }

    /// Why the body was refused its bytes, if it was.
    pub(crate) fn refusal(&self) -> Option<Refusal> {
        self.refused.get().copied()
    }
}

impl Drop for Charge {
    fn drop(&mut self) {
        self.budget.give(*self.held.get_mut());
    }
}

/// A request body that charges its bytes to the budget as they arrive and fails with the
/// [`Refusal`] once they do not fit.
pub(crate) struct ChargedBody {
    inner: Body,
    charge: Arc<Charge>,
    read: usize,
    /// The route's own body limit: bytes past it are not charged, so that the route's 413
    /// (axum's `DefaultBodyLimit`, above this body) answers them rather than a 503.
    route_limit: Option<usize>,
    failed: bool,
}

impl ChargedBody {
    pub(crate) fn new(inner: Body, charge: Arc<Charge>, route_limit: Option<usize>) -> Self {
        Self {
            inner,
            charge,
            read: 0,
            route_limit,
            failed: false,
        }
    }
}

impl http_body::Body for ChargedBody {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        if self.failed {
            return Poll::Ready(None);
        }
        let frame = ready!(Pin::new(&mut self.inner).poll_frame(cx));
        if let Some(Ok(data)) = frame.as_ref().map(|f| f.as_ref().map(Frame::data_ref)) {
            let len = data.map_or(0, Bytes::len);
            self.read = self.read.saturating_add(len);
            let read = self.read;
            if self.route_limit.is_none_or(|limit| read <= limit) {
                if let Err(refusal) = self.charge.raise_to(read) {
                    self.failed = true;
                    return Poll::Ready(Some(Err(axum::Error::new(refusal))));
                }
            }
        }
        Poll::Ready(frame)
    }

    fn is_end_stream(&self) -> bool {
        self.failed || self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn charges_are_given_back_when_dropped() {
        let budget = Arc::new(BodyBudget::new(100));
        let a = Charge::new(budget.clone());
        let b = Charge::new(budget.clone());
        assert_eq!(a.raise_to(60), Ok(()));
        assert_eq!(a.raise_to(40), Ok(()), "a lower total keeps the charge");
        assert_eq!(budget.in_flight(), 60);
        assert_eq!(b.raise_to(50), Err(Refusal::Full { capacity: 100 }));
        assert_eq!(b.refusal(), Some(Refusal::Full { capacity: 100 }));
        assert_eq!(budget.in_flight(), 60, "a refused charge takes nothing");
        drop(a);
        assert_eq!(budget.in_flight(), 0);
        let c = Charge::new(budget.clone());
        assert_eq!(
            c.raise_to(101),
            Err(Refusal::TooLarge {
                size: 101,
                capacity: 100
            })
        );
        assert_eq!(c.raise_to(100), Ok(()));
        drop(c);
        assert_eq!(budget.in_flight(), 0);
    }

    #[tokio::test]
    async fn a_body_is_charged_as_it_is_read_and_refused_past_the_budget() {
        let budget = Arc::new(BodyBudget::new(10));
        let held = Charge::new(budget.clone());
        assert_eq!(held.raise_to(4), Ok(()));
        let charge = Arc::new(Charge::new(budget.clone()));
        let chunks: Vec<Result<Bytes, std::io::Error>> = vec![
            Ok(Bytes::from_static(b"12345")),
            Ok(Bytes::from_static(b"67")),
        ];
        let body = ChargedBody::new(
            Body::from_stream(tokio_stream::iter(chunks)),
            charge.clone(),
            None,
        );
        let err = axum::body::to_bytes(Body::new(body), usize::MAX)
            .await
            .err()
            .map(|e| e.to_string());
        assert!(
            err.as_ref().is_some_and(|e| e.contains("budget of 10")),
            "{err:?}"
        );
        assert_eq!(charge.refusal(), Some(Refusal::Full { capacity: 10 }));
        assert_eq!(budget.in_flight(), 9, "the first chunk stays charged");
        drop(charge);
        drop(held);
        assert_eq!(budget.in_flight(), 0);
    }
}
