//! What a provider emulator's routes share: the emulated world behind one lock, the faults
//! queued for it, the one `Authorization` value it accepts, and the guard in front of every
//! route that checks the credential and then serves or injects a fault.

use std::sync::{Arc, Mutex, MutexGuard};

use axum::extract::{Request, State};
use axum::http::header;
use axum::middleware::Next;
use axum::response::Response;

use crate::faults::{serve_or_fail, Fault, Faults};

/// How one provider's API words the answers the guard gives, in its own error shape.
pub(crate) trait ProviderAnswers {
    /// A missing or wrong credential.
    fn unauthorized(credential: Credential) -> Response;
    /// `429`, asking for a wait of `seconds`.
    fn rate_limited(seconds: u64) -> Response;
    /// A `5xx`.
    fn unavailable() -> Response;
    /// The request creates a machine (whose answer a [`Fault::AnswerLost`] loses).
    fn is_create(request: &Request) -> bool;
}

/// The state of a provider emulator's router.
pub(crate) struct ProviderState<W> {
    world: Arc<Mutex<W>>,
    faults: Faults,
    authorization: Arc<str>,
}

// Derived `Clone` would ask `W: Clone`; the world is shared, not copied.
impl<W> Clone for ProviderState<W> {
    fn clone(&self) -> Self {
        ProviderState {
            world: self.world.clone(),
            faults: self.faults.clone(),
            authorization: self.authorization.clone(),
        }
    }
}

/// How a request's `Authorization` header compares with the accepted one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Credential {
    Missing,
    Wrong,
    Accepted,
}

impl<W> ProviderState<W> {
    /// Serves `world`, failing as `faults` says, to requests whose `Authorization` header is
    /// exactly `authorization`.
    pub(crate) fn new(world: Arc<Mutex<W>>, faults: Faults, authorization: String) -> Self {
        ProviderState {
            world,
            faults,
            authorization: authorization.into(),
        }
    }

    /// The world; a handler that panicked while holding it leaves it usable.
    pub(crate) fn lock(&self) -> MutexGuard<'_, W> {
        self.world.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Checks the request's credential.
    fn credential(&self, request: &Request) -> Credential {
        match request.headers().get(header::AUTHORIZATION) {
            None => Credential::Missing,
            Some(value) if value.as_bytes() == self.authorization.as_bytes() => {
                Credential::Accepted
            }
            Some(_) => Credential::Wrong,
        }
    }
}

/// Authentication first, as the real APIs do, then any injected fault.
pub(crate) async fn guard<W: ProviderAnswers>(
    State(state): State<ProviderState<W>>,
    request: Request,
    next: Next,
) -> Response {
    match state.credential(&request) {
        Credential::Accepted => {}
        refused => return W::unauthorized(refused),
    }
    let is_create = W::is_create(&request);
    serve_or_fail(
        &state.faults,
        is_create,
        request,
        next,
        |fault| match fault {
            Fault::RateLimited => W::rate_limited(1),
            Fault::RateLimitedFor(seconds) => W::rate_limited(seconds),
            Fault::ServerError | Fault::AnswerLost => W::unavailable(),
        },
    )
    .await
}
