//! Policy slicing: which of an action's policies can apply to a request at all. Most operator
//! policies are guarded by a comparison of one attribute with a literal (`principal.tenant ==
//! "globex"`, `resource.vcpu > 8`, `resource.imageId == "img_…"`). A policy's `when`
//! conditions are checked by Cedar only after its scope, and a conjunct that is false (or an
//! error, for a missing attribute) leaves the policy unsatisfied; so when such a conjunct
//! cannot hold for the request's attributes, the policy is left out of the set Cedar evaluates.
//! That changes no decision: a policy that is not satisfied neither permits nor forbids.
//! Everything else (scopes, `unless`, `||`, `has`, comparisons of two attributes) is left to
//! Cedar, which still decides every request on every policy that can apply.

use serde_json::Value;

use super::{Attr, Principal, Resource};

/// One guard: `<var>.<attr> <test>`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Atom {
    on_principal: bool,
    attr: String,
    test: Test,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Test {
    Eq(Attr),
    Lt(i64),
    Le(i64),
    Gt(i64),
    Ge(i64),
}

/// The guards of a policy in Cedar's JSON form: the conjuncts of its `when` conditions that
/// compare an attribute of `principal` or `resource` with a literal.
pub(super) fn atoms(est: &Value) -> Vec<Atom> {
    let mut found = Vec::new();
    for c in est["conditions"].as_array().into_iter().flatten() {
        if c["kind"] == "when" {
            conjuncts(&c["body"], &mut found);
        }
    }
    found
}

fn conjuncts(e: &Value, found: &mut Vec<Atom>) {
    if let Some(and) = e.get("&&") {
        conjuncts(&and["left"], found);
        conjuncts(&and["right"], found);
    } else if let Some(atom) = comparison(e) {
        found.push(atom);
    }
}

/// `attr op literal` or `literal op attr`.
fn comparison(e: &Value) -> Option<Atom> {
    let (op, args) = e.as_object()?.iter().next()?;
    let (left, right) = (args.get("left")?, args.get("right")?);
    let (var, attr, literal, flipped) = match (access(left), literal(right)) {
        (Some((v, a)), Some(l)) => (v, a, l, false),
        _ => {
            let (v, a) = access(right)?;
            (v, a, literal(left)?, true)
        }
    };
    let long = |l: &Attr| match l {
        Attr::Long(n) => Some(*n),
        _ => None,
    };
    // `5 < resource.x` is `resource.x > 5`.
    let test = match (op.as_str(), flipped) {
        ("==", _) => Test::Eq(literal),
        ("<", false) | (">", true) => Test::Lt(long(&literal)?),
        ("<=", false) | (">=", true) => Test::Le(long(&literal)?),
        (">", false) | ("<", true) => Test::Gt(long(&literal)?),
        (">=", false) | ("<=", true) => Test::Ge(long(&literal)?),
        _ => return None,
    };
    Some(Atom {
        on_principal: var,
        attr,
        test,
    })
}

/// `principal.attr` (true) or `resource.attr` (false).
fn access(e: &Value) -> Option<(bool, String)> {
    let dot = e.get(".")?;
    let on_principal = match dot["left"].get("Var")?.as_str()? {
        "principal" => true,
        "resource" => false,
        _ => return None,
    };
    Some((on_principal, dot["attr"].as_str()?.to_string()))
}

fn literal(e: &Value) -> Option<Attr> {
    match e.get("Value")? {
        Value::Bool(b) => Some(Attr::Bool(*b)),
        Value::String(s) => Some(Attr::Text(s.clone())),
        Value::Number(n) => n.as_i64().map(Attr::Long),
        _ => None,
    }
}

impl Atom {
    /// Whether the guard can hold for this request: false when the attribute is missing, of
    /// another type, or compares otherwise.
    pub(super) fn may_hold(&self, principal: &Principal, resource: &Resource) -> bool {
        let value = if self.on_principal {
            principal_attr(principal, &self.attr)
        } else {
            resource_attr(resource, &self.attr)
        };
        let Some(value) = value else { return false };
        match (&self.test, value) {
            (Test::Eq(Attr::Long(want)), Val::Long(v)) => v == *want,
            (Test::Eq(Attr::Bool(want)), Val::Bool(v)) => v == *want,
            (Test::Eq(Attr::Text(want)), Val::Text(v)) => v == want,
            (Test::Lt(n), Val::Long(v)) => v < *n,
            (Test::Le(n), Val::Long(v)) => v <= *n,
            (Test::Gt(n), Val::Long(v)) => v > *n,
            (Test::Ge(n), Val::Long(v)) => v >= *n,
            _ => false,
        }
    }
}

/// An attribute's value, borrowed from the request.
enum Val<'a> {
    Long(i64),
    Bool(bool),
    Text(&'a str),
}

impl<'a> From<&'a Attr> for Val<'a> {
    fn from(a: &'a Attr) -> Self {
        match a {
            Attr::Long(n) => Val::Long(*n),
            Attr::Bool(b) => Val::Bool(*b),
            Attr::Text(s) => Val::Text(s),
        }
    }
}

fn principal_attr<'a>(p: &'a Principal, name: &str) -> Option<Val<'a>> {
    match (p, name) {
        (Principal::Identity { operator, .. }, "operator") => Some(Val::Bool(*operator)),
        (Principal::Identity { tenant, .. }, "tenant") => tenant.as_deref().map(Val::Text),
        _ => None,
    }
}

fn resource_attr<'a>(r: &'a Resource, name: &str) -> Option<Val<'a>> {
    if name == "tenant" {
        return r.tenant.as_deref().map(Val::Text);
    }
    r.attrs
        .iter()
        .find(|(n, _)| *n == name)
        .map(|(_, v)| Val::from(v))
}
