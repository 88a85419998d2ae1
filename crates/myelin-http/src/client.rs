//! A per-core HTTP/1.1 keep-alive client pool to engines, over TCP or TLS (`https://`). One
//! pool per executor, no locks: connections are opened, reused and dropped on the executor
//! that owns the pool.

use std::cell::RefCell;
use std::collections::HashMap;
use std::io;
use std::net::{SocketAddr, ToSocketAddrs};
use std::time::{Duration, Instant};

use glommio::net::TcpStream;
use http::uri::{Authority, PathAndQuery, Scheme};
use http::{HeaderValue, Request, Response, Uri, header};
use hyper::body::Incoming;
use hyper::client::conn::http1::SendRequest;

use crate::body::Body;
use crate::io::GlommioIo;

/// Pool tuning.
#[derive(Clone, Debug)]
pub struct PoolConfig {
    /// Time allowed to establish a TCP connection.
    pub connect_timeout: Duration,
    /// Idle connections kept per engine; more are closed when they come back.
    pub max_idle_per_host: usize,
    /// How `https://` engines are reached (none: an https URI is refused); the TLS handshake
    /// shares `connect_timeout` with the TCP connect.
    pub tls: Option<std::sync::Arc<rustls::ClientConfig>>,
}

impl Default for PoolConfig {
    fn default() -> Self {
        Self {
            connect_timeout: Duration::from_secs(2),
            max_idle_per_host: 64,
            tls: None,
        }
    }
}

/// Why a request to an engine failed.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The URI is not an absolute `http://host:port/...` or `https://host:port/...` URI.
    #[error(
        "unsupported upstream uri {0:?}: expected http://host:port/path or https://host:port/path"
    )]
    BadUri(String),
    /// An `https://` URI, and this pool was given no TLS configuration.
    #[error("https upstream {0}: this client has no TLS configuration")]
    NoTls(String),
    /// The engine's address did not resolve.
    #[error("cannot resolve {authority}: {source}")]
    Resolve {
        /// The host:port that failed.
        authority: String,
        /// The resolver's error.
        source: io::Error,
    },
    /// The TCP connection failed (refused, unreachable).
    #[error("connect to {addr}: {source}")]
    Connect {
        /// The address tried.
        addr: SocketAddr,
        /// The socket error.
        source: io::Error,
    },
    /// The TCP connection (and TLS handshake) did not complete within the connect timeout.
    #[error("connect to {0} timed out")]
    ConnectTimeout(SocketAddr),
    /// The TLS handshake failed (an untrusted or mismatched certificate, a refused client
    /// certificate, a peer that does not speak TLS).
    #[error("TLS handshake with {addr}: {source}")]
    Tls {
        /// The address tried.
        addr: SocketAddr,
        /// rustls' reason.
        source: io::Error,
    },
    /// HTTP failed after the connection was up (reset, malformed response).
    #[error("upstream http: {0}")]
    Http(#[from] hyper::Error),
}

impl ClientError {
    /// True when the engine certainly never saw the request, so sending it elsewhere is safe.
    pub fn is_connect(&self) -> bool {
        matches!(
            self,
            Self::Resolve { .. }
                | Self::Connect { .. }
                | Self::ConnectTimeout(_)
                | Self::Tls { .. }
        )
    }
}

/// How long a resolved engine address is reused before the name is looked up again. Lookups
/// block the executor (the system resolver is synchronous), so they must be rare.
const RESOLVE_TTL: Duration = Duration::from_secs(30);

/// Where a pooled connection goes: TLS or not, and `host:port`.
type Origin = (bool, Authority);

/// A keep-alive pool of HTTP/1.1 connections, keyed by scheme and `host:port`.
pub struct Pool {
    config: PoolConfig,
    idle: RefCell<HashMap<Origin, Vec<SendRequest<Body>>>>,
    /// The system resolver's answers by (host, port), each with when it was asked.
    resolved: RefCell<HashMap<(String, u16), (SocketAddr, Instant)>>,
    /// With [`Pool::with_provided_addresses`]: host names are never resolved here, only
    /// looked up in this table (host, port) -> address, filled by [`Pool::set_address`].
    provided: Option<RefCell<HashMap<(String, u16), SocketAddr>>>,
    /// Connections opened so far (TCP connected; with TLS, before the handshake).
    opened: std::cell::Cell<u64>,
}

impl Pool {
    /// An empty pool.
    pub fn new(config: PoolConfig) -> Self {
        Self {
            config,
            idle: RefCell::new(HashMap::new()),
            resolved: RefCell::new(HashMap::new()),
            provided: None,
            opened: std::cell::Cell::new(0),
        }
    }

    /// This pool never resolves host names (the system resolver blocks the executor): it
    /// connects to IP literals as they are and to host names only at the addresses given to
    /// [`Pool::set_address`] (an unknown name fails like a resolver error).
    pub fn with_provided_addresses(mut self) -> Self {
        self.provided = Some(RefCell::new(HashMap::new()));
        self
    }

    /// The address of `host:port` (port 80 when absent), for a pool with provided addresses.
    /// Returns false when `authority` is not a valid authority or the pool resolves itself.
    pub fn set_address(&self, authority: &str, addr: SocketAddr) -> bool {
        let (Some(provided), Ok(authority)) = (&self.provided, authority.parse::<Authority>())
        else {
            return false;
        };
        provided
            .borrow_mut()
            .insert(host_port(&authority, 80), addr);
        true
    }

    /// Sends `request` (absolute `http://` or `https://` URI) and returns the response head
    /// with a streaming body. Dropping the body before its end closes that connection, which
    /// is how an engine learns that the client went away.
    pub async fn send(&self, request: Request<Body>) -> Result<Response<Incoming>, ClientError> {
        let (origin, mut request) = to_origin_form(request)?;
        // A pooled connection may have been closed by the engine while idle; hyper hands the
        // request back untouched in that case and it goes out on a fresh connection instead.
        while let Some(mut sender) = self.checkout(&origin) {
            match sender.try_send_request(request).await {
                Ok(response) => {
                    self.checkin(origin, sender);
                    return Ok(response);
                }
                Err(mut error) => match error.take_message() {
                    Some(unsent) => request = unsent,
                    None => return Err(ClientError::Http(error.into_error())),
                },
            }
        }
        let mut sender = self.connect(&origin).await?;
        let response = sender.send_request(request).await?;
        self.checkin(origin, sender);
        Ok(response)
    }

    /// Connections this pool has opened so far (each request that found no idle one opened
    /// one).
    pub fn connections_opened(&self) -> u64 {
        self.opened.get()
    }

    /// Number of idle-or-busy pooled connections to `authority`, over TCP and TLS (for
    /// metrics and tests).
    pub fn pooled_connections(&self, authority: &Authority) -> usize {
        let idle = self.idle.borrow();
        [false, true]
            .into_iter()
            .filter_map(|tls| idle.get(&(tls, authority.clone())))
            .map(Vec::len)
            .sum()
    }

    fn checkout(&self, origin: &Origin) -> Option<SendRequest<Body>> {
        let mut idle = self.idle.borrow_mut();
        let senders = idle.get_mut(origin)?;
        senders.retain(|sender| !sender.is_closed());
        let ready = senders.iter().position(SendRequest::is_ready)?;
        Some(senders.swap_remove(ready))
    }

    /// Keeps a connection whose request is under way: hyper marks it ready again once the
    /// response body has been read to the end.
    fn checkin(&self, origin: Origin, sender: SendRequest<Body>) {
        let mut idle = self.idle.borrow_mut();
        let senders = idle.entry(origin).or_default();
        senders.retain(|sender| !sender.is_closed());
        if senders.len() < self.config.max_idle_per_host {
            senders.push(sender);
        }
    }

    /// The engine's address, from the cache while it is fresh. IP literals never block; host
    /// names block the executor only once per `RESOLVE_TTL`.
    fn resolve_cached(
        &self,
        authority: &Authority,
        target: &(String, u16),
    ) -> Result<SocketAddr, ClientError> {
        let now = Instant::now();
        if let Some(&(addr, resolved_at)) = self.resolved.borrow().get(target)
            && now.duration_since(resolved_at) < RESOLVE_TTL
        {
            return Ok(addr);
        }
        let addr = resolve(authority, target)?;
        self.resolved
            .borrow_mut()
            .insert(target.clone(), (addr, now));
        Ok(addr)
    }

    /// Where to connect for `authority`, whose host and port are `target` ([`host_port`]): an
    /// IP literal as it is, else the provided address or (without provided addresses) the
    /// cached system resolver's answer.
    fn address(
        &self,
        authority: &Authority,
        target: &(String, u16),
    ) -> Result<SocketAddr, ClientError> {
        let (host, port) = target;
        if let Ok(ip) = host.parse::<std::net::IpAddr>() {
            return Ok(SocketAddr::new(ip, *port));
        }
        match &self.provided {
            Some(provided) => {
                provided
                    .borrow()
                    .get(target)
                    .copied()
                    .ok_or_else(|| ClientError::Resolve {
                        authority: authority.to_string(),
                        source: io::Error::new(io::ErrorKind::NotFound, "not resolved yet"),
                    })
            }
            None => self.resolve_cached(authority, target),
        }
    }

    async fn connect(&self, origin: &Origin) -> Result<SendRequest<Body>, ClientError> {
        let (tls, authority) = origin;
        let tls = match (tls, &self.config.tls) {
            (false, _) => None,
            (true, Some(config)) => Some(config.clone()),
            (true, None) => return Err(ClientError::NoTls(authority.to_string())),
        };
        let target = host_port(authority, if tls.is_some() { 443 } else { 80 });
        let addr = self.address(authority, &target)?;
        let started = Instant::now();
        let timeout = self.config.connect_timeout;
        let connected = crate::rt::timeout(timeout, TcpStream::connect(addr)).await;
        let stream = connected
            .ok_or(ClientError::ConnectTimeout(addr))?
            .map_err(|error| ClientError::Connect {
                addr,
                source: io::Error::from(error),
            })?;
        self.opened.set(self.opened.get() + 1);
        stream
            .set_nodelay(true)
            .map_err(|error| ClientError::Connect {
                addr,
                source: io::Error::from(error),
            })?;
        let Some(tls) = tls else {
            return handshake(stream).await;
        };
        let left = timeout.saturating_sub(started.elapsed());
        let stream = crate::rt::timeout(left, crate::tls::connect(tls, &target.0, stream))
            .await
            .ok_or(ClientError::ConnectTimeout(addr))?
            .map_err(|source| ClientError::Tls { addr, source })?;
        handshake(stream).await
    }
}

/// An HTTP/1.1 client connection over `stream`, driven by a task of its own.
async fn handshake<S>(stream: S) -> Result<SendRequest<Body>, ClientError>
where
    S: futures_lite::AsyncRead + futures_lite::AsyncWrite + Unpin + 'static,
{
    let (sender, connection) = hyper::client::conn::http1::handshake(GlommioIo::new(stream))
        .await
        .map_err(ClientError::Http)?;
    glommio::spawn_local(async move {
        // Connection-level errors surface on the request that was in flight.
        let _ = connection.await;
    })
    .detach();
    Ok(sender)
}

/// `(host, port)` of an authority: host lower-cased and without IPv6 brackets, `default_port`
/// when it has none.
fn host_port(authority: &Authority, default_port: u16) -> (String, u16) {
    let host = authority
        .host()
        .trim_start_matches('[')
        .trim_end_matches(']')
        .to_ascii_lowercase();
    (host, authority.port_u16().unwrap_or(default_port))
}

/// Resolves `host:port` (port 80 when absent) with the system resolver, which blocks: for a
/// helper thread, not an executor.
pub fn resolve_authority(authority: &str) -> io::Result<SocketAddr> {
    let parsed = authority
        .parse::<Authority>()
        .map_err(|error| io::Error::new(io::ErrorKind::InvalidInput, error.to_string()))?;
    resolve(&parsed, &host_port(&parsed, 80)).map_err(|error| match error {
        ClientError::Resolve { source, .. } => source,
        other => io::Error::other(other.to_string()),
    })
}

/// The system resolver's first address for `target` (`authority`'s [`host_port`]).
fn resolve(authority: &Authority, target: &(String, u16)) -> Result<SocketAddr, ClientError> {
    (target.0.as_str(), target.1)
        .to_socket_addrs()
        .and_then(|mut addrs| {
            addrs
                .next()
                .ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, "no address"))
        })
        .map_err(|source| ClientError::Resolve {
            authority: authority.to_string(),
            source,
        })
}

/// Splits an absolute `http://` or `https://` URI into the origin to connect to and an
/// origin-form request (path only) with a `Host` header, as HTTP/1.1 expects.
fn to_origin_form(request: Request<Body>) -> Result<(Origin, Request<Body>), ClientError> {
    let (mut parts, body) = request.into_parts();
    let uri = std::mem::take(&mut parts.uri).into_parts();
    let bad_uri = || ClientError::BadUri(format!("{:?}{:?}", uri.authority, uri.path_and_query));
    let tls = match uri.scheme.as_ref() {
        Some(scheme) if *scheme == Scheme::HTTP => false,
        Some(scheme) if *scheme == Scheme::HTTPS => true,
        _ => return Err(bad_uri()),
    };
    let authority = uri.authority.clone().ok_or_else(bad_uri)?;
    let path = uri
        .path_and_query
        .clone()
        .unwrap_or_else(|| PathAndQuery::from_static("/"));
    parts.uri = Uri::from(path);
    let host = HeaderValue::from_str(authority.as_str()).map_err(|_| bad_uri())?;
    parts.headers.insert(header::HOST, host);
    Ok(((tls, authority), Request::from_parts(parts, body)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn origin_form_keeps_path_and_sets_host() {
        let request = Request::post("http://127.0.0.1:9000/v1/completions?x=1")
            .body(crate::body::empty())
            .expect("request");
        let ((tls, authority), request) = to_origin_form(request).expect("http uri");
        assert!(!tls);
        assert_eq!(authority.as_str(), "127.0.0.1:9000");
        assert_eq!(request.uri().to_string(), "/v1/completions?x=1");
        assert_eq!(request.headers()[header::HOST], "127.0.0.1:9000");
    }

    #[test]
    fn provided_addresses_replace_the_resolver() {
        let pool = Pool::new(PoolConfig::default()).with_provided_addresses();
        let literal: Authority = "127.0.0.1:9000".parse().unwrap();
        assert_eq!(
            pool.address(&literal, &host_port(&literal, 80)).unwrap(),
            "127.0.0.1:9000".parse().unwrap()
        );
        let v6: Authority = "[::1]:9000".parse().unwrap();
        assert_eq!(
            pool.address(&v6, &host_port(&v6, 80)).unwrap(),
            "[::1]:9000".parse().unwrap()
        );
        let name: Authority = "engine.invalid:8000".parse().unwrap();
        assert!(matches!(
            pool.address(&name, &host_port(&name, 80)),
            Err(ClientError::Resolve { .. })
        ));
        assert!(pool.set_address("Engine.invalid:8000", "10.0.0.7:8000".parse().unwrap()));
        assert_eq!(
            pool.address(&name, &host_port(&name, 80)).unwrap(),
            "10.0.0.7:8000".parse().unwrap()
        );
        assert!(pool.set_address("other.invalid", "10.0.0.8:80".parse().unwrap()));
        let default_port: Authority = "other.invalid".parse().unwrap();
        assert_eq!(
            pool.address(&default_port, &host_port(&default_port, 80))
                .unwrap(),
            "10.0.0.8:80".parse().unwrap()
        );
        assert!(
            !Pool::new(PoolConfig::default()).set_address("h:1", "10.0.0.1:1".parse().unwrap())
        );
    }

    #[test]
    fn https_uris_go_to_a_tls_origin() {
        let request = Request::get("https://engine.example/v1/models")
            .body(crate::body::empty())
            .expect("request");
        let ((tls, authority), request) = to_origin_form(request).expect("https uri");
        assert!(tls);
        assert_eq!(authority.as_str(), "engine.example");
        assert_eq!(host_port(&authority, 443), ("engine.example".into(), 443));
        assert_eq!(request.headers()[header::HOST], "engine.example");
    }

    #[test]
    fn rejects_non_http_uris() {
        for uri in ["ftp://h:1/", "/relative"] {
            let request = Request::get(uri)
                .body(crate::body::empty())
                .expect("request");
            assert!(matches!(
                to_origin_form(request),
                Err(ClientError::BadUri(_))
            ));
        }
    }
}
