//! The one grammar of a domain in a network allow-list (NodeSpec `networkAllow`): the control
//! plane refuses an entry that breaks it, and the host reads by it which entries its resolver
//! answers for. One definition, so an entry the control plane takes is one the host serves.
//!
//! `_` is allowed in a label: DNS names in use carry it (`_dmarc.example.com`, service labels,
//! hosts named before RFC 1123 was read strictly), and the host's resolver matches names, not
//! host-name syntax. `-` may not start or end a label.

/// The longest name, in bytes, without a trailing dot.
pub const MAX_NAME: usize = 253;
/// The longest label.
pub const MAX_LABEL: usize = 63;

/// Whether `name` is a domain as an allow-list names one: dot-separated labels of 1 to
/// [`MAX_LABEL`] ASCII letters, digits, `-` or `_` (`-` not at a label's ends), at most
/// [`MAX_NAME`] bytes, the last label not all digits (that is an address). No trailing dot, no
/// wildcard (see [`is_domain_entry`]).
pub fn is_host_name(name: &str) -> bool {
    if name.is_empty() || name.len() > MAX_NAME {
        return false;
    }
    let labels_ok = name.split('.').all(|label| {
        (1..=MAX_LABEL).contains(&label.len())
            && label
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
            && !label.starts_with('-')
            && !label.ends_with('-')
    });
    let last = name.rsplit('.').next().unwrap_or(name);
    labels_ok && !last.bytes().all(|b| b.is_ascii_digit())
}

/// Whether `entry` names a domain: a host name ([`is_host_name`]), or `*.` and a host name
/// (every name under it).
pub fn is_domain_entry(entry: &str) -> bool {
    is_host_name(entry.strip_prefix("*.").unwrap_or(entry))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_names_are_ldh_labels_with_underscores() {
        for ok in [
            "example.com",
            "a-b.c1.io",
            "localhost",
            "_dmarc.example.com",
            "my_host.example",
            "Example.COM",
            &format!("{}.com", vec!["a".repeat(63); 3].join(".")),
        ] {
            assert!(is_host_name(ok), "{ok}");
        }
        for bad in [
            "",
            "-a.com",
            "a-.com",
            "a..com",
            ".a.com",
            "example.com.",
            " example.com",
            "a b.com",
            "1.2.3.4",
            "example.123",
            "*.example.com",
            "::1",
            &"a".repeat(64),
            &format!("{}.com", vec!["a".repeat(63); 4].join(".")),
        ] {
            assert!(!is_host_name(bad), "{bad}");
        }
    }

    #[test]
    fn an_entry_may_put_a_wildcard_in_front_only() {
        assert!(is_domain_entry("*.example.com"));
        assert!(is_domain_entry("example.com"));
        for bad in ["*", "*.", "a.*.com", "**.example.com", "*example.com"] {
            assert!(!is_domain_entry(bad), "{bad}");
        }
    }
}
