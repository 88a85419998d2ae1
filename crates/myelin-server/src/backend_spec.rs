//! Parsing of backend specifications: `URL[,kv-events=ENDPOINT][,kv-replay=ENDPOINT]` from
//! flags, env and config file.

use std::fmt;

/// One inference engine the router sends requests to, as configured by the user.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BackendSpec {
    /// Base URL of the engine's OpenAI API, without a trailing slash (`http://h:8000`).
    pub url: String,
    /// `host:port` the HTTP client connects to, taken from the URL.
    pub authority: String,
    /// The engine's vLLM KV-event publisher endpoint (`tcp://h:5557`), when it has one.
    pub kv_events: Option<String>,
    /// The engine's KV-event replay endpoint (vLLM `replay_endpoint`), when it has one.
    pub kv_replay: Option<String>,
}

/// Why a backend specification was rejected.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum BackendSpecError {
    #[error("backend `{spec}`: empty URL")]
    EmptyUrl { spec: String },
    #[error(
        "backend `{spec}`: only http:// URLs are supported (TLS to engines is not implemented)"
    )]
    UnsupportedScheme { spec: String },
    #[error("backend `{spec}`: URL has no host")]
    MissingHost { spec: String },
    #[error("backend `{spec}`: URL must not have a path, query or fragment past `/`")]
    UnexpectedPath { spec: String },
    #[error(
        "backend `{spec}`: unknown option `{option}` (known: kv-events=ENDPOINT, kv-replay=ENDPOINT)"
    )]
    UnknownOption { spec: String, option: String },
    #[error("backend `{spec}`: kv-events endpoint must start with tcp://, ipc:// or inproc://")]
    BadKvEventsEndpoint { spec: String },
    #[error("backend `{spec}`: kv-replay endpoint must start with tcp://, ipc:// or inproc://")]
    BadKvReplayEndpoint { spec: String },
    #[error("backend `{spec}`: kv-replay needs kv-events")]
    ReplayWithoutEvents { spec: String },
}

impl BackendSpec {
    /// Parses `http://host:port[,kv-events=tcp://host:port][,kv-replay=tcp://host:port]`.
    pub fn parse(spec: &str) -> Result<BackendSpec, BackendSpecError> {
        let mut parts = spec.split(',').map(str::trim);
        let url = parts.next().unwrap_or_default();
        let (mut kv_events, mut kv_replay) = (None, None);
        for option in parts.filter(|option| !option.is_empty()) {
            match option.split_once('=') {
                Some(("kv-events", endpoint)) => kv_events = Some(endpoint.trim().to_string()),
                Some(("kv-replay", endpoint)) => kv_replay = Some(endpoint.trim().to_string()),
                _ => {
                    return Err(BackendSpecError::UnknownOption {
                        spec: spec.into(),
                        option: option.into(),
                    });
                }
            }
        }
        Self::from_parts(spec, url, kv_events, kv_replay)
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
        let Some(rest) = url.strip_prefix("http://") else {
            return Err(BackendSpecError::UnsupportedScheme { spec: spec.into() });
        };
        let (authority, path) = match rest.find('/') {
            Some(slash) => rest.split_at(slash),
            None => (rest, ""),
        };
        if authority.is_empty() {
            return Err(BackendSpecError::MissingHost { spec: spec.into() });
        }
        // A base path such as `/v1` would double up with the request path; refuse it early.
        if !path.is_empty() && path != "/" {
            return Err(BackendSpecError::UnexpectedPath { spec: spec.into() });
        }
        let authority = if authority.contains(':') && !authority.ends_with(']') {
            authority.to_string()
        } else {
            format!("{authority}:80")
        };
        Ok(BackendSpec {
            url: format!("http://{}", rest.trim_end_matches('/')),
            authority,
            kv_events,
            kv_replay,
        })
    }
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
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
            BackendSpec::parse("https://h:8000"),
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
    }
}
