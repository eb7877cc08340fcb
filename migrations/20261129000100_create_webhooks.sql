-- Webhook subscriptions (SPEC §4.3). `webhooks` is a projection of the `webhook-<id>` streams
-- (webhook.created / webhook.disabled / webhook.deleted): replaying the log rebuilds it.
CREATE TABLE webhooks (
    id                     text        PRIMARY KEY,
    url                    text        NOT NULL,
    types                  text[]      NOT NULL,
    tenant_id              text,
    state                  text        NOT NULL CHECK (state IN ('active', 'disabled', 'deleted')),
    -- Where webhook.created sits in the read order: the subscription receives only events
    -- after it, whenever the fan-out gets to them.
    created_transaction_id xid8        NOT NULL,
    created_position       bigint      NOT NULL,
    created_at             timestamptz NOT NULL,
    updated_at             timestamptz NOT NULL
);
CREATE INDEX webhooks_tenant ON webhooks (tenant_id) WHERE state <> 'deleted';

-- Signing secrets, written by the create command only. They are not in the log (which every
-- auditor reads), so this table is not a projection: a replay keeps it as it is.
CREATE TABLE webhook_secrets (
    webhook_id text        PRIMARY KEY,
    secret     text        NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
);

-- The durable delivery queue: one row per (subscription, event) still to deliver, inserted by
-- the single fan-out follower and removed once delivered or given up. Only a subscription's
-- first row in log order (the event's cursor) is ever attempted, so deliveries keep log order.
CREATE TABLE webhook_outbox (
    id                   bigserial   PRIMARY KEY,
    webhook_id           text        NOT NULL,
    event_id             text        NOT NULL,
    event_transaction_id xid8        NOT NULL,
    event_position       bigint      NOT NULL,
    body            text        NOT NULL,
    attempts        integer     NOT NULL DEFAULT 0,
    next_attempt_at timestamptz NOT NULL DEFAULT now(),
    lease_token     text,
    lease_until     timestamptz,
    enqueued_at     timestamptz NOT NULL DEFAULT now(),
    UNIQUE (webhook_id, event_id)
);
CREATE INDEX webhook_outbox_head
    ON webhook_outbox (webhook_id, event_transaction_id, event_position);

-- Every delivery attempt, kept for `webhooks.deliveries`. `status` is the delivery's state
-- after that attempt: delivered, pending (failed, another attempt is scheduled) or failed
-- (failed, no attempt follows).
CREATE TABLE webhook_deliveries (
    id            bigserial   PRIMARY KEY,
    webhook_id    text        NOT NULL,
    event_id      text        NOT NULL,
    attempt       integer     NOT NULL,
    status        text        NOT NULL CHECK (status IN ('delivered', 'failed', 'pending')),
    response_code integer,
    error         text,
    at            timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX webhook_deliveries_by_webhook ON webhook_deliveries (webhook_id, id DESC);
