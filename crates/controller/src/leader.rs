//! Leader election on a `coordination.k8s.io/v1` Lease: one replica reconciles, every replica
//! serves the webhook (claims are atomic on the lineage records, so the webhook needs no
//! leader). A replica that cannot renew within the lease duration stops leading by exiting
//! (its Deployment restarts it as a follower): never two leaders acting at once for longer than
//! the clock skew.

use std::time::Duration;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use kube::api::{Api, ObjectMeta, PostParams};

use crate::{now_ms, Error, Result};

/// The lease to hold.
#[derive(Debug, Clone)]
pub struct LeaseConfig {
    pub namespace: String,
    pub name: String,
    /// This replica (its pod name).
    pub identity: String,
    /// How long a lease holds without renewal.
    pub duration: Duration,
    /// How often the holder renews (and a follower retries).
    pub renew_every: Duration,
}

fn micro_ms(t: &MicroTime) -> u64 {
    u64::try_from(t.0.as_millisecond()).unwrap_or(0)
}

fn micro(ms: u64) -> MicroTime {
    MicroTime(k8s_openapi::jiff::Timestamp::from_millisecond(ms as i64).unwrap_or_default())
}

/// Whether `identity` may take (or keep) the lease at `now_ms`: it is free, ours, or expired.
pub fn may_take(spec: &LeaseSpec, identity: &str, now_ms: u64) -> bool {
    let holder = spec.holder_identity.as_deref().unwrap_or("");
    if holder.is_empty() || holder == identity {
        return true;
    }
    let duration_ms = u64::try_from(spec.lease_duration_seconds.unwrap_or(15)).unwrap_or(15) * 1000;
    let renewed = spec
        .renew_time
        .as_ref()
        .or(spec.acquire_time.as_ref())
        .map_or(0, micro_ms);
    renewed.saturating_add(duration_ms) < now_ms
}

/// One attempt to acquire or renew; true when this replica holds the lease afterwards.
pub async fn try_hold(api: &Api<Lease>, cfg: &LeaseConfig) -> Result<bool> {
    let now = now_ms();
    let secs = i32::try_from(cfg.duration.as_secs()).unwrap_or(15);
    let Some(mut lease) = api.get_opt(&cfg.name).await? else {
        let lease = Lease {
            metadata: ObjectMeta {
                name: Some(cfg.name.clone()),
                ..Default::default()
            },
            spec: Some(LeaseSpec {
                holder_identity: Some(cfg.identity.clone()),
                lease_duration_seconds: Some(secs),
                acquire_time: Some(micro(now)),
                renew_time: Some(micro(now)),
                lease_transitions: Some(0),
                ..Default::default()
            }),
        };
        return match api.create(&PostParams::default(), &lease).await {
            Ok(_) => Ok(true),
            Err(kube::Error::Api(s)) if s.code == 409 => Ok(false),
            Err(e) => Err(e.into()),
        };
    };
    let spec = lease.spec.get_or_insert_with(LeaseSpec::default);
    if !may_take(spec, &cfg.identity, now) {
        return Ok(false);
    }
    if spec.holder_identity.as_deref() != Some(&cfg.identity) {
        spec.holder_identity = Some(cfg.identity.clone());
        spec.acquire_time = Some(micro(now));
        spec.lease_transitions = Some(spec.lease_transitions.unwrap_or(0) + 1);
    }
    spec.renew_time = Some(micro(now));
    spec.lease_duration_seconds = Some(secs);
    match api.replace(&cfg.name, &PostParams::default(), &lease).await {
        Ok(_) => Ok(true),
        Err(kube::Error::Api(s)) if s.code == 409 => Ok(false),
        Err(e) => Err(e.into()),
    }
}

/// Gives the lease up (on a clean shutdown), so a follower takes over at once instead of after
/// the lease duration. Best effort.
pub async fn release(api: &Api<Lease>, cfg: &LeaseConfig) {
    let Ok(Some(mut lease)) = api.get_opt(&cfg.name).await else {
        return;
    };
    let Some(spec) = lease.spec.as_mut() else {
        return;
    };
    if spec.holder_identity.as_deref() != Some(&cfg.identity) {
        return;
    }
    spec.holder_identity = None;
    spec.renew_time = None;
    if let Err(e) = api.replace(&cfg.name, &PostParams::default(), &lease).await {
        tracing::debug!(error = %e, "lease release");
    }
}

/// Waits until this replica holds the lease.
pub async fn acquire(api: &Api<Lease>, cfg: &LeaseConfig) {
    loop {
        match try_hold(api, cfg).await {
            Ok(true) => return,
            Ok(false) => {}
            Err(e) => tracing::warn!(error = %e, "lease"),
        }
        tokio::time::sleep(cfg.renew_every).await;
    }
}

/// Renews the lease until it cannot be renewed for a whole lease duration; then returns the
/// error (the caller stops leading).
pub async fn keep(api: &Api<Lease>, cfg: &LeaseConfig) -> Error {
    let mut last_ok = now_ms();
    loop {
        tokio::time::sleep(cfg.renew_every).await;
        match try_hold(api, cfg).await {
            Ok(true) => last_ok = now_ms(),
            Ok(false) => return Error::LeaseLost("lost to another replica"),
            Err(e) => {
                tracing::warn!(error = %e, "lease renewal");
                if now_ms().saturating_sub(last_ok) >= cfg.duration.as_millis() as u64 {
                    return Error::LeaseLost("could not be renewed in time");
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lease_rules() {
        let spec = |holder: Option<&str>, renewed: u64| LeaseSpec {
            holder_identity: holder.map(str::to_owned),
            lease_duration_seconds: Some(15),
            renew_time: Some(micro(renewed)),
            ..Default::default()
        };
        assert!(may_take(&spec(None, 0), "a", 1_000));
        assert!(may_take(&spec(Some("a"), 1_000), "a", 2_000));
        assert!(!may_take(&spec(Some("b"), 1_000), "a", 2_000));
        assert!(!may_take(&spec(Some("b"), 1_000), "a", 16_000));
        assert!(may_take(&spec(Some("b"), 1_000), "a", 16_001));
    }
}
