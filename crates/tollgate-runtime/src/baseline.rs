//! The quota baseline: a declarative TOML file (`TOLLGATE_QUOTAS_FILE`,
//! mounted from a ConfigMap in Kubernetes) that workers seed into Redis
//! whenever a quota it names is missing — after a Redis restart or failover
//! lost the live state. Live changes override it (seeding never overwrites a
//! stored quota) until an operator deliberately resets to it
//! (`tollgate quota seed --overwrite`). A deliberate `quota delete` stands
//! too: Redis remembers which version of each entry was applied, and only a
//! changed entry (or lost Redis state) is seeded again. Workers re-read the
//! file at every pass, so an edited ConfigMap applies without a restart.
//! `tollgate quota export` writes the live state in the same format.
//!
//! ```toml
//! [default]
//! rate = "10/s"
//! burst = 1
//!
//! [tenants.acme]
//! rate = "20/s"
//! burst = 1
//! concurrency = 4
//! weight = 3          # its part of the routes it shares (default 1)
//!
//! [tenants.globex]
//! rate = "20/s"        # the ceiling: the rate is learned from the provider's 429s
//! adaptive = { min = "1/s" }   # also decrease, increase, probe_s
//!
//! [routes.email]
//! rate = "100/s"
//! ```

use std::collections::BTreeMap;

use anyhow::Context;
use serde::{Deserialize, Serialize};
use tollgate_core::{Adaptive, Kind, Quota, TenantId};
use tollgate_quota::{Actor, Change, QuotaStore, Settings, Target};

#[derive(Clone, Debug, Default, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Baseline {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub default: Option<Entry>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub tenants: BTreeMap<String, Entry>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub routes: BTreeMap<String, Entry>,
}

#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Entry {
    pub rate: String,
    #[serde(default = "tollgate_core::default_burst")]
    pub burst: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub concurrency: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weight: Option<u32>,
    /// The rate is a ceiling; the quota learns the provider's limit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub adaptive: Option<AdaptiveEntry>,
}

/// An adaptive quota's parameters; each left out takes its default.
#[derive(Clone, Debug, Default, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct AdaptiveEntry {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decrease: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub increase: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub probe_s: Option<f64>,
}

impl AdaptiveEntry {
    /// Checked against the quota's rate, its ceiling.
    pub fn parse(
        &self,
        ceiling: tollgate_core::Rate,
    ) -> Result<Adaptive, tollgate_core::quota::QuotaError> {
        Adaptive::parse(
            ceiling,
            self.min.as_deref(),
            self.decrease,
            self.increase,
            self.probe_s,
        )
    }
}

impl Entry {
    /// Names this version of the entry: a changed entry is seeded again
    /// even where its quota was deleted.
    fn fingerprint(&self) -> String {
        let mut f = format!(
            "rate={};burst={};concurrency={}",
            self.rate,
            self.burst,
            self.concurrency.map(|c| c.to_string()).unwrap_or_default()
        );
        // Entries written before weights existed keep their fingerprint.
        if let Some(w) = self.weight {
            f.push_str(&format!(";weight={w}"));
        }
        if let Some(a) = &self.adaptive {
            f.push_str(&format!(
                ";adaptive={}/{:?}/{:?}/{:?}",
                a.min.as_deref().unwrap_or_default(),
                a.decrease,
                a.increase,
                a.probe_s
            ));
        }
        f
    }

    fn from_settings(s: &Settings) -> Option<Self> {
        s.quota.map(|q| Self {
            rate: q.rate.to_string(),
            burst: q.burst,
            concurrency: s.concurrency,
            weight: s.weight,
            adaptive: s.adaptive.map(|a| AdaptiveEntry {
                min: Some(a.min.to_string()),
                decrease: Some(a.decrease),
                increase: Some(a.increase),
                probe_s: Some(a.probe.as_secs_f64()),
            }),
        })
    }
}

/// Who seeding acts as, in the audit trail.
fn actor() -> Actor {
    Actor {
        who: "baseline".into(),
        source: "baseline",
    }
}

impl Baseline {
    pub fn load(path: &str) -> anyhow::Result<Self> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading the quota baseline {path}"))?;
        let baseline: Baseline =
            toml::from_str(&text).with_context(|| format!("parsing the quota baseline {path}"))?;
        baseline
            .changes()
            .with_context(|| format!("the quota baseline {path}"))?;
        Ok(baseline)
    }

    /// Every entry as a validated (target, change, fingerprint).
    pub fn changes(&self) -> anyhow::Result<Vec<(Target, Change, String)>> {
        let change = |e: &Entry| -> anyhow::Result<Change> {
            let quota = Quota::parse(&e.rate, e.burst).context("rate")?;
            let adaptive = e
                .adaptive
                .as_ref()
                .map(|a| a.parse(quota.rate))
                .transpose()
                .context("adaptive")?;
            Ok(Change::SetQuota {
                quota,
                concurrency: e.concurrency.map(tollgate_core::concurrency).transpose()?,
                weight: e.weight.map(tollgate_core::weight).transpose()?,
                adaptive,
            })
        };
        let mut out = Vec::new();
        if let Some(d) = &self.default {
            anyhow::ensure!(
                d.concurrency.is_none() && d.weight.is_none(),
                "[default]: concurrency and weight apply to tenants"
            );
            anyhow::ensure!(
                d.adaptive.is_none(),
                "[default]: {}",
                tollgate_core::adaptive::NOT_FOR_DEFAULT
            );
            out.push((Target::Default, change(d)?, d.fingerprint()));
        }
        for (name, e) in &self.tenants {
            let tenant =
                TenantId::parse(name.as_str()).with_context(|| format!("[tenants.{name}]"))?;
            out.push((
                Target::Tenant(tenant),
                change(e).with_context(|| format!("[tenants.{name}]"))?,
                e.fingerprint(),
            ));
        }
        for (name, e) in &self.routes {
            let route = Kind::parse(name.as_str()).with_context(|| format!("[routes.{name}]"))?;
            anyhow::ensure!(
                e.concurrency.is_none() && e.weight.is_none(),
                "[routes.{name}]: concurrency and weight apply to tenants"
            );
            out.push((
                Target::Route(route),
                change(e).with_context(|| format!("[routes.{name}]"))?,
                e.fingerprint(),
            ));
        }
        Ok(out)
    }

    /// Writes every entry whose quota Redis does not hold, unless that
    /// same entry was applied before and its quota deliberately deleted
    /// since (all of them with `overwrite`); returns the targets written.
    /// Pause, shadow quotas and anything not in the baseline are left alone.
    pub async fn seed(&self, store: &QuotaStore, overwrite: bool) -> anyhow::Result<Vec<Target>> {
        let mut written = Vec::new();
        for (target, change, fingerprint) in self.changes()? {
            if store
                .seed(&target, change, &fingerprint, overwrite, &actor())
                .await?
            {
                written.push(target);
            }
        }
        Ok(written)
    }

    /// The live state in the baseline's format.
    pub async fn export(store: &QuotaStore) -> anyhow::Result<Self> {
        let mut baseline = Baseline {
            default: store
                .get(&Target::Default)
                .await?
                .as_ref()
                .and_then(Entry::from_settings),
            ..Baseline::default()
        };
        for (tenant, s) in store.tenants().await? {
            if let Some(e) = Entry::from_settings(&s) {
                baseline.tenants.insert(tenant.to_string(), e);
            }
        }
        for (route, s) in store.routes().await? {
            if let Some(e) = Entry::from_settings(&s) {
                baseline.routes.insert(route.to_string(), e);
            }
        }
        Ok(baseline)
    }
}

/// The quota a baseline entry stands for (for tests and tools).
pub fn quota_of(entry: &Entry) -> anyhow::Result<Quota> {
    Ok(Quota::parse(&entry.rate, entry.burst)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_validates_and_round_trips() {
        let text = r#"
            [default]
            rate = "5/s"

            [tenants.acme]
            rate = "20/s"
            concurrency = 4
            weight = 3

            [routes.email]
            rate = "100/s"
            burst = 10
        "#;
        let baseline: Baseline = toml::from_str(text).unwrap();
        let changes = baseline.changes().unwrap();
        assert_eq!(changes.len(), 3);
        assert_eq!(
            quota_of(&baseline.tenants["acme"]).unwrap().to_string(),
            "20/s burst 1"
        );
        assert!(changes.iter().any(|(_, change, fingerprint)| matches!(
            change,
            Change::SetQuota {
                weight: Some(3),
                ..
            }
        )
            && fingerprint.ends_with(";weight=3")));
        let again: Baseline = toml::from_str(&toml::to_string(&baseline).unwrap()).unwrap();
        assert_eq!(again, baseline);
    }

    #[test]
    fn the_shipped_baseline_is_valid() {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../deploy/kubernetes/base/quotas.toml"
        );
        let baseline = Baseline::load(path).unwrap();
        assert_eq!(baseline.default.map(|d| d.rate), Some("10/s".to_owned()));
    }

    #[test]
    fn rejects_bad_entries_with_their_name() {
        let bad: Baseline = toml::from_str("[tenants.\"a b\"]\nrate = \"1/s\"").unwrap();
        assert!(format!("{:#}", bad.changes().unwrap_err()).contains("[tenants.a b]"));
        let bad: Baseline = toml::from_str("[tenants.acme]\nrate = \"lots\"").unwrap();
        assert!(format!("{:#}", bad.changes().unwrap_err()).contains("rate \"lots\""));
        assert!(toml::from_str::<Baseline>("[tenants.acme]\nrate = \"1/s\"\ntypo = 1").is_err());
        let bad: Baseline = toml::from_str("[tenants.acme]\nrate = \"1/s\"\nweight = 0").unwrap();
        let message = format!("{:#}", bad.changes().unwrap_err());
        assert!(
            message.contains("[tenants.acme]") && message.contains("weight 0"),
            "{message}"
        );
        let bad: Baseline =
            toml::from_str("[tenants.acme]\nrate = \"1/s\"\nconcurrency = 0").unwrap();
        let message = format!("{:#}", bad.changes().unwrap_err());
        assert!(
            message.contains("concurrency must be at least 1"),
            "{message}"
        );
        let bad: Baseline =
            toml::from_str("[tenants.acme]\nrate = \"1/s\"\nadaptive = { probe_s = 1e300 }")
                .unwrap();
        let message = format!("{:#}", bad.changes().unwrap_err());
        assert!(message.contains("--probe"), "{message}");
        let bad: Baseline = toml::from_str("[routes.email]\nrate = \"1/s\"\nweight = 2").unwrap();
        assert!(format!("{:#}", bad.changes().unwrap_err()).contains("weight apply to tenants"));
    }

    #[test]
    fn adaptive_entries_are_checked_and_round_trip() {
        let text = r#"
            [tenants.globex]
            rate = "20/s"
            adaptive = { min = "2/s", probe_s = 8 }

            [routes.email]
            rate = "100/s"
            adaptive = {}
        "#;
        let baseline: Baseline = toml::from_str(text).unwrap();
        let changes = baseline.changes().unwrap();
        let adaptive: Vec<Adaptive> = changes
            .iter()
            .filter_map(|(_, change, _)| match change {
                Change::SetQuota { adaptive, .. } => *adaptive,
                _ => None,
            })
            .collect();
        assert_eq!(adaptive.len(), 2);
        assert!(adaptive.iter().any(|a| a.min.to_string() == "2/s"
            && a.probe == std::time::Duration::from_secs(8)
            && a.decrease == Adaptive::DEFAULT_DECREASE));
        assert!(
            adaptive.iter().any(|a| a.min.to_string() == "5/s"),
            "5 % of 100/s"
        );
        // A changed parameter is a new version of the entry (seeded again).
        let mut changed = baseline.clone();
        changed
            .tenants
            .get_mut("globex")
            .unwrap()
            .adaptive
            .as_mut()
            .unwrap()
            .min = Some("3/s".into());
        assert_ne!(
            changed.tenants["globex"].fingerprint(),
            baseline.tenants["globex"].fingerprint()
        );
        let again: Baseline = toml::from_str(&toml::to_string(&baseline).unwrap()).unwrap();
        assert_eq!(again, baseline);

        for (text, says) in [
            (
                "[tenants.acme]\nrate = \"5/s\"\nadaptive = { min = \"9/s\" }",
                "--min 9/s is above the rate 5/s",
            ),
            (
                "[tenants.acme]\nrate = \"5/s\"\nadaptive = { slow = true }",
                "unknown field",
            ),
            ("[default]\nrate = \"5/s\"\nadaptive = {}", "the default"),
        ] {
            let message = match toml::from_str::<Baseline>(text) {
                Ok(bad) => format!("{:#}", bad.changes().unwrap_err()),
                Err(e) => e.to_string(),
            };
            assert!(message.contains(says), "{text}: {message}");
        }
    }
}
