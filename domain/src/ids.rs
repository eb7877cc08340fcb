//! Identifiers (SPEC §2) and the values derived from them.
//!
//! Instance and sandbox ids are derived from (tenant, caller identity, idempotency key), so a
//! retried create lands on the same id without any lookup table. Every other id is a prefix plus a
//! lowercase ULID that the caller generates (this crate draws no randomness).

use data_encoding::BASE32_NOPAD;
use sha2::{Digest, Sha256};

/// The known id prefixes, without their `_` separator.
pub mod prefix {
    /// Instances (derived ids).
    pub const INSTANCE: &str = "inst";
    /// Sandboxes (derived ids).
    pub const SANDBOX: &str = "sbx";
    /// Pools.
    pub const POOL: &str = "pool";
    /// Nodes.
    pub const NODE: &str = "node";
    /// Flavors.
    pub const FLAVOR: &str = "flv";
    /// Images.
    pub const IMAGE: &str = "img";
    /// Provider accounts.
    pub const PROVIDER_ACCOUNT: &str = "pacct";
    /// Sandbox templates.
    pub const SANDBOX_TEMPLATE: &str = "sbxt";
    /// Sandbox snapshots.
    pub const SNAPSHOT: &str = "snap";
    /// Sandbox volumes.
    pub const VOLUME: &str = "vol";
    /// Webhooks.
    pub const WEBHOOK: &str = "whk";
    /// Events in the log.
    pub const EVENT: &str = "evt";
    /// Capacity allocations on a node.
    pub const ALLOCATION: &str = "alloc";
}

/// Length of the body of a derived id: 256 bits in base32 is ⌈256 / 5⌉ characters.
pub const DERIVED_ID_LEN: usize = 52;

/// Length of a ULID in its canonical Crockford base32 form.
pub const ULID_LEN: usize = 26;

/// What a derived id is derived from: who asked, for which tenant, with which idempotency
/// key. Named fields, so the three strings cannot be passed in the wrong order.
#[derive(Debug, Clone, Copy)]
pub struct Origin<'a> {
    /// The tenant the resource belongs to.
    pub tenant: &'a str,
    /// Who created it: the caller's identity, or the resource that made it on its behalf (a
    /// sandbox its instance, a template its warm instances).
    pub caller: &'a str,
    /// The create's idempotency key.
    pub key: &'a str,
}

impl Origin<'_> {
    /// `prefix` + `_` + 52 lowercase base32 characters of SHA-256 over the three fields.
    fn derive(self, prefix: &str) -> String {
        derived(prefix, self.tenant, self.caller, self.key)
    }
}

/// The id of the instance created from `origin`: `inst_` + 52 lowercase base32 characters of
/// SHA-256 over its three fields.
pub fn instance_id(origin: Origin<'_>) -> String {
    origin.derive(prefix::INSTANCE)
}

/// The id of the sandbox created from `origin`, derived exactly like [`instance_id`] but with
/// the `sbx_` prefix.
pub fn sandbox_id(origin: Origin<'_>) -> String {
    origin.derive(prefix::SANDBOX)
}

/// The id of the snapshot taken from `origin`, derived like [`sandbox_id`] with the `snap_`
/// prefix (a retry lands on the same snapshot).
pub fn snapshot_id(origin: Origin<'_>) -> String {
    origin.derive(prefix::SNAPSHOT)
}

/// The id of the sandbox volume created from `origin`, derived exactly like [`instance_id`]
/// but with the `vol_` prefix.
pub fn volume_id(origin: Origin<'_>) -> String {
    origin.derive(prefix::VOLUME)
}

/// `prefix` + `_` + the ULID string the caller generated, lowercased (`pool_01j…`).
pub fn prefixed(prefix: &str, ulid: &str) -> String {
    format!("{prefix}_{}", ulid.to_ascii_lowercase())
}

/// Whether `s` is a well-formed id of kind `prefix` (given without its `_`).
///
/// `inst`, `sbx` and `vol` ids must carry a 52-character lowercase base32 body, `snap` ids either
/// form; every other prefix a lowercase ULID (26 Crockford base32 characters whose first one is
/// at most `7`).
pub fn is_valid_id(prefix: &str, s: &str) -> bool {
    let Some(body) = s
        .strip_prefix(prefix)
        .and_then(|rest| rest.strip_prefix('_'))
    else {
        return false;
    };
    let derived = body.len() == DERIVED_ID_LEN
        && body
            .bytes()
            .all(|b| b.is_ascii_lowercase() || (b'2'..=b'7').contains(&b));
    match prefix {
        prefix::INSTANCE | prefix::SANDBOX | prefix::VOLUME => derived,
        // A snapshot's id derives from its key when it was given one.
        prefix::SNAPSHOT => derived || is_lowercase_ulid(body),
        _ => is_lowercase_ulid(body),
    }
}

/// A stable, locally administered unicast MAC address for an instance's NIC (`02:xx:xx:xx:xx:xx`).
///
/// The first octet is fixed at `02` (locally administered bit set, multicast bit clear), the other
/// five come from SHA-256 of the id, so the guest sees the same MAC on every host it lands on.
pub fn mac_for(instance_id: &str) -> String {
    let digest = Sha256::digest(instance_id.as_bytes());
    let mut mac = String::from("02");
    for byte in &digest[..5] {
        mac.push_str(&format!(":{byte:02x}"));
    }
    mac
}

/// The guest hostname for an instance: its id with `_` turned into `-`, since hostnames may not
/// hold underscores (57 characters, under the 63-character label limit).
pub fn hostname_for(instance_id: &str) -> String {
    instance_id.replace('_', "-")
}

/// A string that is not a well-formed id of the kind asked for.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{value:?} is not a {kind} id")]
pub struct BadId {
    /// `instance`, `pool`, …
    pub kind: &'static str,
    /// What was given.
    pub value: String,
}

const NOT_AN_ID: &str = "not an id: ";

impl BadId {
    /// The message a `Deserialize` fails with, which [`not_an_id`] reads back: an id that
    /// is not well formed names nothing, so the edge answers it as not found.
    fn marked(&self) -> String {
        format!("{NOT_AN_ID}{} {}", self.kind, self.value)
    }
}

/// What a message made by a typed id's `Deserialize` names (`instance inst_x`), so the API
/// answers `NOT_FOUND` for it as it does for a well-formed id that names nothing.
pub fn not_an_id(message: &str) -> Option<&str> {
    message.strip_prefix(NOT_AN_ID)
}

/// A typed id: parsed once at the edge ([`FromStr`](std::str::FromStr), `Deserialize`),
/// serialized as the same string as before.
macro_rules! typed_id {
    // An id whose resource has its own stream: `stream()` names it.
    ($(#[$doc:meta])* $name:ident, $kind:literal, $valid:expr, $aggregate:ty) => {
        typed_id!($(#[$doc])* $name, $kind, $valid);

        impl $name {
            /// The name of this resource's event stream (`<category>-<id>`).
            pub fn stream(&self) -> String {
                <$aggregate as crate::aggregate::Aggregate>::stream(&self.0)
            }
        }
    };
    ($(#[$doc:meta])* $name:ident, $kind:literal, $valid:expr) => {
        $(#[$doc])*
        #[derive(
            Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, schemars::JsonSchema,
        )]
        #[serde(transparent)]
        pub struct $name(String);

        impl $name {
            /// What kind of id this is, for messages.
            pub const KIND: &'static str = $kind;

            /// `s` as this id, when it is well formed.
            pub fn parse(s: &str) -> Result<Self, BadId> {
                let valid: fn(&str) -> bool = $valid;
                if valid(s) {
                    Ok($name(s.to_owned()))
                } else {
                    Err(BadId { kind: $kind, value: s.to_owned() })
                }
            }

            /// The id as the string it serializes to.
            pub fn as_str(&self) -> &str {
                &self.0
            }
        }

        impl std::str::FromStr for $name {
            type Err = BadId;

            fn from_str(s: &str) -> Result<Self, Self::Err> {
                $name::parse(s)
            }
        }

        impl<'de> serde::Deserialize<'de> for $name {
            fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                let s = String::deserialize(d)?;
                $name::parse(&s).map_err(|e| serde::de::Error::custom(e.marked()))
            }
        }

        impl std::fmt::Display for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(&self.0)
            }
        }

        // Read as the string it is wherever a `&str` is taken (SQL binds, lookups).
        impl std::ops::Deref for $name {
            type Target = str;

            fn deref(&self) -> &str {
                &self.0
            }
        }

        impl AsRef<str> for $name {
            fn as_ref(&self) -> &str {
                &self.0
            }
        }

        impl From<$name> for String {
            fn from(id: $name) -> String {
                id.0
            }
        }
    };
}

typed_id!(
    /// An instance (`inst_` and a derived body).
    InstanceId, "instance", |s| is_valid_id(prefix::INSTANCE, s), crate::instance::Instance
);
typed_id!(
    /// A sandbox (`sbx_` and a derived body).
    SandboxId, "sandbox", |s| is_valid_id(prefix::SANDBOX, s), crate::sandbox::Sandbox
);
typed_id!(
    /// A node (`node_` and a ULID).
    NodeId, "node", |s| is_valid_id(prefix::NODE, s), crate::node::Node
);
typed_id!(
    /// A pool (`pool_` and a ULID).
    PoolId, "pool", |s| is_valid_id(prefix::POOL, s), crate::pool::Pool
);
typed_id!(
    /// A sandbox snapshot (`snap_` and a derived body or a ULID); its events live in its
    /// sandbox's stream, so it names no stream of its own.
    SnapshotId, "snapshot", |s| is_valid_id(prefix::SNAPSHOT, s)
);
typed_id!(
    /// A sandbox volume (`vol_` and a derived body).
    VolumeId, "volume", |s| is_valid_id(prefix::VOLUME, s), crate::volume::Volume
);
typed_id!(
    /// A sandbox template (`sbxt_` and a ULID).
    TemplateId, "template", |s| is_valid_id(prefix::SANDBOX_TEMPLATE, s), crate::template::Template
);
typed_id!(
    /// A webhook (`whk_` and a ULID).
    WebhookId, "webhook", |s| is_valid_id(prefix::WEBHOOK, s), crate::webhook::Webhook
);
typed_id!(
    /// A tenant: any name of 1 to 128 characters (tenants carry no prefix).
    TenantId, "tenant", |s| !s.is_empty() && s.len() <= 128, crate::tenant::Tenant
);
typed_id!(
    /// An identity: a configured, non-empty name (`id_alice`, `reactor:sandboxes`).
    IdentityId, "identity", |s| !s.is_empty(), crate::identity::Identity
);

fn derived(prefix: &str, tenant_id: &str, caller_identity: &str, idempotency_key: &str) -> String {
    let mut hasher = Sha256::new();
    // Length-prefix every field so ("ab", "c") and ("a", "bc") hash differently.
    for field in [tenant_id, caller_identity, idempotency_key] {
        hasher.update((field.len() as u64).to_be_bytes());
        hasher.update(field.as_bytes());
    }
    let body = BASE32_NOPAD.encode(&hasher.finalize()).to_ascii_lowercase();
    format!("{prefix}_{body}")
}

fn is_lowercase_ulid(body: &str) -> bool {
    const CROCKFORD: &[u8] = b"0123456789abcdefghjkmnpqrstvwxyz";
    body.len() == ULID_LEN
        && body.as_bytes()[0] <= b'7'
        && body.bytes().all(|b| CROCKFORD.contains(&b))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_instance_id_is_inst_and_52_lowercase_base32_characters() {
        let id = instance_id(Origin {
            tenant: "acme",
            caller: "id_alice",
            key: "build-agent-7",
        });
        assert!(id.starts_with("inst_"));
        assert_eq!(id.len(), 5 + DERIVED_ID_LEN);
        assert!(is_valid_id(prefix::INSTANCE, &id), "{id}");
    }

    #[test]
    fn the_same_inputs_always_give_the_same_id() {
        assert_eq!(
            instance_id(Origin {
                tenant: "t",
                caller: "c",
                key: "k"
            }),
            instance_id(Origin {
                tenant: "t",
                caller: "c",
                key: "k"
            })
        );
        assert_ne!(
            instance_id(Origin {
                tenant: "t",
                caller: "c",
                key: "k"
            }),
            instance_id(Origin {
                tenant: "t",
                caller: "c",
                key: "k2"
            })
        );
    }

    #[test]
    fn moving_a_character_between_fields_changes_the_id() {
        assert_ne!(
            instance_id(Origin {
                tenant: "ab",
                caller: "c",
                key: "k"
            }),
            instance_id(Origin {
                tenant: "a",
                caller: "bc",
                key: "k"
            })
        );
        assert_ne!(
            instance_id(Origin {
                tenant: "t",
                caller: "ab",
                key: "c"
            }),
            instance_id(Origin {
                tenant: "t",
                caller: "a",
                key: "bc"
            })
        );
    }

    #[test]
    fn a_sandbox_id_has_the_same_body_under_its_own_prefix() {
        let inst = instance_id(Origin {
            tenant: "t",
            caller: "c",
            key: "k",
        });
        let sbx = sandbox_id(Origin {
            tenant: "t",
            caller: "c",
            key: "k",
        });
        assert_eq!(&inst[5..], &sbx[4..]);
        assert!(is_valid_id(prefix::SANDBOX, &sbx));
        assert!(!is_valid_id(prefix::INSTANCE, &sbx));
    }

    #[test]
    fn prefixed_ids_lowercase_the_ulid() {
        let id = prefixed(prefix::POOL, "01ARZ3NDEKTSV4RRFFQ69G5FAV");
        assert_eq!(id, "pool_01arz3ndektsv4rrffq69g5fav");
        assert!(is_valid_id(prefix::POOL, &id));
    }

    #[test]
    fn malformed_ids_are_refused() {
        assert!(!is_valid_id("pool", "pool_01ARZ3NDEKTSV4RRFFQ69G5FAV"));
        assert!(!is_valid_id("pool", "node_01arz3ndektsv4rrffq69g5fav"));
        assert!(!is_valid_id("pool", "pool_01arz3ndektsv4rrffq69g5fa"));
        assert!(!is_valid_id("pool", "pool_81arz3ndektsv4rrffq69g5fav"));
        assert!(!is_valid_id("pool", "pool_01arz3ndektsv4rrffq69g5fau"));
        assert!(!is_valid_id("inst", "inst_short"));
        assert!(!is_valid_id("inst", "inst01arz3ndektsv4rrffq69g5fav"));
    }

    #[test]
    fn a_typed_id_parses_its_prefix_once_and_serializes_to_the_same_string() {
        let raw = instance_id(Origin {
            tenant: "t",
            caller: "c",
            key: "k",
        });
        let id: InstanceId = raw.parse().unwrap();
        assert_eq!(id.as_str(), raw);
        assert_eq!(serde_json::to_value(&id).unwrap(), serde_json::json!(raw));
        let back: InstanceId = serde_json::from_value(serde_json::json!(raw)).unwrap();
        assert_eq!(back, id);
        assert_eq!(id.stream(), format!("instance-{raw}"));
        let pool = prefixed(prefix::POOL, "01ARZ3NDEKTSV4RRFFQ69G5FAV");
        assert!(pool.parse::<PoolId>().is_ok());
        assert_eq!(
            pool.parse::<NodeId>(),
            Err(BadId {
                kind: "node",
                value: pool.clone()
            })
        );
        assert!(serde_json::from_value::<InstanceId>(serde_json::json!(pool)).is_err());
        assert!(sandbox_id(Origin {
            tenant: "t",
            caller: "c",
            key: "k"
        })
        .parse::<InstanceId>()
        .is_err());
        assert!("acme".parse::<TenantId>().is_ok());
        assert!("".parse::<TenantId>().is_err());
        assert!("x".repeat(129).parse::<TenantId>().is_err());
        assert!("id_alice".parse::<IdentityId>().is_ok());
        assert_eq!("acme".parse::<TenantId>().unwrap().stream(), "tenancy-acme");
    }

    #[test]
    fn a_mac_is_stable_locally_administered_and_unicast() {
        let id = instance_id(Origin {
            tenant: "t",
            caller: "c",
            key: "k",
        });
        let mac = mac_for(&id);
        assert_eq!(mac, mac_for(&id));
        assert_ne!(
            mac,
            mac_for(&instance_id(Origin {
                tenant: "t",
                caller: "c",
                key: "other"
            }))
        );
        assert_eq!(mac.len(), 17);
        let first = u8::from_str_radix(&mac[..2], 16).unwrap();
        assert_eq!(first & 0b10, 0b10, "locally administered");
        assert_eq!(first & 0b01, 0, "unicast");
    }

    #[test]
    fn a_hostname_has_no_underscore() {
        let id = instance_id(Origin {
            tenant: "t",
            caller: "c",
            key: "k",
        });
        let host = hostname_for(&id);
        assert!(host.starts_with("inst-"));
        assert!(host.len() <= 63);
        assert!(!host.contains('_'));
    }

    #[test]
    fn a_malformed_id_fails_to_parse_with_a_message_the_edge_reads_back() {
        let err = serde_json::from_str::<InstanceId>("\"inst_x\"").err();
        let message = err.map(|e| e.to_string()).unwrap_or_default();
        assert_eq!(not_an_id(&message), Some("instance inst_x"), "{message}");
        let ok: Result<InstanceId, _> =
            serde_json::from_str(&format!("\"inst_{}\"", "a".repeat(52)));
        assert_eq!(ok.map(|id| id.len()).ok(), Some(57));
    }
}
