//! Redis key layout. The keys of one tenant share the `{tenant}` hash tag and
//! the keys of one route share `{route:<kind>}`. Tenants are validated to
//! `[A-Za-z0-9._:-]`, so a tenant can never close a tag or reach another
//! tenant's keys.
//!
//! On a Redis Cluster an installation's tenants and routes thus spread over
//! the masters. Every script call names the keys of one slot: a tenant's
//! (`permit.lua`, `complete.lua`, `change.lua` for a tenant), or a route's
//! (`route.lua`, `change.lua` for a route). A job on a route with a quota
//! takes its permit in a call to each ([`Keys::no_route`] stands in for the
//! route's keys in the tenant's call). The installation's own keys (the
//! default quota, the indexes, the audit stream, locks) are each read or
//! written alone.

use tollgate_core::{IdempotencyKey, JobId, Kind, TenantId};

#[derive(Clone, Debug)]
pub struct Keys {
    prefix: String,
    /// What the installation's own keys start with: the prefix, or on a
    /// cluster the prefix and its hash tag, so that they share a slot.
    installation: String,
}

impl Keys {
    /// The layout on one Redis.
    pub fn new(prefix: impl Into<String>) -> Self {
        let prefix = prefix.into();
        Self {
            installation: prefix.clone(),
            prefix,
        }
    }

    /// The layout on a Redis Cluster: as on one Redis, but the
    /// installation's own keys carry the `{prefix}` tag
    /// (`tollgate:{tollgate}:audit`), so a change and its audit entry and
    /// listing, or a completion's marks, are written in one call.
    pub fn on_cluster(prefix: impl Into<String>) -> Self {
        let prefix = prefix.into();
        Self {
            installation: format!("{prefix}:{{{prefix}}}"),
            prefix,
        }
    }

    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    fn tenant_key(&self, what: &str, tenant: &TenantId) -> String {
        format!("{}:{what}:{{{tenant}}}", self.prefix)
    }

    fn route_key(&self, what: &str, route: &Kind) -> String {
        format!("{}:{what}:{{route:{route}}}", self.prefix)
    }

    /// Hash: `count`, `period_ms`, `burst`, `concurrency`, `paused`,
    /// `shadow_count`, `shadow_period_ms`, `shadow_burst`, `weight`,
    /// `adaptive` with its `min_count`, `min_period_ms`, `decrease`,
    /// `increase`, `probe_ms`, and who/when of the last change.
    pub fn quota(&self, tenant: &TenantId) -> String {
        self.tenant_key("quota", tenant)
    }

    /// The GCRA theoretical arrival time, in microseconds of Redis time.
    pub fn tat(&self, tenant: &TenantId) -> String {
        self.tenant_key("tat", tenant)
    }

    /// The tenant's virtual queue of denied jobs: a string, its next free
    /// virtual slot and their spacing. (Named `line`, not the hash
    /// `waiting` it was before, so pods of both kinds can run side by side
    /// during an upgrade.)
    pub fn waiting(&self, tenant: &TenantId) -> String {
        self.tenant_key("line", tenant)
    }

    /// The tenant's line of denied high-priority jobs, served before
    /// [`Keys::waiting`].
    pub fn waiting_high(&self, tenant: &TenantId) -> String {
        self.tenant_key("line-high", tenant)
    }

    /// The tenant's line of denied low-priority jobs, served after
    /// [`Keys::waiting`].
    pub fn waiting_low(&self, tenant: &TenantId) -> String {
        self.tenant_key("line-low", tenant)
    }

    /// Set after a provider 429: no send before this instant.
    pub fn penalty(&self, tenant: &TenantId) -> String {
        self.tenant_key("penalty", tenant)
    }

    /// Sorted set of the tenant's in-flight calls (lease token → expiry).
    pub fn in_flight(&self, tenant: &TenantId) -> String {
        self.tenant_key("inflight", tenant)
    }

    /// Hash: what the tenant's adaptive quota learned (the effective rate
    /// and the state that moves it; see `adapt.lua`).
    pub fn adapt(&self, tenant: &TenantId) -> String {
        self.tenant_key("adapt", tenant)
    }

    /// What the tenant's sends came to, fleet-wide, in 10 s buckets over
    /// the last 5 minutes (`outcomes.lua`, from the pods' tallies), for the
    /// console.
    pub fn stats(&self, tenant: &TenantId) -> String {
        self.tenant_key("stats", tenant)
    }

    /// Hash of the tenant's parked copies by reason and when they come back
    /// (`parked.lua`), for the console.
    pub fn parked(&self, tenant: &TenantId) -> String {
        self.tenant_key("parked", tenant)
    }

    pub fn shadow_tat(&self, tenant: &TenantId) -> String {
        self.tenant_key("shadow-tat", tenant)
    }

    /// Present once the key was sent; holds the job id.
    pub fn sent(&self, tenant: &TenantId, key: &IdempotencyKey) -> String {
        format!("{}:{key}", self.tenant_key("sent", tenant))
    }

    /// The in-flight lease of one idempotency key.
    pub fn lease(&self, tenant: &TenantId, key: &IdempotencyKey) -> String {
        format!("{}:{key}", self.tenant_key("lease", tenant))
    }

    pub fn cancelled_id(&self, tenant: &TenantId, id: &JobId) -> String {
        format!("{}:id:{id}", self.tenant_key("cancel", tenant))
    }

    pub fn cancelled_key(&self, tenant: &TenantId, key: &IdempotencyKey) -> String {
        format!("{}:key:{key}", self.tenant_key("cancel", tenant))
    }

    pub fn route_quota(&self, route: &Kind) -> String {
        self.route_key("quota", route)
    }

    pub fn route_tat(&self, route: &Kind) -> String {
        self.route_key("tat", route)
    }

    /// A tenant's line on the route: its share of the route's capacity
    /// (in the route's slot): a string, its next free place in the route's
    /// virtual time.
    pub fn route_share(&self, route: &Kind, tenant: &TenantId) -> String {
        format!("{}:{tenant}", self.route_key("share-line", route))
    }

    /// Sorted set of the route's tenants with work (tenant → until when).
    pub fn route_active(&self, route: &Kind) -> String {
        self.route_key("active", route)
    }

    /// Hash: the weight each tenant with work counts for on the route
    /// (`w:<tenant>`), their sum (`total`) and when it last changed.
    pub fn route_weights(&self, route: &Kind) -> String {
        self.route_key("weights", route)
    }

    /// Hash: what the route's adaptive quota learned.
    pub fn route_adapt(&self, route: &Kind) -> String {
        self.route_key("adapt", route)
    }

    pub fn route_penalty(&self, route: &Kind) -> String {
        self.route_key("penalty", route)
    }

    /// Sorted set of the route's send times reserved and given back, still
    /// ahead (`route.lua`): used when the route's keys live in another
    /// slot than its tenants'.
    pub fn route_holes(&self, route: &Kind) -> String {
        self.route_key("holes", route)
    }

    /// Hash of the route's tenants held below their share by their own quota
    /// (`permit.lua`, on one Redis): tenant -> the places of its line the
    /// route keeps clear for it.
    pub fn route_kept(&self, route: &Kind) -> String {
        self.route_key("kept", route)
    }

    /// A tenant's line on the route when the route's keys live in another
    /// slot than its tenants' (`route.lua`, in the route's slot): a string,
    /// its next free place.
    pub fn route_line(&self, route: &Kind, tenant: &TenantId) -> String {
        format!("{}:{tenant}", self.route_key("line", route))
    }

    /// Never written: stands in for the route's keys in a tenant's call
    /// when those live in another slot (the route's side is its own call).
    pub fn no_route(&self, tenant: &TenantId) -> String {
        self.tenant_key("no-route", tenant)
    }

    /// Hash `count`, `period_ms`, `burst`: the quota of tenants with none.
    pub fn default_quota(&self) -> String {
        format!("{}:quota-default", self.installation)
    }

    /// Never written: the default quota does not adapt (it is shared by
    /// tenants whose providers' limits differ).
    pub fn default_adapt(&self) -> String {
        format!("{}:adapt-default", self.installation)
    }

    /// Sorted set: tenant -> when a pod last counted a call of it
    /// (seconds), or when its furthest parked copy is back if later
    /// (`QuotaStore::count_activity`): the console lists the tenants active
    /// in the last 10 minutes beside those with settings.
    pub fn active_tenants(&self) -> String {
        format!("{}:active-tenants", self.installation)
    }

    /// Set of tenants with stored settings (for `quota list`).
    pub fn tenants(&self) -> String {
        format!("{}:tenants", self.installation)
    }

    /// Set of routes with a stored quota.
    pub fn routes(&self) -> String {
        format!("{}:routes", self.installation)
    }

    /// String: the fingerprint of the quota-baseline entry last applied to
    /// the tenant, so a deleted quota is not seeded back (in the tenant's
    /// slot, so the change script reads and writes it with the quota).
    pub fn baseline_mark(&self, tenant: &TenantId) -> String {
        self.tenant_key("baseline", tenant)
    }

    pub fn route_baseline_mark(&self, route: &Kind) -> String {
        self.route_key("baseline", route)
    }

    pub fn default_baseline_mark(&self) -> String {
        format!("{}:baseline-default", self.installation)
    }

    /// Hash: target label → baseline fingerprint, where installations
    /// before the marks above kept them. Read when seeding a target that
    /// has no mark yet, and emptied as marks are written.
    pub fn legacy_baseline_marks(&self) -> String {
        format!("{}:baseline-applied", self.installation)
    }

    /// How many work queues may exist (`{prefix}.work.0` up to it): the
    /// largest `shards` declared whose queues are not all gone.
    pub fn work_queues(&self) -> String {
        format!("{}:work-queues", self.installation)
    }

    /// String: who holds the fleet-wide lock `name` (expires).
    pub fn lock(&self, name: &str) -> String {
        format!("{}:lock:{name}", self.installation)
    }

    /// Stream of every quota change: who, when, old → new.
    pub fn audit(&self) -> String {
        format!("{}:audit", self.installation)
    }

    /// Pattern matching every key of this prefix (tests, demo, bench cleanup).
    pub fn all_pattern(&self) -> String {
        format!("{}:*", self.prefix)
    }
}

#[cfg(test)]
mod tests {
    use redis::cluster_routing::Slot;
    use tollgate_core::{IdempotencyKey, JobId, Kind, TenantId};

    use super::Keys;

    fn every_key(keys: &Keys) -> Vec<String> {
        let tenant = TenantId::parse("acme").unwrap();
        let route = Kind::parse("email").unwrap();
        let key = IdempotencyKey::parse("order-1").unwrap();
        let id = JobId::parse("job-1").unwrap();
        vec![
            keys.quota(&tenant),
            keys.tat(&tenant),
            keys.waiting(&tenant),
            keys.waiting_high(&tenant),
            keys.waiting_low(&tenant),
            keys.penalty(&tenant),
            keys.in_flight(&tenant),
            keys.adapt(&tenant),
            keys.stats(&tenant),
            keys.parked(&tenant),
            keys.shadow_tat(&tenant),
            keys.sent(&tenant, &key),
            keys.lease(&tenant, &key),
            keys.cancelled_id(&tenant, &id),
            keys.cancelled_key(&tenant, &key),
            keys.route_quota(&route),
            keys.route_tat(&route),
            keys.route_share(&route, &tenant),
            keys.route_active(&route),
            keys.route_weights(&route),
            keys.route_adapt(&route),
            keys.route_penalty(&route),
            keys.route_holes(&route),
            keys.route_kept(&route),
            keys.route_line(&route, &tenant),
            keys.no_route(&tenant),
            keys.default_quota(),
            keys.default_adapt(),
            keys.active_tenants(),
            keys.tenants(),
            keys.routes(),
            keys.baseline_mark(&tenant),
            keys.route_baseline_mark(&route),
            keys.default_baseline_mark(),
            keys.legacy_baseline_marks(),
            keys.work_queues(),
            keys.lock("seed"),
            keys.audit(),
        ]
    }

    #[test]
    fn a_tenants_keys_share_its_slot_and_a_routes_keys_share_the_routes() {
        let keys = Keys::new("tollgate");
        let all = every_key(&keys);
        let tenant = TenantId::parse("acme").unwrap();
        let route = Kind::parse("email").unwrap();
        let tenant_slot = Slot::for_key(keys.quota(&tenant));
        let route_slot = Slot::for_key(keys.route_quota(&route));
        assert_ne!(tenant_slot, route_slot);
        assert_eq!(all[0], "tollgate:quota:{acme}");
        for key in &all {
            let slot = Slot::for_key(key);
            if key.contains("{acme}") {
                assert_eq!(slot, tenant_slot, "{key}");
            } else if key.contains("{route:email}") {
                assert_eq!(slot, route_slot, "{key}");
            }
        }
        // On a cluster the installation's own keys share the prefix's slot.
        let cluster = Keys::on_cluster("tollgate");
        let own = [
            cluster.default_quota(),
            cluster.active_tenants(),
            cluster.tenants(),
            cluster.routes(),
            cluster.legacy_baseline_marks(),
            cluster.work_queues(),
            cluster.lock("seed"),
            cluster.audit(),
        ];
        for key in &own {
            assert!(key.starts_with("tollgate:{tollgate}:"), "{key}");
            assert_eq!(Slot::for_key(key), Slot::for_key("{tollgate}"), "{key}");
        }
        assert_eq!(cluster.quota(&tenant), keys.quota(&tenant));
        // What a tenant's calls name, with the route's stand-in, is all in
        // the tenant's slot; a share line (the route's) is the route's.
        assert_eq!(Slot::for_key(keys.no_route(&tenant)), tenant_slot);
        assert_eq!(Slot::for_key(keys.route_share(&route, &tenant)), route_slot);
        assert_eq!(Slot::for_key(keys.route_holes(&route)), route_slot);
    }
}
