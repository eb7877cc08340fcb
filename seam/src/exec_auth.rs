//! Who an exec session admits (SPEC §3.7): the user `sandbox` with an OpenSSH user certificate
//! signed by the deployment's sandbox CA, naming the principal the redeemed ticket names,
//! inside its validity window. Both hosts terminate the client's SSH session and check its
//! certificate with this, so the two cannot admit different things.

use chrono::{DateTime, Utc};
use ssh_key::certificate::CertType;
use ssh_key::{Certificate, Fingerprint, HashAlg, PublicKey};

use crate::Redeemed;

/// The one account a guest admits (the reference's `sandboxExec.account` default).
pub const ACCOUNT: &str = "sandbox";

/// What one redeemed ticket lets in.
#[derive(Debug, Clone)]
pub struct CertificateCheck {
    /// The CA the certificate must be signed by.
    ca: Fingerprint,
    /// The principal the certificate must name.
    principal: String,
    /// When the ticket's grant ends, if the check should hold the session to it too.
    valid_before: Option<DateTime<Utc>>,
}

impl CertificateCheck {
    /// The check for `redeemed`: its CA and principal. `hold_to_ticket` also refuses a
    /// certificate presented at or after the ticket's `validBefore`.
    pub fn new(redeemed: &Redeemed, hold_to_ticket: bool) -> Result<CertificateCheck, String> {
        let ca = redeemed
            .ca_public_key
            .as_deref()
            .ok_or("the server names no sandbox CA")?;
        let ca = PublicKey::from_openssh(ca)
            .map_err(|e| format!("the server's CA key: {e}"))?
            .fingerprint(HashAlg::Sha256);
        Ok(CertificateCheck {
            ca,
            principal: redeemed.principal.clone(),
            valid_before: if hold_to_ticket {
                redeemed.valid_before
            } else {
                None
            },
        })
    }

    /// Whether `certificate` lets `user` in at `now`: the CA's, a user certificate, for this
    /// principal, valid now, with no critical option a guest would have to enforce. The error
    /// says why not, for the log (never for the client).
    pub fn admits(
        &self,
        user: &str,
        certificate: &Certificate,
        now: DateTime<Utc>,
    ) -> Result<(), &'static str> {
        if user != ACCOUNT {
            return Err("not the sandbox account");
        }
        if certificate.cert_type() != CertType::User {
            return Err("not a user certificate");
        }
        if self.valid_before.is_some_and(|end| now >= end) {
            return Err("the ticket's grant has ended");
        }
        let at = u64::try_from(now.timestamp()).unwrap_or(0);
        if certificate.validate_at(at, [&self.ca]).is_err() {
            return Err("not signed by the sandbox CA, or outside its validity");
        }
        if !certificate.valid_principals().contains(&self.principal) {
            return Err("for another principal");
        }
        if !certificate.critical_options().is_empty() {
            return Err("carries critical options");
        }
        Ok(())
    }
}
