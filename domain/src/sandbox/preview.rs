//! Preview URLs (`sandboxes.expose`, `sandboxes.unexpose`): a port of a ready sandbox's guest
//! made reachable over HTTP until an expiry. The URL's signed token is made above the domain
//! (it needs the server's key); this decides the expiry, the events that record an exposure and
//! its revocation, and whether a token's claim still stands.

use chrono::{DateTime, TimeDelta, Utc};

use super::{Sandbox, SandboxEvent, SandboxExposed, SandboxState, SandboxUnexposed};
use crate::error::DomainError;

/// How long a preview URL lives when the request names no `ttlSeconds` (never past the
/// sandbox's own expiry).
pub const DEFAULT_TTL_SECONDS: u64 = 3600;

/// A guest port as a request gives it: 1 to 65535, else `INVALID_INPUT` on `port`.
pub fn port(port: u64) -> Result<u16, DomainError> {
    u16::try_from(port)
        .ok()
        .filter(|p| *p != 0)
        .ok_or_else(|| DomainError::invalid_input("port", "a TCP port, 1 to 65535"))
}

/// Decides `sandboxes.expose` of `port` at `now` for `ttl_seconds` (default
/// [`DEFAULT_TTL_SECONDS`], capped by the sandbox's remaining lifetime): the sandbox must be
/// ready, and a `ttlSeconds` may not outlive it. Answers the event and the URL's end, in whole
/// seconds (what the token carries). Exposing a port again replaces its earlier URL.
pub fn expose(
    s: &Sandbox,
    port: u16,
    ttl_seconds: Option<u64>,
    now: DateTime<Utc>,
) -> Result<(Vec<SandboxEvent>, DateTime<Utc>), DomainError> {
    if s.state != SandboxState::Ready {
        return Err(DomainError::invalid_state(format!(
            "sandbox {} is {}; a preview URL needs a ready sandbox",
            s.id,
            s.state.as_str()
        )));
    }
    let now = whole_seconds(now);
    let remaining = (whole_seconds(s.expires_at) - now).num_seconds().max(0) as u64;
    if remaining == 0 {
        return Err(DomainError::invalid_state(format!(
            "sandbox {} has expired",
            s.id
        )));
    }
    let ttl = match ttl_seconds {
        Some(t) if t == 0 || t > remaining => {
            return Err(DomainError::invalid_input(
                "ttlSeconds",
                format!("1 to the sandbox's remaining lifetime ({remaining} s)"),
            ))
        }
        Some(t) => t,
        None => DEFAULT_TTL_SECONDS.min(remaining),
    };
    let expires_at = now + TimeDelta::seconds(ttl as i64);
    let event = SandboxEvent::Exposed(SandboxExposed {
        ids: s.lifecycle(),
        port,
        expires_at,
    });
    Ok((vec![event], expires_at))
}

/// Decides `sandboxes.unexpose` of `port`: its URL is revoked (`sandbox.unexposed`). A port
/// not exposed decides nothing.
pub fn unexpose(s: &Sandbox, port: u16) -> Vec<SandboxEvent> {
    if !s.exposures.contains_key(&port) {
        return Vec::new();
    }
    vec![SandboxEvent::Unexposed(SandboxUnexposed {
        ids: s.lifecycle(),
        port,
    })]
}

/// Whether a token for `port` ending at `expires_at` (unix seconds) opens `s` at `now`: the
/// sandbox is ready, the exposure it was made for is the port's current one (not revoked, not
/// replaced) and it has not ended.
pub fn admits(s: &Sandbox, port: u16, expires_at: i64, now: DateTime<Utc>) -> bool {
    s.state == SandboxState::Ready
        && s.exposures.get(&port).map(DateTime::timestamp) == Some(expires_at)
        && expires_at > now.timestamp()
}

/// `t` without its fraction of a second.
fn whole_seconds(t: DateTime<Utc>) -> DateTime<Utc> {
    DateTime::from_timestamp(t.timestamp(), 0).unwrap_or(t)
}

#[cfg(test)]
mod tests {
    use chrono::TimeZone;

    use super::*;
    use crate::aggregate::Aggregate;
    use crate::sandbox::{created_event, CreateSandbox, Lifecycle};

    fn ready(now: DateTime<Utc>) -> Sandbox {
        let request = CreateSandbox {
            id: "sbx_a".into(),
            tenant_id: "acme".into(),
            template_id: "sbxt_t".into(),
            ttl_seconds: Some(600),
            idempotency_key: "k".into(),
            request_hash: "h".into(),
            owner_identity_id: "id_alice".into(),
            from_snapshot: None,
            on_timeout: None,
            labels: Default::default(),
        };
        let ids = Lifecycle {
            sandbox_id: "sbx_a".into(),
            tenant_id: "acme".into(),
            template_id: "sbxt_t".into(),
            instance_id: "inst_i".into(),
            pool_id: "pool_p".into(),
        };
        let created = created_event(&request, ids, false, 600, now);
        let mut s = Sandbox::create(&created, now).unwrap();
        s.state = SandboxState::Ready;
        s
    }

    #[test]
    fn a_port_outside_1_to_65535_is_invalid_input_on_port() {
        for bad in [0, 65_536, 1 << 40] {
            let e = port(bad).unwrap_err();
            assert_eq!(e.code(), crate::error::ErrorCode::InvalidInput);
            assert!(format!("{e:?}").contains("port"), "{e:?}");
        }
        assert_eq!(port(8080).unwrap(), 8080);
    }

    #[test]
    fn an_exposure_ends_within_the_sandbox_lifetime_and_is_revoked_by_unexpose() {
        let now = Utc.with_ymd_and_hms(2026, 1, 1, 0, 0, 0).unwrap();
        let s = ready(now);
        let (events, end) = expose(&s, 8080, None, now).unwrap();
        assert_eq!(end, now + TimeDelta::seconds(600));
        let e = expose(&s, 8080, Some(601), now).unwrap_err();
        assert!(format!("{e:?}").contains("ttlSeconds"), "{e:?}");
        let mut s = s;
        for event in &events {
            s.apply(event, now);
        }
        assert!(admits(&s, 8080, end.timestamp(), now));
        assert!(!admits(&s, 8080, end.timestamp() - 1, now));
        assert!(!admits(&s, 8081, end.timestamp(), now));
        assert!(!admits(&s, 8080, end.timestamp(), end));
        for event in &unexpose(&s, 8080) {
            s.apply(event, now);
        }
        assert!(!admits(&s, 8080, end.timestamp(), now));
        assert!(unexpose(&s, 8080).is_empty());
    }

    #[test]
    fn a_sandbox_not_ready_cannot_be_exposed() {
        let now = Utc.with_ymd_and_hms(2026, 1, 1, 0, 0, 0).unwrap();
        let mut s = ready(now);
        s.state = SandboxState::Starting;
        let e = expose(&s, 80, None, now).unwrap_err();
        assert_eq!(e.code(), crate::error::ErrorCode::InvalidState);
    }
}
