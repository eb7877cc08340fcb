//! Failures an emulator answers instead of serving, so tests can reach the clients' error
//! paths on demand.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use axum::extract::Request;
use axum::http::{header, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

/// A failure the next requests get.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// `429` with `Retry-After: 1` and the provider's rate-limit body.
    RateLimited,
    /// `429` asking for a wait of this many seconds (`Retry-After` and `RateLimit-Reset`).
    RateLimitedFor(u64),
    /// A `5xx` with the provider's error body.
    ServerError,
    /// Serve the request, then answer `504` from "a proxy", as if the answer were lost.
    AnswerLost,
}

/// The faults queued for one emulator (shared by its handle and its server).
#[derive(Clone, Default)]
pub(crate) struct Faults(Arc<Mutex<Queue>>);

#[derive(Default)]
struct Queue {
    next: VecDeque<Fault>,
    lost_creates: usize,
}

impl Faults {
    /// Queues `fault` for the next `times` requests.
    pub(crate) fn push(&self, fault: Fault, times: usize) {
        self.lock().next.extend(std::iter::repeat_n(fault, times));
    }

    /// Loses the answers to the next `times` create requests, whatever comes between.
    pub(crate) fn lose_creates(&self, times: usize) {
        self.lock().lost_creates += times;
    }

    /// The fault due for this request, if any.
    pub(crate) fn take(&self, is_create: bool) -> Option<Fault> {
        let mut queue = self.lock();
        if is_create && queue.lost_creates > 0 {
            queue.lost_creates -= 1;
            return Some(Fault::AnswerLost);
        }
        queue.next.pop_front()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Queue> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Serves `request` unless a fault is due. A lost answer is served first, so its effect
/// happens; `failure` answers the other faults in the provider's own shape.
pub(crate) async fn serve_or_fail(
    faults: &Faults,
    is_create: bool,
    request: Request,
    next: Next,
    failure: impl FnOnce(Fault) -> Response,
) -> Response {
    match faults.take(is_create) {
        None => next.run(request).await,
        Some(Fault::AnswerLost) => {
            next.run(request).await;
            answer_lost()
        }
        Some(fault) => failure(fault),
    }
}

/// What a client sees when the answer was lost: a gateway timeout page, not the API's JSON.
fn answer_lost() -> Response {
    (
        StatusCode::GATEWAY_TIMEOUT,
        [(header::CONTENT_TYPE, "text/html")],
        "<html><body><h1>504 Gateway Time-out</h1></body></html>",
    )
        .into_response()
}
