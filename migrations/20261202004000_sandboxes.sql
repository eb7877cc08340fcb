-- Sandbox templates and sandboxes: projections of their streams (`template-…`, `sandbox-…`).
CREATE TABLE sandbox_templates (
    id               text PRIMARY KEY,
    tenant_id        text NOT NULL,
    name             text NOT NULL,
    pool_id          text NOT NULL,
    deleted          boolean NOT NULL,
    instance_version bigint NOT NULL,
    doc              jsonb NOT NULL,
    created_at       timestamptz NOT NULL,
    updated_at       timestamptz NOT NULL,
    version          bigint NOT NULL
);
-- A deleted template frees its name.
CREATE UNIQUE INDEX sandbox_templates_live_name ON sandbox_templates (tenant_id, name) WHERE NOT deleted;

CREATE TABLE sandboxes (
    id                text PRIMARY KEY,
    tenant_id         text NOT NULL,
    template_id       text NOT NULL,
    instance_id       text NOT NULL,
    owner_identity_id text NOT NULL,
    state             text NOT NULL,
    expires_at        timestamptz NOT NULL,
    doc               jsonb NOT NULL,
    created_at        timestamptz NOT NULL,
    updated_at        timestamptz NOT NULL,
    version           bigint NOT NULL
);
CREATE INDEX sandboxes_listing ON sandboxes (tenant_id, created_at DESC, id DESC);
CREATE INDEX sandboxes_open_by_expiry ON sandboxes (expires_at) WHERE state IN ('starting', 'ready', 'failed');
-- No instance ever drives two sandboxes.
CREATE UNIQUE INDEX sandboxes_instance ON sandboxes (instance_id);

-- Warm instances, found by template for claims and pool upkeep.
ALTER TABLE instances ADD COLUMN warm_template_id text, ADD COLUMN template_version bigint;
CREATE INDEX instances_warm ON instances (warm_template_id, created_at) WHERE warm_template_id IS NOT NULL;
