//! What of the user data reaches a Proxmox VM.
//!
//! The Proxmox API cannot upload a cloud-init user-data file (snippets can only be placed on
//! a storage from the host's shell), and `cicustom` can only point at such a file. So the
//! client delivers what the API can carry: the SSH keys listed in the user data go into the
//! cloud-init `sshkeys` option, and the template's cloud-init drive does the rest. The whole
//! user data is not delivered; operators who need it bake it into the template.

/// The SSH public keys a cloud-config lists (`ssh_authorized_keys:` items, or any line that
/// holds a public key), in order, without duplicates.
pub(super) fn ssh_keys(user_data: &str) -> Vec<String> {
    let mut keys: Vec<String> = Vec::new();
    for line in user_data.lines() {
        let item = line.trim().trim_start_matches('-').trim();
        let item = item.trim_matches(|c| c == '"' || c == '\'');
        if is_public_key(item) && !keys.iter().any(|k| k == item) {
            keys.push(item.to_owned());
        }
    }
    keys
}

/// The `sshkeys` option's value: the keys one per line, percent-encoded as the API requires
/// (it URI-unescapes the value, and `+` is not a space there).
pub(super) fn sshkeys_option(keys: &[String]) -> String {
    let joined = keys.join("\n");
    let mut encoded = String::with_capacity(joined.len() * 3);
    for byte in joined.bytes() {
        if byte.is_ascii_alphanumeric() || matches!(byte, b'-' | b'_' | b'.' | b'~') {
            encoded.push(byte as char);
        } else {
            encoded.push_str(&format!("%{byte:02X}"));
        }
    }
    encoded
}

fn is_public_key(item: &str) -> bool {
    const KINDS: [&str; 4] = ["ssh-", "ecdsa-sha2-", "sk-ssh-", "sk-ecdsa-"];
    KINDS.iter().any(|kind| item.starts_with(kind)) && item.split_whitespace().count() >= 2
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_read_from_a_cloud_config() {
        let user_data = "#cloud-config\nssh_authorized_keys:\n  - ssh-ed25519 AAAA alice\n  - \"ecdsa-sha2-nistp256 BBBB bob\"\nruncmd: []\n";
        assert_eq!(
            ssh_keys(user_data),
            ["ssh-ed25519 AAAA alice", "ecdsa-sha2-nistp256 BBBB bob"]
        );
    }

    #[test]
    fn the_option_is_percent_encoded_with_spaces_as_percent_twenty() {
        let keys = vec!["ssh-ed25519 AA+A= a@b".to_owned()];
        assert_eq!(sshkeys_option(&keys), "ssh-ed25519%20AA%2BA%3D%20a%40b");
    }
}
