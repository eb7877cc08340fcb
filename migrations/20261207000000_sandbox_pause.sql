-- Paused sandboxes (SPEC §3.12): the expiry scan also covers `pausing`, `paused` and
-- `resuming` (a paused sandbox's `expires_at` is when its pausedTtlSeconds run out).
DROP INDEX sandboxes_open_by_expiry;
CREATE INDEX sandboxes_open_by_expiry ON sandboxes (expires_at)
    WHERE state IN ('starting', 'ready', 'failed', 'pausing', 'paused', 'resuming');
