-- Tenants read the log (events.list, the SSE stream) filtered to their own events: this index
-- serves that read in the log's read order, so a tenant's read costs its own events, not a scan
-- of everyone's from its cursor.
CREATE INDEX events_by_tenant
    ON events ((metadata->>'tenantId'), transaction_id, position);
