-- The append-only event log: the single source of truth. Rows are never updated or deleted.
CREATE TABLE events (
    position       bigserial   NOT NULL,
    transaction_id xid8        NOT NULL DEFAULT pg_current_xact_id(),
    stream         text        NOT NULL,
    version        bigint      NOT NULL CHECK (version > 0),
    id             text        NOT NULL UNIQUE,
    type           text        NOT NULL,
    data           jsonb       NOT NULL,
    metadata       jsonb       NOT NULL DEFAULT '{}',
    recorded_at    timestamptz NOT NULL DEFAULT now(),
    UNIQUE (stream, version),
    -- The one read order every follower agrees on (ARCHITECTURE.md, "Reading in order"). As
    -- the primary key it is the only index besides the two uniqueness rules: every index
    -- costs each append.
    PRIMARY KEY (transaction_id, position)
);

CREATE FUNCTION vps_forbid_change() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION '% is append-only: % is not allowed', TG_TABLE_NAME, TG_OP
        USING ERRCODE = 'object_not_in_prerequisite_state';
END
$$;

CREATE TRIGGER events_append_only BEFORE UPDATE OR DELETE ON events
    FOR EACH ROW EXECUTE FUNCTION vps_forbid_change();
CREATE TRIGGER events_no_truncate BEFORE TRUNCATE ON events
    FOR EACH STATEMENT EXECUTE FUNCTION vps_forbid_change();

-- Durable cursors of named followers.
CREATE TABLE follower_checkpoints (
    name           text        PRIMARY KEY,
    transaction_id xid8        NOT NULL DEFAULT '0',
    position       bigint      NOT NULL DEFAULT 0,
    updated_at     timestamptz NOT NULL DEFAULT now()
);

-- The tamper-evidence chain, written by the single chainer in read order.
CREATE TABLE event_hashes (
    position       bigint      NOT NULL,
    transaction_id xid8        NOT NULL,
    hash           bytea       NOT NULL,
    chained_at     timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (transaction_id, position)
);

CREATE TRIGGER event_hashes_append_only BEFORE UPDATE OR DELETE ON event_hashes
    FOR EACH ROW EXECUTE FUNCTION vps_forbid_change();
CREATE TRIGGER event_hashes_no_truncate BEFORE TRUNCATE ON event_hashes
    FOR EACH STATEMENT EXECUTE FUNCTION vps_forbid_change();
