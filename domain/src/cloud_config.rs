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

/// A sandbox instance's user data: the template's (`base`), plus `/etc/sandbox/env` (root,
/// mode 0600) holding one `NAME='value'` shell assignment per line when the template names
/// environment values. The two go as a MIME multi-part document, which cloud-init runs part
/// by part, so the template's own user data stays as the tenant wrote it.
pub fn sandbox_user_data(base: &str, env: &[(String, String)]) -> String {
    if env.is_empty() {
        return base.to_string();
    }
    let file: String = env
        .iter()
        .map(|(name, value)| format!("{name}='{}'\n", value.replace('\'', "'\\''")))
        .collect();
    let boundary = "==vps-sandbox-env==";
    let base_type = if base.starts_with("#cloud-config") {
        "text/cloud-config"
    } else {
        "text/x-shellscript"
    };
    format!(
        "Content-Type: multipart/mixed; boundary=\"{boundary}\"\nMIME-Version: 1.0\n\n\
         --{boundary}\nContent-Type: text/cloud-config; charset=\"utf-8\"\n\n\
         #cloud-config\nwrite_files:\n  - path: /etc/sandbox/env\n    owner: root:root\n    \
         permissions: '0600'\n    encoding: b64\n    content: {}\n\
         --{boundary}\nContent-Type: {base_type}; charset=\"utf-8\"\n\n{base}\n--{boundary}--\n",
        data_encoding::BASE64.encode(file.as_bytes())
    )
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

    #[test]
    fn sandbox_env_goes_to_a_root_only_file_beside_the_template_user_data() {
        let base = "#!/bin/sh\necho hi\n";
        assert_eq!(sandbox_user_data(base, &[]), base);
        let env = vec![("TOKEN".to_string(), "it's secret".to_string())];
        let doc = sandbox_user_data(base, &env);
        assert!(doc.contains("path: /etc/sandbox/env"));
        assert!(doc.contains("permissions: '0600'"));
        assert!(doc.contains("text/x-shellscript"));
        assert!(
            !doc.contains("it's secret"),
            "values are encoded, never in the clear"
        );
        let encoded = doc
            .lines()
            .find_map(|l| l.trim().strip_prefix("content: "))
            .unwrap();
        let file = data_encoding::BASE64.decode(encoded.as_bytes()).unwrap();
        assert_eq!(
            String::from_utf8(file).unwrap(),
            "TOKEN='it'\\''s secret'\n"
        );
    }
    use crate::ids::{hostname_for, instance_id};

    #[test]
    fn the_document_names_the_host_and_lists_every_key() {
        let host = hostname_for(&instance_id(crate::ids::Origin {
            tenant: "acme",
            caller: "id_alice",
            key: "k",
        }));
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
