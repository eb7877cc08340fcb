//! The deployment's sandbox SSH certificate authority (`[sandbox_exec] ca_key`): one OpenSSH
//! private key, `ssh-ed25519` or `ecdsa-sha2-nistp256`, that signs short user certificates
//! with the `ssh-key` crate.

use std::path::Path;

use chrono::{DateTime, Utc};
use ssh_key::certificate::{Builder, CertType};
use ssh_key::getrandom::SysRng;
use ssh_key::rand_core::UnwrapErr;
use ssh_key::{Algorithm, EcdsaCurve, LineEnding, PrivateKey, PublicKey};
use vps_domain::sandbox::exec::ExecWindow;
use vps_domain::DomainError;

/// The comment a generated CA key carries.
pub const GENERATED_COMMENT: &str = "vps-sandbox-ca";
/// The longest public key line accepted from a caller.
pub const MAX_PUBLIC_KEY_LEN: usize = 8192;

/// The sandbox CA, loaded and checked.
pub struct SandboxCa {
    key: PrivateKey,
    public: String,
}

impl std::fmt::Debug for SandboxCa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the private half.
        f.debug_struct("SandboxCa")
            .field("public", &self.public)
            .finish()
    }
}

impl SandboxCa {
    /// The CA in an OpenSSH private key file's text. A key of another type, an encrypted one or
    /// anything unparsable is refused with a sentence for the configuration error.
    pub fn from_openssh(text: &str) -> Result<SandboxCa, String> {
        let key = PrivateKey::from_openssh(text.trim())
            .map_err(|e| format!("not an OpenSSH private key ({e})"))?;
        if key.is_encrypted() {
            return Err("the key is encrypted; vps needs it unencrypted (ssh-keygen -N '')".into());
        }
        match key.algorithm() {
            Algorithm::Ed25519
            | Algorithm::Ecdsa {
                curve: EcdsaCurve::NistP256,
            } => {}
            other => {
                return Err(format!(
                    "a {} key; the sandbox CA must be ssh-ed25519 or ecdsa-sha2-nistp256",
                    other.as_str()
                ))
            }
        }
        let public = key
            .public_key()
            .to_openssh()
            .map_err(|e| format!("cannot encode its public key ({e})"))?;
        Ok(SandboxCa { key, public })
    }

    /// The CA in the file at `path`.
    pub fn load(path: &Path) -> Result<SandboxCa, String> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
        SandboxCa::from_openssh(&text).map_err(|e| format!("{}: {e}", path.display()))
    }

    /// A new ed25519 CA, written to `path` (readable by its owner only) unless the file already
    /// exists, in which case that one is loaded: `vps dev` and tests keep theirs across runs.
    pub fn load_or_generate(path: &Path) -> Result<SandboxCa, String> {
        if path.exists() {
            return SandboxCa::load(path);
        }
        let mut key = PrivateKey::random(&mut UnwrapErr(SysRng), Algorithm::Ed25519)
            .map_err(|e| format!("cannot generate a key: {e}"))?;
        key.set_comment(GENERATED_COMMENT);
        let text = key
            .to_openssh(LineEnding::LF)
            .map_err(|e| format!("cannot encode the key: {e}"))?;
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        }
        let mut options = std::fs::OpenOptions::new();
        options.write(true).create_new(true);
        #[cfg(unix)]
        std::os::unix::fs::OpenOptionsExt::mode(&mut options, 0o600);
        let mut file = options
            .open(path)
            .map_err(|e| format!("{}: {e}", path.display()))?;
        std::io::Write::write_all(&mut file, text.as_bytes())
            .map_err(|e| format!("{}: {e}", path.display()))?;
        SandboxCa::from_openssh(&text)
    }

    /// The CA's public key line (what a guest's `TrustedUserCAKeys` holds).
    pub fn public_key(&self) -> &str {
        &self.public
    }

    /// Signs a user certificate for `subject` over `window`: one principal, the `permit-pty`
    /// extension only (no forwarding), `serial` and `key_id` as given. Answers the certificate
    /// as one OpenSSH line (what `key-cert.pub` holds).
    pub fn sign(
        &self,
        subject: &UserKey,
        window: &ExecWindow,
        serial: u64,
        key_id: &str,
    ) -> Result<String, DomainError> {
        let failed = |e: ssh_key::Error| DomainError::invalid_input("publicKey", e.to_string());
        let mut builder = Builder::new_with_random_nonce(
            &mut UnwrapErr(SysRng),
            subject.0.key_data().clone(),
            unix_seconds(window.valid_after),
            unix_seconds(window.valid_before),
        )
        .map_err(failed)?;
        builder
            .serial(serial)
            .and_then(|b| b.key_id(key_id))
            .and_then(|b| b.cert_type(CertType::User))
            .and_then(|b| b.valid_principal(window.principal.clone()))
            .and_then(|b| b.extension("permit-pty", ""))
            .and_then(|b| b.comment(key_id))
            .map_err(failed)?;
        let certificate = builder.sign(&self.key).map_err(failed)?;
        certificate.to_openssh().map_err(failed)
    }
}

/// A caller's public key that may be certified: ed25519 or ECDSA, security keys included.
#[derive(Debug, Clone)]
pub struct UserKey(PublicKey);

impl UserKey {
    /// Parses one OpenSSH public key line (`type base64 [comment]`). RSA and DSA keys, private
    /// keys, certificates and anything malformed are `INVALID_INPUT` on `publicKey`.
    pub fn parse(text: &str) -> Result<UserKey, DomainError> {
        let bad = |message: String| DomainError::invalid_input("publicKey", message);
        let text = text.trim();
        if text.contains("PRIVATE KEY") {
            return Err(bad(
                "this is a private key; give the public key (the .pub file)".into(),
            ));
        }
        if text.is_empty() || text.len() > MAX_PUBLIC_KEY_LEN || text.contains(['\n', '\r']) {
            return Err(bad(format!(
                "one OpenSSH public key line of at most {MAX_PUBLIC_KEY_LEN} characters"
            )));
        }
        let key = PublicKey::from_openssh(text)
            .map_err(|e| bad(format!("not an OpenSSH public key ({e})")))?;
        match key.algorithm() {
            Algorithm::Ed25519
            | Algorithm::Ecdsa { .. }
            | Algorithm::SkEd25519
            | Algorithm::SkEcdsaSha2NistP256 => Ok(UserKey(key)),
            other => Err(bad(format!(
                "{} keys are not certified; use ssh-ed25519 or ECDSA",
                other.as_str()
            ))),
        }
    }
}

fn unix_seconds(t: DateTime<Utc>) -> u64 {
    u64::try_from(t.timestamp()).unwrap_or(0)
}
