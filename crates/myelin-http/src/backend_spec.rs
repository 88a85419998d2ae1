//! Parsing of backend specifications: `URL[,kv-events=ENDPOINT][,kv-replay=ENDPOINT]
//! [,capacity-tokens=N]`, the way an engine is named to `myelin serve` (`--backend`, env and
//! config file) and to `myelin bench --engine`: one grammar and one set of errors for both.

use std::fmt;

/// One inference engine the router sends requests to, as configured by the user.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BackendSpec {
    /// Base URL of the engine's OpenAI API, without a trailing slash (`http://h:8000`, or
    /// `https://h:8443` for an engine behind TLS).
    pub url: String,
    /// `host:port` the HTTP client connects to, taken from the URL.
    pub authority: String,
    /// The engine's vLLM KV-event publisher endpoint (`tcp://h:5557`), when it has one.
    pub kv_events: Option<String>,
    /// The engine's KV-event replay endpoint (vLLM `replay_endpoint`), when it has one.
    pub kv_replay: Option<String>,
    /// The engine's KV-cache capacity in tokens (`capacity-tokens=N`), for the residency
    /// estimate when its metrics do not report one.
    pub capacity_tokens: Option<u64>,
}

/// Why a backend specification was rejected.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum BackendSpecError {
    #[error("backend `{spec}`: empty URL")]
    EmptyUrl { spec: String },
    #[error("backend `{spec}`: the URL must start with http:// or https://")]
    UnsupportedScheme { spec: String },
    #[error("backend `{spec}`: URL has no host")]
    MissingHost { spec: String },
    #[error("backend `{spec}`: `{host}` is not a host name or IP address")]
    InvalidHost { spec: String, host: String },
    #[error("backend `{spec}`: port must be a number from 1 to 65535")]
    InvalidPort { spec: String },
    #[error(
        "backend `{spec}`: credentials in the URL are refused (they would be shown in the admin \
         API, logs and metrics); engines are reached without URL credentials"
    )]
    Credentials { spec: String },
    #[error("backend `{spec}`: URL must not have a path, query or fragment past `/`")]
    UnexpectedPath { spec: String },
    #[error(
        "backend `{spec}`: unknown option `{option}` (known: kv-events=ENDPOINT, kv-replay=ENDPOINT, capacity-tokens=N)"
    )]
    UnknownOption { spec: String, option: String },
    #[error("backend `{spec}`: kv-events endpoint must start with tcp://, ipc:// or inproc://")]
    BadKvEventsEndpoint { spec: String },
    #[error("backend `{spec}`: kv-replay endpoint must start with tcp://, ipc:// or inproc://")]
    BadKvReplayEndpoint { spec: String },
    #[error("backend `{spec}`: kv-replay needs kv-events")]
    ReplayWithoutEvents { spec: String },
    #[error("backend `{spec}`: capacity-tokens must be a whole number of tokens from 1 to 2^40")]
    BadCapacity { spec: String },
    #[error("backend `{spec}`: `{option}` is given twice")]
    Repeated { spec: String, option: String },
}

/// The largest `capacity-tokens` accepted (a KV cache of 2^40 tokens is beyond any engine).
pub const MAX_CAPACITY_TOKENS: u64 = 1 << 40;

/// A `capacity-tokens` value: a whole number from 1 to [`MAX_CAPACITY_TOKENS`].
pub fn parse_capacity(spec: &str, tokens: &str) -> Result<u64, BackendSpecError> {
    let tokens = tokens.trim();
    match tokens.parse::<u64>() {
        Ok(value)
            if (1..=MAX_CAPACITY_TOKENS).contains(&value)
                && tokens.bytes().all(|byte| byte.is_ascii_digit()) =>
        {
            Ok(value)
        }
        _ => Err(BackendSpecError::BadCapacity {
            spec: redact_credentials(spec),
        }),
    }
}

impl BackendSpec {
    /// Parses `http://host:port[,kv-events=tcp://host:port][,kv-replay=tcp://host:port]`.
    pub fn parse(spec: &str) -> Result<BackendSpec, BackendSpecError> {
        let mut parts = spec.split(',').map(str::trim);
        let url = parts.next().unwrap_or_default();
        let (mut kv_events, mut kv_replay, mut capacity) = (None, None, None);
        let repeated = |option: &str| BackendSpecError::Repeated {
            spec: redact_credentials(spec),
            option: option.split('=').next().unwrap_or_default().to_string(),
        };
        for option in parts.filter(|option| !option.is_empty()) {
            match option.split_once('=') {
                Some(("kv-events", _)) if kv_events.is_some() => return Err(repeated(option)),
                Some(("kv-replay", _)) if kv_replay.is_some() => return Err(repeated(option)),
                Some(("capacity-tokens", _)) if capacity.is_some() => {
                    return Err(repeated(option));
                }
                Some(("kv-events", endpoint)) => kv_events = Some(endpoint.trim().to_string()),
                Some(("kv-replay", endpoint)) => kv_replay = Some(endpoint.trim().to_string()),
                Some(("capacity-tokens", tokens)) => {
                    capacity = Some(parse_capacity(spec, tokens)?);
                }
                _ => {
                    return Err(BackendSpecError::UnknownOption {
                        spec: spec.into(),
                        option: option.into(),
                    });
                }
            }
        }
        let mut parsed = Self::from_parts(spec, url, kv_events, kv_replay)?;
        parsed.capacity_tokens = capacity;
        Ok(parsed)
    }

    /// Builds a spec from a URL and optional KV-event endpoints (config-file table form).
    pub fn from_parts(
        spec: &str,
        url: &str,
        kv_events: Option<String>,
        kv_replay: Option<String>,
    ) -> Result<BackendSpec, BackendSpecError> {
        let is_zmq_endpoint = |endpoint: &str| {
            ["tcp://", "ipc://", "inproc://"]
                .iter()
                .any(|prefix| endpoint.starts_with(prefix) && endpoint.len() > prefix.len())
        };
        if kv_events.as_deref().is_some_and(|e| !is_zmq_endpoint(e)) {
            return Err(BackendSpecError::BadKvEventsEndpoint { spec: spec.into() });
        }
        if kv_replay.as_deref().is_some_and(|e| !is_zmq_endpoint(e)) {
            return Err(BackendSpecError::BadKvReplayEndpoint { spec: spec.into() });
        }
        if kv_replay.is_some() && kv_events.is_none() {
            return Err(BackendSpecError::ReplayWithoutEvents { spec: spec.into() });
        }
        let url = url.trim();
        if url.is_empty() {
            return Err(BackendSpecError::EmptyUrl { spec: spec.into() });
        }
        // Credentials first: every later error message quotes the spec, which must not carry a
        // password into logs or an admin API answer.
        if has_credentials(url) {
            return Err(BackendSpecError::Credentials {
                spec: redact_credentials(spec),
            });
        }
        let (scheme, default_port, rest) = if let Some(rest) = url.strip_prefix("http://") {
            ("http", 80, rest)
        } else if let Some(rest) = url.strip_prefix("https://") {
            ("https", 443, rest)
        } else {
            return Err(BackendSpecError::UnsupportedScheme { spec: spec.into() });
        };
        let end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
        let (authority, path) = rest.split_at(end);
        if authority.is_empty() {
            return Err(BackendSpecError::MissingHost { spec: spec.into() });
        }
        // A base path such as `/v1` would double up with the request path; refuse it early.
        if !path.is_empty() && path != "/" {
            return Err(BackendSpecError::UnexpectedPath { spec: spec.into() });
        }
        let (host, port) = split_host_port(authority);
        if host.is_empty() {
            return Err(BackendSpecError::MissingHost { spec: spec.into() });
        }
        if !is_valid_host(host) {
            return Err(BackendSpecError::InvalidHost {
                spec: spec.into(),
                host: host.into(),
            });
        }
        let port = match port {
            None => default_port,
            Some(text) => match text.parse::<u16>() {
                Ok(port) if port > 0 && text.bytes().all(|byte| byte.is_ascii_digit()) => port,
                _ => return Err(BackendSpecError::InvalidPort { spec: spec.into() }),
            },
        };
        Ok(BackendSpec {
            url: format!("{scheme}://{authority}"),
            authority: format!("{host}:{port}"),
            kv_events,
            kv_replay,
            capacity_tokens: None,
        })
    }
}

/// True when the URL's authority has a `user[:password]@` part.
fn has_credentials(url: &str) -> bool {
    let after_scheme = url.split_once("://").map_or(url, |(_, rest)| rest);
    let end = after_scheme
        .find(['/', '?', '#'])
        .unwrap_or(after_scheme.len());
    after_scheme[..end].contains('@')
}

/// `spec` with every `user:password@` replaced by `***@`.
fn redact_credentials(spec: &str) -> String {
    spec.split(',')
        .map(|part| {
            let (prefix, url) = match part.split_once('=') {
                Some((option, url)) if !option.contains("://") => (format!("{option}="), url),
                _ => (String::new(), part),
            };
            let Some((scheme, rest)) = url.split_once("://") else {
                return part.to_string();
            };
            let end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
            match rest[..end].rfind('@') {
                Some(at) => format!("{prefix}{scheme}://***@{}", &rest[at + 1..]),
                None => part.to_string(),
            }
        })
        .collect::<Vec<_>>()
        .join(",")
}

/// Splits `host[:port]` or `[v6][:port]` (brackets kept on the host).
fn split_host_port(authority: &str) -> (&str, Option<&str>) {
    if authority.starts_with('[') {
        return match authority.find(']') {
            Some(close) => {
                let (host, rest) = authority.split_at(close + 1);
                (
                    host,
                    rest.strip_prefix(':')
                        .or(Some(rest).filter(|r| !r.is_empty())),
                )
            }
            None => (authority, None),
        };
    }
    match authority.rsplit_once(':') {
        Some((host, port)) => (host, Some(port)),
        None => (authority, None),
    }
}

/// A DNS name (letters, digits, `-`, `_`, dots), an IPv4 address, or a bracketed IPv6 address.
fn is_valid_host(host: &str) -> bool {
    if let Some(inner) = host.strip_prefix('[') {
        return inner
            .strip_suffix(']')
            .is_some_and(|v6| v6.parse::<std::net::Ipv6Addr>().is_ok());
    }
    host.len() <= 253
        && host.split('.').all(|label| {
            !label.is_empty()
                && label.len() <= 63
                && label
                    .bytes()
                    .all(|byte| byte.is_ascii_alphanumeric() || byte == b'-' || byte == b'_')
        })
}

impl fmt::Display for BackendSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.url)?;
        if let Some(endpoint) = &self.kv_events {
            write!(f, ",kv-events={endpoint}")?;
        }
        if let Some(endpoint) = &self.kv_replay {
            write!(f, ",kv-replay={endpoint}")?;
        }
        if let Some(tokens) = self.capacity_tokens {
            write!(f, ",capacity-tokens={tokens}")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn capacity_tokens() {
        let spec = BackendSpec::parse("http://h:1,capacity-tokens=262144").unwrap();
        assert_eq!(spec.capacity_tokens, Some(262_144));
        assert_eq!(spec.to_string(), "http://h:1,capacity-tokens=262144");
        assert_eq!(
            BackendSpec::parse("http://h:1").unwrap().capacity_tokens,
            None
        );
        for bad in ["0", "-5", "1e6", "+3", "", "1099511627777"] {
            assert!(matches!(
                BackendSpec::parse(&format!("http://h:1,capacity-tokens={bad}")),
                Err(BackendSpecError::BadCapacity { .. })
            ));
        }
    }

    #[test]
    fn plain_url() {
        let spec = BackendSpec::parse("http://10.0.0.1:8000").unwrap();
        assert_eq!(spec.url, "http://10.0.0.1:8000");
        assert_eq!(spec.authority, "10.0.0.1:8000");
        assert_eq!(spec.kv_events, None);
    }

    #[test]
    fn trailing_slash_and_default_port() {
        let spec = BackendSpec::parse("http://engine/").unwrap();
        assert_eq!(spec.url, "http://engine");
        assert_eq!(spec.authority, "engine:80");
    }

    #[test]
    fn https_engines_default_to_port_443() {
        let spec = BackendSpec::parse("https://engine.example/").unwrap();
        assert_eq!(spec.url, "https://engine.example");
        assert_eq!(spec.authority, "engine.example:443");
        let spec =
            BackendSpec::parse("https://10.0.0.1:8443,kv-events=tcp://10.0.0.1:5557").unwrap();
        assert_eq!(spec.url, "https://10.0.0.1:8443");
        assert_eq!(spec.authority, "10.0.0.1:8443");
    }

    #[test]
    fn kv_events_option() {
        let spec = BackendSpec::parse("http://h:8000,kv-events=tcp://h:5557").unwrap();
        assert_eq!(spec.kv_events.as_deref(), Some("tcp://h:5557"));
        assert_eq!(spec.to_string(), "http://h:8000,kv-events=tcp://h:5557");
        assert_eq!(spec.kv_replay, None);
        let text = "http://h:8000,kv-events=tcp://h:5557,kv-replay=tcp://h:5558";
        let spec = BackendSpec::parse(text).unwrap();
        assert_eq!(spec.kv_replay.as_deref(), Some("tcp://h:5558"));
        assert_eq!(spec.to_string(), text);
    }

    #[test]
    fn rejects_bad_specs() {
        assert!(matches!(
            BackendSpec::parse("ftp://h:8000"),
            Err(BackendSpecError::UnsupportedScheme { .. })
        ));
        assert!(matches!(
            BackendSpec::parse(""),
            Err(BackendSpecError::EmptyUrl { .. })
        ));
        assert!(matches!(
            BackendSpec::parse("http://h:8000,weight=3"),
            Err(BackendSpecError::UnknownOption { .. })
        ));
        assert!(matches!(
            BackendSpec::parse("http://h:8000,kv-events=h:5557"),
            Err(BackendSpecError::BadKvEventsEndpoint { .. })
        ));
        assert!(matches!(
            BackendSpec::parse("http://h:8000,kv-events=tcp://h:1,kv-replay=5558"),
            Err(BackendSpecError::BadKvReplayEndpoint { .. })
        ));
        assert!(matches!(
            BackendSpec::parse("http://h:8000,kv-replay=tcp://h:5558"),
            Err(BackendSpecError::ReplayWithoutEvents { .. })
        ));
        assert!(matches!(
            BackendSpec::parse("http://h:8000/v1"),
            Err(BackendSpecError::UnexpectedPath { .. })
        ));
        assert!(matches!(
            BackendSpec::parse("http:///x"),
            Err(BackendSpecError::MissingHost { .. })
        ));
        for twice in [
            "http://h:8000,kv-events=tcp://h:1,kv-events=tcp://h:2",
            "http://h:8000,kv-events=tcp://h:1,kv-replay=tcp://h:2,kv-replay=tcp://h:3",
            "http://h:8000,capacity-tokens=1,capacity-tokens=2",
        ] {
            let error = BackendSpec::parse(twice).unwrap_err();
            assert!(
                matches!(error, BackendSpecError::Repeated { .. }),
                "{twice}: {error}"
            );
            assert!(error.to_string().contains("given twice"), "{error}");
        }
    }

    #[test]
    fn validates_host_and_port() {
        for (text, authority) in [
            ("http://h:1", "h:1"),
            ("http://h:65535", "h:65535"),
            ("http://[::1]:8000", "[::1]:8000"),
            ("http://[::1]", "[::1]:80"),
            ("http://engine-1.local_x:8000/", "engine-1.local_x:8000"),
        ] {
            assert_eq!(
                BackendSpec::parse(text).unwrap().authority,
                authority,
                "{text}"
            );
        }
        for bad_port in [
            "http://h:0",
            "http://h:99999",
            "http://h:",
            "http://h:+80",
            "http://h:8a",
            "http://[::1]x",
        ] {
            assert!(
                matches!(
                    BackendSpec::parse(bad_port),
                    Err(BackendSpecError::InvalidPort { .. })
                ),
                "{bad_port}: {:?}",
                BackendSpec::parse(bad_port)
            );
        }
        for bad_host in [
            "http://h h:1",
            "http://a..b:1",
            "http://[::g]:1",
            "http://h%41:1",
        ] {
            assert!(
                matches!(
                    BackendSpec::parse(bad_host),
                    Err(BackendSpecError::InvalidHost { .. })
                ),
                "{bad_host}: {:?}",
                BackendSpec::parse(bad_host)
            );
        }
        assert!(matches!(
            BackendSpec::parse("http://h:1?x=1"),
            Err(BackendSpecError::UnexpectedPath { .. })
        ));
    }

    #[test]
    fn refuses_credentials_without_repeating_them() {
        for text in [
            "http://user:hunter2@h:8000",
            "http://user@h:8000",
            "https://user:hunter2@h:8000",
            "http://user:hunter2@h:8000,kv-events=tcp://h:5557",
        ] {
            let error = BackendSpec::parse(text).unwrap_err();
            assert!(
                matches!(error, BackendSpecError::Credentials { .. }),
                "{text}: {error}"
            );
            let message = error.to_string();
            assert!(!message.contains("hunter2"), "{message}");
            assert!(message.contains("***@h:8000"), "{message}");
        }
        let table = BackendSpec::from_parts("table", "http://u:hunter2@h:1", None, None);
        assert!(matches!(table, Err(BackendSpecError::Credentials { .. })));
    }
}
