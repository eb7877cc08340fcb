-- Idle pause (issue 40): how lately each ready sandbox with an idle timeout showed life. Not a
-- projection (replay neither rebuilds nor compares it): like `node_heartbeats`, it holds what
-- the latest host reports, exec sessions and preview requests said, rewritten every few seconds;
-- only what it leads to, a pause or an expiry with `reason: idle`, goes to the log. The
-- sandbox reconciler arms a row when a sandbox is ready and drops it when it no longer is.
CREATE TABLE sandbox_activity (
    instance_id     text PRIMARY KEY,
    sandbox_id      text NOT NULL UNIQUE,
    -- The template's idleTimeoutSeconds, and idleCpuPercent as CPU seconds per second.
    idle_timeout    double precision NOT NULL,
    busy_rate       double precision NOT NULL,
    -- The guest's CPU seconds at the last sample, and when it was taken (NULL until a host
    -- reports them: a host that never does never idles a sandbox out).
    cpu_seconds     double precision,
    sampled_at      timestamptz,
    -- The last sign of life: arming, a busy sample, an exec session, a preview request.
    active_at       timestamptz NOT NULL,
    -- The samples showed no busy stretch for idle_timeout since active_at.
    idle            boolean NOT NULL DEFAULT false
);
CREATE INDEX sandbox_activity_idle ON sandbox_activity (active_at) WHERE idle;
