//! The cloud-config rendered at admission when the tenant gives no user data (SPEC §3.3).

/// A `#cloud-config` document setting `hostname` and the authorised SSH keys.
///
/// Keys are written as YAML double-quoted strings so a comment with `:` or `#` cannot change the
/// document's structure.
pub fn render_cloud_config(hostname: &str, ssh_keys: &[String]) -> String {
    let mut out = String::from("#cloud-config\n");
    out.push_str(&format!("hostname: {}\n", yaml_quoted(hostname)));
    out.push_str("preserve_hostname: false\n");
    if ssh_keys.is_empty() {
        out.push_str("ssh_authorized_keys: []\n");
    } else {
        out.push_str("ssh_authorized_keys:\n");
        for key in ssh_keys {
            out.push_str(&format!("  - {}\n", yaml_quoted(key.trim())));
        }
    }
    out
}

fn yaml_quoted(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c.is_control() => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::{hostname_for, instance_id};

    #[test]
    fn the_document_names_the_host_and_lists_every_key() {
        let host = hostname_for(&instance_id("acme", "id_alice", "k"));
        let keys = vec![
            "ssh-ed25519 AAAAC3Nz alice@laptop".to_string(),
            "ssh-rsa AAAAB3Nz \"quoted\" # note".to_string(),
        ];
        let doc = render_cloud_config(&host, &keys);
        assert!(doc.starts_with("#cloud-config\n"));
        assert!(doc.contains(&format!("hostname: \"{host}\"\n")));
        assert!(doc.contains("  - \"ssh-ed25519 AAAAC3Nz alice@laptop\"\n"));
        assert!(doc.contains("  - \"ssh-rsa AAAAB3Nz \\\"quoted\\\" # note\"\n"));
    }

    #[test]
    fn no_keys_renders_an_empty_list() {
        let doc = render_cloud_config("inst-x", &[]);
        assert!(doc.contains("ssh_authorized_keys: []\n"));
    }
}
