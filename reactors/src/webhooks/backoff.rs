//! When a failed delivery is tried again: exponential back-off with jitter, capped, unless the
//! endpoint said when (`Retry-After`).

use std::time::Duration;

use chrono::{DateTime, Utc};
use rand::Rng;

/// The wait after failed attempt number `attempt` (1-based): `base · 2^(attempt-1)`, capped at
/// `max`, then drawn uniformly from its upper half ("equal jitter"), so endpoints that failed
/// together are not retried together, and the wait still grows with each failure.
pub fn retry_delay(base: Duration, max: Duration, attempt: u32) -> Duration {
    let exp = base
        .saturating_mul(2u32.saturating_pow(attempt.saturating_sub(1)))
        .min(max);
    exp.mul_f64(rand::thread_rng().gen_range(0.5..=1.0))
}

/// The wait a `Retry-After` header asks for: delay-seconds or an HTTP date (`None` when it is
/// neither). A date in the past means "now".
pub fn parse_retry_after(value: &str, now: DateTime<Utc>) -> Option<Duration> {
    let value = value.trim();
    if let Ok(seconds) = value.parse::<u64>() {
        return Some(Duration::from_secs(seconds));
    }
    let at = DateTime::parse_from_rfc2822(value).ok()?;
    Some(
        (at.with_timezone(&Utc) - now)
            .to_std()
            .unwrap_or(Duration::ZERO),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_delay_doubles_per_attempt_within_jitter_and_cap() {
        let base = Duration::from_secs(1);
        let max = Duration::from_secs(60);
        for attempt in 1..=5u32 {
            let d = retry_delay(base, max, attempt);
            let full = base * 2u32.pow(attempt - 1);
            assert!(d >= full / 2 && d <= full, "{attempt}: {d:?}");
        }
        assert!(retry_delay(base, max, 40) <= max);
    }

    #[test]
    fn retry_after_takes_seconds_or_an_http_date() {
        let now = DateTime::parse_from_rfc3339("2026-01-01T00:00:00Z")
            .unwrap()
            .with_timezone(&Utc);
        assert_eq!(parse_retry_after(" 7 ", now), Some(Duration::from_secs(7)));
        assert_eq!(
            parse_retry_after("Thu, 01 Jan 2026 00:00:30 GMT", now),
            Some(Duration::from_secs(30))
        );
        assert_eq!(
            parse_retry_after("Wed, 31 Dec 2025 00:00:00 GMT", now),
            Some(Duration::ZERO)
        );
        assert_eq!(parse_retry_after("soon", now), None);
    }
}
