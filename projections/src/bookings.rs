//! What each node's allocations book, summed on the node's row (`nodes.booked_*`) by the same
//! statement that changes `node_allocations`: placement reads one row a node instead of
//! summing every allocation of the pool. Every writer of a node's allocations holds the node's
//! row lock already or takes it here before anything later in its lock order (quota rows), so
//! the sums add no lock a transaction would not take anyway.

/// What a statement on `node_allocations` answers for the sums.
macro_rules! returning {
    () => {
        " RETURNING node_id, vcpu, memory_gib, disk_gib"
    };
}
pub(crate) use returning;

/// Adds the rows of the CTE `booked (node_id, vcpu, memory_gib, disk_gib)` to their nodes.
macro_rules! on_nodes {
    () => {
        "UPDATE nodes n
            SET booked_vcpu = n.booked_vcpu + b.vcpu,
                booked_memory_gib = n.booked_memory_gib + b.memory_gib,
                booked_disk_gib = n.booked_disk_gib + b.disk_gib
           FROM (SELECT node_id, sum(vcpu) AS vcpu, sum(memory_gib) AS memory_gib,
                        sum(disk_gib) AS disk_gib
                   FROM booked GROUP BY node_id) b
          WHERE n.id = b.node_id"
    };
}
pub(crate) use on_nodes;

/// The sums of a batch's CTE `allocations` (an insert ending in [`returning`]), as CTEs to
/// follow it.
macro_rules! new_allocations {
    () => {
        concat!(
            "booked AS (SELECT node_id, vcpu, memory_gib, disk_gib FROM allocations),
             on_nodes AS (",
            $crate::bookings::on_nodes!(),
            ")"
        )
    };
}
pub(crate) use new_allocations;

/// `change` (an insert or delete on `node_allocations` ending in [`returning`]) with its rows
/// added to their nodes' sums, or taken away (`release`).
pub(crate) fn booking(change: &str, release: bool) -> String {
    let sign = if release { "-" } else { "" };
    format!(
        concat!(
            "WITH changed AS ({change}),
             booked AS (SELECT node_id, {sign}vcpu AS vcpu, {sign}memory_gib AS memory_gib,
                               {sign}disk_gib AS disk_gib FROM changed) ",
            on_nodes!()
        ),
        change = change,
        sign = sign
    )
}

/// `update` (an update of the allocation `WHERE {key} = $1`, ending in [`returning`]) with the
/// difference it makes added to its node's sums.
pub(crate) fn rebooking(update: &str, key: &str) -> String {
    format!(
        concat!(
            "WITH before AS (SELECT node_id, vcpu, memory_gib, disk_gib
                               FROM node_allocations WHERE {key} = $1),
             changed AS ({update}),
             booked AS (SELECT node_id, vcpu, memory_gib, disk_gib FROM changed
                        UNION ALL
                        SELECT node_id, -vcpu, -memory_gib, -disk_gib FROM before) ",
            on_nodes!()
        ),
        key = key,
        update = update
    )
}
