//! `sandboxes.exec`: whether a sandbox can be entered now, and for how long a certificate for it
//! may be valid. Signing the certificate needs the CA key and randomness, so it happens above
//! the domain; this decides the window and the `sandbox.exec.issued` event that records it.

use chrono::{DateTime, TimeDelta, Utc};
use serde_json::json;

use super::{Sandbox, SandboxEvent, SandboxExecIssued, SandboxState};
use crate::error::DomainError;

/// The longest certificate: 15 minutes. Guests have no agent to receive a revocation list, so a
/// short lifetime is the revocation control.
pub const MAX_TTL_SECONDS: u64 = 900;
/// A certificate's lifetime when the request names none.
pub const DEFAULT_TTL_SECONDS: u64 = 300;
/// How far before `now` a certificate is already valid, so a guest whose clock runs a little
/// behind still accepts it.
pub const CLOCK_SKEW: TimeDelta = TimeDelta::seconds(60);
/// A sandbox that ends sooner than this is refused: extend it first.
pub const EXPIRING_WITHIN: TimeDelta = TimeDelta::minutes(1);
/// The account a sandbox's guest lets certificate holders in as.
pub const SANDBOX_ACCOUNT: &str = "sandbox";

/// What a certificate for a sandbox may say.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExecWindow {
    /// The one principal: the instance the guest's sshd answers as.
    pub principal: String,
    /// Valid from (a little before now, see [`CLOCK_SKEW`]).
    pub valid_after: DateTime<Utc>,
    /// Valid until: `now + ttl`, never past the sandbox's `expiresAt`.
    pub valid_before: DateTime<Utc>,
}

/// Decides whether `s` can be entered at `now` (its instance running or not) with a
/// certificate of `ttl_seconds` (default [`DEFAULT_TTL_SECONDS`]).
pub fn window(
    s: &Sandbox,
    instance_running: bool,
    ttl_seconds: Option<u64>,
    now: DateTime<Utc>,
) -> Result<ExecWindow, DomainError> {
    let ttl = ttl_seconds.unwrap_or(DEFAULT_TTL_SECONDS);
    if !(1..=MAX_TTL_SECONDS).contains(&ttl) {
        return Err(DomainError::invalid_input(
            "ttlSeconds",
            format!("1 to {MAX_TTL_SECONDS}"),
        ));
    }
    if s.state != SandboxState::Ready {
        return Err(DomainError::invalid_state(format!(
            "sandbox {} is {}; exec needs a ready sandbox",
            s.id,
            s.state.as_str()
        )));
    }
    if !instance_running {
        return Err(DomainError::invalid_state(format!(
            "the instance {} of sandbox {} is not running",
            s.instance_id, s.id
        )));
    }
    if s.expires_at - now < EXPIRING_WITHIN {
        return Err(DomainError::InvalidState {
            message: format!(
                "sandbox {} expires at {}, within a minute; extend it first",
                s.id,
                s.expires_at.to_rfc3339()
            ),
            details: json!({ "reason": "sandbox-expiring" }),
        });
    }
    // Certificates count whole seconds: the window is what the certificate will say.
    let now = whole_seconds(now);
    Ok(ExecWindow {
        principal: s.instance_id.clone(),
        valid_after: now - CLOCK_SKEW,
        valid_before: (now + TimeDelta::seconds(ttl as i64)).min(whole_seconds(s.expires_at)),
    })
}

/// `t` without its fraction of a second.
fn whole_seconds(t: DateTime<Utc>) -> DateTime<Utc> {
    DateTime::from_timestamp(t.timestamp(), 0).unwrap_or(t)
}

/// The refusal while another live guest shares the sandbox's SSH identity (a memory restore
/// resumes the guest its snapshot was taken from, principal included).
pub fn shares_identity_refusal(s: &Sandbox) -> DomainError {
    DomainError::InvalidState {
        message: format!(
            "another live guest shares the SSH identity of sandbox {}; a certificate for one \
             would open the other",
            s.id
        ),
        details: json!({ "reason": "restore-shares-identity" }),
    }
}

/// The key id a certificate is signed with: `vps:<tenant>:<sandbox>:<serial>`.
pub fn key_id(s: &Sandbox, serial: u64) -> String {
    format!("vps:{}:{}:{serial}", s.tenant_id, s.id)
}

/// Records a signed certificate (never the certificate itself).
pub fn issued(s: &Sandbox, serial: u64, window: &ExecWindow) -> Vec<SandboxEvent> {
    vec![SandboxEvent::ExecIssued(SandboxExecIssued {
        ids: s.lifecycle(),
        serial,
        key_id: key_id(s, serial),
        principal: window.principal.clone(),
        valid_before: window.valid_before,
    })]
}

#[cfg(test)]
mod tests {
    use chrono::TimeZone;
    use serde_json::json;

    use super::*;
    use crate::aggregate::{fold, Event};
    use crate::error::ErrorCode;

    fn at(s: i64) -> DateTime<Utc> {
        Utc.timestamp_opt(1_800_000_000 + s, 0).unwrap()
    }

    /// A sandbox created at 0 that lives `ttl` seconds, made ready at 1.
    fn ready_sandbox(ttl: i64) -> Sandbox {
        // Built from the wire form, so fields added later with defaults need no change here.
        let created = SandboxEvent::from_parts(
            "sandbox.created",
            json!({ "sandboxId": "sbx_a", "tenantId": "acme", "templateId": "sbxt_t",
                    "instanceId": "inst_i", "poolId": "pool_p", "warm": true,
                    "ttlSeconds": ttl, "expiresAt": at(ttl), "ownerIdentityId": "id_alice",
                    "idempotencyKey": "k", "requestHash": "h" }),
        )
        .unwrap();
        let ready = SandboxEvent::from_parts(
            "sandbox.ready",
            json!({ "sandboxId": "sbx_a", "tenantId": "acme", "templateId": "sbxt_t",
                    "instanceId": "inst_i", "poolId": "pool_p", "warm": true }),
        )
        .unwrap();
        fold::<Sandbox>([(&created, at(0)), (&ready, at(1))])
            .unwrap()
            .unwrap()
    }

    #[test]
    fn a_ready_sandbox_gets_a_window_from_a_minute_ago_to_the_ttl() {
        let s = ready_sandbox(3600);
        let w = window(&s, true, None, at(10)).unwrap();
        assert_eq!(w.principal, "inst_i");
        assert_eq!(w.valid_after, at(10 - 60));
        assert_eq!(w.valid_before, at(10 + DEFAULT_TTL_SECONDS as i64));
        let w = window(&s, true, Some(900), at(10)).unwrap();
        assert_eq!(w.valid_before, at(910));
    }

    #[test]
    fn the_window_never_passes_the_sandbox_expiry() {
        let s = ready_sandbox(200);
        let w = window(&s, true, Some(900), at(10)).unwrap();
        assert_eq!(w.valid_before, s.expires_at);
    }

    #[test]
    fn a_ttl_outside_one_to_nine_hundred_seconds_is_invalid_input() {
        let s = ready_sandbox(3600);
        for ttl in [0, 901] {
            let err = window(&s, true, Some(ttl), at(10)).unwrap_err();
            assert_eq!(err.code(), ErrorCode::InvalidInput, "ttl {ttl}");
            assert_eq!(err.details()["field"], "ttlSeconds");
        }
    }

    #[test]
    fn a_sandbox_not_ready_or_not_running_is_invalid_state() {
        let mut s = ready_sandbox(3600);
        let err = window(&s, false, None, at(10)).unwrap_err();
        assert_eq!(err.code(), ErrorCode::InvalidState);
        for state in [
            SandboxState::Starting,
            SandboxState::Failed,
            SandboxState::Deleting,
            SandboxState::Deleted,
        ] {
            s.state = state;
            let err = window(&s, true, None, at(10)).unwrap_err();
            assert_eq!(err.code(), ErrorCode::InvalidState, "{state:?}");
        }
    }

    #[test]
    fn a_sandbox_ending_within_a_minute_is_refused_as_expiring() {
        let s = ready_sandbox(100);
        let err = window(&s, true, None, at(41)).unwrap_err();
        assert_eq!(err.code(), ErrorCode::InvalidState);
        assert_eq!(err.details(), json!({ "reason": "sandbox-expiring" }));
        assert!(window(&s, true, None, at(40)).is_ok());
    }

    #[test]
    fn issuing_records_serial_key_id_principal_and_validity_and_changes_nothing_else() {
        let s = ready_sandbox(3600);
        let w = window(&s, true, Some(60), at(10)).unwrap();
        let events = issued(&s, 42, &w);
        let data = events[0].data();
        assert_eq!(events[0].event_type(), "sandbox.exec.issued");
        assert_eq!(data["serial"], 42);
        assert_eq!(data["keyId"], "vps:acme:sbx_a:42");
        assert_eq!(data["principal"], "inst_i");
        assert_eq!(data["instanceId"], "inst_i");
        let after =
            <Sandbox as crate::aggregate::Aggregate>::evolve(Some(s.clone()), &events[0], at(11))
                .unwrap();
        assert_eq!(after.version, s.version + 1);
        assert_eq!(
            Sandbox {
                version: s.version,
                ..after
            },
            s
        );
    }
}
