//! Stored Cedar policies: `policies.put` and `policies.delete`. The text is validated against
//! the schema in the pure decision; the `policies` projection moves in the same transaction.

use vps_domain::authz::AuthzSchema;
use vps_domain::policy::{decide, PolicyCommand, PolicyPut, StoredPolicy};

use crate::context::Ctx;
use crate::error::CommandError;
use crate::pipeline::{change_existing, transaction};

/// Creates or replaces a policy; answers it as stored.
pub async fn put(
    ctx: &Ctx,
    schema: &AuthzSchema,
    put: PolicyPut,
) -> Result<StoredPolicy, CommandError> {
    let id = put.id.clone();
    run(ctx, &id, PolicyCommand::Put(put), schema).await
}

/// Deletes a policy; answers it as it stands after the deletion.
pub async fn delete(
    ctx: &Ctx,
    schema: &AuthzSchema,
    id: &str,
) -> Result<StoredPolicy, CommandError> {
    run(ctx, id, PolicyCommand::Delete, schema).await
}

async fn run(
    ctx: &Ctx,
    id: &str,
    command: PolicyCommand,
    schema: &AuthzSchema,
) -> Result<StoredPolicy, CommandError> {
    transaction(ctx, id, async |tx| {
        change_existing::<StoredPolicy>(ctx, tx, id, None, |p| decide(p, command.clone(), schema))
            .await
    })
    .await
}
