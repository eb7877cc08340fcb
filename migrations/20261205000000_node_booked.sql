-- What a node's allocations book, summed on the node's row by the projectors that write
-- node_allocations (in the same statement): placement reads one row a node instead of summing
-- every allocation of the pool, which grew with the pool. Every writer of a node's allocations
-- holds (or takes) the node's row lock anyway, so the sums add no lock. GPUs stay summed from
-- their allocations (rare rows, found by the partial index).
ALTER TABLE nodes
    ADD COLUMN booked_vcpu       bigint NOT NULL DEFAULT 0,
    ADD COLUMN booked_memory_gib bigint NOT NULL DEFAULT 0,
    ADD COLUMN booked_disk_gib   bigint NOT NULL DEFAULT 0;

UPDATE nodes n
   SET booked_vcpu = s.vcpu, booked_memory_gib = s.memory_gib, booked_disk_gib = s.disk_gib
  FROM (SELECT node_id, sum(vcpu) AS vcpu, sum(memory_gib) AS memory_gib, sum(disk_gib) AS disk_gib
          FROM node_allocations GROUP BY node_id) s
 WHERE n.id = s.node_id;

CREATE INDEX node_allocations_gpus ON node_allocations (node_id) WHERE gpus > 0;
