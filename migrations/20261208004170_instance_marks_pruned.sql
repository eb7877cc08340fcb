-- Marks of instances no longer live on their node (deleted, or moved off it) are pruned once
-- every copy of a node's views that could still need them has been read whole again
-- (commands/src/report_views.rs reads a copy whole when it is older than its limit;
-- projections/src/instances/reads.rs `prune_marks`): `marked_at` is when a mark last moved.
ALTER TABLE instance_marks ADD COLUMN marked_at timestamptz NOT NULL DEFAULT now();

CREATE OR REPLACE FUNCTION vps_mark_instance() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP <> 'DELETE' AND NEW.node_id IS NOT NULL THEN
        INSERT INTO instance_marks VALUES (NEW.node_id, NEW.id, pg_current_xact_id(), now())
            ON CONFLICT (node_id, instance_id)
            DO UPDATE SET transaction_id = excluded.transaction_id,
                          marked_at = excluded.marked_at;
    END IF;
    IF TG_OP <> 'INSERT' AND OLD.node_id IS NOT NULL
       AND (TG_OP = 'DELETE' OR OLD.node_id IS DISTINCT FROM NEW.node_id) THEN
        INSERT INTO instance_marks VALUES (OLD.node_id, OLD.id, pg_current_xact_id(), now())
            ON CONFLICT (node_id, instance_id)
            DO UPDATE SET transaction_id = excluded.transaction_id,
                          marked_at = excluded.marked_at;
    END IF;
    RETURN NULL;
END
$$;
