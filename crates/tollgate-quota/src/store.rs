//! The live quota store: what `tollgate quota …`, `tollgate tenant …`,
//! `tollgate cancel` and the admin API read and write. The permit script
//! reads the same hashes on every decision, so a change applies to the next
//! decision of every pod. Every change is appended, atomically with the
//! change itself, to an audit stream (who, when, old → new).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use redis::{AsyncCommands, Script};
use tollgate_core::{Adaptive, IdempotencyKey, JobId, Kind, Learning, Quota, Rate, TenantId};

use crate::{Keys, QuotaError, Redis};

static CHANGE_LUA: &str = crate::lua!("change.lua");
/// Extends (ARGV[2] ms) or, with 0, deletes a lock still held by ARGV[1].
static RENEW_LOCK_LUA: &str = r"
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
if ARGV[2] == '0' then redis.call('DEL', KEYS[1]) else redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 1
";

/// Audit entries kept (approximately; older ones are trimmed).
pub(crate) const AUDIT_MAX_LEN: u32 = 100_000;

/// Whose settings: a tenant, a provider route's shared bucket, or the
/// default quota of tenants with none.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Target {
    Tenant(TenantId),
    Route(Kind),
    Default,
}

impl Target {
    /// How the target is named in the audit stream.
    pub fn label(&self) -> String {
        match self {
            Self::Tenant(t) => format!("tenant:{t}"),
            Self::Route(r) => format!("route:{r}"),
            Self::Default => "default".into(),
        }
    }

    fn hash(&self, keys: &Keys) -> String {
        match self {
            Self::Tenant(t) => keys.quota(t),
            Self::Route(r) => keys.route_quota(r),
            Self::Default => keys.default_quota(),
        }
    }

    /// Where an adaptive quota keeps what it learned (the default quota
    /// never adapts; its key stays empty).
    fn adapt(&self, keys: &Keys) -> String {
        match self {
            Self::Tenant(t) => keys.adapt(t),
            Self::Route(r) => keys.route_adapt(r),
            Self::Default => keys.default_adapt(),
        }
    }

    /// The fingerprint of the baseline entry last applied to the target.
    fn baseline_mark(&self, keys: &Keys) -> String {
        match self {
            Self::Tenant(t) => keys.baseline_mark(t),
            Self::Route(r) => keys.route_baseline_mark(r),
            Self::Default => keys.default_baseline_mark(),
        }
    }

    /// The set this target is listed in (for `quota list`), and its name
    /// there. The default quota is listed nowhere.
    fn index(&self, keys: &Keys) -> Option<(String, String)> {
        match self {
            Self::Tenant(t) => Some((keys.tenants(), t.to_string())),
            Self::Route(r) => Some((keys.routes(), r.to_string())),
            Self::Default => None,
        }
    }
}

/// A change to a target's settings.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Change {
    /// Replace the enforced settings: the quota, the concurrency limit, the
    /// weight on shared routes (`None` = none, weight 1), and whether the
    /// quota adapts to the provider's 429s (its rate is then the ceiling).
    SetQuota {
        quota: Quota,
        concurrency: Option<u32>,
        weight: Option<u32>,
        adaptive: Option<Adaptive>,
    },
    /// Change only the tenant's weight on the routes it shares.
    SetWeight(u32),
    /// A quota computed and counted beside the enforced one, never enforced.
    SetShadow(Quota),
    ClearShadow,
    /// Remove the quota, concurrency and shadow (the default applies again).
    Delete,
    Pause,
    Resume,
}

impl Change {
    pub fn action(self) -> &'static str {
        match self {
            Self::SetQuota { .. } => "set",
            Self::SetWeight(_) => "weight",
            Self::SetShadow(_) => "shadow",
            Self::ClearShadow => "clear-shadow",
            Self::Delete => "delete",
            Self::Pause => "pause",
            Self::Resume => "resume",
        }
    }

    /// Field updates; an empty value deletes the field.
    fn fields(self) -> Vec<(&'static str, String)> {
        let quota = |prefix: &'static [&'static str; 3], q: Option<Quota>| {
            let values = match q {
                Some(q) => [
                    q.rate.count.to_string(),
                    q.rate.period.as_millis().to_string(),
                    q.burst.to_string(),
                ],
                None => Default::default(),
            };
            prefix.iter().copied().zip(values).collect::<Vec<_>>()
        };
        let adaptive = |a: Option<Adaptive>| {
            let values = match a {
                Some(a) => [
                    "1".to_owned(),
                    a.min.count.to_string(),
                    a.min.period.as_millis().to_string(),
                    a.decrease.to_string(),
                    a.increase.to_string(),
                    a.probe.as_millis().to_string(),
                ],
                None => Default::default(),
            };
            ADAPTIVE.iter().copied().zip(values).collect::<Vec<_>>()
        };
        const LIVE: [&str; 3] = ["count", "period_ms", "burst"];
        const SHADOW: [&str; 3] = ["shadow_count", "shadow_period_ms", "shadow_burst"];
        match self {
            Self::SetQuota {
                quota: q,
                concurrency,
                weight,
                adaptive: a,
            } => {
                let mut f = quota(&LIVE, Some(q));
                f.push((
                    "concurrency",
                    concurrency.map(|c| c.to_string()).unwrap_or_default(),
                ));
                f.push(("weight", weight.map(|w| w.to_string()).unwrap_or_default()));
                f.extend(adaptive(a));
                f
            }
            Self::SetWeight(w) => vec![("weight", w.to_string())],
            Self::SetShadow(q) => quota(&SHADOW, Some(q)),
            Self::ClearShadow => quota(&SHADOW, None),
            Self::Delete => {
                let mut f = quota(&LIVE, None);
                f.extend(quota(&SHADOW, None));
                f.push(("concurrency", String::new()));
                f.push(("weight", String::new()));
                f.extend(adaptive(None));
                f
            }
            Self::Pause => vec![("paused", "1".into())],
            Self::Resume => vec![("paused", String::new())],
        }
    }
}

/// Who made a change, and through what.
#[derive(Clone, Debug)]
pub struct Actor {
    pub who: String,
    /// `cli` or `api`.
    pub source: &'static str,
}

impl Actor {
    /// `source:name`, for a name of 1 to 64 characters, not blank, without
    /// control characters; else why not.
    pub fn named(source: &'static str, name: &str) -> Result<Self, String> {
        if name.trim().is_empty() || name.chars().count() > 64 || name.chars().any(char::is_control)
        {
            return Err(format!(
                "{name:?} must be 1 to 64 characters, not blank, without control characters"
            ));
        }
        Ok(Self {
            who: format!("{source}:{name}"),
            source,
        })
    }
}

/// Audit entries read per round trip when looking for one target's.
const HISTORY_PAGE: usize = 1000;

/// The quota hash's fields of an adaptive quota (`adapt.lua` reads them).
const ADAPTIVE: [&str; 6] = [
    "adaptive",
    "min_count",
    "min_period_ms",
    "decrease",
    "increase",
    "probe_ms",
];

/// Settings as stored.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Settings {
    pub quota: Option<Quota>,
    /// Set when the quota adapts: its rate is then the ceiling.
    pub adaptive: Option<Adaptive>,
    /// The rate an adaptive quota enforces now, per second (what the fleet
    /// learned; an `adapt` audit entry's old and new).
    pub effective: Option<f64>,
    pub concurrency: Option<u32>,
    /// Weight on the routes the tenant shares (`None` = 1).
    pub weight: Option<u32>,
    pub paused: bool,
    pub shadow: Option<Quota>,
    pub updated_by: Option<String>,
    pub updated_at_ms: Option<i64>,
}

impl Settings {
    fn from_fields(fields: &HashMap<String, String>) -> Result<Self, String> {
        let num = |name: &str| parsed::<u64>(fields, name);
        let quota = |c: &str, p: &str, b: &str| -> Result<Option<Quota>, String> {
            match (num(c)?, num(p)?, num(b)?) {
                (Some(count), Some(period_ms), Some(burst)) => {
                    let rate = Rate {
                        count: u32::try_from(count).map_err(|_| format!("{c} is too large"))?,
                        period: Duration::from_millis(period_ms),
                    };
                    let burst = u32::try_from(burst).map_err(|_| format!("{b} is too large"))?;
                    Quota::new(rate, burst).map(Some).map_err(|e| e.to_string())
                }
                (None, None, None) => Ok(None),
                _ => Err(format!("{c}, {p} and {b} must be set together")),
            }
        };
        let float = |name: &str| parsed::<f64>(fields, name);
        let adaptive = if fields.get("adaptive").is_some_and(|v| v == "1") {
            let min = match (num("min_count")?, num("min_period_ms")?) {
                (Some(count), Some(ms)) => Rate {
                    count: u32::try_from(count).map_err(|_| "min_count is too large")?,
                    period: Duration::from_millis(ms),
                },
                _ => return Err("min_count and min_period_ms must be set".into()),
            };
            Some(Adaptive {
                min,
                decrease: float("decrease")?.ok_or("decrease must be set")?,
                increase: float("increase")?.ok_or("increase must be set")?,
                probe: Duration::from_millis(num("probe_ms")?.ok_or("probe_ms must be set")?),
            })
        } else {
            None
        };
        Ok(Self {
            quota: quota("count", "period_ms", "burst")?,
            adaptive,
            effective: float("effective")?,
            concurrency: num("concurrency")?.map(|c| c as u32),
            weight: num("weight")?.map(|w| w as u32),
            paused: fields.get("paused").is_some_and(|v| v == "1"),
            shadow: quota("shadow_count", "shadow_period_ms", "shadow_burst")?,
            updated_by: fields.get("updated_by").cloned(),
            updated_at_ms: fields.get("updated_at_ms").and_then(|v| v.parse().ok()),
        })
    }

    /// One line for humans: `20/s burst 1, concurrency 4, paused, shadow 5/s burst 1`.
    pub fn describe(&self) -> String {
        let mut parts = match (self.quota, self.effective) {
            (Some(q), _) => vec![q.to_string()],
            (None, None) => vec!["default quota".to_owned()],
            (None, Some(_)) => vec![],
        };
        if let Some(a) = self.adaptive {
            parts.push(a.to_string());
        }
        if let Some(e) = self.effective {
            parts.push(format!("effective {}", per_second(e)));
        }
        if let Some(c) = self.concurrency {
            parts.push(format!("concurrency {c}"));
        }
        if let Some(w) = self.weight {
            parts.push(format!("weight {w}"));
        }
        if self.paused {
            parts.push("PAUSED".into());
        }
        if let Some(s) = self.shadow {
            parts.push(format!("shadow {s}"));
        }
        parts.join(", ")
    }
}

/// A stored number, if the field is there.
fn parsed<T: std::str::FromStr>(
    fields: &HashMap<String, String>,
    name: &str,
) -> Result<Option<T>, String> {
    fields
        .get(name)
        .map(|v| {
            v.parse()
                .map_err(|_| format!("{name} = {v:?} is not a number"))
        })
        .transpose()
}

/// A rate per second as people read it: `8.16/s`, or per minute or per
/// hour when it is less than one a second (`0.97/h`, not `0/s`).
pub fn per_second(rate: f64) -> String {
    let (count, unit) = if rate >= 1.0 {
        (rate, "s")
    } else if rate * 60.0 >= 1.0 {
        (rate * 60.0, "m")
    } else {
        (rate * 3600.0, "h")
    };
    let text = format!("{count:.2}");
    format!(
        "{}/{unit}",
        text.trim_end_matches('0').trim_end_matches('.')
    )
}

/// One audited change.
#[derive(Clone, Debug)]
pub struct AuditEntry {
    pub at_ms: i64,
    pub target: String,
    pub action: String,
    pub who: String,
    pub source: String,
    pub old: Settings,
    pub new: Settings,
    /// What an action other than a quota change did ("job_id 42",
    /// "replayed 3 of reason exhausted"); `None` for quota changes.
    pub detail: Option<String>,
}

/// How long a tenant stays listed after its last call (`outcomes.lua`'s
/// `STATS_TTL_S`).
pub(crate) const ACTIVE_FOR_S: i64 = 600;

pub struct QuotaStore {
    pub(crate) redis: Arc<Redis>,
    pub(crate) keys: Keys,
    change: Script,
    pub(crate) parked: Script,
    pub(crate) outcomes: Script,
}

impl QuotaStore {
    pub fn new(redis: Arc<Redis>, keys: Keys) -> Self {
        Self {
            redis,
            keys,
            change: Script::new(CHANGE_LUA),
            parked: Script::new(crate::activity::PARKED_LUA),
            outcomes: Script::new(crate::activity::OUTCOMES_LUA),
        }
    }

    pub fn keys(&self) -> &Keys {
        &self.keys
    }

    /// Applies and audits one change; returns the settings before and after.
    pub async fn apply(
        &self,
        target: &Target,
        change: Change,
        actor: &Actor,
    ) -> Result<(Settings, Settings), QuotaError> {
        let (old, new, _) = self.change(target, change, actor, None).await?;
        Ok((old, new))
    }

    /// Applies a quota-baseline entry (identified by `fingerprint`) if the
    /// target holds no quota and this entry was not applied before, or
    /// always with `overwrite`. Returns whether it wrote.
    pub async fn seed(
        &self,
        target: &Target,
        change: Change,
        fingerprint: &str,
        overwrite: bool,
        actor: &Actor,
    ) -> Result<bool, QuotaError> {
        let seed = Some((fingerprint, overwrite));
        let (_, _, written) = self.change(target, change, actor, seed).await?;
        Ok(written)
    }

    /// How many work queues may exist, as last recorded.
    pub async fn work_queues(&self) -> Result<Option<u16>, QuotaError> {
        let mut conn = self.redis.conn().await?;
        let n: Option<u16> = conn
            .get(self.keys.work_queues())
            .await
            .map_err(|e| self.redis.classify(e))?;
        Ok(n)
    }

    pub async fn set_work_queues(&self, n: u16) -> Result<(), QuotaError> {
        let mut conn = self.redis.conn().await?;
        conn.set(self.keys.work_queues(), n)
            .await
            .map_err(|e| self.redis.classify(e))
    }

    /// Whether the quota baseline has an entry for `target` (one was
    /// applied, or found overridden by a live quota).
    pub async fn in_baseline(&self, target: &Target) -> Result<bool, QuotaError> {
        let mut conn = self.redis.conn().await?;
        let marked: bool = conn
            .exists(target.baseline_mark(&self.keys))
            .await
            .map_err(|e| self.redis.classify(e))?;
        if marked {
            return Ok(true);
        }
        conn.hexists(self.keys.legacy_baseline_marks(), target.label())
            .await
            .map_err(|e| self.redis.classify(e))
    }

    async fn change(
        &self,
        target: &Target,
        change: Change,
        actor: &Actor,
        seed: Option<(&str, bool)>,
    ) -> Result<(Settings, Settings, bool), QuotaError> {
        let label = target.label();
        let mut conn = self.redis.conn().await?;
        // Where an older installation kept its baseline marks: read when
        // seeding, carried into the target's own mark by the script.
        let legacy: Option<String> = match seed {
            Some(_) => conn
                .hget(self.keys.legacy_baseline_marks(), &label)
                .await
                .map_err(|e| self.redis.classify(e))?,
            None => None,
        };
        let mut invocation = self.change.key(target.hash(&self.keys));
        invocation
            .key(target.baseline_mark(&self.keys))
            .key(target.adapt(&self.keys));
        if let Target::Tenant(tenant) = target {
            // Its lines of places, which a pause or resume empties.
            invocation
                .key(self.keys.waiting(tenant))
                .key(self.keys.waiting_high(tenant))
                .key(self.keys.waiting_low(tenant));
        }
        invocation
            .arg(&actor.who)
            .arg(legacy.as_deref().unwrap_or(""))
            .arg(seed.map(|(fingerprint, _)| fingerprint).unwrap_or(""))
            .arg(if seed.is_some_and(|(_, overwrite)| overwrite) {
                "1"
            } else {
                "0"
            });
        for (field, value) in change.fields() {
            invocation.arg(field).arg(value);
        }
        let (old, new, written, held, at_ms): (String, String, i64, i64, i64) = invocation
            .invoke_async(&mut conn)
            .await
            .map_err(|e| self.redis.classify(e))?;
        // The rest of the change lives outside the target's slot: its
        // listing, its audit entry, and the older installation's mark,
        // now carried over.
        let mut pipe = redis::pipe();
        if legacy.is_some() {
            pipe.hdel(self.keys.legacy_baseline_marks(), &label)
                .ignore();
        }
        if written == 1 {
            if let Some((set, member)) = target.index(&self.keys) {
                if held == 1 {
                    pipe.sadd(set, member).ignore();
                } else {
                    pipe.srem(set, member).ignore();
                }
            }
            audit_entry(
                &mut pipe,
                &self.keys,
                AuditFields {
                    target: &label,
                    action: change.action(),
                    who: &actor.who,
                    source: actor.source,
                    at_ms,
                    old: &old,
                    new: &new,
                },
            );
        }
        if legacy.is_some() || written == 1 {
            let unfinished = if written == 1 {
                "the change is written, but not its audit entry or listing"
            } else {
                "its baseline mark was not carried over"
            };
            pipe.query_async::<()>(&mut conn).await.map_err(|e| {
                QuotaError::Unavailable(format!(
                    "{label}: {unfinished}: {}",
                    self.redis.classify(e)
                ))
            })?;
        }
        Ok((
            parse_json(target, &old)?,
            parse_json(target, &new)?,
            written == 1,
        ))
    }

    pub async fn get(&self, target: &Target) -> Result<Option<Settings>, QuotaError> {
        let mut conn = self.redis.conn().await?;
        let fields: HashMap<String, String> = conn
            .hgetall(target.hash(&self.keys))
            .await
            .map_err(|e| self.redis.classify(e))?;
        if fields.is_empty() {
            return Ok(None);
        }
        let mut settings =
            Settings::from_fields(&fields).map_err(|reason| QuotaError::BadQuota {
                target: target.label(),
                reason,
            })?;
        if let (Some(quota), Some(adaptive)) = (settings.quota, settings.adaptive) {
            let tuning = adaptive.tuning(quota.rate);
            let learning = self.learning(target, &tuning).await?;
            settings.effective = Some(learning.effective(&tuning));
        }
        Ok(Some(settings))
    }

    /// What an adaptive quota learned so far (nothing learned: the ceiling).
    pub async fn learning(
        &self,
        target: &Target,
        tuning: &tollgate_core::Tuning,
    ) -> Result<Learning, QuotaError> {
        let mut conn = self.redis.conn().await?;
        let f: HashMap<String, String> = conn
            .hgetall(target.adapt(&self.keys))
            .await
            .map_err(|e| self.redis.classify(e))?;
        let bad = |name: &str| QuotaError::BadQuota {
            target: target.label(),
            reason: format!("learned {name} = {:?} is not a number", f.get(name)),
        };
        let float = |name: &str| -> Result<Option<f64>, QuotaError> {
            f.get(name)
                .map(|v| v.parse::<f64>().map_err(|_| bad(name)))
                .transpose()
        };
        let micros = |name: &str| float(name).map(|v| v.map(|v| v as u64));
        let mut learning = Learning::new(tuning);
        learning.rate = float("rate")?.unwrap_or(tuning.ceiling);
        learning.good = float("good")?;
        learning.step = float("step")?.unwrap_or(0.0);
        learning.trial = float("trial")?.is_some_and(|t| t == 1.0);
        learning.resume = float("resume")?.is_some_and(|t| t == 1.0);
        learning.failed = float("failed")?;
        learning.probe_at = micros("probe_at")?.unwrap_or(0);
        learning.probe_wait = micros("probe_wait")?.unwrap_or(0);
        learning.cool_until = micros("cool")?.unwrap_or(0);
        learning.throttled_at = micros("throttled")?;
        learning.unproven = float("unproven")?.is_some_and(|t| t == 1.0);
        learning.window = match micros("win")? {
            Some(start) => Some((start, micros("n")?.unwrap_or(0) as u32)),
            None => None,
        };
        learning.changed_at = micros("changed")?.unwrap_or(0);
        learning.audited = match float("audited")? {
            Some(rate) => Some((rate, micros("audited_at")?.unwrap_or(0))),
            None => None,
        };
        Ok(learning)
    }

    /// Every tenant with stored settings, sorted.
    pub async fn tenants(&self) -> Result<Vec<(TenantId, Settings)>, QuotaError> {
        let names = self.members(&self.keys.tenants()).await?;
        let mut out = Vec::with_capacity(names.len());
        // The set is written only with validated names; anything else was put
        // there by hand and is skipped rather than trusted.
        for tenant in names.into_iter().filter_map(|n| TenantId::parse(n).ok()) {
            if let Some(s) = self.get(&Target::Tenant(tenant.clone())).await? {
                out.push((tenant, s));
            }
        }
        Ok(out)
    }

    /// The tenants whose names start with `prefix` that have stored
    /// settings or had outcomes in the last 10 minutes, sorted by name (one
    /// set read and one sorted-set read).
    pub async fn tenant_names(&self, prefix: &str) -> Result<Vec<TenantId>, QuotaError> {
        let mut names = self.members(&self.keys.tenants()).await?;
        let mut conn = self.redis.conn().await?;
        // Trimmed when written; a fleet gone quiet leaves its last members.
        let since_s = self.now_ms(&mut conn).await? / 1000 - ACTIVE_FOR_S;
        let active: Vec<String> = redis::cmd("ZRANGEBYSCORE")
            .arg(self.keys.active_tenants())
            .arg(since_s)
            .arg("+inf")
            .query_async(&mut conn)
            .await
            .map_err(|e| self.redis.classify(e))?;
        names.extend(active);
        names.sort();
        names.dedup();
        Ok(names
            .into_iter()
            .filter(|n| n.starts_with(prefix))
            .filter_map(|n| TenantId::parse(n).ok())
            .collect())
    }

    /// Every route with a stored shared quota, sorted.
    pub async fn routes(&self) -> Result<Vec<(Kind, Settings)>, QuotaError> {
        let names = self.members(&self.keys.routes()).await?;
        let mut out = Vec::with_capacity(names.len());
        for route in names.into_iter().filter_map(|n| Kind::parse(n).ok()) {
            if let Some(s) = self.get(&Target::Route(route.clone())).await? {
                out.push((route, s));
            }
        }
        Ok(out)
    }

    async fn members(&self, set: &str) -> Result<Vec<String>, QuotaError> {
        let mut conn = self.redis.conn().await?;
        let mut names: Vec<String> = conn
            .smembers(set)
            .await
            .map_err(|e| self.redis.classify(e))?;
        names.retain(|n| !n.is_empty());
        names.sort();
        Ok(names)
    }

    /// Newest first; only `target`'s entries when given. Reads the audit
    /// stream a page at a time from its newest entry and stops at `limit`
    /// entries: reading all of it (up to 100,000 entries, 127 ms of Redis)
    /// for every call made the console's polling of a tenant's history
    /// cost Redis more than the fleet's permits.
    pub async fn history(
        &self,
        target: Option<&Target>,
        limit: usize,
    ) -> Result<Vec<AuditEntry>, QuotaError> {
        let mut conn = self.redis.conn().await?;
        let wanted = target.map(Target::label);
        // Unfiltered, one page holds the answer; filtered, a page is read
        // large enough that a busy stream takes few round trips.
        let page = if wanted.is_some() {
            limit.clamp(HISTORY_PAGE, AUDIT_MAX_LEN as usize)
        } else {
            limit.max(1)
        };
        let mut out = Vec::new();
        let mut before = "+".to_owned();
        while out.len() < limit {
            let raw: redis::streams::StreamRangeReply = conn
                .xrevrange_count(self.keys.audit(), &before, "-", page)
                .await
                .map_err(|e| self.redis.classify(e))?;
            let read = raw.ids.len();
            for entry in raw.ids {
                before = format!("({}", entry.id);
                let text = |name: &str| entry.get::<String>(name).unwrap_or_default();
                let label = text("target");
                if wanted.as_ref().is_some_and(|w| *w != label) {
                    continue;
                }
                let parse = |name: &str| {
                    serde_json_map(&text(name))
                        .and_then(|m| Settings::from_fields(&m).ok())
                        .unwrap_or_default()
                };
                let detail = serde_json_map(&text("new"))
                    .and_then(|m| m.get("detail").or_else(|| m.get("cancelled")).cloned());
                out.push(AuditEntry {
                    detail,
                    at_ms: text("at_ms").parse().unwrap_or(0),
                    action: text("action"),
                    who: text("who"),
                    source: text("source"),
                    old: parse("old"),
                    new: parse("new"),
                    target: label,
                });
                if out.len() >= limit {
                    break;
                }
            }
            if read < page {
                break;
            }
        }
        Ok(out)
    }

    /// Marks a job (by id) or every job with a key as cancelled: it is
    /// skipped at its turn, consuming no quota. Audited.
    pub async fn cancel(
        &self,
        tenant: &TenantId,
        by: &Cancel,
        ttl: Duration,
        actor: &Actor,
    ) -> Result<(), QuotaError> {
        let key = match by {
            Cancel::JobId(id) => self.keys.cancelled_id(tenant, id),
            Cancel::Key(k) => self.keys.cancelled_key(tenant, k),
        };
        let what = by.to_string();
        let mut conn = self.redis.conn().await?;
        let at_ms = self.now_ms(&mut conn).await?;
        let mut pipe = redis::pipe();
        pipe.cmd("SET")
            .arg(&key)
            .arg(&actor.who)
            .arg("PX")
            .arg(ttl.as_millis() as u64)
            .ignore();
        let mut audit = redis::pipe();
        let target = Target::Tenant(tenant.clone()).label();
        let new = format!("{{\"cancelled\":{}}}", json_string(&what));
        self.audit_entry(&mut audit, &target, "cancel", actor, at_ms, &new);
        if self.redis.is_cluster() {
            // Two slots, the tenant's and the installation's: the
            // cancellation first, then its audit entry.
            pipe.query_async::<()>(&mut conn)
                .await
                .map_err(|e| self.redis.classify(e))?;
            return audit
                .query_async::<()>(&mut conn)
                .await
                .map_err(|e| self.redis.classify(e));
        }
        for cmd in audit.cmd_iter() {
            pipe.add_command(cmd.clone()).ignore();
        }
        pipe.atomic()
            .query_async::<()>(&mut conn)
            .await
            .map_err(|e| self.redis.classify(e))
    }

    /// Audits an action that is not a quota change (a dead-letter replay or
    /// purge): `target` is what it acted on (`dlq`), `detail` says what it did.
    pub async fn record(
        &self,
        target: &str,
        action: &str,
        actor: &Actor,
        detail: &str,
    ) -> Result<(), QuotaError> {
        let mut conn = self.redis.conn().await?;
        let at_ms = self.now_ms(&mut conn).await?;
        let mut pipe = redis::pipe();
        let new = format!("{{\"detail\":{}}}", json_string(detail));
        self.audit_entry(&mut pipe, target, action, actor, at_ms, &new);
        pipe.query_async::<()>(&mut conn)
            .await
            .map_err(|e| self.redis.classify(e))
    }

    /// Takes the fleet-wide lock `name` for `holder` for `ttl`, unless someone
    /// holds it: `Ok(Err(holder))` names who does. The lock is released by
    /// [`QuotaStore::unlock`] or lapses after `ttl` (renewed with
    /// [`QuotaStore::renew_lock`]).
    pub async fn try_lock(
        &self,
        name: &str,
        holder: &str,
        ttl: Duration,
    ) -> Result<Result<(), String>, QuotaError> {
        let mut conn = self.redis.conn().await?;
        let key = self.keys.lock(name);
        let (taken, current): (Option<String>, Option<String>) = redis::pipe()
            .cmd("SET")
            .arg(&key)
            .arg(holder)
            .arg("NX")
            .arg("PX")
            .arg(ttl.as_millis() as u64)
            .cmd("GET")
            .arg(&key)
            .query_async(&mut conn)
            .await
            .map_err(|e| self.redis.classify(e))?;
        Ok(match taken {
            Some(_) => Ok(()),
            None => Err(current.unwrap_or_else(|| "someone".into())),
        })
    }

    /// Extends the lock `name` by `ttl` if `holder` still holds it; false
    /// when it lapsed (or someone else took it since).
    pub async fn renew_lock(
        &self,
        name: &str,
        holder: &str,
        ttl: Duration,
    ) -> Result<bool, QuotaError> {
        let mut conn = self.redis.conn().await?;
        let renewed: i64 = Script::new(RENEW_LOCK_LUA)
            .key(self.keys.lock(name))
            .arg(holder)
            .arg(ttl.as_millis() as u64)
            .invoke_async(&mut conn)
            .await
            .map_err(|e| self.redis.classify(e))?;
        Ok(renewed == 1)
    }

    /// Releases the lock `name` if `holder` still holds it.
    pub async fn unlock(&self, name: &str, holder: &str) -> Result<(), QuotaError> {
        let mut conn = self.redis.conn().await?;
        Script::new(RENEW_LOCK_LUA)
            .key(self.keys.lock(name))
            .arg(holder)
            .arg(0)
            .invoke_async::<i64>(&mut conn)
            .await
            .map_err(|e| self.redis.classify(e))?;
        Ok(())
    }

    /// Redis's clock, in milliseconds (every pod agrees on it).
    async fn now_ms(&self, conn: &mut crate::Conn) -> Result<i64, QuotaError> {
        // The clock of the node that holds the keys, as the scripts read it.
        let (secs, micros): (i64, i64) = conn
            .query_near(&redis::cmd("TIME"), &self.keys.audit())
            .await
            .map_err(|e| self.redis.classify(e))?;
        Ok(secs * 1000 + micros / 1000)
    }

    /// Appends one audit entry by `actor` to `pipe`.
    fn audit_entry(
        &self,
        pipe: &mut redis::Pipeline,
        target: &str,
        action: &str,
        actor: &Actor,
        at_ms: i64,
        new: &str,
    ) {
        audit_entry(
            pipe,
            &self.keys,
            AuditFields {
                target,
                action,
                who: &actor.who,
                source: actor.source,
                at_ms,
                old: "{}",
                new,
            },
        );
    }

    /// Deletes every key under this prefix (tests, demo, bench cleanup).
    pub async fn purge_prefix(&self) -> Result<u64, QuotaError> {
        let keys = self.redis.keys_matching(&self.keys.all_pattern()).await?;
        let mut conn = self.redis.conn().await?;
        let mut deleted = 0;
        for chunk in keys.chunks(1000) {
            // On a cluster the keys of several slots: the connection splits
            // the command by slot and adds the counts up.
            deleted += redis::cmd("UNLINK")
                .arg(chunk)
                .query_async::<u64>(&mut conn)
                .await
                .map_err(|e| self.redis.classify(e))?;
        }
        Ok(deleted)
    }
}

/// One entry of the audit stream.
pub(crate) struct AuditFields<'a> {
    pub target: &'a str,
    pub action: &'a str,
    pub who: &'a str,
    pub source: &'a str,
    pub at_ms: i64,
    pub old: &'a str,
    pub new: &'a str,
}

/// Appends one audit entry to `pipe`.
pub(crate) fn audit_entry(pipe: &mut redis::Pipeline, keys: &Keys, e: AuditFields<'_>) {
    pipe.cmd("XADD")
        .arg(keys.audit())
        .arg("MAXLEN")
        .arg("~")
        .arg(AUDIT_MAX_LEN)
        .arg("*")
        .arg(&[
            ("target", e.target),
            ("action", e.action),
            ("who", e.who),
            ("source", e.source),
            ("at_ms", &e.at_ms.to_string()),
            ("old", e.old),
            ("new", e.new),
        ])
        .ignore();
}

/// What to cancel.
#[derive(Clone, Debug)]
pub enum Cancel {
    JobId(JobId),
    Key(IdempotencyKey),
}

impl std::fmt::Display for Cancel {
    /// `job_id 42` or `idempotency_key k-1`, as the audit records it.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Cancel::JobId(id) => write!(f, "job_id {id}"),
            Cancel::Key(key) => write!(f, "idempotency_key {key}"),
        }
    }
}

fn parse_json(target: &Target, json: &str) -> Result<Settings, QuotaError> {
    let map =
        serde_json_map(json).ok_or_else(|| QuotaError::BadReply(format!("audit json {json:?}")))?;
    Settings::from_fields(&map).map_err(|reason| QuotaError::BadQuota {
        target: target.label(),
        reason,
    })
}

/// A flat JSON object of strings (what the change script encodes).
fn serde_json_map(json: &str) -> Option<HashMap<String, String>> {
    let value: serde_json::Value = serde_json::from_str(json).ok()?;
    let object = value.as_object()?;
    Some(
        object
            .iter()
            .map(|(k, v)| {
                (
                    k.clone(),
                    v.as_str()
                        .map(str::to_owned)
                        .unwrap_or_else(|| v.to_string()),
                )
            })
            .collect(),
    )
}

fn json_string(s: &str) -> String {
    serde_json::Value::String(s.to_owned()).to_string()
}

#[cfg(test)]
mod shown {
    use super::per_second;

    #[test]
    fn a_rate_below_one_a_second_is_shown_per_minute_or_hour() {
        assert_eq!(per_second(8.16), "8.16/s");
        assert_eq!(per_second(20.0), "20/s");
        assert_eq!(per_second(1.0 / 60.0), "1/m");
        assert_eq!(per_second(0.5), "30/m");
        assert_eq!(per_second(17.0 / 3600.0), "17/h");
        assert_eq!(per_second(0.97 / 3600.0), "0.97/h");
    }
}
