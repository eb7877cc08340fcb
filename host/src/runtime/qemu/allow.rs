//! The entries of a guest's `network.allow` that name domains, apart from its addresses and
//! CIDRs: what `policy` keeps out of its address sets, and what `dns` answers for.
//!
//! `example.com` allows exactly that name; `*.example.com` every name under it, at any depth,
//! but not `example.com` itself (list both for both). Names compare case-insensitively. What
//! a domain is (`_` included) is `vps_seam::host_name`, the grammar the control plane checks
//! entries by; an entry is read here with a trailing dot and surrounding space forgiven.

use vps_seam::host_name::is_host_name;

/// Where guests ask for names: the resolver listens here, and a guest's DNS is sent here.
pub const DNS_PORT: u16 = 53;

/// An allow-list entry that names a domain.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DomainPattern {
    /// `example.com`: that name only.
    Exact(String),
    /// `*.example.com`: every name under `example.com`, not the name itself.
    Under(String),
}

impl DomainPattern {
    /// An entry as a domain pattern: lower case, without a trailing dot; `None` when it is not
    /// a host name (an address, a CIDR, IPv6, a wildcard anywhere but the first label).
    pub fn parse(entry: &str) -> Option<DomainPattern> {
        let entry = entry.trim().trim_end_matches('.').to_ascii_lowercase();
        match entry.strip_prefix("*.") {
            Some(rest) => is_host_name(rest).then(|| DomainPattern::Under(rest.to_owned())),
            None => is_host_name(&entry).then_some(DomainPattern::Exact(entry)),
        }
    }

    /// Whether `name` (lower case, no trailing dot) matches.
    pub fn matches(&self, name: &str) -> bool {
        match self {
            DomainPattern::Exact(exact) => name == exact,
            DomainPattern::Under(parent) => name
                .strip_suffix(parent.as_str())
                .is_some_and(|head| head.len() > 1 && head.ends_with('.')),
        }
    }
}

/// The domain entries of an allow-list.
pub fn domains(allow: &[String]) -> Vec<DomainPattern> {
    allow
        .iter()
        .filter_map(|e| DomainPattern::parse(e))
        .collect()
}

/// Whether `patterns` allow the queried `name` (any case, a trailing dot or not).
pub fn allows(patterns: &[DomainPattern], name: &str) -> bool {
    let name = name.trim_end_matches('.').to_ascii_lowercase();
    patterns.iter().any(|p| p.matches(&name))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn patterns(entries: &[&str]) -> Vec<DomainPattern> {
        domains(&entries.iter().map(|e| e.to_string()).collect::<Vec<_>>())
    }

    #[test]
    fn only_host_names_are_domain_entries() {
        let found = patterns(&[
            "Allowed.Test.",
            "*.example.com",
            "198.51.100.7",
            "203.0.113.0/24",
            "2001:db8::/32",
            "a.*.example.com",
            "*",
            "-bad.example",
            "_dmarc.example.com",
            "1.2.3.999",
            "",
        ]);
        assert_eq!(
            found,
            [
                DomainPattern::Exact("allowed.test".into()),
                DomainPattern::Under("example.com".into()),
                DomainPattern::Exact("_dmarc.example.com".into()),
            ]
        );
    }

    #[test]
    fn an_exact_entry_allows_its_name_and_a_wildcard_the_names_under_it() {
        let allow = patterns(&["allowed.test", "*.example.com"]);
        assert!(allows(&allow, "allowed.test."));
        assert!(allows(&allow, "ALLOWED.test"));
        assert!(!allows(&allow, "www.allowed.test"));
        assert!(!allows(&allow, "denied.test"));
        assert!(!allows(&allow, "notallowed.test"));
        assert!(allows(&allow, "www.example.com."));
        assert!(allows(&allow, "a.b.example.com"));
        assert!(!allows(&allow, "example.com"));
        assert!(!allows(&allow, "badexample.com"));
        assert!(!allows(&[], "allowed.test"));
    }
}
