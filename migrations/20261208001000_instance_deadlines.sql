-- The deadline sweep (issue 40) reads instances in transitional states: a partial index keeps
-- it off the settled majority.
CREATE INDEX instances_transitional ON instances (state)
    WHERE state IN ('provisioning', 'starting', 'resizing', 'deleting')
       OR desired_state = 'stopped';
