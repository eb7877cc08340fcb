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

#[cfg(test)]
mod tests {
    use chrono::TimeDelta;
    use ssh_key::certificate::Builder;
    use ssh_key::rand_core::UnwrapErr;
    use ssh_key::{Algorithm, PrivateKey};

    use super::*;

    fn key() -> PrivateKey {
        PrivateKey::random(
            &mut UnwrapErr(ssh_key::getrandom::SysRng),
            Algorithm::Ed25519,
        )
        .unwrap()
    }

    /// A user certificate from `ca` for `principal`, valid from 60 s before `now` to `ends_in`
    /// seconds after it.
    fn certificate(
        ca: &PrivateKey,
        principal: &str,
        now: DateTime<Utc>,
        ends_in: i64,
    ) -> Certificate {
        let at = |t: DateTime<Utc>| u64::try_from(t.timestamp()).unwrap();
        let mut builder = Builder::new_with_random_nonce(
            &mut UnwrapErr(ssh_key::getrandom::SysRng),
            key().public_key().key_data().clone(),
            at(now - TimeDelta::seconds(60)),
            at(now + TimeDelta::seconds(ends_in)),
        )
        .unwrap();
        builder.cert_type(CertType::User).unwrap();
        builder.valid_principal(principal).unwrap();
        builder.extension("permit-pty", "").unwrap();
        builder.sign(ca).unwrap()
    }

    fn redeemed(ca: &PrivateKey, principal: &str, valid_before: DateTime<Utc>) -> Redeemed {
        Redeemed {
            instance_id: "inst_a".into(),
            principal: principal.into(),
            valid_before: Some(valid_before),
            ca_public_key: Some(ca.public_key().to_openssh().unwrap()),
            port: None,
        }
    }

    #[test]
    fn only_the_cas_certificate_for_the_redeemed_principal_in_its_window_gets_in() {
        let now = DateTime::from_timestamp(1_700_000_000, 0).unwrap();
        let ca = key();
        let check =
            CertificateCheck::new(&redeemed(&ca, "inst_a", now + TimeDelta::seconds(60)), true)
                .unwrap();
        let good = certificate(&ca, "inst_a", now, 60);
        assert_eq!(check.admits(ACCOUNT, &good, now), Ok(()));
        assert_eq!(
            check.admits("root", &good, now),
            Err("not the sandbox account")
        );
        let other = certificate(&ca, "inst_b", now, 60);
        assert_eq!(
            check.admits(ACCOUNT, &other, now),
            Err("for another principal")
        );
        let ended = certificate(&ca, "inst_a", now, -1);
        assert!(check.admits(ACCOUNT, &ended, now).is_err());
        let forged = certificate(&key(), "inst_a", now, 60);
        assert!(check.admits(ACCOUNT, &forged, now).is_err());
    }

    #[test]
    fn a_check_held_to_the_ticket_refuses_once_the_grant_ends() {
        let now = DateTime::from_timestamp(1_700_000_000, 0).unwrap();
        let ca = key();
        let redeemed = redeemed(&ca, "inst_a", now);
        let long = certificate(&ca, "inst_a", now, 600);
        let held = CertificateCheck::new(&redeemed, true).unwrap();
        assert_eq!(
            held.admits(ACCOUNT, &long, now),
            Err("the ticket's grant has ended")
        );
        let free = CertificateCheck::new(&redeemed, false).unwrap();
        assert_eq!(free.admits(ACCOUNT, &long, now), Ok(()));
    }
}
