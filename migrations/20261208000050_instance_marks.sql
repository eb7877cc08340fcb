-- Which instances changed on which node, and in which transaction: a host's report keeps its
-- node's instance views in memory and reads again only the instances marked by transactions
-- its last read did not see (commands/src/hosts/views.rs), so a report that changes nothing
-- reads no instance row. One row per (node, instance), moved by a trigger on every write of
-- `instances`, whoever writes; a replay's scratch copies (`LIKE … INCLUDING ALL`) carry no
-- trigger, so a rebuild marks nothing.
CREATE TABLE instance_marks (
    node_id        text NOT NULL,
    instance_id    text NOT NULL,
    transaction_id xid8 NOT NULL,
    PRIMARY KEY (node_id, instance_id)
);
CREATE INDEX instance_marks_recent ON instance_marks (node_id, transaction_id);

CREATE FUNCTION vps_mark_instance() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP <> 'DELETE' AND NEW.node_id IS NOT NULL THEN
        INSERT INTO instance_marks VALUES (NEW.node_id, NEW.id, pg_current_xact_id())
            ON CONFLICT (node_id, instance_id)
            DO UPDATE SET transaction_id = excluded.transaction_id;
    END IF;
    IF TG_OP <> 'INSERT' AND OLD.node_id IS NOT NULL
       AND (TG_OP = 'DELETE' OR OLD.node_id IS DISTINCT FROM NEW.node_id) THEN
        INSERT INTO instance_marks VALUES (OLD.node_id, OLD.id, pg_current_xact_id())
            ON CONFLICT (node_id, instance_id)
            DO UPDATE SET transaction_id = excluded.transaction_id;
    END IF;
    RETURN NULL;
END
$$;

CREATE TRIGGER instances_mark AFTER INSERT OR UPDATE OR DELETE ON instances
    FOR EACH ROW EXECUTE FUNCTION vps_mark_instance();
