//! The pool aggregate (stream `pool-<id>`): created, renamed or given a new policy, given an
//! IPv4 range, offered to tenants with quota maxima.

use std::collections::BTreeMap;
use std::net::Ipv4Addr;

use chrono::{DateTime, Utc};

use crate::aggregate::Aggregate;
use crate::error::DomainError;
use crate::ipam::Ipv4Cidr;
use crate::operator::{
    check_name, check_name_free, IpRangeSet, PoolCreated, PoolOffered, PoolPolicy, PoolUpdated,
    RUNTIMES,
};
use crate::resources::QuotaResource;

crate::event_enum! {
    /// What happens to a pool.
    pub enum PoolEvent {
        /// `pool.created`.
        Created(PoolCreated) = "pool.created",
        /// `pool.updated`.
        Updated(PoolUpdated) = "pool.updated",
        /// `pool.ip_range.set`.
        IpRangeSet(IpRangeSet) = "pool.ip_range.set",
        /// `pool.offered`.
        Offered(PoolOffered) = "pool.offered",
    }
}

/// A pool as its events leave it.
#[derive(Debug, Clone, PartialEq)]
pub struct Pool {
    /// `pool_…`.
    pub id: String,
    /// Unique name.
    pub name: String,
    /// `vps-host` or `provider`.
    pub class: String,
    /// Hosted pools: the runtime.
    pub runtime: Option<String>,
    /// Host-loss policy.
    pub policy: PoolPolicy,
    /// Hosted pools: the IPv4 range, once set.
    pub ip_range: Option<IpRangeSet>,
    /// Events folded.
    pub version: u64,
}

impl Pool {
    /// Whether instances run on registered nodes.
    pub fn is_hosted(&self) -> bool {
        self.class == "vps-host"
    }
}

impl Aggregate for Pool {
    type Event = PoolEvent;
    const CATEGORY: &'static str = "pool";

    fn create(event: &PoolEvent, _at: DateTime<Utc>) -> Option<Self> {
        let PoolEvent::Created(c) = event else {
            return None;
        };
        Some(Pool {
            id: c.pool_id.clone(),
            name: c.name.clone(),
            class: c.class.clone(),
            runtime: c.runtime.clone(),
            policy: c.policy.clone(),
            ip_range: None,
            version: 1,
        })
    }

    fn apply(&mut self, event: &PoolEvent, _at: DateTime<Utc>) {
        match event {
            PoolEvent::Updated(u) => {
                self.name = u.name.clone();
                self.policy = u.policy.clone();
            }
            PoolEvent::IpRangeSet(r) => self.ip_range = Some(r.clone()),
            PoolEvent::Created(_) | PoolEvent::Offered(_) => {}
        }
    }

    fn version(&self) -> u64 {
        self.version
    }

    fn version_mut(&mut self) -> &mut u64 {
        &mut self.version
    }
}

/// What can be asked of a pool, with the facts each needs.
#[derive(Debug, Clone)]
pub enum PoolCommand {
    /// `pools.create`.
    Create {
        /// The new id.
        id: String,
        /// Unique name.
        name: String,
        /// `vps-host` or `provider`.
        class: String,
        /// Hosted pools' runtime (default `libvirt-kvm`).
        runtime: Option<String>,
        /// Provider pools' account.
        provider_account_id: Option<String>,
        /// Host-loss policy.
        policy: PoolPolicy,
        /// Fact: another pool has the name.
        name_taken: bool,
    },
    /// `pools.update`.
    Update {
        /// A new name.
        name: Option<String>,
        /// A new policy.
        policy: Option<PoolPolicy>,
        /// Fact: another pool has the new name.
        name_taken: bool,
    },
    /// `pools.setIpPool`.
    SetIpRange {
        /// IPv4 CIDR.
        cidr: String,
        /// Default: the first host address.
        gateway: Option<String>,
        /// Fact: addresses leased from the current range.
        leased: u64,
    },
    /// `pools.offer`.
    Offer {
        /// The tenant.
        tenant_id: String,
        /// Maxima by resource wire name; a missing one is 0.
        quota: BTreeMap<String, u64>,
    },
}

/// The events `command` produces on `state`, or why it is refused.
pub fn decide(state: Option<&Pool>, command: &PoolCommand) -> Result<Vec<PoolEvent>, DomainError> {
    match (state, command) {
        (None, PoolCommand::Create { .. }) => create(command).map(|e| vec![e]),
        (Some(_), PoolCommand::Create { .. }) => Err(DomainError::invalid_state("the pool exists")),
        (None, _) => Err(DomainError::NotFound {
            what: "pool".into(),
        }),
        (
            Some(pool),
            PoolCommand::Update {
                name,
                policy,
                name_taken,
            },
        ) => {
            let name = name.clone().unwrap_or_else(|| pool.name.clone());
            check_name("name", &name)?;
            check_name_free(*name_taken && name != pool.name, "pool", &name, "")?;
            let policy = policy.clone().unwrap_or_else(|| pool.policy.clone());
            check_policy(&policy)?;
            Ok(vec![PoolEvent::Updated(PoolUpdated {
                pool_id: pool.id.clone(),
                name,
                policy,
            })])
        }
        (
            Some(pool),
            PoolCommand::SetIpRange {
                cidr,
                gateway,
                leased,
            },
        ) => set_ip_range(pool, cidr, gateway.as_deref(), *leased).map(|e| vec![e]),
        (Some(pool), PoolCommand::Offer { tenant_id, quota }) => {
            check_name("tenantId", tenant_id)?;
            check_quota(quota)?;
            Ok(vec![PoolEvent::Offered(PoolOffered {
                pool_id: pool.id.clone(),
                tenant_id: tenant_id.clone(),
                quota: quota.clone(),
            })])
        }
    }
}

fn create(command: &PoolCommand) -> Result<PoolEvent, DomainError> {
    let PoolCommand::Create {
        id,
        name,
        class,
        runtime,
        provider_account_id,
        policy,
        name_taken,
    } = command
    else {
        unreachable!("only creates")
    };
    check_name("name", name)?;
    let runtime = match class.as_str() {
        "vps-host" => {
            let runtime = runtime.clone().unwrap_or_else(|| "libvirt-kvm".into());
            if !RUNTIMES.contains(&runtime.as_str()) {
                let one_of = format!("one of {}", RUNTIMES.join(", "));
                return Err(DomainError::invalid_input("runtime", one_of));
            }
            Some(runtime)
        }
        "provider" if runtime.is_some() => {
            return Err(DomainError::invalid_input(
                "runtime",
                "provider pools have no runtime",
            ))
        }
        "provider" => None,
        _ => {
            return Err(DomainError::invalid_input(
                "class",
                "`vps-host` or `provider`",
            ))
        }
    };
    check_policy(policy)?;
    check_name_free(*name_taken, "pool", name, "")?;
    Ok(PoolEvent::Created(PoolCreated {
        pool_id: id.clone(),
        name: name.clone(),
        class: class.clone(),
        runtime,
        provider_account_id: provider_account_id.clone(),
        policy: policy.clone(),
    }))
}

fn check_policy(policy: &PoolPolicy) -> Result<(), DomainError> {
    if policy.lost_after_seconds == Some(0) {
        return Err(DomainError::invalid_input(
            "policy.lostAfterSeconds",
            "must be positive",
        ));
    }
    Ok(())
}

fn check_quota(quota: &BTreeMap<String, u64>) -> Result<(), DomainError> {
    for (resource, max) in quota {
        let field = format!("quota.{resource}");
        if QuotaResource::parse(resource).is_none() {
            return Err(DomainError::invalid_input(
                field,
                "unknown resource (vcpu, memoryGiB, diskGiB, gpu)",
            ));
        }
        if *max > 1_000_000_000 {
            return Err(DomainError::invalid_input(field, "out of range"));
        }
    }
    Ok(())
}

fn set_ip_range(
    pool: &Pool,
    cidr: &str,
    gateway: Option<&str>,
    leased: u64,
) -> Result<PoolEvent, DomainError> {
    let range =
        Ipv4Cidr::parse(cidr).map_err(|e| DomainError::invalid_input("cidr", e.to_string()))?;
    let gateway = match gateway {
        Some(g) => {
            let addr: Ipv4Addr = g
                .parse()
                .map_err(|_| DomainError::invalid_input("gateway", "not an IPv4 address"))?;
            range
                .check_gateway(addr)
                .map_err(|e| DomainError::invalid_input("gateway", e.to_string()))?;
            addr
        }
        None => range.default_gateway(),
    };
    if !pool.is_hosted() {
        return Err(DomainError::invalid_input(
            "poolId",
            "only hosted pools have an IP range",
        ));
    }
    let same_range = pool.ip_range.as_ref().is_some_and(|r| r.cidr == cidr);
    if leased > 0 && !same_range {
        return Err(DomainError::invalid_state(format!(
            "{leased} addresses are leased from the current range"
        )));
    }
    Ok(PoolEvent::IpRangeSet(IpRangeSet {
        pool_id: pool.id.clone(),
        cidr: cidr.to_string(),
        gateway: gateway.to_string(),
    }))
}
