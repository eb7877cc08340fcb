//! The HTTP plumbing the provider clients share: one client with timeouts on every request,
//! rate-limit headers, and transport failures as provider errors.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use reqwest::header::HeaderMap;
use reqwest::{RequestBuilder, StatusCode, Url};
use serde::de::DeserializeOwned;

use super::error::ProviderError;

/// The longest a single provider request may take, connection included.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);
/// The longest we wait to connect: an unreachable API should fail fast and be retried.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// `RateLimit-Reset` values above this are UNIX timestamps (Hetzner), below it delta-seconds.
const UNIX_TIMESTAMP_FLOOR: u64 = 1_000_000_000;

/// An HTTP client whose every request has a timeout.
pub(crate) fn http_client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(REQUEST_TIMEOUT)
        .connect_timeout(CONNECT_TIMEOUT)
        .user_agent(concat!("vps/", env!("CARGO_PKG_VERSION")))
        .build()
        // Building fails only if the TLS backend cannot initialise, which no retry can fix.
        .expect("the HTTP client for provider calls can be built")
}

/// `base` followed by `segments`, each percent-encoded as one path segment.
pub(crate) fn endpoint(base: &str, segments: &[&str]) -> Result<Url, ProviderError> {
    let mut url = Url::parse(base)
        .map_err(|e| ProviderError::invalid_config(format!("base URL {base}: {e}")))?;
    url.path_segments_mut()
        .map_err(|()| ProviderError::invalid_config(format!("base URL {base} cannot have paths")))?
        .pop_if_empty()
        .extend(segments);
    Ok(url)
}

/// How long a throttled answer asks us to wait: `Retry-After` (seconds), else `RateLimit-Reset`
/// (a UNIX timestamp on Hetzner, delta-seconds in the IETF draft).
pub(crate) fn retry_after(headers: &HeaderMap) -> Option<Duration> {
    let number = |name: &str| headers.get(name)?.to_str().ok()?.trim().parse::<u64>().ok();
    if let Some(seconds) = number("retry-after") {
        return Some(Duration::from_secs(seconds));
    }
    let reset = number("ratelimit-reset")?;
    if reset < UNIX_TIMESTAMP_FLOOR {
        return Some(Duration::from_secs(reset));
    }
    let now = SystemTime::now().duration_since(UNIX_EPOCH).ok()?.as_secs();
    // A reset already past still means "not now": wait at least a second.
    Some(Duration::from_secs(reset.saturating_sub(now).max(1)))
}

/// Sends `request` and decodes a successful answer's JSON body; a failed answer becomes
/// `api_error(status, body, wait)`, with the wait its rate-limit headers ask for.
pub(crate) async fn send_json<T, E>(
    provider: &str,
    request: RequestBuilder,
    api_error: impl FnOnce(StatusCode, &str, Option<Duration>) -> E,
) -> Result<T, E>
where
    T: DeserializeOwned,
    E: From<ProviderError>,
{
    let response = request
        .send()
        .await
        .map_err(|e| transport_error(provider, e))?;
    let status = response.status();
    if status.is_success() {
        return Ok(response
            .json::<T>()
            .await
            .map_err(|e| transport_error(provider, e))?);
    }
    let wait = retry_after(response.headers());
    let body = response.text().await.unwrap_or_default();
    Err(api_error(status, &body, wait))
}

/// A request that got no usable answer: retryable, since the provider may be back soon.
pub(crate) fn transport_error(provider: &str, error: reqwest::Error) -> ProviderError {
    let what = if error.is_timeout() {
        "timed out"
    } else if error.is_connect() {
        "could not connect"
    } else if error.is_decode() {
        "answered with an unexpected body"
    } else {
        "request failed"
    };
    // Without the URL: it may carry ids, never secrets, but the message is for a condition.
    ProviderError::provider(format!("{provider}: {what}: {}", error.without_url()))
}

#[cfg(test)]
mod tests {
    use reqwest::header::HeaderValue;

    use super::*;

    #[test]
    fn retry_after_seconds_win_over_rate_limit_reset() {
        let mut headers = HeaderMap::new();
        headers.insert("retry-after", HeaderValue::from_static("3"));
        headers.insert("ratelimit-reset", HeaderValue::from_static("60"));
        assert_eq!(retry_after(&headers), Some(Duration::from_secs(3)));
    }

    #[test]
    fn a_rate_limit_reset_timestamp_becomes_a_wait() {
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .as_secs();
        let mut headers = HeaderMap::new();
        let reset = HeaderValue::from_str(&(now + 5).to_string()).unwrap();
        headers.insert("ratelimit-reset", reset);
        let wait = retry_after(&headers).unwrap();
        assert!(wait >= Duration::from_secs(4) && wait <= Duration::from_secs(5));
    }

    #[test]
    fn no_rate_limit_headers_mean_no_wait_is_known() {
        assert_eq!(retry_after(&HeaderMap::new()), None);
    }

    #[test]
    fn endpoint_segments_are_appended_and_encoded() {
        let url = endpoint("http://127.0.0.1:1/api2/json", &["nodes", "pve", "a b"]).unwrap();
        assert_eq!(url.as_str(), "http://127.0.0.1:1/api2/json/nodes/pve/a%20b");
    }
}
