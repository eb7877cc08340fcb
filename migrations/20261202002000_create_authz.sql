-- Authorization (SPEC §9), identities and API keys, tenant teardown (SPEC §3.10).

-- Stored Cedar policies: a projection of the `policy-<id>` streams. Deleted policies stay as
-- tombstones so `max(position)` only grows: replicas compare it to know when to rebuild.
CREATE TABLE policies (
    id         text        PRIMARY KEY,
    tenant_id  text,
    text       text        NOT NULL,
    deleted    boolean     NOT NULL,
    version    bigint      NOT NULL,
    position   bigint      NOT NULL,
    updated_at timestamptz NOT NULL
);

-- Identities created at run time: a projection of the `identity-<id>` streams.
CREATE TABLE identities (
    id         text        PRIMARY KEY,
    tenant_id  text,
    operator   boolean     NOT NULL,
    name       text        NOT NULL,
    keys       integer     NOT NULL,
    created_at timestamptz NOT NULL,
    version    bigint      NOT NULL
);

-- Tenants being torn down: a projection of the `tenant-<id>` streams.
CREATE TABLE tenants (
    id         text        PRIMARY KEY,
    state      text        NOT NULL CHECK (state IN ('deleting', 'deleted')),
    position   bigint      NOT NULL,
    updated_at timestamptz NOT NULL
);

-- API key hashes, written by the identity commands only. Keys are not in the log (which every
-- auditor reads), so this table is not a projection: a replay keeps it as it is. A revoke
-- deletes the rows in the transaction that records `identity.keys.revoked`.
CREATE TABLE api_keys (
    key_id      text        PRIMARY KEY,
    identity_id text        NOT NULL,
    hash        bytea       NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX api_keys_identity ON api_keys (identity_id);

-- Node token hashes leave the log and the `nodes` projection: written by `nodes.register` and
-- `nodes.rotateToken` only, like `api_keys`.
CREATE TABLE node_tokens (
    node_id    text        PRIMARY KEY,
    token_hash text        NOT NULL UNIQUE,
    rotated_at timestamptz NOT NULL DEFAULT now()
);
INSERT INTO node_tokens (node_id, token_hash) SELECT id, token_hash FROM nodes;
ALTER TABLE nodes DROP COLUMN token_hash;
