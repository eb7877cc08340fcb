-- Every free address of each hosted pool's range, so concurrent creates in one pool each claim
-- a different one with FOR UPDATE SKIP LOCKED instead of queueing behind one lock (SPEC §3.1:
-- any free address may be leased). A projection: written only by the pool and instance
-- projectors, rebuilt by replay.
CREATE TABLE ip_free (
    pool_id text NOT NULL,
    address text NOT NULL,
    PRIMARY KEY (pool_id, address)
);

INSERT INTO ip_free (pool_id, address)
SELECT p.id, host(network(inet(p.ip_cidr)) + g)
  FROM pools p,
       generate_series(1, (2::bigint ^ (32 - masklen(inet(p.ip_cidr))))::bigint - 2) AS g
 WHERE p.ip_cidr IS NOT NULL
   AND host(network(inet(p.ip_cidr)) + g) <> p.ip_gateway
   AND NOT EXISTS (SELECT 1 FROM ip_leases l
                    WHERE l.pool_id = p.id AND l.address = host(network(inet(p.ip_cidr)) + g));
