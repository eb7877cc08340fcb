//! Resource labels (SPEC §3.12): `{ key: value }` on instances, sandboxes, templates and
//! volumes, at most [`MAX_LABELS`], keys and values in Kubernetes label syntax. A `list`
//! filter is a set of pairs that must all match.

use std::collections::BTreeMap;

use crate::error::DomainError;

/// A resource's labels, sorted by key.
pub type Labels = BTreeMap<String, String>;

/// Most labels on one resource, and most pairs in one filter.
pub const MAX_LABELS: usize = 32;
/// Longest name part of a key, and longest value.
const MAX_NAME: usize = 63;
/// Longest prefix of a key (a DNS subdomain).
const MAX_PREFIX: usize = 253;

/// Checks `labels` (or a filter of them, `field` `labels`): at most 32, each key
/// `[prefix/]name` and each value in Kubernetes label syntax. A refusal names the key.
pub fn check(field: &str, labels: &Labels) -> Result<(), DomainError> {
    if labels.len() > MAX_LABELS {
        return Err(DomainError::invalid_input(
            field,
            format!("at most {MAX_LABELS} labels ({} given)", labels.len()),
        ));
    }
    for (key, value) in labels {
        let named = || format!("{field}.{}", shown(key));
        if let Err(why) = check_key(key) {
            return Err(DomainError::invalid_input(
                named(),
                format!("label key {:?}: {why}", shown(key)),
            ));
        }
        if !value.is_empty() && !is_name(value) {
            return Err(DomainError::invalid_input(
                named(),
                format!(
                    "the value of label {:?}: at most {MAX_NAME} characters of letters, digits, \
                     '-', '_' and '.', beginning and ending with a letter or digit",
                    shown(key)
                ),
            ));
        }
    }
    Ok(())
}

/// A key as a message may show it: at most 80 characters.
fn shown(key: &str) -> String {
    key.chars().take(80).collect()
}

fn check_key(key: &str) -> Result<(), &'static str> {
    let (prefix, name) = match key.split_once('/') {
        Some((prefix, name)) => (Some(prefix), name),
        None => (None, key),
    };
    if let Some(prefix) = prefix {
        let valid = !prefix.is_empty()
            && prefix.len() <= MAX_PREFIX
            && prefix.split('.').all(|part| {
                !part.is_empty()
                    && part
                        .chars()
                        .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
                    && !part.starts_with('-')
                    && !part.ends_with('-')
            });
        if !valid {
            return Err("the prefix must be a DNS subdomain (lowercase, at most 253 characters)");
        }
    }
    if name.is_empty() || !is_name(name) {
        return Err(
            "the name must be 1 to 63 letters, digits, '-', '_' or '.', beginning and \
                    ending with a letter or digit",
        );
    }
    Ok(())
}

/// 1 to 63 of `[A-Za-z0-9_.-]`, alphanumeric at both ends.
fn is_name(s: &str) -> bool {
    let edge = |c: Option<char>| c.is_some_and(|c| c.is_ascii_alphanumeric());
    s.len() <= MAX_NAME
        && edge(s.chars().next())
        && edge(s.chars().last())
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
}

/// Whether `labels` carry every pair of `filter`.
pub fn matches(labels: &Labels, filter: &Labels) -> bool {
    filter.iter().all(|(k, v)| labels.get(k) == Some(v))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn labels(pairs: &[(&str, &str)]) -> Labels {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn kubernetes_syntax_is_accepted() {
        let ok = labels(&[
            ("team", "ml"),
            ("app.kubernetes.io/name", "web-1"),
            ("empty", ""),
            ("a_b.c-d", "X.y_z-9"),
        ]);
        assert!(check("labels", &ok).is_ok());
    }

    #[test]
    fn a_bad_key_or_value_is_refused_naming_the_key() {
        for (key, value) in [
            ("-team", "ml"),
            ("team-", "ml"),
            ("", "ml"),
            ("Upper.Prefix/x", "ml"),
            ("a/b/c", "ml"),
            ("team", "-ml"),
            ("team", "has space"),
            (&"k".repeat(64), "v"),
            ("team", &"v".repeat(64)),
        ] {
            let err = check("labels", &labels(&[(key, value)])).unwrap_err();
            assert_eq!(
                err.code(),
                crate::error::ErrorCode::InvalidInput,
                "{key:?}={value:?}"
            );
            assert_eq!(
                err.details()["field"],
                format!("labels.{}", shown(key)),
                "{key:?}"
            );
        }
    }

    #[test]
    fn more_than_32_are_refused_and_a_filter_matches_every_pair() {
        let many: Labels = (0..33).map(|i| (format!("k{i}"), "v".into())).collect();
        assert_eq!(
            check("labels", &many).unwrap_err().code(),
            crate::error::ErrorCode::InvalidInput
        );
        let have = labels(&[("team", "ml"), ("env", "prod")]);
        assert!(matches(&have, &labels(&[("team", "ml")])));
        assert!(!matches(&have, &labels(&[("team", "ml"), ("env", "dev")])));
        assert!(matches(&have, &Labels::new()));
    }
}
