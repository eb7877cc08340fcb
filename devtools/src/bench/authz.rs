//! `vps bench authz`: Cedar decisions per second on one core, against the baseline policies
//! alone in the same run, with 100 policies:
//! - on the action decided, guarded as operators write them (shape caps, image and tenant
//!   rules): the per-action index keeps them all, slicing leaves out those whose guards
//!   cannot hold for the request;
//! - on the action decided, none of which slicing can leave out (`unless` conditions): Cedar
//!   evaluates every one, the worst case;
//! - spread over every action.

use std::time::{Duration, Instant};

use serde_json::json;
use vps_domain::authz::{InstanceDraft, PolicyBook, PolicySource, Principal, Resource};

use super::round;
use vps_api::authz::Authorizer;
use vps_api::registry::actions;

/// Options of the benchmark.
#[derive(Debug, Clone)]
pub struct AuthzBench {
    /// Seconds per phase.
    pub seconds: f64,
    /// Policies added to the baseline.
    pub policies: usize,
}

/// Runs the three phases on this thread and prints the figures, then the JSON line.
pub fn run(options: &AuthzBench) -> anyhow::Result<()> {
    let authz = Authorizer::new(&actions(vps_api::methods::registry().methods()), None)?;
    let schema = authz.schema();
    let action = "compute:instances:create";
    let all_actions: Vec<String> = actions(vps_api::methods::registry().methods())
        .into_iter()
        .map(|a| a.name)
        .collect();
    let focused = sources(options.policies, |_| action.to_string());
    let spread = sources(options.policies, |i| {
        all_actions[i % all_actions.len()].clone()
    });
    let (baseline, _) = PolicyBook::build(schema, &[]);
    let (focused, skipped) = PolicyBook::build(schema, &focused);
    anyhow::ensure!(
        skipped.is_empty(),
        "bench policies fail the schema: {skipped:?}"
    );
    let (spread, _) = PolicyBook::build(schema, &spread);
    let (unsliced, _) = PolicyBook::build(schema, &unsliceable(options.policies, action));
    let phase = Duration::from_secs_f64(options.seconds);
    let base_rate = decisions_per_second(&baseline, action, phase);
    let focused_rate = decisions_per_second(&focused, action, phase);
    let spread_rate = decisions_per_second(&spread, action, phase);
    let unsliced_rate = decisions_per_second(&unsliced, action, phase);
    println!(
        "baseline only ({} policies): {base_rate:.0} decisions/s",
        baseline.len()
    );
    println!(
        "{} policies on {action}: {focused_rate:.0} decisions/s ({:.2} of baseline)",
        options.policies,
        focused_rate / base_rate
    );
    println!(
        "{} policies on {action} that slicing cannot leave out: {unsliced_rate:.0} decisions/s ({:.2} of baseline)",
        options.policies,
        unsliced_rate / base_rate
    );
    println!(
        "{} policies over {} actions: {spread_rate:.0} decisions/s ({:.2} of baseline)",
        options.policies,
        all_actions.len(),
        spread_rate / base_rate
    );
    println!(
        "{}",
        json!({
            "policies": options.policies,
            "decisions_per_s": round(focused_rate, 0),
            "spread_decisions_per_s": round(spread_rate, 0),
            "unsliced_decisions_per_s": round(unsliced_rate, 0),
            "baseline_decisions_per_s": round(base_rate, 0),
            "ratio": round(focused_rate / base_rate, 3),
            "target_per_s": 50_000,
        })
    );
    Ok(())
}

/// `n` policies like an operator's: shape caps, tenant rules, image rules.
fn sources(n: usize, action_of: impl Fn(usize) -> String) -> Vec<PolicySource> {
    (0..n)
        .map(|i| {
            let action = action_of(i);
            let condition = match (action.as_str(), i % 3) {
                ("compute:instances:create", 0) => format!("resource.vcpu > {} && resource.gpus > 0", 64 + i),
                ("compute:instances:create", 1) => {
                    format!("!resource.imageVerified && resource.imageId == \"img_{i}\"")
                }
                _ => format!("principal has tenant && principal.tenant == \"tenant-{i}\""),
            };
            PolicySource {
                id: format!("bench-{i}"),
                tenant_id: None,
                text: format!(
                    "forbid (principal, action == Action::\"{action}\", resource) when {{ {condition} }};"
                ),
            }
        })
        .collect()
}

/// `n` policies on `action` whose conditions are `unless`, so every one is evaluated.
fn unsliceable(n: usize, action: &str) -> Vec<PolicySource> {
    (0..n)
        .map(|i| PolicySource {
            id: format!("unsliced-{i}"),
            tenant_id: None,
            text: format!(
                "forbid (principal, action == Action::\"{action}\", resource) \
                 unless {{ resource.vcpu <= {} || resource.gpus == 0 }};",
                64 + i
            ),
        })
        .collect()
}

fn decisions_per_second(book: &PolicyBook, action: &str, phase: Duration) -> f64 {
    let principal = Principal::Identity {
        id: "id_alice".into(),
        tenant: Some("acme".into()),
        operator: false,
    };
    let draft = InstanceDraft {
        vcpu: 4,
        memory_gib: 8,
        gpus: 0,
        disk_gib: 20,
        image_id: "img_ubuntu".into(),
        image_verified: true,
        project_id: None,
        labels: Default::default(),
    };
    let resource = Resource::instance_draft("inst_bench", "acme", &draft);
    let started = Instant::now();
    let mut n = 0u64;
    while started.elapsed() < phase {
        for _ in 0..256 {
            let decision = book.decide(&principal, action, &resource);
            debug_assert_eq!(decision, vps_domain::authz::Decision::Allow);
            std::hint::black_box(decision);
        }
        n += 256;
    }
    n as f64 / started.elapsed().as_secs_f64()
}
