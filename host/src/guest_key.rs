//! The host's own SSH key: the tunnel logs in to each guest's `sshd` with it, once it has
//! checked the client's certificate itself (see [`crate::tunnel`]). Its public half reaches
//! every guest on the config drive (`vps/host-ssh.pub`), which the minimal guest's `sshd`
//! admits for `sandbox`.
//!
//! One ed25519 key per host, made on the first start and kept in the state directory, so a
//! guest booted before an agent restart still admits the restarted agent.

use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use ssh_key::{Algorithm, LineEnding, PrivateKey};

/// Where the key is kept under the state directory.
pub fn path(state_dir: &Path) -> PathBuf {
    state_dir.join("host_ssh_ed25519")
}

/// The host's key: read from the state directory, or made and written there (mode 0600)
/// the first time.
pub fn load_or_create(state_dir: &Path) -> Result<PrivateKey, String> {
    let path = path(state_dir);
    match std::fs::read_to_string(&path) {
        Ok(text) => {
            return PrivateKey::from_openssh(text.as_bytes())
                .map_err(|e| format!("{}: {e}", path.display()))
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(format!("{}: {e}", path.display())),
    }
    let mut rng = ssh_key::rand_core::UnwrapErr(ssh_key::getrandom::SysRng);
    let key = PrivateKey::random(&mut rng, Algorithm::Ed25519)
        .map_err(|e| format!("making the host's SSH key: {e}"))?;
    let text = key
        .to_openssh(LineEnding::LF)
        .map_err(|e| format!("encoding the host's SSH key: {e}"))?;
    std::fs::create_dir_all(state_dir).map_err(|e| format!("{}: {e}", state_dir.display()))?;
    // Written beside and renamed: a crash never leaves half a key that a restart would refuse.
    let partial = path.with_extension(format!("partial-{}", std::process::id()));
    let write = || -> std::io::Result<()> {
        let mut file = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&partial)?;
        file.write_all(text.as_bytes())?;
        file.sync_all()?;
        std::fs::rename(&partial, &path)
    };
    write().map_err(|e| format!("{}: {e}", path.display()))?;
    Ok(key)
}

/// The key's public half, one OpenSSH line (`ssh-ed25519 AAAA… vps-host`).
pub fn public_line(key: &PrivateKey) -> Result<String, String> {
    let mut public = key.public_key().clone();
    public.set_comment("vps-host");
    public
        .to_openssh()
        .map_err(|e| format!("encoding the host's public SSH key: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_key_is_made_once_and_read_back_after_a_restart() {
        let dir = std::env::temp_dir().join(format!("vps-guest-key-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let first = load_or_create(&dir).unwrap();
        let again = load_or_create(&dir).unwrap();
        assert_eq!(first.public_key(), again.public_key());
        let mode = std::fs::metadata(path(&dir)).unwrap().permissions();
        assert_eq!(
            std::os::unix::fs::PermissionsExt::mode(&mode) & 0o777,
            0o600
        );
        assert!(public_line(&first).unwrap().starts_with("ssh-ed25519 "));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
