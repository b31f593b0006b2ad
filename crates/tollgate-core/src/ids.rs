//! Validated identifiers. Everything inside tollgate handles these newtypes,
//! never an unchecked string: Redis keys and metric labels are built only from
//! values that passed these checks.

use std::fmt;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum IdError {
    #[error("{what} is empty")]
    Empty { what: &'static str },
    #[error("{what} is {len} characters long, the limit is {max}")]
    TooLong {
        what: &'static str,
        len: usize,
        max: usize,
    },
    #[error(
        "{what} starts or ends with whitespace, which HTTP drops from a header value: \
         the provider would see another {what}"
    )]
    Padded { what: &'static str },
    #[error(
        "{what} starts with {prefix:?}, which names a route's keys in Redis: a {what} so named \
         would share the route's quota"
    )]
    Reserved {
        what: &'static str,
        prefix: &'static str,
    },
    #[error("{what} contains {found:?}; allowed: {allowed}")]
    BadChar {
        what: &'static str,
        found: char,
        allowed: &'static str,
    },
}

fn check(
    what: &'static str,
    s: &str,
    max: usize,
    allowed: &'static str,
    ok: impl Fn(char) -> bool,
) -> Result<(), IdError> {
    if s.is_empty() {
        return Err(IdError::Empty { what });
    }
    if s.starts_with(char::is_whitespace) || s.ends_with(char::is_whitespace) {
        return Err(IdError::Padded { what });
    }
    let len = s.chars().count();
    if len > max {
        return Err(IdError::TooLong { what, len, max });
    }
    match s.chars().find(|&c| !ok(c)) {
        Some(found) => Err(IdError::BadChar {
            what,
            found,
            allowed,
        }),
        None => Ok(()),
    }
}

macro_rules! id_type {
    ($(#[$doc:meta])* $name:ident, $what:literal, $max:expr, $allowed:literal, $ok:expr) => {
        id_type!($(#[$doc])* $name, $what, $max, $allowed, $ok, |_: &str| Ok(()));
    };
    ($(#[$doc:meta])* $name:ident, $what:literal, $max:expr, $allowed:literal, $ok:expr,
     $also:expr) => {
        $(#[$doc])*
        #[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
        pub struct $name(String);

        impl $name {
            pub const MAX_LEN: usize = $max;

            pub fn parse(s: impl Into<String>) -> Result<Self, IdError> {
                let s = s.into();
                check($what, &s, $max, $allowed, $ok)?;
                ($also)(s.as_str())?;
                Ok(Self(s))
            }

            pub fn as_str(&self) -> &str {
                &self.0
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }

        impl AsRef<str> for $name {
            fn as_ref(&self) -> &str {
                &self.0
            }
        }
    };
}

fn tenant_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | ':' | '-')
}

fn kind_char(c: char) -> bool {
    c.is_ascii_lowercase() || c.is_ascii_digit() || matches!(c, '_' | '-' | '.')
}

/// Printable text: no control characters (they break logs and terminals).
fn printable(c: char) -> bool {
    !c.is_control()
}

/// What a tenant may not start with: a route's Redis keys carry the hash
/// tag `{route:<kind>}`, and a tenant's `{<tenant>}`.
pub const RESERVED_TENANT_PREFIX: &str = "route:";

id_type!(
    /// A tenant: `[A-Za-z0-9._:-]{1,64}`, not starting with `route:`. Also
    /// the AMQP routing key and the Redis hash tag, so the charset excludes
    /// `{`, `}`, `*`, `#` and spaces; a tenant named `route:email` would
    /// have the route `email`'s keys.
    TenantId, "tenant", 64, "A-Z a-z 0-9 . _ : -", tenant_char,
    |s: &str| match s.starts_with(RESERVED_TENANT_PREFIX) {
        true => Err(IdError::Reserved { what: "tenant", prefix: RESERVED_TENANT_PREFIX }),
        false => Ok(()),
    }
);
id_type!(
    /// A job id chosen by the producer, unique per job.
    JobId, "id", 128, "printable characters", printable
);
id_type!(
    /// The key that makes a send happen at most once; survives every retry.
    IdempotencyKey, "idempotency_key", 256, "printable characters", printable
);
id_type!(
    /// Selects the provider route; `default` when absent.
    Kind, "kind", 32, "a-z 0-9 . _ -", kind_char
);

impl Kind {
    pub fn default_kind() -> Self {
        Self("default".to_owned())
    }
}

impl From<&JobId> for IdempotencyKey {
    fn from(id: &JobId) -> Self {
        // A JobId is at most 128 printable characters, so it is always a valid key.
        Self(id.0.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tenant_charset_is_enforced() {
        assert!(TenantId::parse("acme").is_ok());
        assert!(TenantId::parse("eu-west:acme_2.prod").is_ok());
        assert_eq!(TenantId::parse(""), Err(IdError::Empty { what: "tenant" }));
        assert!(matches!(
            TenantId::parse("a{b}"),
            Err(IdError::BadChar { found: '{', .. })
        ));
        assert!(matches!(
            TenantId::parse("a\nb"),
            Err(IdError::BadChar { found: '\n', .. })
        ));
        assert!(matches!(
            TenantId::parse("x".repeat(65)),
            Err(IdError::TooLong { len: 65, .. })
        ));
        assert!(TenantId::parse("x".repeat(64)).is_ok());
        // A route's keys are tagged `{route:<kind>}`: no tenant has them.
        assert!(matches!(
            TenantId::parse("route:email"),
            Err(IdError::Reserved { .. })
        ));
        assert!(TenantId::parse("router:email").is_ok());
        assert!(TenantId::parse("eu:route:email").is_ok());
    }

    #[test]
    fn job_id_rejects_control_characters() {
        assert!(JobId::parse("job-1 ünïcode").is_ok());
        assert!(JobId::parse("job\u{0}").is_err());
        assert!(JobId::parse("j".repeat(129)).is_err());
    }

    /// A provider reads `Idempotency-Key: dup-1 ` as `dup-1` (HTTP drops a
    /// header value's outer whitespace), and `"   "` as no key at all.
    #[test]
    fn ids_and_keys_with_outer_whitespace_are_refused() {
        for padded in ["   ", " dup-1", "dup-1 ", "dup-1\u{a0}", "\tx"] {
            assert_eq!(
                IdempotencyKey::parse(padded),
                Err(IdError::Padded {
                    what: "idempotency_key"
                }),
                "{padded:?}"
            );
            assert!(JobId::parse(padded).is_err(), "{padded:?}");
        }
        assert!(
            IdempotencyKey::parse("dup 1").is_ok(),
            "inner spaces are kept"
        );
    }
}
