-- Projection tables: written only by the projectors of the `projections` crate, rebuildable
-- from the log (`vps replay --verify`).

CREATE TABLE pools (
    id                  text PRIMARY KEY,
    name                text NOT NULL UNIQUE,
    class               text NOT NULL,
    runtime             text,
    policy              jsonb NOT NULL,
    provider_account_id text,
    ip_cidr             text,
    ip_gateway          text,
    created_at          timestamptz NOT NULL,
    updated_at          timestamptz NOT NULL,
    version             bigint NOT NULL
);

CREATE TABLE quotas (
    pool_id   text   NOT NULL,
    tenant_id text   NOT NULL,
    resource  text   NOT NULL,
    max       bigint NOT NULL DEFAULT 0,
    used      bigint NOT NULL DEFAULT 0,
    offered   boolean NOT NULL DEFAULT false,
    PRIMARY KEY (pool_id, tenant_id, resource)
);

CREATE TABLE nodes (
    id             text PRIMARY KEY,
    pool_id        text NOT NULL,
    name           text NOT NULL,
    state          text NOT NULL,
    capacity       jsonb NOT NULL,
    labels         jsonb NOT NULL,
    runtimes       jsonb NOT NULL,
    cpu_model      text,
    token_hash     text NOT NULL,
    last_report_at timestamptz,
    created_at     timestamptz NOT NULL,
    updated_at     timestamptz NOT NULL,
    version        bigint NOT NULL,
    UNIQUE (pool_id, name)
);

CREATE TABLE node_allocations (
    id          text PRIMARY KEY,
    node_id     text NOT NULL,
    instance_id text NOT NULL UNIQUE,
    vcpu        bigint NOT NULL,
    memory_gib  bigint NOT NULL,
    disk_gib    bigint NOT NULL,
    gpu_model   text,
    gpus        bigint NOT NULL DEFAULT 0
);
CREATE INDEX node_allocations_node ON node_allocations (node_id);

CREATE TABLE flavors (
    id         text PRIMARY KEY,
    pool_id    text NOT NULL,
    name       text NOT NULL,
    shape      jsonb NOT NULL,
    offer_id   text,
    archived   boolean NOT NULL,
    created_at timestamptz NOT NULL,
    version    bigint NOT NULL,
    UNIQUE (pool_id, name)
);

CREATE TABLE images (
    id         text PRIMARY KEY,
    tenant_id  text,
    url        text NOT NULL,
    sha256     text NOT NULL,
    format     text NOT NULL,
    verified   boolean NOT NULL,
    deleted    boolean NOT NULL,
    created_at timestamptz NOT NULL,
    version    bigint NOT NULL
);

CREATE TABLE ip_leases (
    pool_id     text NOT NULL,
    address     text NOT NULL,
    instance_id text NOT NULL UNIQUE,
    PRIMARY KEY (pool_id, address)
);

CREATE TABLE instances (
    id                text PRIMARY KEY,
    tenant_id         text NOT NULL,
    pool_id           text NOT NULL,
    state             text NOT NULL,
    desired_state     text NOT NULL,
    node_id           text,
    owner_identity_id text NOT NULL,
    warm              boolean NOT NULL,
    doc               jsonb NOT NULL,
    created_at        timestamptz NOT NULL,
    updated_at        timestamptz NOT NULL,
    version           bigint NOT NULL
);
CREATE INDEX instances_tenant_listing ON instances (tenant_id, created_at DESC, id DESC);
CREATE INDEX instances_node ON instances (node_id) WHERE node_id IS NOT NULL;

-- Not a projection: sealed user data, written by commands, never in the log.
CREATE TABLE sealed_secrets (
    ref         text PRIMARY KEY,
    instance_id text NOT NULL,
    nonce       bytea NOT NULL,
    ciphertext  bytea NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now()
);
