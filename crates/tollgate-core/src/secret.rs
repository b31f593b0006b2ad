//! Values that must never reach a log line: URLs that may carry a password
//! and bare secrets. Their `Debug` and `Display` show nothing secret; the
//! real value is read through `expose`, by the one call that needs it.

use std::fmt;

use serde::{Deserialize, Serialize};

/// A URL that may carry a password: `Debug` and `Display` redact it.
#[derive(Clone, Deserialize, Serialize, PartialEq, Eq)]
#[serde(transparent)]
pub struct SecretUrl(String);

impl SecretUrl {
    pub fn new(url: impl Into<String>) -> Self {
        Self(url.into())
    }

    /// The real URL, for the one call that connects with it.
    pub fn expose(&self) -> &str {
        &self.0
    }

    pub fn redacted(&self) -> String {
        redact_url(&self.0)
    }
}

impl fmt::Debug for SecretUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}", self.redacted())
    }
}

impl fmt::Display for SecretUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.redacted())
    }
}

/// A secret string; `Debug` prints nothing of it.
#[derive(Clone, Deserialize, Serialize, PartialEq, Eq)]
#[serde(transparent)]
pub struct Secret(String);

impl Secret {
    pub fn new(secret: impl Into<String>) -> Self {
        Self(secret.into())
    }

    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(REDACTED)")
    }
}

/// Replaces the password of a URL-like string (`scheme://user:password@host…`)
/// with `REDACTED`, even in a string no URL parser would accept. Whatever
/// sits between `://` and the last `@` of the authority is credentials: the
/// user name is kept, the rest replaced. A list of URLs separated by commas
/// (the nodes of a cluster) has each one's password replaced.
pub fn redact_url(raw: &str) -> String {
    raw.split(',').map(redact_one).collect::<Vec<_>>().join(",")
}

fn redact_one(raw: &str) -> String {
    let Some(scheme_end) = raw.find("://").map(|i| i + 3) else {
        return raw.to_owned();
    };
    let rest = &raw[scheme_end..];
    let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let Some(at) = rest[..authority_end].rfind('@') else {
        return raw.to_owned();
    };
    let credentials = &rest[..at];
    let shown = match credentials.split_once(':') {
        Some((user, _password)) => format!("{user}:REDACTED"),
        // No password, or a string too broken to tell: hide it all.
        None if credentials.is_empty() => String::new(),
        None => "REDACTED".to_owned(),
    };
    format!("{}{shown}{}", &raw[..scheme_end], &rest[at..])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passwords_never_show() {
        assert_eq!(
            redact_url("amqp://guest:s3cret@rabbit:5672/%2f"),
            "amqp://guest:REDACTED@rabbit:5672/%2f"
        );
        assert_eq!(
            redact_url("redis://:s3cret@redis:6379"),
            "redis://:REDACTED@redis:6379"
        );
        assert_eq!(
            redact_url("https://user:p@ss@provider.example/send?x=@"),
            "https://user:REDACTED@provider.example/send?x=@"
        );
        assert_eq!(redact_url("amqp://u:p@[bad"), "amqp://u:REDACTED@[bad");
        assert_eq!(
            redact_url("redis://127.0.0.1:6379"),
            "redis://127.0.0.1:6379"
        );
        assert_eq!(redact_url("not a url"), "not a url");
        assert_eq!(
            redact_url("amqp://u:one@a/%2f,amqp://u:two@b/%2f"),
            "amqp://u:REDACTED@a/%2f,amqp://u:REDACTED@b/%2f"
        );
        let url = SecretUrl::new("amqp://guest:canary@rabbit/%2f");
        assert!(!format!("{url:?} {url}").contains("canary"));
        assert!(!format!("{:?}", Secret::new("canary")).contains("canary"));
    }
}
