//! Authorization at the edge (SPEC §9): the Cedar schema built from the registry's actions, the policies
//! in force on this replica, and the decision every call goes through.
//!
//! Every method is decided twice at most, both before anything is written:
//! - by [`crate::registry::Method::call`], generically: the caller, the method's action, and a
//!   resource of the method's type with the tenant the request names;
//! - by the handler, when it knows more: `call.authorize(&resource)` with a resource carrying
//!   the attributes policies test (e.g. `instances.create`'s flavor shape and image).
//!
//! The policy set is rebuilt from the `policies` projection whenever its generation (the
//! highest position it applied) moves: this replica's own changes at once, other replicas'
//! on the log's wake-up (NOTIFY) or, at worst, the next poll.

use std::collections::HashSet;
use std::path::Path;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use serde_json::json;
use sqlx::PgPool;
use vps_domain::authz::{
    ActionDecl, AuthzSchema, Decision, PolicyBook, PolicySource, Principal, Resource,
};
use vps_domain::DomainError;
use vps_events::Notifier;

use crate::error::ApiError;

/// How often a replica looks for policy changes when no wake-up came.
pub const POLL: Duration = Duration::from_millis(500);

/// The policies in force and the tenants that take no new work, as of one generation.
pub struct Snapshot {
    /// The compiled policies.
    pub book: PolicyBook,
    /// Tenants deleted or being deleted.
    pub closed_tenants: HashSet<String>,
    /// The projections' generation this was built from.
    pub generation: i64,
}

/// The schema, the file policies and the current [`Snapshot`].
pub struct Authorizer {
    schema: AuthzSchema,
    files: Vec<PolicySource>,
    current: RwLock<Arc<Snapshot>>,
}

impl Authorizer {
    /// The authorizer of the registry's `actions`, with the policies of `[policies] dir` (each must pass the
    /// schema: a bad file stops the start, naming it).
    pub fn new(actions: &[ActionDecl], dir: Option<&Path>) -> anyhow::Result<Authorizer> {
        let schema =
            AuthzSchema::new(actions).map_err(|e| anyhow::anyhow!("authorization schema: {e}"))?;
        let files = match dir {
            Some(dir) => load_dir(&schema, dir)?,
            None => Vec::new(),
        };
        let (book, _) = PolicyBook::build(&schema, &files);
        Ok(Authorizer {
            schema,
            files,
            current: RwLock::new(Arc::new(Snapshot {
                book,
                closed_tenants: HashSet::new(),
                generation: -1,
            })),
        })
    }

    /// The Cedar schema stored policies must pass.
    pub fn schema(&self) -> &AuthzSchema {
        &self.schema
    }

    /// The policies in force now.
    pub fn snapshot(&self) -> Arc<Snapshot> {
        self.current.read().expect("not poisoned").clone()
    }

    /// Rebuilds the policy set when the projections moved since the last build.
    pub async fn refresh(&self, pool: &PgPool) -> Result<(), sqlx::Error> {
        let generation = vps_projections::policies::generation(pool).await?;
        if generation == self.snapshot().generation {
            return Ok(());
        }
        let stored = vps_projections::policies::list(pool).await?;
        let closed = vps_projections::tenants::deleted(pool).await?;
        let mut sources = self.files.clone();
        sources.extend(stored.into_iter().map(|p| PolicySource {
            id: p.id,
            tenant_id: p.tenant_id,
            text: p.text,
        }));
        let (book, skipped) = PolicyBook::build(&self.schema, &sources);
        for s in skipped {
            tracing::warn!(policy = %s.id, error = %s.message, "stored policy no longer passes the schema; left out");
        }
        tracing::debug!(generation, policies = book.len(), "policies rebuilt");
        *self.current.write().expect("not poisoned") = Arc::new(Snapshot {
            book,
            closed_tenants: closed.into_iter().collect(),
            generation,
        });
        Ok(())
    }

    /// Keeps this replica's policies current: a look on every wake-up of the log (which
    /// other replicas' appends reach through NOTIFY) and every [`POLL`].
    pub async fn follow(
        self: Arc<Self>,
        pool: PgPool,
        notifier: Notifier,
    ) -> Result<(), sqlx::Error> {
        let mut wake = notifier.subscribe();
        loop {
            self.refresh(&pool).await?;
            let _ = tokio::time::timeout(POLL, wake.changed()).await;
            // Coalesce bursts of appends into one look.
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

fn load_dir(schema: &AuthzSchema, dir: &Path) -> anyhow::Result<Vec<PolicySource>> {
    let mut paths: Vec<_> = std::fs::read_dir(dir)
        .map_err(|e| anyhow::anyhow!("policies.dir {}: {e}", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "cedar"))
        .collect();
    paths.sort();
    let mut sources = Vec::new();
    for path in paths {
        let text = std::fs::read_to_string(&path)
            .map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
        let name = path
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or("policy");
        let id = format!("file:{name}");
        schema
            .parse(&id, &text)
            .map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
        sources.push(PolicySource {
            id,
            tenant_id: None,
            text,
        });
    }
    Ok(sources)
}

/// What a call may do: the policies in force when it began, who calls and its method's
/// action. Handlers reach it through [`crate::registry::Call::authorize`].
#[derive(Clone)]
pub struct Guard {
    /// The policies in force.
    pub snapshot: Arc<Snapshot>,
    /// Who calls.
    pub principal: Principal,
    /// The method's action.
    pub action: String,
}

impl Guard {
    /// Decides `action` on `resource`: `ACCESS_DENIED` with `details.policyIds` when refused.
    pub fn decide(&self, action: &str, resource: &Resource) -> Result<(), ApiError> {
        Ok(self.refusal(action, resource)?)
    }

    /// [`Guard::decide`] as a domain refusal, for decisions a command makes on facts it reads
    /// itself (a create's draft in its admission batch).
    pub fn refusal(&self, action: &str, resource: &Resource) -> Result<(), DomainError> {
        let decision = self.snapshot.book.decide(&self.principal, action, resource);
        let outcome = if decision == Decision::Allow {
            "allow"
        } else {
            "deny"
        };
        metrics::counter!("vps_authz_decisions_total", "decision" => outcome).increment(1);
        match decision {
            Decision::Allow => Ok(()),
            Decision::Deny { policy_ids } => Err(DomainError::AccessDenied {
                message: format!(
                    "{action} on {} {} is not allowed",
                    resource.kind, resource.id
                ),
                details: json!({ "action": action, "policyIds": policy_ids }),
            }),
        }
    }

    /// `INVALID_STATE` (`details.reason: tenant-deleted`) when a call would change anything
    /// of a tenant being deleted: every action but reads. Not only creates: a template
    /// written after teardown began would keep a warm pool booting, an update or an exec
    /// would act for a tenant that no longer is. Teardown itself runs as a reactor, not
    /// through this edge.
    pub fn refuse_closed_tenant(&self, resource: &Resource) -> Result<(), ApiError> {
        match &resource.tenant {
            Some(t) if mutates(&self.action) && self.snapshot.closed_tenants.contains(t) => {
                Err(vps_domain::tenant::refuse_new_work(t).into())
            }
            _ => Ok(()),
        }
    }
}

/// Whether an action can change anything: every verb but `read`.
fn mutates(action: &str) -> bool {
    !action.ends_with(":read")
}
