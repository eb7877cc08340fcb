//! The fast path of a decision. Cedar evaluates policies one by one, rebuilding each one's
//! condition per request; with a hundred policies on one action that dominates. So each
//! indexed policy set is also compiled into two Cedar policies, "some permit holds" and "some
//! forbid holds", each the disjunction of its policies' scopes and conditions (in Cedar's JSON
//! form). Cedar evaluates those two; when they allow without any error, the full set would
//! allow too (every forbid evaluated to false, one permit to true). Any other outcome (a
//! refusal, or an error that the one-by-one evaluation would skip) is decided again on the
//! full set, which also names the refusing policies.

use cedar_policy::{Policy, PolicyId, PolicySet};
use serde_json::{json, Value};

/// The two-policy set equivalent to `policies` when it allows without error, or `None` when
/// a policy cannot be expressed so (a template slot: none are stored).
pub fn fast_set(policies: &[&Policy]) -> Option<PolicySet> {
    let mut permits = Vec::new();
    let mut forbids = Vec::new();
    for p in policies {
        let est = p.to_json().ok()?;
        let holds = holds(&est)?;
        match est["effect"].as_str()? {
            "permit" => permits.push(holds),
            "forbid" => forbids.push(holds),
            _ => return None,
        }
    }
    let mut set = PolicySet::new();
    for (effect, list) in [("permit", permits), ("forbid", forbids)] {
        if list.is_empty() {
            continue;
        }
        let policy = json!({
            "effect": effect,
            "principal": { "op": "All" },
            "action": { "op": "All" },
            "resource": { "op": "All" },
            "conditions": [{ "kind": "when", "body": balanced("||", &list) }],
        });
        let id = PolicyId::new(format!("combined.{effect}"));
        set.add(Policy::from_json(Some(id), policy).ok()?).ok()?;
    }
    Some(set)
}

/// The expression that holds exactly when the policy (in Cedar's JSON form) is satisfied: its
/// scope, then its conditions, in the order Cedar evaluates them.
fn holds(est: &Value) -> Option<Value> {
    let mut parts = vec![
        scope("principal", &est["principal"])?,
        scope("action", &est["action"])?,
        scope("resource", &est["resource"])?,
    ];
    for c in est["conditions"].as_array()? {
        let body = c["body"].clone();
        parts.push(match c["kind"].as_str()? {
            "when" => body,
            "unless" => json!({ "!": { "arg": body } }),
            _ => return None,
        });
    }
    // Left to right, as Cedar's own `&&` of scope and conditions short-circuits.
    parts
        .into_iter()
        .reduce(|left, right| json!({ "&&": { "left": left, "right": right } }))
}

fn scope(var: &str, constraint: &Value) -> Option<Value> {
    let left = json!({ "Var": var });
    let entity = |e: &Value| json!({ "Value": { "__entity": e } });
    Some(match constraint["op"].as_str()? {
        "All" => json!({ "Value": true }),
        "==" => json!({ "==": { "left": left, "right": entity(constraint.get("entity")?) } }),
        "in" => match (constraint.get("entity"), constraint.get("entities")) {
            (Some(e), _) => json!({ "in": { "left": left, "right": entity(e) } }),
            (None, Some(list)) => {
                let set: Vec<Value> = list.as_array()?.iter().map(entity).collect();
                json!({ "in": { "left": left, "right": { "Set": set } } })
            }
            _ => return None,
        },
        "is" => {
            let mut is = json!({ "left": left, "entity_type": constraint.get("entity_type")? });
            if let Some(within) = constraint.get("in") {
                is["in"] = entity(within.get("entity")?);
            }
            json!({ "is": is })
        }
        _ => return None,
    })
}

/// `op` over `items` as a balanced tree (shallow, whatever the count).
fn balanced(op: &str, items: &[Value]) -> Value {
    match items {
        [one] => one.clone(),
        _ => {
            let (left, right) = items.split_at(items.len() / 2);
            json!({ op: { "left": balanced(op, left), "right": balanced(op, right) } })
        }
    }
}
