//! The authorizer on its own: the baseline, the reference's example policies on `Sandbox` and
//! `Volume` resources (their HTTP tests come with the sandbox methods), validation.

use proptest::prelude::*;

use super::*;
use crate::error::ErrorCode;

fn decl(name: &str, resources: &[&'static str], host: bool) -> ActionDecl {
    ActionDecl {
        name: name.into(),
        resources: resources.iter().copied().collect(),
        host,
    }
}

fn schema() -> AuthzSchema {
    AuthzSchema::new(&[
        decl("compute:instances:create", &["Instance"], false),
        decl("compute:instances:read", &["Instance", "Tenant"], false),
        decl("compute:sandboxes:create", &["Sandbox"], false),
        decl("compute:sandboxes:update", &["Sandbox"], false),
        decl("compute:sandboxes:manage", &["Volume", "Template"], false),
        decl("compute:pools:create", &["Pool"], false),
        decl("compute:nodes:read", &["Node"], true),
        decl(NODE_SECRET_ACTION, &["Node"], true),
    ])
    .expect("schema")
}

fn alice() -> Principal {
    Principal::Identity {
        id: "id_alice".into(),
        tenant: Some("acme".into()),
        operator: false,
    }
}

fn operator() -> Principal {
    Principal::Identity {
        id: "id_operator".into(),
        tenant: None,
        operator: true,
    }
}

fn book(policies: &[(&str, Option<&str>, &str)]) -> PolicyBook {
    let sources: Vec<PolicySource> = policies
        .iter()
        .map(|(id, tenant, text)| PolicySource {
            id: id.to_string(),
            tenant_id: tenant.map(str::to_string),
            text: text.to_string(),
        })
        .collect();
    let (book, skipped) = PolicyBook::build(&schema(), &sources);
    assert!(skipped.is_empty(), "{skipped:?}");
    book
}

fn sandbox(ttl_seconds: i64, gpus: u32) -> Resource {
    Resource::sandbox_draft(
        "sbx_1",
        "acme",
        &SandboxDraft {
            template_id: "sbxt_1".into(),
            ttl_seconds,
            warm: false,
            vcpu: 2,
            memory_gib: 4,
            gpus,
            disk_gib: 20,
            from_snapshot: None,
            labels: Default::default(),
        },
    )
}

const SHORT_SANDBOXES: &str = r#"forbid (principal, action in [Action::"compute:sandboxes:create", Action::"compute:sandboxes:update"], resource)
  when { resource.ttlSeconds > 3600 || resource.gpus > 0 };"#;

#[test]
fn the_baseline_lets_tenants_act_within_their_tenant_and_operators_everywhere() {
    let book = book(&[]);
    let own = Resource::new("Instance", "inst_1", Some("acme".into()));
    let other = Resource::new("Instance", "inst_2", Some("globex".into()));
    let pool = Resource::new("Pool", "new", None);
    assert_eq!(
        book.decide(&alice(), "compute:instances:read", &own),
        Decision::Allow
    );
    assert!(matches!(
        book.decide(&alice(), "compute:instances:read", &other),
        Decision::Deny { .. }
    ));
    assert!(matches!(
        book.decide(&alice(), "compute:pools:create", &pool),
        Decision::Deny { .. }
    ));
    assert_eq!(
        book.decide(&operator(), "compute:pools:create", &pool),
        Decision::Allow
    );
}

#[test]
fn a_node_acts_only_on_itself_and_only_it_reads_its_secrets() {
    let book = book(&[]);
    let node = Principal::Node {
        id: "node_a".into(),
    };
    let own = Resource::new("Node", "node_a", None);
    let other = Resource::new("Node", "node_b", None);
    assert_eq!(
        book.decide(&node, "compute:nodes:read", &own),
        Decision::Allow
    );
    assert_eq!(
        book.decide(&node, NODE_SECRET_ACTION, &own),
        Decision::Allow
    );
    assert!(matches!(
        book.decide(&node, "compute:nodes:read", &other),
        Decision::Deny { .. }
    ));
    let tenants = Resource::new("Tenant", "acme", Some("acme".into()));
    assert!(matches!(
        book.decide(&node, "compute:instances:read", &tenants),
        Decision::Deny { .. }
    ));
    assert_eq!(
        book.decide(&operator(), NODE_SECRET_ACTION, &own),
        Decision::Deny {
            policy_ids: vec!["baseline.node-secrets".into()]
        }
    );
}

#[test]
fn sandboxes_of_at_most_an_hour_without_gpus_are_expressible() {
    let book = book(&[("short-sandboxes", None, SHORT_SANDBOXES)]);
    let refused = Decision::Deny {
        policy_ids: vec!["short-sandboxes".into()],
    };
    for action in ["compute:sandboxes:create", "compute:sandboxes:update"] {
        assert_eq!(
            book.decide(&alice(), action, &sandbox(3600, 0)),
            Decision::Allow
        );
        assert_eq!(book.decide(&alice(), action, &sandbox(3601, 0)), refused);
        assert_eq!(book.decide(&alice(), action, &sandbox(600, 1)), refused);
    }
}

#[test]
fn a_volume_size_cap_is_expressible() {
    let book = book(&[(
        "volume-cap",
        None,
        r#"forbid (principal, action == Action::"compute:sandboxes:manage", resource is Volume) when { resource.sizeGiB > 100 };"#,
    )]);
    let manage = "compute:sandboxes:manage";
    assert_eq!(
        book.decide(&alice(), manage, &Resource::volume("vol_1", "acme", 100)),
        Decision::Allow
    );
    assert_eq!(
        book.decide(&alice(), manage, &Resource::volume("vol_1", "acme", 101)),
        Decision::Deny {
            policy_ids: vec!["volume-cap".into()]
        }
    );
}

#[test]
fn a_tenant_scoped_policy_applies_to_that_tenant_only() {
    let book = book(&[("acme-short", Some("acme"), SHORT_SANDBOXES)]);
    let long = sandbox(7200, 0);
    let mut globex_long = long.clone();
    globex_long.tenant = Some("globex".into());
    let eve = Principal::Identity {
        id: "id_eve".into(),
        tenant: Some("globex".into()),
        operator: false,
    };
    assert!(matches!(
        book.decide(&alice(), "compute:sandboxes:create", &long),
        Decision::Deny { .. }
    ));
    assert_eq!(
        book.decide(&eve, "compute:sandboxes:create", &globex_long),
        Decision::Allow
    );
}

#[test]
fn a_policy_naming_an_unknown_attribute_or_action_is_invalid_input_with_cedars_message() {
    let schema = schema();
    for text in [
        r#"forbid (principal, action == Action::"compute:sandboxes:create", resource) when { resource.colour == "red" };"#,
        r#"forbid (principal, action == Action::"compute:nothing:create", resource);"#,
        "permit (principal, action, resource",
        "",
    ] {
        let err = schema.parse("p", text).unwrap_err();
        assert_eq!(err.code(), ErrorCode::InvalidInput, "{text}");
        assert!(!err.to_string().is_empty());
    }
    assert!(check_policy_id("baseline.x").is_err());
    assert!(check_policy_id("file:x").is_err());
    assert!(check_policy_id("small-vms").is_ok());
}

#[test]
fn several_policies_in_one_text_answer_with_the_stored_id() {
    let book = book(&[(
        "two",
        None,
        r#"forbid (principal, action == Action::"compute:sandboxes:create", resource) when { resource.gpus > 0 };
           forbid (principal, action == Action::"compute:sandboxes:create", resource) when { resource.ttlSeconds > 60 };"#,
    )]);
    assert_eq!(
        book.decide(&alice(), "compute:sandboxes:create", &sandbox(120, 0)),
        Decision::Deny {
            policy_ids: vec!["two".into()]
        }
    );
}

#[test]
fn every_indexed_set_has_a_fast_path_that_agrees_with_the_full_set() {
    let schema = schema();
    let mut policies = Vec::new();
    for (id, text) in schema.baseline() {
        policies.extend(schema.parse(&id, &text).unwrap());
    }
    policies.extend(schema.parse("short", SHORT_SANDBOXES).unwrap());
    let refs: Vec<&cedar_policy::Policy> = policies.iter().collect();
    let fast = combine::fast_set(&refs);
    assert!(fast.is_some());
    let book = book(&[("short", None, SHORT_SANDBOXES)]);
    assert!(book
        .everyone
        .by_action
        .values()
        .all(|c| c.for_request(&alice(), &sandbox(60, 0)).fast.is_some()));
    assert_eq!(
        book.decide(&alice(), "compute:sandboxes:create", &sandbox(60, 0)),
        Decision::Allow
    );
}

/// Cedar's own decision on every policy of the book's sources, without index, slices or fast
/// path: what the book must always answer.
fn plain_cedar(sources: &[String], principal: &Principal, action: &str, r: &Resource) -> Decision {
    let schema = schema();
    let mut set = PolicySet::new();
    for (id, text) in schema.baseline() {
        for p in schema.parse(&id, &text).unwrap() {
            set.add(p).unwrap();
        }
    }
    for (i, text) in sources.iter().enumerate() {
        for p in schema.parse(&format!("p{i}"), text).unwrap() {
            set.add(p).unwrap();
        }
    }
    let (request, entities) = request(principal, action, r).unwrap();
    decision_of(&Authorizer::new().is_authorized(&request, &set, &entities))
}

/// Guards slicing reads (attribute against literal, either side, every operator), next to
/// conditions it leaves to Cedar (`||`, `unless`, `has`, two attributes).
fn guarded_policy() -> impl Strategy<Value = String> {
    let condition = prop_oneof![
        (0i64..12).prop_map(|n| format!("resource.vcpu > {n}")),
        (0i64..12).prop_map(|n| format!("{n} >= resource.gpus")),
        (0i64..12).prop_map(|n| format!("resource.memoryGiB <= {n}")),
        (0i64..12).prop_map(|n| format!("resource.vcpu < {n} || resource.gpus == {n}")),
        prop_oneof![Just("acme"), Just("globex")]
            .prop_map(|t| format!("principal has tenant && principal.tenant == \"{t}\"")),
        prop_oneof![Just("img_a"), Just("img_b")]
            .prop_map(|i| format!("\"{i}\" == resource.imageId")),
        any::<bool>().prop_map(|b| format!("resource.imageVerified == {b}")),
        Just("resource has projectId && resource.projectId == \"p1\"".to_string()),
        Just("resource.vcpu == resource.memoryGiB".to_string()),
    ];
    (
        any::<bool>(),
        any::<bool>(),
        proptest::collection::vec(condition, 1..3),
    )
        .prop_map(|(permit, unless, conditions)| {
            let effect = if permit { "permit" } else { "forbid" };
            let kind = if unless { "unless" } else { "when" };
            format!(
                "{effect} (principal, action == Action::\"compute:instances:create\", resource) \
                 {kind} {{ {} }};",
                conditions.join(" && ")
            )
        })
}

proptest! {
    #[test]
    fn slicing_and_the_fast_path_never_change_a_decision(
        policies in proptest::collection::vec(guarded_policy(), 0..12),
        requests in proptest::collection::vec(
            (0u32..12, 0u32..12, 0u32..3, prop_oneof![Just("img_a"), Just("img_b")], any::<bool>(),
             prop_oneof![Just(None), Just(Some("p1".to_string()))],
             prop_oneof![Just("acme"), Just("globex")], any::<bool>()),
            1..8),
    ) {
        let sources: Vec<(String, Option<&str>, &str)> = policies
            .iter()
            .enumerate()
            .map(|(i, text)| (format!("p{i}"), None, text.as_str()))
            .collect();
        let refs: Vec<(&str, Option<&str>, &str)> =
            sources.iter().map(|(id, t, text)| (id.as_str(), *t, *text)).collect();
        let book = book(&refs);
        for (vcpu, memory_gib, gpus, image, verified, project, tenant, operator) in requests {
            let draft = InstanceDraft {
                vcpu, memory_gib, gpus, disk_gib: 20, image_id: image.into(), image_verified: verified,
                project_id: project, labels: Default::default(),
            };
            let principal = Principal::Identity {
                id: "id_x".into(),
                tenant: (!operator).then(|| tenant.to_string()),
                operator,
            };
            let resource = Resource::instance_draft("inst_1", "acme", &draft);
            let action = "compute:instances:create";
            prop_assert_eq!(
                book.decide(&principal, action, &resource),
                plain_cedar(&policies, &principal, action, &resource)
            );
        }
    }
}

/// The shape attributes every draft carries, with their value in a draft of `shape`.
fn shape_attributes(shape: (u32, u32, u32, u32)) -> [(&'static str, u32); 4] {
    let (vcpu, memory_gib, gpus, disk_gib) = shape;
    [
        ("vcpu", vcpu),
        ("memoryGiB", memory_gib),
        ("gpus", gpus),
        ("diskGiB", disk_gib),
    ]
}

proptest! {
    /// For every method that makes or changes a shape (an instance's create and resize are
    /// decided on `instance_draft`, a sandbox's create and extend on `sandbox_draft`), a forbid
    /// on any shape attribute refuses exactly the shapes it names: none fails open.
    #[test]
    fn a_forbid_on_each_shape_attribute_refuses_every_shape_it_names(
        shape in (0u32..64, 0u32..512, 0u32..8, 0u32..4096),
        attribute in 0usize..4,
        bound in 0u32..4096,
    ) {
        let (name, value) = shape_attributes(shape)[attribute];
        let (vcpu, memory_gib, gpus, disk_gib) = shape;
        let instance = Resource::instance_draft("inst_1", "acme", &InstanceDraft {
            vcpu, memory_gib, gpus, disk_gib, image_id: "img_a".into(), image_verified: true,
            project_id: None, labels: Default::default(),
        });
        let sandbox = Resource::sandbox_draft("sbx_1", "acme", &SandboxDraft {
            template_id: "sbxt_1".into(), ttl_seconds: 60, warm: false,
            vcpu, memory_gib, gpus, disk_gib, from_snapshot: None, labels: Default::default(),
        });
        for (action, resource) in [
            ("compute:instances:create", &instance),
            ("compute:sandboxes:create", &sandbox),
            ("compute:sandboxes:update", &sandbox),
        ] {
            let text = format!(
                "forbid (principal, action == Action::\"{action}\", resource) \
                 when {{ resource.{name} > {bound} }};"
            );
            let book = book(&[("shape", None, &text)]);
            let refused = matches!(book.decide(&alice(), action, resource), Decision::Deny { .. });
            prop_assert_eq!(refused, value > bound, "{} {} > {}", action, name, bound);
        }
    }
}
