-- Sandbox volumes: a projection of their streams (`volume-…`), written only by the projector.
CREATE TABLE sandbox_volumes (
    id                text PRIMARY KEY,
    tenant_id         text NOT NULL,
    pool_id           text NOT NULL,
    name              text NOT NULL,
    node_id           text NOT NULL,
    state             text NOT NULL,
    size_gib          bigint NOT NULL,
    owner_identity_id text NOT NULL,
    doc               jsonb NOT NULL,
    created_at        timestamptz NOT NULL,
    updated_at        timestamptz NOT NULL,
    version           bigint NOT NULL
);
-- A name is unique among a tenant's volumes that are not deleted.
CREATE UNIQUE INDEX sandbox_volumes_live_name ON sandbox_volumes (tenant_id, name) WHERE state <> 'deleted';
CREATE INDEX sandbox_volumes_listing ON sandbox_volumes (tenant_id, created_at, id);
CREATE INDEX sandbox_volumes_deleting ON sandbox_volumes (id) WHERE state = 'deleting';

-- A volume's disk is booked on its node like an instance's shape: one allocation per owner.
ALTER TABLE node_allocations ALTER COLUMN instance_id DROP NOT NULL,
    ADD COLUMN volume_id text UNIQUE,
    ADD CONSTRAINT node_allocations_one_owner CHECK ((instance_id IS NULL) <> (volume_id IS NULL));

-- Live attachments, found by volume in the instances' documents (only sandbox instances with
-- volumes have the key), and templates naming a volume.
CREATE INDEX instances_volumes ON instances USING gin ((doc->'volumes') jsonb_path_ops)
    WHERE doc ? 'volumes';
CREATE INDEX sandbox_templates_volumes ON sandbox_templates USING gin ((doc->'volumes') jsonb_path_ops)
    WHERE doc ? 'volumes';

-- NodeSpecs list each node's volumes (kept by the NodeSpec follower, like node_spec_entries).
CREATE TABLE node_spec_volumes (
    node_id   text  NOT NULL,
    volume_id text  NOT NULL,
    entry     jsonb NOT NULL,
    PRIMARY KEY (node_id, volume_id)
);
CREATE INDEX node_spec_volumes_volume ON node_spec_volumes (volume_id);

-- The NodeSpec generation each host last reported applied (operational, like the heartbeat):
-- a deleting volume's disk is released once its host applied a spec without it.
ALTER TABLE node_heartbeats ADD COLUMN applied_generation bigint;
