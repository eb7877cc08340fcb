//! Validation of the OpenSSH public keys a tenant puts on an instance (SPEC §3.3).
//!
//! A key is `type base64-body [comment]`. The body must decode and must name the same type as the
//! prefix, which catches truncated pastes and mixed-up keys. Private keys are refused with a
//! message that says so, because pasting the wrong file is the usual mistake.

use data_encoding::BASE64;

use crate::error::DomainError;

/// The key types accepted.
pub const KEY_TYPES: &[&str] = &[
    "ssh-ed25519",
    "ssh-rsa",
    "ecdsa-sha2-nistp256",
    "ecdsa-sha2-nistp384",
    "ecdsa-sha2-nistp521",
    "sk-ssh-ed25519@openssh.com",
    "sk-ecdsa-sha2-nistp256@openssh.com",
];

/// The longest key line accepted (a 16384-bit RSA key with a long comment fits).
pub const MAX_KEY_LEN: usize = 8192;

/// Checks that `key` is one OpenSSH public key line. Errors are `INVALID_INPUT` on `sshKeys`.
pub fn validate_ssh_public_key(key: &str) -> Result<(), DomainError> {
    let bad = |message: &str| DomainError::invalid_input("sshKeys", message);
    let key = key.trim();
    if key.contains("PRIVATE KEY") || key.starts_with("PuTTY-User-Key-File") {
        return Err(bad(
            "this is a private key; give the public key (the .pub file) instead",
        ));
    }
    if key.is_empty() {
        return Err(bad("an ssh key is empty"));
    }
    if key.len() > MAX_KEY_LEN {
        return Err(bad("an ssh key is longer than 8192 characters"));
    }
    if key.contains(['\n', '\r']) {
        return Err(bad(
            "an ssh key spans several lines; give one key per entry",
        ));
    }
    let mut parts = key.split_whitespace();
    let key_type = parts.next().unwrap_or_default();
    if !KEY_TYPES.contains(&key_type) {
        return Err(bad(&format!(
            "unsupported ssh key type {key_type:?}; expected one of {}",
            KEY_TYPES.join(", ")
        )));
    }
    let body = parts
        .next()
        .ok_or_else(|| bad("the ssh key has no base64 body"))?;
    let blob = BASE64
        .decode(body.as_bytes())
        .map_err(|_| bad("the ssh key body is not valid base64"))?;
    if embedded_type(&blob) != Some(key_type.as_bytes()) {
        return Err(bad(&format!(
            "the ssh key body does not hold a {key_type} key"
        )));
    }
    Ok(())
}

/// The key type string at the start of a public key blob (a u32 length, then the bytes).
fn embedded_type(blob: &[u8]) -> Option<&[u8]> {
    let len = u32::from_be_bytes(blob.get(..4)?.try_into().ok()?) as usize;
    blob.get(4..4 + len)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key_of(key_type: &str, payload: &[u8]) -> String {
        let mut blob = (key_type.len() as u32).to_be_bytes().to_vec();
        blob.extend_from_slice(key_type.as_bytes());
        blob.extend_from_slice(payload);
        format!("{key_type} {}", BASE64.encode(&blob))
    }

    #[test]
    fn a_real_ed25519_public_key_with_a_comment_is_accepted() {
        let key = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOMqqnkVzrm0SdG6UOoqKLsabgH5C9okWi0dh2l9GKJl alice@laptop";
        assert!(validate_ssh_public_key(key).is_ok());
    }

    #[test]
    fn every_supported_type_is_accepted_without_a_comment() {
        for key_type in KEY_TYPES {
            let key = key_of(key_type, &[0u8; 32]);
            assert!(validate_ssh_public_key(&key).is_ok(), "{key}");
        }
    }

    #[test]
    fn a_private_key_is_refused_as_a_private_key() {
        let key = "-----BEGIN OPENSSH PRIVATE KEY-----\nb3BlbnNzaC1rZXktdjEAAAAA\n-----END OPENSSH PRIVATE KEY-----";
        let error = validate_ssh_public_key(key).unwrap_err();
        assert_eq!(error.code(), crate::error::ErrorCode::InvalidInput);
        assert!(error.to_string().contains("private key"), "{error}");
        let rsa = "-----BEGIN RSA PRIVATE KEY-----\nMIIE\n-----END RSA PRIVATE KEY-----";
        assert!(validate_ssh_public_key(rsa)
            .unwrap_err()
            .to_string()
            .contains("private key"));
    }

    #[test]
    fn a_body_naming_another_type_is_refused() {
        let body = key_of("ssh-rsa", &[1, 2, 3]);
        let lying = body.replacen("ssh-rsa", "ssh-ed25519", 1);
        let error = validate_ssh_public_key(&lying).unwrap_err();
        assert!(error
            .to_string()
            .contains("does not hold a ssh-ed25519 key"));
    }

    #[test]
    fn garbage_is_refused() {
        for key in [
            "",
            "ssh-dss AAAAB3NzaC1kc3M=",
            "ssh-ed25519",
            "ssh-ed25519 not*base64",
            "ssh-ed25519 AAAA",
            "hello world",
        ] {
            assert!(validate_ssh_public_key(key).is_err(), "{key:?}");
        }
    }
}
