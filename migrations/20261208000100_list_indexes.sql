-- `instances.list` and `sandboxes.list` with a filter walk an index in the page's order
-- (newest first) that holds only the rows the filter selects: a rare state, a small template
-- or one identity's sandboxes among 100,000 rows is then a few index entries, not a walk of
-- the tenant's whole listing (`vps bench list`).
CREATE INDEX instances_state_listing ON instances (tenant_id, state, created_at DESC, id DESC);
CREATE INDEX sandboxes_owner_listing
    ON sandboxes (tenant_id, owner_identity_id, created_at DESC, id DESC);
CREATE INDEX sandboxes_template_listing ON sandboxes (template_id, created_at DESC, id DESC);
