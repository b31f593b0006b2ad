//! Any bytes a producer can publish go through `decode`: it must never
//! panic, and whatever it accepts must satisfy the contract the rest of
//! tollgate relies on.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tollgate_core::job::{Limits, decode};
use tollgate_core::TenantId;

fuzz_target!(|data: &[u8]| {
    let limits = Limits {
        max_body_bytes: 64 * 1024,
        max_depth: 32,
    };
    if let Ok(job) = decode(data, &limits) {
        // Accepted jobs hold only validated values…
        assert!(TenantId::parse(job.tenant.as_str()).is_ok());
        assert!(!job.id.as_str().is_empty() && job.id.as_str().chars().count() <= 128);
        assert!(!job.tenant.as_str().contains(['{', '}']));
        if let (Some(due), Some(exp)) = (job.due_at, job.expires_at) {
            assert!(exp >= due);
        }
        // …and survive their own encoding unchanged.
        let again = decode(&job.to_json(), &Limits { max_body_bytes: usize::MAX, max_depth: usize::MAX })
            .expect("an accepted job re-encodes to a valid job");
        assert_eq!(again.id, job.id);
        assert_eq!(again.tenant, job.tenant);
        assert_eq!(again.idempotency_key, job.idempotency_key);
        assert_eq!(again.due_at, job.due_at);
        assert_eq!(again.payload.get(), job.payload.get());
    }
});
