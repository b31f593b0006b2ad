//! [`PermitStore`] on Redis: `permit.lua` decides, `complete.lua` records,
//! both through `batch.lua` by `EVALSHA` (falling back to `EVAL` on
//! `NOSCRIPT` after a restart or failover), time from Redis `TIME` so the
//! whole fleet shares one clock. A pod's calls are batched: the decisions and
//! records asked for while one call is in flight go in the next, one round
//! trip for all of them. The batches' round trips also teach the pod where
//! Redis's clock is against its own ([`ClockOffset`]), so a grant's send
//! time is kept on the pod's clock however late its reply is read.
//!
//! A small local cache spares Redis the deliveries of a tenant that is
//! already known to wait. While a tenant flows, every request goes to Redis
//! and a denial takes one virtual slot. Once Redis has said the
//! tenant waits, this pod's fresh requests for it go single file: the first
//! takes a block of `denial_block` slots, the ones queued behind it use the
//! rest without a round trip. A slot is only a time to come back and ask
//! again, never a permit, so the fleet decision stays in Redis; a job coming
//! back for its slot always asks Redis. Nothing cached lives longer than
//! `denial_cache_ttl`.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use redis::Script;
use redis::cluster_routing::Slot;
use tokio::sync::{mpsc, oneshot};
use tollgate_core::ports::{
    Decided, Learned, Penalty, PermitRequest, PermitStore, PermitUse, SharePlace, ThrottleScope,
};
use tollgate_core::{Kind, PermitDecision, Priority, Quota, Shadow, TenantId, UnixMillis};

use crate::clock_offset::ClockOffset;
use crate::store::{AuditFields, audit_entry};
use crate::{Keys, QuotaError, Redis, Target};

/// The permit and completion scripts, called in batches through
/// `batch.lua`.
static BATCH_LUA: &str = crate::lua!(
    "adapt.lua",
    "complete.lua",
    "buckets.lua",
    "shares.lua",
    "permit.lua",
    "route.lua",
    "batch.lua"
);

/// The permit script's keys, by name: the one place the Rust side writes
/// its positional contract (`permit.lua` binds the same names in the same
/// order; a test checks it).
struct PermitKeys {
    tenant_quota_key: String,
    tenant_tat_key: String,
    tenant_waiting_key: String,
    tenant_penalty_key: String,
    tenant_in_flight_key: String,
    shadow_tat_key: String,
    sent_key: String,
    lease_key: String,
    cancelled_id_key: String,
    cancelled_idempotency_key: String,
    route_quota_key: String,
    route_tat_key: String,
    route_share_key: String,
    route_penalty_key: String,
    tenant_waiting_high_key: String,
    tenant_waiting_low_key: String,
    route_active_key: String,
    route_weights_key: String,
    tenant_adapt_key: String,
    route_adapt_key: String,
    route_kept_key: String,
}

impl PermitKeys {
    const NAMES: [&'static str; 21] = [
        "tenant_quota_key",
        "tenant_tat_key",
        "tenant_waiting_key",
        "tenant_penalty_key",
        "tenant_in_flight_key",
        "shadow_tat_key",
        "sent_key",
        "lease_key",
        "cancelled_id_key",
        "cancelled_idempotency_key",
        "route_quota_key",
        "route_tat_key",
        "route_share_key",
        "route_penalty_key",
        "tenant_waiting_high_key",
        "tenant_waiting_low_key",
        "route_active_key",
        "route_weights_key",
        "tenant_adapt_key",
        "route_adapt_key",
        "route_kept_key",
    ];

    /// `split`: the route's keys live in another slot ([`route_side`]).
    fn new(k: &Keys, req: &PermitRequest<'_>, split: bool) -> Self {
        let route = |key: String| route_side(k, req.tenant, split, key);
        Self {
            tenant_quota_key: k.quota(req.tenant),
            tenant_tat_key: k.tat(req.tenant),
            tenant_waiting_key: k.waiting(req.tenant),
            tenant_penalty_key: k.penalty(req.tenant),
            tenant_in_flight_key: k.in_flight(req.tenant),
            shadow_tat_key: k.shadow_tat(req.tenant),
            sent_key: k.sent(req.tenant, req.key),
            lease_key: k.lease(req.tenant, req.key),
            cancelled_id_key: k.cancelled_id(req.tenant, req.job_id),
            cancelled_idempotency_key: k.cancelled_key(req.tenant, req.key),
            route_quota_key: route(k.route_quota(req.route)),
            route_tat_key: route(k.route_tat(req.route)),
            route_share_key: route(k.route_share(req.route, req.tenant)),
            route_penalty_key: route(k.route_penalty(req.route)),
            tenant_waiting_high_key: k.waiting_high(req.tenant),
            tenant_waiting_low_key: k.waiting_low(req.tenant),
            route_active_key: route(k.route_active(req.route)),
            route_weights_key: route(k.route_weights(req.route)),
            tenant_adapt_key: k.adapt(req.tenant),
            route_adapt_key: route(k.route_adapt(req.route)),
            route_kept_key: route(k.route_kept(req.route)),
        }
    }

    /// In [`PermitKeys::NAMES`] order.
    fn in_order(self) -> [String; 21] {
        [
            self.tenant_quota_key,
            self.tenant_tat_key,
            self.tenant_waiting_key,
            self.tenant_penalty_key,
            self.tenant_in_flight_key,
            self.shadow_tat_key,
            self.sent_key,
            self.lease_key,
            self.cancelled_id_key,
            self.cancelled_idempotency_key,
            self.route_quota_key,
            self.route_tat_key,
            self.route_share_key,
            self.route_penalty_key,
            self.tenant_waiting_high_key,
            self.tenant_waiting_low_key,
            self.route_active_key,
            self.route_weights_key,
            self.tenant_adapt_key,
            self.route_adapt_key,
            self.route_kept_key,
        ]
    }
}

/// A route's key as a tenant's call names it: when the route's keys live
/// in another slot (`split`, a Redis Cluster), the route's side is a call
/// of its own and a stand-in in the tenant's slot takes its place.
fn route_side(k: &Keys, tenant: &TenantId, split: bool, key: String) -> String {
    if split { k.no_route(tenant) } else { key }
}

/// The permit script's arguments, by name (see [`PermitKeys`]). Optional
/// ones are sent as "" when absent.
struct PermitArgs<'a> {
    default_count: u32,
    default_period_ms: u64,
    default_burst: u32,
    lease_token: &'a str,
    horizon_us: u64,
    lease_ttl_ms: u64,
    pacing_factor: f64,
    pause_recheck_us: u64,
    denial_slots: u32,
    concurrency_retry_us: u64,
    now_override_us: Option<u64>,
    returning_until_us: Option<u64>,
    returning_interval_us: Option<u64>,
    seen_cancel_ttl_ms: u64,
    reserve_us: u64,
    priority: Priority,
    tenant_name: &'a str,
    returning_share_place: Option<u64>,
    default_changed_ms: Option<u64>,
    route_at: Option<u64>,
    returning_share_step: Option<u64>,
}

impl PermitArgs<'_> {
    const NAMES: [&'static str; 21] = [
        "default_count",
        "default_period_ms",
        "default_burst",
        "lease_token",
        "horizon_us",
        "lease_ttl_ms",
        "pacing_factor",
        "pause_recheck_us",
        "denial_slots",
        "concurrency_retry_us",
        "now_override_us",
        "returning_until_us",
        "returning_interval_us",
        "seen_cancel_ttl_ms",
        "reserve_us",
        "priority",
        "tenant_name",
        "returning_share_place",
        "default_changed_ms",
        "route_at",
        "returning_share_step",
    ];

    /// In [`PermitArgs::NAMES`] order.
    fn in_order(&self) -> [String; 21] {
        let optional = |v: Option<u64>| v.map(|v| v.to_string()).unwrap_or_default();
        [
            self.default_count.to_string(),
            self.default_period_ms.to_string(),
            self.default_burst.to_string(),
            self.lease_token.to_owned(),
            self.horizon_us.to_string(),
            self.lease_ttl_ms.to_string(),
            self.pacing_factor.to_string(),
            self.pause_recheck_us.to_string(),
            self.denial_slots.to_string(),
            self.concurrency_retry_us.to_string(),
            optional(self.now_override_us),
            optional(self.returning_until_us),
            optional(self.returning_interval_us),
            self.seen_cancel_ttl_ms.to_string(),
            self.reserve_us.to_string(),
            self.priority.as_str().to_owned(),
            self.tenant_name.to_owned(),
            optional(self.returning_share_place),
            optional(self.default_changed_ms),
            optional(self.route_at),
            optional(self.returning_share_step),
        ]
    }
}

#[derive(Clone, Debug)]
pub struct PermitSettings {
    /// Applies to tenants with no stored quota when no default is stored
    /// either. Conservative by design: never unlimited.
    pub default_quota: Quota,
    /// How far ahead a permit may be reserved. A reserved job is held
    /// in-process until its slot, so this must not exceed the hold limit,
    /// and it bounds how long a quota change takes to apply.
    pub horizon: Duration,
    /// How long a granted job may stay in flight before another copy may
    /// try (provider timeout plus margin). Expires if a pod dies.
    pub lease_ttl: Duration,
    /// How long a sent idempotency key is remembered.
    pub sent_ttl: Duration,
    /// Fraction by which sends are spaced wider than the quota (0.02 = 2 %).
    /// Permits are exact, but sends arrive with a few milliseconds of jitter;
    /// without a margin, a provider counting per sliding second would see
    /// rate + 1 requests in some windows.
    pub pacing_margin: f64,
    /// How often a paused tenant's jobs look again.
    pub pause_recheck: Duration,
    /// Wait before asking again when the tenant is at its concurrency limit.
    pub concurrency_retry: Duration,
    /// Virtual slots a pod takes per denial (1 = no local cache).
    pub denial_block: u32,
    /// How long this pod may use those slots (and a paused answer) locally.
    pub denial_cache_ttl: Duration,
    /// Routes whose 429s are account-wide: every tenant of the route waits
    /// out one, so on a Redis Cluster their jobs ask the route's slot.
    pub account_wide: Vec<Kind>,
}

/// What this pod knows about one (tenant, route) without asking Redis.
#[derive(Debug, Default)]
struct Local {
    /// Redis said "wait" until about this instant: fresh requests go single file.
    waiting_until: Option<Instant>,
    /// The unused rest of a block of virtual slots.
    slots: Option<Slots>,
    /// Redis said "paused": answer so locally until `expires`.
    paused: Option<(Duration, Instant)>,
}

#[derive(Clone, Copy, Debug)]
struct Slots {
    next: Instant,
    interval: Duration,
    left: u32,
    expires: Instant,
    /// Slots on a share of a route: the next one's place in the route's
    /// virtual time, and their spacing there.
    share: Option<SharePlaces>,
}

/// Places on a tenant's share of a route, in the route's virtual time: the
/// first and their spacing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SharePlaces {
    pub first: u64,
    pub step: u64,
}

impl SharePlaces {
    /// The first, as a job carries it.
    pub fn first_place(&self) -> SharePlace {
        SharePlace {
            at: self.first,
            step: Some(self.step),
        }
    }

    /// From a script's reply: the first place and the step, when both are
    /// there (0: none).
    fn from_reply(first: Option<&i64>, step: Option<&i64>) -> Option<Self> {
        match (first, step) {
            (Some(&first), Some(&step)) if first > 0 && step > 0 => Some(Self {
                first: first as u64,
                step: step as u64,
            }),
            _ => None,
        }
    }
}

impl Local {
    fn waiting(&self, now: Instant) -> bool {
        self.waiting_until.is_some_and(|t| t > now)
    }

    /// A decision from what Redis said recently, if it still holds.
    fn take(&mut self, now: Instant) -> Option<PermitDecision> {
        if let Some((retry_in, expires)) = self.paused {
            if expires > now {
                return Some(PermitDecision::Paused { retry_in });
            }
            self.paused = None;
        }
        let slots = self.slots.as_mut()?;
        if slots.expires <= now || slots.left == 0 {
            self.slots = None;
            return None;
        }
        let retry_in = slots.next.saturating_duration_since(now);
        let interval = slots.interval;
        let share_place = slots.share.map(|s| s.first_place());
        slots.next += interval;
        slots.left -= 1;
        if let Some(share) = slots.share.as_mut() {
            share.first += share.step;
        }
        Some(PermitDecision::Denied {
            retry_in,
            interval: Some(interval),
            kept: false,
            share_place,
        })
    }

    /// Learns from a Redis reply; returns the decision for the asking job.
    /// The unused rest of a block is kept until used or expired, whatever
    /// else Redis says: its slots are places already taken in the tenant's
    /// line, and dropping them would leave gaps nobody fills.
    fn learn(&mut self, reply: Reply, now: Instant, ttl: Duration, fresh: bool) -> PermitDecision {
        let expires = now + ttl;
        match reply {
            Reply::Denied {
                retry_in,
                interval,
                slots,
                kept,
                share,
            } => {
                self.waiting_until = Some(expires);
                if let Some(interval) = interval
                    && !kept
                    && slots > 1
                {
                    self.slots = Some(Slots {
                        next: now + retry_in + interval,
                        interval,
                        left: slots - 1,
                        expires,
                        share: share.map(|s| SharePlaces {
                            first: s.first + s.step,
                            step: s.step,
                        }),
                    });
                }
                PermitDecision::Denied {
                    retry_in,
                    interval,
                    kept,
                    share_place: share.map(|s| s.first_place()),
                }
            }
            Reply::Decision(decision) => {
                match decision {
                    PermitDecision::Paused { retry_in } => self.paused = Some((retry_in, expires)),
                    // A new job got through: the tenant flows again. (A job
                    // back for its place says nothing about newcomers.)
                    PermitDecision::Granted { .. } if fresh => {
                        self.waiting_until = None;
                        self.paused = None;
                    }
                    _ => {}
                }
                decision
            }
        }
    }

    fn is_empty(&self) -> bool {
        self.waiting_until.is_none() && self.slots.is_none() && self.paused.is_none()
    }
}

pub struct RedisPermits {
    redis: Arc<Redis>,
    keys: Keys,
    settings: PermitSettings,
    calls: Batched,
    local: Mutex<HashMap<LocalKey, Arc<KeyState>>>,
    /// The stored default quota as this pod last read it, and when.
    default_copy: tokio::sync::Mutex<Option<(Instant, Option<StoredDefault>)>>,
    /// The route's keys live in other slots than its tenants' (a Redis
    /// Cluster): a job whose route has a quota takes its permit in a call
    /// to each (`tollgate_core::cross_slot`).
    split: bool,
    /// Each route's quota as this pod last read it, and when.
    route_copies: tokio::sync::Mutex<HashMap<Kind, (Instant, RouteCopy)>>,
    /// Each tenant's weight (thousandths) as its slot last told this pod,
    /// for its share of a route in the route's slot.
    weights: Mutex<HashMap<TenantId, u64>>,
}

/// Tenants whose weight a pod keeps, at most (then it starts afresh).
const WEIGHTS_MAX: usize = 100_000;

/// What a pod keeps of a route's quota when the route's keys live in
/// another slot: whether its jobs ask there.
#[derive(Clone, Copy, Debug, Default)]
struct RouteCopy {
    /// The route has a quota, or its 429s are account-wide.
    asks: bool,
    /// Its quota adapts: its completions learn there.
    adaptive: bool,
}

/// How old this pod's copy of the stored default quota may be: a change of
/// the default reaches every pod within it. The permit script is not given
/// the default's key, which lives outside the tenant's and the route's
/// slots.
const DEFAULT_COPY_FOR: Duration = Duration::from_secs(1);

/// What a completion's reply asks the pod to write outside the tenant's
/// slot (see [`RedisPermits::record_afterwards`]).
#[derive(Clone, Copy, Debug)]
struct Afterwards {
    /// An adaptive quota's adjustment to audit: (old, new) in millionths
    /// per second, negative when none.
    tenant_audit: (i64, i64),
    route_audit: (i64, i64),
    at_ms: i64,
}

/// The default quota as stored (`quota set --default`).
#[derive(Clone, Copy, Debug)]
struct StoredDefault {
    count: u32,
    period_ms: u64,
    burst: u32,
    /// When it last changed (places in line are re-spaced around it).
    changed_ms: Option<u64>,
}

/// Groups per call of `batch.lua`, at most. A call blocks Redis (every
/// pod) while it runs; a permit decision is a few dozen commands.
const BATCH_MAX: usize = 64;

/// What a group of `batch.lua` does.
#[derive(Clone, Copy, Debug)]
enum Group {
    /// A permit decision (`permit.lua`).
    Permit,
    /// A completion (`complete.lua`).
    Complete,
    /// A send time reserved on a route's slot (`route.lua`).
    RouteReserve,
    /// A route's send time given back (`route.lua`).
    RouteGiveBack,
    /// A route's side of a completion (`route.lua`).
    RouteComplete,
}

impl Group {
    fn letter(self) -> char {
        match self {
            Group::Permit => 'p',
            Group::Complete => 'c',
            Group::RouteReserve => 'r',
            Group::RouteGiveBack => 'g',
            Group::RouteComplete => 'R',
        }
    }

    /// How many keys and arguments its group takes, as `batch.lua` reads
    /// them (a test checks both agree): one more or less shifts every
    /// group after it in a batch.
    fn shape(self) -> (usize, usize) {
        match self {
            Group::Permit => (PermitKeys::NAMES.len(), PermitArgs::NAMES.len()),
            Group::Complete => (9, 8),
            Group::RouteReserve => (8, 9),
            Group::RouteGiveBack => (5, 5),
            Group::RouteComplete => (3, 3),
        }
    }
}

/// One job's group in a batched call: its keys and arguments, and who
/// waits for its own reply.
struct Call {
    group: Group,
    keys: Vec<String>,
    args: Vec<String>,
    /// Its reply reads Redis's clock (no `now` override): a sample of the
    /// clocks' offset.
    reads_clock: bool,
    /// A permit decision for a tenant this pod already holds a backlog of
    /// (see [`BACKLOG_SHARE`]).
    backlog: bool,
    done: oneshot::Sender<Result<Vec<i64>, QuotaError>>,
}

/// A batch's places for decisions of tenants backlogged in this pod. A
/// tenant with no hold room left here is denied with a place in line and
/// parks (`reserve_within`); what can send now (a quiet tenant's job, a
/// completion an ack waits on) must not queue behind the hundreds of such
/// decisions a fresh backlog asks for at once: in this pod's next call, nor
/// in Redis behind another pod's (a call holds Redis while it runs). So
/// each call carries at most this many, and every other call waiting
/// besides; a backlog still gets its places in every call.
const BACKLOG_SHARE: usize = BATCH_MAX / 4;

/// What a pod's call of `batch.lua` was for, as [`CallObserver`] is told.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CallKind {
    /// A permit decision (on a Redis Cluster also a route's side of one).
    Permit,
    /// A permit decision for a tenant this pod already holds a backlog of,
    /// which gives way to the other calls waiting (at most a quarter of a
    /// batch): a fresh backlog's decisions wait their turn by design.
    BacklogPermit,
    /// The record of a permit's use: a sent record, which the job's ack
    /// waits for, or a permit given back.
    Complete,
}

impl CallKind {
    fn of(group: Group, backlog: bool) -> Self {
        match group {
            Group::Complete | Group::RouteComplete => Self::Complete,
            _ if backlog => Self::BacklogPermit,
            Group::Permit | Group::RouteReserve | Group::RouteGiveBack => Self::Permit,
        }
    }
}

/// Told, for every permit decision and completion a pod asks Redis for, how
/// long its caller waited: from asking to the answer, the wait for the
/// pod's batched call included, whether or not the call succeeded.
pub type CallObserver = Arc<dyn Fn(CallKind, Duration) + Send + Sync>;

/// The pod's calls of `batch.lua`: whatever permit decisions and
/// completions queued while one call was in flight go in the next, so an
/// idle pod waits for nothing and a busy one makes one round trip for many
/// jobs. Each job gets the reply to its own group, from the call that
/// carried it: "acked only after the sent record is written" holds per job.
struct Batched {
    redis: Arc<Redis>,
    script: Script,
    /// Started with the first call, inside the runtime; ends when the
    /// permit store is dropped.
    queue: OnceLock<mpsc::UnboundedSender<Call>>,
    /// Redis's clock against this pod's, learned from the batches.
    clock: Arc<Mutex<ClockOffset>>,
    observer: Option<CallObserver>,
}

impl Batched {
    fn new(redis: Arc<Redis>) -> Self {
        Self {
            redis,
            script: Script::new(BATCH_LUA),
            queue: OnceLock::new(),
            clock: Arc::default(),
            observer: None,
        }
    }

    /// Redis's clock minus this pod's (microseconds), once a batch taught it.
    fn clock_offset(&self) -> Option<i64> {
        self.clock.lock().expect("not poisoned").offset()
    }

    async fn call(
        &self,
        group: Group,
        keys: Vec<String>,
        args: Vec<String>,
        reads_clock: bool,
    ) -> Result<Vec<i64>, QuotaError> {
        self.call_in_lane(group, keys, args, reads_clock, false)
            .await
    }

    /// [`Batched::call`], for a call that `backlog` may put behind the
    /// others waiting ([`BACKLOG_SHARE`]).
    async fn call_in_lane(
        &self,
        group: Group,
        keys: Vec<String>,
        args: Vec<String>,
        reads_clock: bool,
        backlog: bool,
    ) -> Result<Vec<i64>, QuotaError> {
        debug_assert_eq!((keys.len(), args.len()), group.shape(), "{group:?}");
        let asked = self.observer.is_some().then(Instant::now);
        let queue = self.queue.get_or_init(|| {
            let (queue, calls) = mpsc::unbounded_channel();
            tokio::spawn(call_in_batches(
                Arc::clone(&self.redis),
                self.script.clone(),
                calls,
                Arc::clone(&self.clock),
            ));
            queue
        });
        let (done, reply) = oneshot::channel();
        let stopped = || QuotaError::Unavailable("the Redis call batcher stopped".into());
        queue
            .send(Call {
                group,
                keys,
                args,
                reads_clock,
                backlog,
                done,
            })
            .map_err(|_| stopped())?;
        let answer = reply.await.unwrap_or_else(|_| Err(stopped()));
        if let (Some(observer), Some(asked)) = (&self.observer, asked) {
            observer(CallKind::of(group, backlog), asked.elapsed());
        }
        answer
    }
}

/// The calls waiting for a batch, in two lanes ([`BACKLOG_SHARE`]).
#[derive(Default)]
struct Lanes {
    first: VecDeque<Call>,
    backlog: VecDeque<Call>,
}

impl Lanes {
    /// The next batch: every call queued since the last (waiting for one
    /// when none is), the backlog's decisions behind the rest. `None` once
    /// the queue is closed and empty.
    async fn next_batch(&mut self, queue: &mut mpsc::UnboundedReceiver<Call>) -> Option<Vec<Call>> {
        let mut incoming = Vec::new();
        if self.first.is_empty()
            && self.backlog.is_empty()
            && queue.recv_many(&mut incoming, BATCH_MAX).await == 0
        {
            return None;
        }
        while let Ok(call) = queue.try_recv() {
            incoming.push(call);
        }
        for call in incoming {
            if call.backlog {
                self.backlog.push_back(call);
            } else {
                self.first.push_back(call);
            }
        }
        let backlog = self.backlog.len().min(BACKLOG_SHARE);
        let first = self.first.len().min(BATCH_MAX - backlog);
        Some(
            self.first
                .drain(..first)
                .chain(self.backlog.drain(..backlog))
                .collect(),
        )
    }
}

async fn call_in_batches(
    redis: Arc<Redis>,
    script: Script,
    mut queue: mpsc::UnboundedReceiver<Call>,
    clock: Arc<Mutex<ClockOffset>>,
) {
    let mut waiting = Lanes::default();
    while let Some(mut batch) = waiting.next_batch(&mut queue).await {
        if !redis.is_cluster() {
            call_once(&redis, &script, batch, &clock).await;
            continue;
        }
        // On a cluster a call may name the keys of one slot only: one call
        // per slot, all in flight at once. Each group's keys share its
        // first key's slot (the callers' layout: a tenant's keys, or a
        // route's).
        let mut by_slot: HashMap<Slot, Vec<Call>> = HashMap::new();
        for call in batch.drain(..) {
            let slot = Slot::for_key(call.keys.first().map_or("", String::as_str));
            by_slot.entry(slot).or_default().push(call);
        }
        let mut calls = tokio::task::JoinSet::new();
        for (_, of_slot) in by_slot {
            let (redis, script, clock) = (Arc::clone(&redis), script.clone(), Arc::clone(&clock));
            calls.spawn(async move { call_once(&redis, &script, of_slot, &clock).await });
        }
        while calls.join_next().await.is_some() {}
    }
}

/// One call of `batch.lua` for `batch`; each caller gets its own group's
/// reply.
async fn call_once(redis: &Redis, script: &Script, batch: Vec<Call>, clock: &Mutex<ClockOffset>) {
    let mut invocation = script.prepare_invoke();
    invocation.arg(batch.iter().map(|c| c.group.letter()).collect::<String>());
    for c in &batch {
        for key in &c.keys {
            invocation.key(key);
        }
        for arg in &c.args {
            invocation.arg(arg);
        }
    }
    // Taking a connection counts in the round trip: it only loosens the
    // bound on the clocks' offset, and the quickest round trip wins.
    let sent = wall_clock_micros();
    let replies = match redis.conn().await {
        Ok(mut conn) => invocation
            .invoke_async::<Vec<Vec<i64>>>(&mut conn)
            .await
            .map_err(|e| redis.classify(e)),
        Err(e) => Err(e),
    };
    if let Ok(replies) = &replies {
        // A grant is `{0, delay, _, send}`: Redis's clock read `send - delay`.
        let remote = batch.iter().zip(replies).find_map(|(c, r)| {
            (c.reads_clock && matches!(c.group, Group::Permit) && r.len() > 3 && r[0] == 0)
                .then(|| r[3] - r[1])
        });
        if let Some(remote) = remote {
            let received = wall_clock_micros();
            clock
                .lock()
                .expect("not poisoned")
                .observe(sent, received, remote);
        }
    }
    let replies: Vec<_> = match replies {
        Ok(r) if r.len() == batch.len() => r.into_iter().map(Ok).collect(),
        Ok(r) => {
            let e = QuotaError::BadReply(format!("{} replies to {} calls", r.len(), batch.len()));
            batch.iter().map(|_| Err(e.clone())).collect()
        }
        Err(e) => batch.iter().map(|_| Err(e.clone())).collect(),
    };
    for (c, reply) in batch.into_iter().zip(replies) {
        // The job may have stopped waiting; its call was made anyway.
        let _ = c.done.send(reply);
    }
}

/// What the pod's cache is kept by: each priority class has its own line.
type LocalKey = (TenantId, Kind, Priority);

/// One (tenant, route, priority) in this pod: what it knows, and how many fresh
/// requests are queued for it.
#[derive(Default)]
struct KeyState {
    queued: std::sync::atomic::AtomicU32,
    local: tokio::sync::Mutex<Local>,
}

/// A tenant's slot's answer ([`RedisPermits::decide_on_tenant`]).
struct Tenant {
    reply: Reply,
    /// For a grant or a denial on Redis's own clock, when Redis made it on
    /// this pod's.
    made: Option<UnixMillis>,
    /// For a grant of a route's send time, how far past it the tenant's
    /// slot's clock already was.
    late: Duration,
    /// The tenant's weight (thousandths), when the answer says it.
    weight: Option<u64>,
}

/// The script's reply, before the local cache interprets it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reply {
    Decision(PermitDecision),
    /// Denied, with `slots` virtual slots `interval` apart from `retry_in`;
    /// `kept` when a returning job kept its place; `share` when the places
    /// are on the tenant's share of a route.
    Denied {
        retry_in: Duration,
        /// The spacing of the tenant's places (none: the route's slot
        /// denied it, before the tenant was asked).
        interval: Option<Duration>,
        slots: u32,
        kept: bool,
        share: Option<SharePlaces>,
    },
}

impl RedisPermits {
    pub fn new(redis: Arc<Redis>, keys: Keys, settings: PermitSettings) -> Self {
        let split = redis.is_cluster();
        Self {
            calls: Batched::new(Arc::clone(&redis)),
            redis,
            keys,
            settings,
            local: Mutex::new(HashMap::new()),
            default_copy: tokio::sync::Mutex::new(None),
            split,
            route_copies: tokio::sync::Mutex::default(),
            weights: Mutex::default(),
        }
    }

    /// Tells `observer` how long each permit decision and completion waited
    /// for Redis.
    pub fn observing_calls(mut self, observer: CallObserver) -> Self {
        self.calls.observer = Some(observer);
        self
    }

    /// Decides as on a Redis Cluster whatever the Redis: each route's side
    /// in a call of its own. Tests run the cluster's protocol on one Redis
    /// with it.
    pub fn splitting_routes(mut self) -> Self {
        self.split = true;
        self
    }

    /// Whether a job on `route` asks the route's slot first, and learns
    /// there: the route has a quota (as read at most [`DEFAULT_COPY_FOR`]
    /// ago), or its 429s are account-wide (its penalty is there).
    async fn route_copy(&self, route: &Kind) -> Result<RouteCopy, QuotaError> {
        let mut copies = self.route_copies.lock().await;
        if let Some(&(read, copy)) = copies.get(route)
            && read.elapsed() < DEFAULT_COPY_FOR
        {
            return Ok(copy);
        }
        let mut conn = self.redis.conn().await?;
        let (count, adaptive): (Option<String>, Option<String>) = redis::cmd("HMGET")
            .arg(self.keys.route_quota(route))
            .arg(&["count", "adaptive"])
            .query_async(&mut conn)
            .await
            .map_err(|e| self.redis.classify(e))?;
        let copy = RouteCopy {
            asks: count.is_some() || self.settings.account_wide.contains(route),
            adaptive: count.is_some() && adaptive.as_deref() == Some("1"),
        };
        copies.insert(route.clone(), (Instant::now(), copy));
        Ok(copy)
    }

    /// The stored default quota (none stored: `None`), read again once this
    /// pod's copy is [`DEFAULT_COPY_FOR`] old.
    async fn default_quota(&self) -> Result<Option<StoredDefault>, QuotaError> {
        let mut copy = self.default_copy.lock().await;
        if let Some((read, stored)) = *copy
            && read.elapsed() < DEFAULT_COPY_FOR
        {
            return Ok(stored);
        }
        let mut conn = self.redis.conn().await?;
        let fields: Vec<Option<String>> = redis::cmd("HMGET")
            .arg(self.keys.default_quota())
            .arg(&["count", "period_ms", "burst", "updated_at_ms"])
            .query_async(&mut conn)
            .await
            .map_err(|e| self.redis.classify(e))?;
        let field = |i: usize| fields.get(i).cloned().flatten();
        let number = |i: usize| {
            field(i)
                .and_then(|v| v.parse::<u64>().ok())
                .filter(|&n| n > 0)
        };
        let stored = match (number(0), number(1), number(2)) {
            (Some(count), Some(period_ms), Some(burst)) => Some(StoredDefault {
                count: u32::try_from(count).unwrap_or(u32::MAX),
                period_ms,
                burst: u32::try_from(burst).unwrap_or(u32::MAX),
                changed_ms: number(3),
            }),
            _ => None,
        };
        *copy = Some((Instant::now(), stored));
        Ok(stored)
    }

    /// One decision of the permit script (batched with the others this pod
    /// asks for meanwhile). `now_micros` replaces Redis `TIME`;
    /// only tests and tools pass it.
    /// `slots`: virtual slots to take if the job is denied.
    pub async fn decide(
        &self,
        req: PermitRequest<'_>,
        slots: u32,
        now_micros: Option<u64>,
    ) -> Result<Reply, QuotaError> {
        Ok(self.decide_made(req, slots, now_micros).await?.0)
    }

    /// [`Self::decide`], and for a grant on Redis's own clock, when Redis
    /// made it on this pod's clock (its `delay` counts from then).
    ///
    /// When the route's keys live in another slot and the route has a
    /// quota, in up to three calls (`tollgate_core::cross_slot`): the
    /// route's slot reserves a send time; the tenant's takes exactly that
    /// time or refuses it; a time refused (or not used: a duplicate, a
    /// cancelled job) is given back to the route.
    async fn decide_made(
        &self,
        req: PermitRequest<'_>,
        slots: u32,
        now_micros: Option<u64>,
    ) -> Result<(Reply, Option<UnixMillis>), QuotaError> {
        if !self.split || !self.route_copy(req.route).await?.asks {
            let tenant = self.decide_on_tenant(req, slots, now_micros, None).await?;
            return Ok((tenant.reply, tenant.made));
        }
        let s = &self.settings;
        let window = micros(req.reserve_within.unwrap_or(s.horizon).min(s.horizon));
        // A job back for its place on the tenant's line was told to come
        // back the window before it (the tenant's script says so): the
        // route's time is sought from its place on. A job back for a place
        // on the route's line brings it. A fresh job asks from now.
        let not_before = req
            .returning
            .map_or(0, |r| self.on_redis_clock(now_micros, r.until) + window);
        let place = req.returning.and_then(|r| r.share_place);
        let pacing = (1.0 + s.pacing_margin).to_string();
        let now_arg = now_micros.map(|n| n.to_string()).unwrap_or_default();
        let k = &self.keys;
        let weight = self
            .weights
            .lock()
            .expect("not poisoned")
            .get(req.tenant)
            .map(|&w| format!("{:.3}", w as f64 / 1000.0));
        let reserved = self
            .calls
            .call(
                Group::RouteReserve,
                vec![
                    k.route_quota(req.route),
                    k.route_tat(req.route),
                    k.route_holes(req.route),
                    k.route_penalty(req.route),
                    k.route_adapt(req.route),
                    k.route_line(req.route, req.tenant),
                    k.route_active(req.route),
                    k.route_weights(req.route),
                ],
                vec![
                    not_before.to_string(),
                    window.to_string(),
                    pacing.clone(),
                    micros(s.horizon).to_string(),
                    now_arg.clone(),
                    place.map(|p| p.at.to_string()).unwrap_or_default(),
                    req.tenant.as_str().to_owned(),
                    weight.unwrap_or_default(),
                    place
                        .and_then(|p| p.step)
                        .map(|s| s.to_string())
                        .unwrap_or_default(),
                ],
                false,
            )
            .await?;
        let at =
            |i: usize| Duration::from_micros(reserved.get(i).copied().unwrap_or(0).max(0) as u64);
        match reserved.first().copied() {
            Some(0) if reserved.len() > 4 => {}
            // No quota on the route (this pod's copy was old): the tenant's
            // decision is the whole of it.
            Some(7) => {
                let tenant = self.decide_on_tenant(req, slots, now_micros, None).await?;
                return Ok((tenant.reply, tenant.made));
            }
            // Nothing reserved: ask again then (for a place on the route's
            // line, if given one). A job back for its place keeps it.
            Some(1 | 8) => {
                // As the tenant's denials: from when Redis made it.
                let (retry_in, made) = self.retry_on_pod_clock(now_micros, reserved.get(4), at(1));
                let share = SharePlaces::from_reply(reserved.get(2), reserved.get(3));
                let denied = Reply::Denied {
                    retry_in,
                    interval: req.returning.and_then(|r| r.interval),
                    slots: 1,
                    kept: req.returning.is_some(),
                    share,
                };
                return Ok((denied, made));
            }
            _ => return Err(QuotaError::BadReply(format!("route {reserved:?}"))),
        }
        let route_at = reserved[2].max(0) as u64;
        let route_leeway = at(3);
        let Tenant {
            reply,
            made,
            late,
            weight,
        } = self
            .decide_on_tenant(req, slots, now_micros, Some(route_at))
            .await?;
        if let Some(weight) = weight {
            let mut weights = self.weights.lock().expect("not poisoned");
            if weights.len() >= WEIGHTS_MAX {
                weights.clear();
            }
            weights.insert(req.tenant.clone(), weight);
        }
        let Reply::Decision(PermitDecision::Granted {
            delay,
            shadow,
            leeway,
        }) = reply
        else {
            let given_back = self
                .calls
                .call(
                    Group::RouteGiveBack,
                    vec![
                        k.route_holes(req.route),
                        k.route_quota(req.route),
                        k.route_adapt(req.route),
                        k.route_line(req.route, req.tenant),
                        k.route_active(req.route),
                    ],
                    vec![
                        route_at.to_string(),
                        pacing,
                        now_arg,
                        // Paused: it leaves the route's tenants with work.
                        if matches!(reply, Reply::Decision(PermitDecision::Paused { .. })) {
                            req.tenant.as_str().to_owned()
                        } else {
                            String::new()
                        },
                        micros(s.pause_recheck).to_string(),
                    ],
                    false,
                )
                .await;
            if let Err(e) = given_back {
                // Lost: the route's capacity at that time goes unused, no
                // send goes beyond a limit.
                tracing::warn!(route = req.route.as_str(), error = %e, "could not give a route's send time back");
            }
            return Ok((reply, made));
        };
        // The tenant's slot may have read its clock after the route's time
        // (a round trip later): the send is that late already, and the call
        // may begin only what is left of the leeway after it.
        let leeway = leeway.min(route_leeway).saturating_sub(late);
        let granted = PermitDecision::Granted {
            delay,
            shadow,
            leeway,
        };
        Ok((Reply::Decision(granted), made))
    }

    /// One decision of the permit script. `route_at`: the send time the
    /// route's slot reserved ([`Self::decide_made`]).
    async fn decide_on_tenant(
        &self,
        req: PermitRequest<'_>,
        slots: u32,
        now_micros: Option<u64>,
        route_at: Option<u64>,
    ) -> Result<Tenant, QuotaError> {
        let s = &self.settings;
        let d = self.default_quota().await?.unwrap_or(StoredDefault {
            count: s.default_quota.rate.count,
            period_ms: s.default_quota.rate.period.as_millis() as u64,
            burst: s.default_quota.burst,
            changed_ms: None,
        });
        // With the route's keys in another slot, a place on the route's
        // line is the route's call's (`decide_made`).
        let share_place = req
            .returning
            .and_then(|r| r.share_place)
            .filter(|_| !self.split);
        let args = PermitArgs {
            default_count: d.count,
            default_period_ms: d.period_ms,
            default_burst: d.burst,
            lease_token: req.lease_token,
            horizon_us: micros(s.horizon),
            lease_ttl_ms: s.lease_ttl.as_millis() as u64,
            pacing_factor: 1.0 + s.pacing_margin,
            pause_recheck_us: micros(s.pause_recheck),
            denial_slots: slots.max(1),
            concurrency_retry_us: micros(s.concurrency_retry),
            now_override_us: now_micros,
            returning_until_us: req
                .returning
                .map(|r| self.on_redis_clock(now_micros, r.until)),
            returning_interval_us: req.returning.and_then(|r| r.interval).map(micros),
            seen_cancel_ttl_ms: s.sent_ttl.as_millis() as u64,
            reserve_us: micros(req.reserve_within.unwrap_or(s.horizon).min(s.horizon)),
            priority: req.priority,
            tenant_name: req.tenant.as_str(),
            returning_share_place: share_place.map(|p| p.at),
            returning_share_step: share_place.and_then(|p| p.step),
            default_changed_ms: d.changed_ms,
            route_at,
        };
        let keys = PermitKeys::new(&self.keys, &req, self.split)
            .in_order()
            .into();
        let reply = self
            .calls
            .call_in_lane(
                Group::Permit,
                keys,
                args.in_order().into(),
                now_micros.is_none(),
                req.reserve_within.is_some(),
            )
            .await?;
        let at = |i: usize| Duration::from_micros(reply.get(i).copied().unwrap_or(0).max(0) as u64);
        let decision = match reply.first().copied() {
            Some(0) => {
                let shadow = match reply.get(2) {
                    Some(1) => Shadow::Allow,
                    Some(2) => Shadow::Deny,
                    _ => Shadow::None,
                };
                // The send time Redis chose, on this pod's clock: counted from
                // when the reply was read instead, a send went out as late as
                // the reply had waited (in Redis's socket, or for the pod's
                // runtime). With a `now` override there is no clock to map.
                let (delay, made) =
                    self.on_pod_clock(now_micros, reply.get(3).copied(), at(1), Due::Send);
                let granted = PermitDecision::Granted {
                    delay,
                    shadow,
                    leeway: at(4),
                };
                return Ok(Tenant {
                    reply: Reply::Decision(granted),
                    made,
                    late: at(5),
                    weight: reply.get(6).map(|&w| w.max(0) as u64),
                });
            }
            Some(1) => {
                // As a grant's send time: the retry counts from when Redis
                // made the decision, on this pod's clock.
                let (retry_in, made) = self.retry_on_pod_clock(now_micros, reply.get(7), at(1));
                let denied = Reply::Denied {
                    retry_in,
                    interval: Some(at(2)),
                    slots: reply.get(3).copied().unwrap_or(1).max(1) as u32,
                    kept: reply.get(4) == Some(&1),
                    share: SharePlaces::from_reply(reply.get(5), reply.get(6)),
                };
                return Ok(Tenant {
                    reply: denied,
                    made,
                    late: Duration::ZERO,
                    weight: None,
                });
            }
            Some(2) => PermitDecision::Duplicate,
            Some(3) => PermitDecision::InFlight { retry_in: at(1) },
            Some(4) => PermitDecision::Paused { retry_in: at(1) },
            Some(5) => PermitDecision::Cancelled,
            Some(6) => PermitDecision::AtConcurrency { retry_in: at(1) },
            _ => return Err(QuotaError::BadReply(format!("{reply:?}"))),
        };
        Ok(Tenant {
            reply: Reply::Decision(decision),
            made: None,
            late: Duration::ZERO,
            weight: None,
        })
    }

    /// A grant's send time, or a denial's time to ask again (`at`, Redis's
    /// clock, microseconds), `delay` after Redis made the decision: the
    /// delay from when it made it, and when that was, on this pod's clock
    /// ([`due_on_pod_clock`]). With a `now` override, or no time in the
    /// reply, there is no clock to map: `delay` as it is.
    fn on_pod_clock(
        &self,
        now_micros: Option<u64>,
        at: Option<i64>,
        delay: Duration,
        due: Due,
    ) -> (Duration, Option<UnixMillis>) {
        match (now_micros, at) {
            (None, Some(at)) if at > 0 => {
                let at = at - self.calls.clock_offset().unwrap_or(0);
                let (delay, made) = due_on_pod_clock(at, delay, wall_clock_micros(), due);
                (delay, Some(made))
            }
            _ => (delay, None),
        }
    }

    /// A denial's `retry` from `made` (Redis's time when it decided, as a
    /// script's reply carries it): [`Self::on_pod_clock`] for its time to
    /// come back.
    fn retry_on_pod_clock(
        &self,
        now_micros: Option<u64>,
        made: Option<&i64>,
        retry: Duration,
    ) -> (Duration, Option<UnixMillis>) {
        let again = made.map(|&made| made + micros(retry) as i64);
        self.on_pod_clock(now_micros, again, retry, Due::ComeBack)
    }

    /// A job's time to come back (`until`, the job's clock) on Redis's, in
    /// microseconds: back by the offset [`Self::on_pod_clock`] mapped it
    /// with, so a place comes back as it was given, however many hops it
    /// makes and however long each request takes to reach Redis. With a
    /// `now` override, on the override's clock.
    fn on_redis_clock(&self, now_micros: Option<u64>, until: UnixMillis) -> u64 {
        let at = until.0.saturating_mul(1000);
        let offset = match now_micros {
            Some(_) => 0,
            None => self.calls.clock_offset().unwrap_or(0),
        };
        at.saturating_add(offset).max(0) as u64
    }

    /// One completion ([`PermitStore::complete`]), batched with the others
    /// this pod records meanwhile.
    /// `now_micros` replaces Redis `TIME`; only tests and tools pass it.
    pub async fn record(
        &self,
        req: PermitRequest<'_>,
        used: PermitUse,
        penalty: Option<Penalty>,
        now_micros: Option<u64>,
    ) -> Result<Learned, QuotaError> {
        // The route's side is a call of its own when its keys live in
        // another slot.
        let elsewhere = self.split;
        let account_wide = matches!(penalty.map(|p| p.scope), Some(ThrottleScope::Route));
        let scope = match (account_wide, elsewhere) {
            (true, true) => "elsewhere",
            (true, false) => "route",
            (false, _) => "tenant",
        };
        let k = &self.keys;
        let route = |key: String| route_side(k, req.tenant, elsewhere, key);
        let keys = vec![
            k.sent(req.tenant, req.key),
            k.lease(req.tenant, req.key),
            k.in_flight(req.tenant),
            k.penalty(req.tenant),
            route(k.route_penalty(req.route)),
            k.quota(req.tenant),
            k.adapt(req.tenant),
            route(k.route_quota(req.route)),
            route(k.route_adapt(req.route)),
        ];
        let args = vec![
            req.lease_token.to_owned(),
            match used {
                PermitUse::Sent => "1",
                PermitUse::CallFailed { .. } => "0",
                PermitUse::Unanswered => "u",
                PermitUse::Unused => "",
            }
            .to_owned(),
            self.settings.sent_ttl.as_millis().to_string(),
            req.job_id.as_str().to_owned(),
            penalty.map(|p| micros(p.wait)).unwrap_or(0).to_string(),
            now_micros.map(|n| n.to_string()).unwrap_or_default(),
            scope.to_owned(),
            match used {
                PermitUse::CallFailed {
                    retry_after: Some(wait),
                } => wait.as_millis().max(1).to_string(),
                _ => String::new(),
            },
        ];
        let reply = self.calls.call(Group::Complete, keys, args, false).await?;
        let value = |i: usize| {
            reply
                .get(i)
                .copied()
                .ok_or_else(|| QuotaError::BadReply(format!("completion {reply:?}")))
        };
        let mut learned = Learned {
            tenant: learned_rate(value(1)?),
            route: learned_rate(value(2)?),
        };
        let mut afterwards = Afterwards {
            tenant_audit: (value(3)?, value(4)?),
            route_audit: (value(5)?, value(6)?),
            at_ms: value(7)?,
        };
        if elsewhere {
            match self
                .record_on_route(&req, used, penalty, learned.tenant.is_none(), now_micros)
                .await
            {
                Ok(Some((rate, audit, at_ms))) => {
                    learned.route = rate;
                    afterwards.route_audit = audit;
                    if afterwards.at_ms == 0 {
                        afterwards.at_ms = at_ms;
                    }
                }
                Ok(None) => {}
                // The tenant's side is written (the sent record with it):
                // running it again would count the outcome twice. What is
                // lost is the route's learning from this outcome, or an
                // account-wide 429's pause on other pods.
                Err(e) => {
                    tracing::warn!(route = req.route.as_str(), error = %e, "could not record a completion on the route's slot");
                }
            }
        }
        self.record_afterwards(&req, afterwards).await;
        Ok(learned)
    }

    /// A completion's side on the route's slot, when its keys live in
    /// another slot than the tenant's: an account-wide 429's penalty, and
    /// what the route's adaptive quota learns (a 429 the tenant's quota did
    /// not learn from is the route's, as `complete.lua` does in one slot).
    /// Returns the route's effective rate, an adjustment to audit and when,
    /// if the route was called.
    async fn record_on_route(
        &self,
        req: &PermitRequest<'_>,
        used: PermitUse,
        penalty: Option<Penalty>,
        tenant_did_not_learn: bool,
        now_micros: Option<u64>,
    ) -> Result<Option<(Option<f64>, (i64, i64), i64)>, QuotaError> {
        let account_wide = matches!(penalty.map(|p| p.scope), Some(ThrottleScope::Route));
        let outcome = match (penalty, used) {
            (Some(_), _) if account_wide || tenant_did_not_learn => "throttled",
            (None, PermitUse::Sent) => "sent",
            _ => "",
        };
        let copy = self.route_copy(req.route).await?;
        let outcome = if copy.adaptive { outcome } else { "" };
        let route_penalty = penalty.filter(|_| account_wide);
        if outcome.is_empty() && route_penalty.is_none() {
            return Ok(None);
        }
        let k = &self.keys;
        let reply = self
            .calls
            .call(
                Group::RouteComplete,
                vec![
                    k.route_penalty(req.route),
                    k.route_quota(req.route),
                    k.route_adapt(req.route),
                ],
                vec![
                    route_penalty
                        .map(|p| micros(p.wait))
                        .unwrap_or(0)
                        .to_string(),
                    now_micros.map(|n| n.to_string()).unwrap_or_default(),
                    outcome.to_owned(),
                ],
                false,
            )
            .await?;
        let value = |i: usize| {
            reply
                .get(i)
                .copied()
                .ok_or_else(|| QuotaError::BadReply(format!("route completion {reply:?}")))
        };
        Ok(Some((
            learned_rate(value(1)?),
            (value(2)?, value(3)?),
            value(4)?,
        )))
    }

    /// What a completion leaves to write outside the tenant's slot: an
    /// adaptive quota's adjustment in the audit stream. Written after the
    /// completion, in one round trip, only when there is something to write
    /// (at most once per 10 s per adaptive quota). A failure is logged and
    /// not returned: the completion itself is written, and running it again
    /// would learn from the outcome twice.
    async fn record_afterwards(&self, req: &PermitRequest<'_>, after: Afterwards) {
        let mut pipe = redis::pipe();
        let mut any = false;
        let effective = |micro: i64| {
            serde_json::json!({ "effective": significant(micro as f64 / 1e6) }).to_string()
        };
        for (target, (old, new)) in [
            (Target::Tenant(req.tenant.clone()), after.tenant_audit),
            (Target::Route(req.route.clone()), after.route_audit),
        ] {
            if old < 0 || new < 0 {
                continue;
            }
            audit_entry(
                &mut pipe,
                &self.keys,
                AuditFields {
                    target: &target.label(),
                    action: "adapt",
                    who: "tollgate",
                    source: "adaptive",
                    at_ms: after.at_ms,
                    old: &effective(old),
                    new: &effective(new),
                },
            );
            any = true;
        }
        if !any {
            return;
        }
        let written = match self.redis.conn().await {
            Ok(mut conn) => pipe
                .query_async::<()>(&mut conn)
                .await
                .map_err(|e| self.redis.classify(e)),
            Err(e) => Err(e),
        };
        if let Err(e) = written {
            tracing::warn!(tenant = req.tenant.as_str(), error = %e, "could not audit an adaptive adjustment");
        }
    }

    fn state(&self, key: &LocalKey) -> Arc<KeyState> {
        let mut all = self.local.lock().expect("not poisoned");
        Arc::clone(all.entry(key.clone()).or_default())
    }

    /// Forgets a key with nothing worth remembering (bounded memory).
    fn tidy(&self, key: &LocalKey, local: &Local) {
        if local.is_empty() {
            self.local.lock().expect("not poisoned").remove(key);
        }
    }
}

/// What a time a decision names is for, which decides how it rounds to
/// the whole milliseconds the job's clock counts.
#[derive(Clone, Copy, Debug)]
enum Due {
    /// A grant's send time. One still ahead is rounded up, so a job never
    /// goes before it; one already past (every grant for "now", read a
    /// moment after it was made) is due at once, not rounded up into a
    /// wait of up to 2 ms (the timer's granularity) that every job sent at
    /// once paid before.
    Send,
    /// A denial's time to come back, to the nearest millisecond. The job
    /// brings it back ([`RedisPermits::on_redis_clock`]), each hop, through
    /// a clock offset that moves by fractions of a millisecond as the pod
    /// learns it: rounded up, every such move one way added a millisecond
    /// to the job's place.
    ComeBack,
}

/// A decision's time `at` (microseconds on this pod's clock), `delay`
/// after Redis made the decision, read at `now`: the delay from when it was
/// made, in the whole milliseconds the job's clock counts ([`Due`]), and
/// when it was made.
fn due_on_pod_clock(at: i64, delay: Duration, now: i64, due: Due) -> (Duration, UnixMillis) {
    let made_ms = (at - delay.as_micros() as i64).div_euclid(1000);
    let slot_ms = match due {
        Due::ComeBack => (at + 500).div_euclid(1000),
        Due::Send if at <= now => at.div_euclid(1000),
        Due::Send => (at + 999).div_euclid(1000),
    };
    (
        Duration::from_millis((slot_ms - made_ms).max(0) as u64),
        UnixMillis(made_ms),
    )
}

/// This pod's wall clock, microseconds since the epoch.
fn wall_clock_micros() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_micros() as i64)
        .unwrap_or(0)
}

/// When a decision was made, on both of the pod's clocks: the monotonic
/// one for this store's own bookkeeping, the wall clock (the worker's) for
/// the job.
#[derive(Clone, Copy)]
struct Made {
    instant: Instant,
    wall: UnixMillis,
}

impl Made {
    /// Now, or `at` on the wall clock (when Redis made a decision), and as
    /// long before now on the monotonic one: a denial's places, cached for
    /// the tenant's next jobs, count from then too.
    fn now(at: Option<UnixMillis>) -> Self {
        let (instant, wall) = (
            Instant::now(),
            UnixMillis(wall_clock_micros().div_euclid(1000)),
        );
        let Some(at) = at else {
            return Self { instant, wall };
        };
        let ago = Duration::from_millis((wall.0 - at.0).max(0) as u64);
        Self {
            instant: instant.checked_sub(ago).unwrap_or(instant),
            wall: at,
        }
    }

    fn decided(self, decision: PermitDecision) -> Decided {
        Decided {
            decision,
            made_at: self.wall,
        }
    }
}

/// An adaptive quota's effective rate as a completion replies it
/// (millionths per second; negative: the quota does not adapt).
fn learned_rate(micro: i64) -> Option<f64> {
    (micro >= 0).then(|| micro as f64 / 1e6)
}

/// A rate per second in the audit stream: three decimals, or three
/// significant digits below 1 (a 1/h quota's 0.000278, not 0.000).
fn significant(rate: f64) -> String {
    let decimals = if rate >= 1.0 || rate <= 0.0 {
        3
    } else {
        (2 - rate.log10().floor() as i32).clamp(3, 9) as usize
    };
    format!("{rate:.decimals$}")
}

fn micros(d: Duration) -> u64 {
    d.as_micros() as u64
}

impl PermitStore for RedisPermits {
    type Error = QuotaError;

    async fn acquire(&self, req: PermitRequest<'_>) -> Result<Decided, QuotaError> {
        let key = (req.tenant.clone(), req.route.clone(), req.priority);
        let ttl = self.settings.denial_cache_ttl;
        let state = self.state(&key);
        if req.returning.is_some() {
            let (reply, made_at) = self.decide_made(req, 1, None).await?;
            let made = Made::now(made_at);
            // The lock may be held by another job of the tenant across its
            // own round trip: the decision counts from its reply, not from
            // when the lock came free.
            let mut local = state.local.lock().await;
            let decision = local.learn(reply, made.instant, ttl, false);
            self.tidy(&key, &local);
            return Ok(made.decided(decision));
        }
        state.queued.fetch_add(1, Ordering::Relaxed);
        let mut local = state.local.lock().await;
        let behind = state.queued.fetch_sub(1, Ordering::Relaxed) - 1;
        let made = Made::now(None);
        if let Some(decision) = local.take(made.instant) {
            return Ok(made.decided(decision));
        }
        if local.waiting(made.instant) {
            // Single file while the tenant waits: the lock is held across
            // the call, and the block is sized to the requests queued
            // behind, which take the rest of it without a round trip.
            let slots = (1 + behind).min(self.settings.denial_block);
            let (reply, made_at) = self.decide_made(req, slots, None).await?;
            let made = Made::now(made_at);
            return Ok(made.decided(local.learn(reply, made.instant, ttl, true)));
        }
        drop(local);
        let (reply, made_at) = self.decide_made(req, 1, None).await?;
        let made = Made::now(made_at);
        let mut local = state.local.lock().await;
        let decision = local.learn(reply, made.instant, ttl, true);
        self.tidy(&key, &local);
        Ok(made.decided(decision))
    }

    async fn ping(&self) -> Result<(), QuotaError> {
        self.redis.ping().await
    }

    async fn complete(
        &self,
        req: PermitRequest<'_>,
        used: PermitUse,
        penalty: Option<Penalty>,
    ) -> Result<Learned, QuotaError> {
        self.record(req, used, penalty, None).await
    }
}

#[cfg(test)]
mod contract {
    use std::collections::HashSet;

    use super::*;

    static PERMIT_LUA: &str = include_str!("lua/permit.lua");

    /// The names `permit.lua` binds, in order, from lines such as
    /// `local sent_key = KEYS[7]`.
    fn bound(script: &str, table: &str) -> Vec<String> {
        let mut bound = Vec::new();
        for line in script.lines() {
            let Some((name, value)) = line
                .trim_start()
                .strip_prefix("local ")
                .and_then(|rest| rest.split_once(" = "))
            else {
                continue;
            };
            if value.trim() == format!("{table}[{}]", bound.len() + 1) {
                bound.push(name.to_owned());
            }
        }
        bound
    }

    #[test]
    fn the_rust_side_names_the_scripts_keys_and_arguments_in_its_order() {
        assert_eq!(bound(PERMIT_LUA, "KEYS"), PermitKeys::NAMES);
        assert_eq!(bound(PERMIT_LUA, "ARGV"), PermitArgs::NAMES);
        // `batch.lua` cuts each group's keys and arguments by these counts.
        for group in [
            Group::Permit,
            Group::Complete,
            Group::RouteReserve,
            Group::RouteGiveBack,
            Group::RouteComplete,
        ] {
            let (keys, args) = group.shape();
            let cut = include_str!("lua/batch.lua")
                .lines()
                .map(str::trim)
                .find(|l| l.starts_with(&format!("{} = {{", group.letter())));
            assert!(
                cut.is_some_and(|l| l.ends_with(&format!(", {keys}, {args}}},"))),
                "batch.lua cuts {group:?} as {cut:?}, not {keys} keys and {args} arguments"
            );
        }
        for (table, names) in [
            ("KEYS", &PermitKeys::NAMES[..]),
            ("ARGV", &PermitArgs::NAMES[..]),
        ] {
            for (i, name) in names.iter().enumerate() {
                let documented = format!("-- {table}[{}]", i + 1);
                assert!(
                    PERMIT_LUA
                        .lines()
                        .any(|l| l.starts_with(&documented) && l.contains(name)),
                    "the header documents {table}[{}] as {name}",
                    i + 1
                );
            }
        }
        // Nothing else reads the tables by position.
        let positional: Vec<&str> = PERMIT_LUA
            .lines()
            .map(str::trim_start)
            .filter(|l| !l.starts_with("--") && !l.starts_with("local "))
            .filter(|l| l.contains("KEYS[") || l.contains("ARGV["))
            .collect();
        assert!(positional.is_empty(), "{positional:?}");
        // The key builder fills every key; with the route's side in a call
        // of its own, every key is in the tenant's slot.
        let tenant = TenantId::parse("acme").unwrap();
        let req = PermitRequest {
            tenant: &tenant,
            route: &Kind::default_kind(),
            job_id: &tollgate_core::JobId::parse("j").unwrap(),
            key: &tollgate_core::IdempotencyKey::parse("k").unwrap(),
            priority: Priority::Normal,
            lease_token: "t",
            returning: None,
            reserve_within: None,
        };
        let keys = PermitKeys::new(&Keys::new("p"), &req, false).in_order();
        assert!(keys.iter().all(|k| k.starts_with("p:")));
        let slots: HashSet<Slot> = keys.iter().map(Slot::for_key).collect();
        assert!(slots.len() > 1, "the route's keys are in its own slot");
        let split = PermitKeys::new(&Keys::new("p"), &req, true).in_order();
        assert!(
            split
                .iter()
                .all(|k| Slot::for_key(k) == Slot::for_key("{acme}")),
            "{split:?}"
        );
    }
}

#[cfg(test)]
mod send_time {
    use super::*;

    #[test]
    fn a_grant_for_now_read_after_it_was_made_is_due_at_once() {
        // Made and meant for 1,000.400 ms; read 300 µs later.
        let (delay, made) = due_on_pod_clock(1_000_400, Duration::ZERO, 1_000_700, Due::Send);
        assert_eq!((delay, made), (Duration::ZERO, UnixMillis(1_000)));
    }

    #[test]
    fn a_send_time_still_ahead_is_never_rounded_down() {
        // Made at 1,000.400 ms for 1,003.400 ms, read at 1,000.700 ms: the
        // job waits until 1,004 ms, never goes at 1,003.
        let (delay, made) =
            due_on_pod_clock(1_003_400, Duration::from_millis(3), 1_000_700, Due::Send);
        assert_eq!((delay, made), (Duration::from_millis(4), UnixMillis(1_000)));
        // Read after it passed: due at once, from its own millisecond.
        let (delay, _) =
            due_on_pod_clock(1_003_400, Duration::from_millis(3), 1_003_500, Due::Send);
        assert_eq!(delay, Duration::from_millis(3));
    }

    #[test]
    fn a_time_to_come_back_survives_a_small_move_of_the_clock_offset() {
        // Told to come back at 1,003 ms on the job's clock, it brings that
        // back; Redis's reply names it again, mapped through an offset that
        // moved 200 µs either way: the job's clock reads 1,003 ms again
        // (rounded up, 1,003.2 ms read 1,004).
        for at in [1_002_800, 1_003_000, 1_003_200] {
            let delay = Duration::from_micros((at - 1_000_400) as u64);
            let (delay, made) = due_on_pod_clock(at, delay, 1_000_700, Due::ComeBack);
            assert_eq!(made.0 + delay.as_millis() as i64, 1_003, "{at}");
        }
    }
}

#[cfg(test)]
mod lanes {
    use super::*;

    fn call(n: usize, backlog: bool) -> Call {
        Call {
            group: if backlog {
                Group::Permit
            } else {
                Group::Complete
            },
            keys: vec![n.to_string()],
            args: Vec::new(),
            reads_clock: false,
            backlog,
            done: oneshot::channel().0,
        }
    }

    fn numbers(batch: &[Call]) -> Vec<usize> {
        batch.iter().map(|c| c.keys[0].parse().unwrap()).collect()
    }

    #[tokio::test]
    async fn a_backlog_takes_a_quarter_of_each_call_and_the_rest_go_first() {
        let (queue, mut calls) = mpsc::unbounded_channel();
        for n in 0..100 {
            queue.send(call(n, true)).unwrap();
        }
        for n in 100..103 {
            queue.send(call(n, false)).unwrap();
        }
        let mut lanes = Lanes::default();
        let first = lanes.next_batch(&mut calls).await.unwrap();
        let expected: Vec<usize> = (100..103).chain(0..BACKLOG_SHARE).collect();
        assert_eq!(
            numbers(&first),
            expected,
            "the others first, then the backlog in order"
        );
        // A call queued meanwhile goes in the next batch, before the backlog.
        queue.send(call(103, false)).unwrap();
        let second = lanes.next_batch(&mut calls).await.unwrap();
        let expected: Vec<usize> = std::iter::once(103)
            .chain(BACKLOG_SHARE..2 * BACKLOG_SHARE)
            .collect();
        assert_eq!(numbers(&second), expected);
        drop(queue);
        let mut rest = Vec::new();
        while let Some(batch) = lanes.next_batch(&mut calls).await {
            assert!(batch.len() <= BACKLOG_SHARE, "{} in one call", batch.len());
            rest.extend(numbers(&batch));
        }
        assert_eq!(
            rest,
            (2 * BACKLOG_SHARE..100).collect::<Vec<_>>(),
            "none lost"
        );
    }

    #[tokio::test]
    async fn without_a_backlog_a_call_carries_up_to_the_batch_limit() {
        let (queue, mut calls) = mpsc::unbounded_channel();
        for n in 0..100 {
            queue.send(call(n, false)).unwrap();
        }
        let mut lanes = Lanes::default();
        let first = lanes.next_batch(&mut calls).await.unwrap();
        assert_eq!(numbers(&first), (0..BATCH_MAX).collect::<Vec<_>>());
        let second = lanes.next_batch(&mut calls).await.unwrap();
        assert_eq!(numbers(&second), (BATCH_MAX..100).collect::<Vec<_>>());
    }
}

#[cfg(test)]
mod audited_rate {
    use super::significant;

    #[test]
    fn a_small_rate_keeps_three_significant_digits() {
        assert_eq!(significant(7.9233), "7.923");
        assert_eq!(significant(0.5), "0.500");
        assert_eq!(significant(1.0 / 3600.0), "0.000278");
        assert_eq!(significant(0.0), "0.000");
    }
}
