-- Sandbox exec (SPEC §3.7): single-use tunnel tickets, and where each node accepts tunnels.
-- Neither is a projection (replay neither rebuilds nor compares them): a ticket is operational
-- state consumed exactly once by `DELETE … RETURNING`, like a work item's lease, and a node's
-- tunnel endpoint is what its latest report said, like its heartbeat.

CREATE TABLE exec_tickets (
    -- SHA-256 (hex) of the ticket: the ticket itself is never stored.
    ticket_hash  text        PRIMARY KEY,
    node_id      text        NOT NULL,
    instance_id  text        NOT NULL,
    principal    text        NOT NULL,
    -- The certificate's end.
    valid_before timestamptz NOT NULL,
    -- The ticket's own end (60 s after issue).
    expires_at   timestamptz NOT NULL
);
CREATE INDEX exec_tickets_expires_at ON exec_tickets (expires_at);

CREATE TABLE node_tunnels (
    node_id     text        PRIMARY KEY,
    url         text        NOT NULL,
    reported_at timestamptz NOT NULL
);
