//! Event type patterns as subscribers write them: `instance.created` (exact), `instance.*`
//! (every type under `instance.`), `*` (everything).

/// Whether `event_type` matches `pattern`.
pub fn matches(pattern: &str, event_type: &str) -> bool {
    match pattern.strip_suffix('*') {
        Some(prefix) => event_type.starts_with(prefix),
        None => pattern == event_type,
    }
}

/// Checks a pattern's form: dot-separated lowercase words, optionally ending in `*`.
pub fn validate(pattern: &str) -> Result<(), String> {
    let body = pattern.strip_suffix('*').unwrap_or(pattern);
    let ok = pattern == "*"
        || (!body.is_empty()
            && body.chars().all(|c| {
                c.is_ascii_lowercase() || c.is_ascii_digit() || c == '.' || c == '_' || c == '-'
            })
            && !body.starts_with('.')
            && (pattern.ends_with(".*") || !pattern.contains('*')));
    if ok {
        Ok(())
    } else {
        Err(format!(
            "`{pattern}` is not an event type pattern (e.g. `instance.created`, `instance.*`, `*`)"
        ))
    }
}

/// The SQL `LIKE` form of a pattern.
pub fn to_like(pattern: &str) -> String {
    let escaped = pattern
        .replace('\\', "\\\\")
        .replace('%', "\\%")
        .replace('_', "\\_");
    match escaped.strip_suffix('*') {
        Some(prefix) => format!("{prefix}%"),
        None => escaped,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_wildcard_pattern_matches_every_type_under_its_prefix() {
        assert!(matches("instance.*", "instance.created"));
        assert!(matches("*", "usage.recorded"));
        assert!(!matches("instance.*", "sandbox.created"));
        assert!(matches("instance.created", "instance.created"));
        assert!(!matches("instance.created", "instance.created.more"));
    }

    #[test]
    fn malformed_patterns_are_refused() {
        for bad in ["", "Instance.*", "inst*ance", ".x", "a b"] {
            assert!(validate(bad).is_err(), "{bad}");
        }
        for good in ["*", "instance.*", "sandbox.snapshot.ready"] {
            assert!(validate(good).is_ok(), "{good}");
        }
        assert_eq!(to_like("instance.*"), "instance.%");
        assert_eq!(to_like("a_b"), "a\\_b");
    }
}
