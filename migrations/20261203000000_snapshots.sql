-- Sandbox snapshots: a projection of the snapshot events on their sandbox's stream.
CREATE TABLE sandbox_snapshots (
    id                text PRIMARY KEY,
    sandbox_id        text NOT NULL,
    tenant_id         text NOT NULL,
    owner_identity_id text NOT NULL,
    template_id       text NOT NULL,
    node_id           text NOT NULL,
    instance_id       text NOT NULL,
    state             text NOT NULL,
    include_memory    boolean NOT NULL,
    keep              boolean NOT NULL,
    deleted           boolean NOT NULL,
    purged            boolean NOT NULL,
    doc               jsonb NOT NULL,
    created_at        timestamptz NOT NULL
);
CREATE INDEX sandbox_snapshots_listing ON sandbox_snapshots (tenant_id, created_at DESC, id DESC) WHERE NOT deleted;
CREATE INDEX sandbox_snapshots_of_sandbox ON sandbox_snapshots (sandbox_id);
-- A node's host commands, and the reconciler's timeouts.
CREATE INDEX sandbox_snapshots_pending ON sandbox_snapshots (node_id, created_at) WHERE state = 'pending';
-- The reconciler's purge.
CREATE INDEX sandbox_snapshots_to_purge ON sandbox_snapshots (id) WHERE deleted AND NOT purged;
-- Live restores of a snapshot hold its object.
CREATE INDEX instances_restoring ON instances ((doc->'restoreFrom'->>'snapshotId')) WHERE doc ? 'restoreFrom';
