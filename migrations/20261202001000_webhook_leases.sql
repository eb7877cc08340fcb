-- One lease per webhook subscription: the fence that keeps a subscription's deliveries on one
-- worker at a time. A worker renews its lease before any POST that could outlast it and records
-- outcomes only while the row still carries its token, so a lease that runs out mid-run cannot
-- let a second worker deliver the same subscription alongside it. Not a projection: delivery
-- bookkeeping, like `webhook_outbox` (whose per-row lease columns are no longer used).
CREATE TABLE webhook_leases (
    webhook_id  text        PRIMARY KEY,
    token       text        NOT NULL,
    lease_until timestamptz NOT NULL
);
