//! Provider failures, coded so the reconciler can decide between retrying and failing.

use std::fmt;
use std::time::Duration;

/// The longest message a [`ProviderError`] keeps; the reconciler stores it in a condition.
pub const MAX_MESSAGE_CHARS: usize = 500;

/// The longest a provider's `Retry-After` (or `RateLimit-Reset`) is honoured.
pub const MAX_RETRY_AFTER: Duration = Duration::from_secs(3600);

/// A failed provider call.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{code}: {message}")]
pub struct ProviderError {
    /// What kind of failure this is.
    pub code: ProviderErrorCode,
    /// What happened, for people (at most [`MAX_MESSAGE_CHARS`] characters, no secrets).
    pub message: String,
    /// How long the provider asked us to wait before calling again, when it said.
    pub retry_after: Option<Duration>,
}

/// The kinds of provider failure (SPEC §8).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ProviderErrorCode {
    /// The machine (or what the call names) does not exist.
    NotFound,
    /// The provider is throttling us; call again after `retry_after`.
    RateLimited,
    /// The provider failed or could not be reached; calling again may succeed.
    ProviderError,
    /// The provider cannot do what was asked.
    Unsupported,
    /// The machine is in a state that refuses the call (locked, busy, protected).
    InvalidState,
    /// The account's configuration or the request is wrong (credentials, ids, parameters).
    InvalidConfig,
}

impl ProviderError {
    /// An error with `code` and `message`, the message cut to [`MAX_MESSAGE_CHARS`].
    pub fn new(code: ProviderErrorCode, message: impl Into<String>) -> Self {
        let mut message = message.into();
        if let Some((cut, _)) = message.char_indices().nth(MAX_MESSAGE_CHARS) {
            message.truncate(cut);
        }
        Self {
            code,
            message,
            retry_after: None,
        }
    }

    /// A `NOT_FOUND` error.
    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(ProviderErrorCode::NotFound, message)
    }

    /// A `RATE_LIMITED` error carrying the wait the provider asked for.
    pub fn rate_limited(message: impl Into<String>, retry_after: Option<Duration>) -> Self {
        Self::new(ProviderErrorCode::RateLimited, message).with_retry_after(retry_after)
    }

    /// A `PROVIDER_ERROR`.
    pub fn provider(message: impl Into<String>) -> Self {
        Self::new(ProviderErrorCode::ProviderError, message)
    }

    /// An `INVALID_CONFIG` error.
    pub fn invalid_config(message: impl Into<String>) -> Self {
        Self::new(ProviderErrorCode::InvalidConfig, message)
    }

    /// An `INVALID_STATE` error.
    pub fn invalid_state(message: impl Into<String>) -> Self {
        Self::new(ProviderErrorCode::InvalidState, message)
    }

    /// The same error with `retry_after` set, at most [`MAX_RETRY_AFTER`]: a provider (or
    /// whatever answers in its place) cannot park an instance for days.
    pub fn with_retry_after(mut self, retry_after: Option<Duration>) -> Self {
        self.retry_after = retry_after.map(|wait| wait.min(MAX_RETRY_AFTER));
        self
    }

    /// Whether the reconciler should stop retrying and move the instance to `error`.
    pub fn is_terminal(&self) -> bool {
        self.code.is_terminal()
    }
}

impl ProviderErrorCode {
    /// The SPEC's name of the code: `NOT_FOUND`, `RATE_LIMITED`, …
    pub fn as_str(self) -> &'static str {
        match self {
            ProviderErrorCode::NotFound => "NOT_FOUND",
            ProviderErrorCode::RateLimited => "RATE_LIMITED",
            ProviderErrorCode::ProviderError => "PROVIDER_ERROR",
            ProviderErrorCode::Unsupported => "UNSUPPORTED",
            ProviderErrorCode::InvalidState => "INVALID_STATE",
            ProviderErrorCode::InvalidConfig => "INVALID_CONFIG",
        }
    }

    /// `UNSUPPORTED`, `INVALID_STATE` and `INVALID_CONFIG` will not heal by retrying
    /// (SPEC §3.6); everything else is retried.
    pub fn is_terminal(self) -> bool {
        matches!(
            self,
            ProviderErrorCode::Unsupported
                | ProviderErrorCode::InvalidState
                | ProviderErrorCode::InvalidConfig
        )
    }
}

impl fmt::Display for ProviderErrorCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_long_message_is_cut_to_five_hundred_characters() {
        let error = ProviderError::provider("é".repeat(800));
        assert_eq!(error.message.chars().count(), MAX_MESSAGE_CHARS);
    }

    #[test]
    fn only_unsupported_invalid_state_and_invalid_config_are_terminal() {
        use ProviderErrorCode::*;
        for code in [NotFound, RateLimited, ProviderError] {
            assert!(!code.is_terminal(), "{code:?} is worth calling again");
        }
        for code in [Unsupported, InvalidState, InvalidConfig] {
            assert!(code.is_terminal(), "{code:?} stays as it is");
        }
    }
}

#[cfg(test)]
mod cap_tests {
    use super::*;

    #[test]
    fn a_retry_after_longer_than_an_hour_is_capped() {
        let asked = Some(Duration::from_secs(30 * 86_400));
        let error = ProviderError::rate_limited("slow down", asked);
        assert_eq!(error.retry_after, Some(MAX_RETRY_AFTER));
        let short = ProviderError::rate_limited("slow down", Some(Duration::from_secs(3)));
        assert_eq!(short.retry_after, Some(Duration::from_secs(3)));
    }
}
