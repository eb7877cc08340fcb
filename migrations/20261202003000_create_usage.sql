-- Usage metering (SPEC §3.9).

-- A projection: one row per `usage.recorded` event, for `usage.list` and `vps usage export`.
CREATE TABLE usage_records (
    id           text        NOT NULL,
    tenant_id    text        NOT NULL,
    meter        text        NOT NULL,
    resource_id  text        NOT NULL,
    pool_id      text        NOT NULL,
    identity_id  text,
    unit         text        NOT NULL,
    quantity     numeric     NOT NULL,
    window_start timestamptz NOT NULL,
    window_end   timestamptz NOT NULL,
    PRIMARY KEY (tenant_id, window_start, id)
);
-- Operators' reads across tenants.
CREATE INDEX usage_records_by_window ON usage_records (window_start, id);

-- A projection: per tenant, meter and UTC day, the sum of each hour (by window start, hour 0
-- first) and of the day, so a billing pipeline reads totals without scanning records.
CREATE TABLE usage_rollups (
    tenant_id text      NOT NULL,
    meter     text      NOT NULL,
    day       date      NOT NULL,
    hourly    numeric[] NOT NULL,
    daily     numeric   NOT NULL,
    PRIMARY KEY (tenant_id, meter, day)
);

-- Not a projection: the metering reactor's memory, written in the same transaction as its
-- checkpoint and the records it appends. Each metered resource's unsettled segments.
CREATE TABLE usage_meters (
    resource_id text  PRIMARY KEY,
    state       jsonb NOT NULL
);

-- Up to where every window has been recorded, and with which window length.
CREATE TABLE usage_progress (
    name          text        PRIMARY KEY,
    settled_until timestamptz NOT NULL,
    window_micros bigint      NOT NULL
);
