-- The host seam: per-node specs (a projection), node orphan sets (a projection), heartbeats
-- and the reconcilers' work queue (operational state, not projections).

CREATE TABLE node_specs (
    node_id    text PRIMARY KEY,
    generation bigint NOT NULL,
    spec       jsonb NOT NULL
);

ALTER TABLE nodes ADD COLUMN orphans jsonb NOT NULL DEFAULT '[]';
ALTER TABLE nodes DROP COLUMN last_report_at;

CREATE TABLE node_heartbeats (
    node_id        text PRIMARY KEY,
    last_report_at timestamptz NOT NULL
);

CREATE TABLE work_items (
    kind        text        NOT NULL,
    key         text        NOT NULL,
    due_at      timestamptz NOT NULL,
    wakes       bigint      NOT NULL DEFAULT 0,
    attempts    integer     NOT NULL DEFAULT 0,
    last_error  text,
    lease_until timestamptz,
    PRIMARY KEY (kind, key)
);
CREATE INDEX work_items_due ON work_items (kind, due_at);
