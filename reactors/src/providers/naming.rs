//! The name a machine carries at the provider.
//!
//! Both Hetzner Cloud and Proxmox VE require machine names to be valid hostnames (RFC 1123:
//! letters, digits and hyphens, at most 63 characters), and instance ids contain `_`. Since
//! idempotency rests on finding a machine by name, the name is a pure function of the key.

/// The provider-side name for an idempotency key: lowercased, every character outside
/// `[a-z0-9-]` replaced by `-`, cut to 63 characters, with no leading or trailing `-`.
/// `inst_abc…` becomes `inst-abc…`.
pub fn machine_name(idempotency_key: &str) -> String {
    let name: String = idempotency_key
        .chars()
        .map(|c| c.to_ascii_lowercase())
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' {
                c
            } else {
                '-'
            }
        })
        .take(63)
        .collect();
    let name = name.trim_matches('-');
    if name.is_empty() {
        // An all-symbol key still needs a valid, stable hostname.
        "vps-machine".to_owned()
    } else {
        name.to_owned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_instance_id_becomes_a_hostname() {
        assert_eq!(machine_name("inst_abcd234"), "inst-abcd234");
    }

    #[test]
    fn a_long_key_is_cut_to_sixty_three_characters() {
        assert_eq!(machine_name(&"a".repeat(100)).len(), 63);
    }

    #[test]
    fn leading_and_trailing_symbols_are_dropped() {
        assert_eq!(machine_name("_Key_"), "key");
    }
}
