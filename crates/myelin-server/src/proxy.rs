//! Talking to engines: header forwarding (minus hop-by-hop), one upstream attempt, and how its
//! result counts for retries. The retry loop itself is in `request_path.rs`.

use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Method, Request, Response, StatusCode};
use hyper::body::Incoming;
use myelin_http::client::{ClientError, Pool};

/// Response header naming the backend that served the request.
pub const BACKEND_HEADER: &str = "x-myelin-backend";
/// Response header: the time to first token the router predicted for the request on the
/// backend it chose, in microseconds from sending it there (the routing cost's figure; the
/// harness compares it with what it observes).
pub const PREDICTED_TTFT_HEADER: &str = "x-myelin-predicted-ttft-us";
/// A client asks for its decision's evidence with `x-myelin-trace: 1` (honoured only with
/// `--decision-trace`) ...
pub const TRACE_REQUEST_HEADER: &str = "x-myelin-trace";
/// ... and gets it in this response header, as JSON.
pub const TRACE_RESPONSE_HEADER: &str = "x-myelin-decision";

/// Headers that describe one connection, not the message (RFC 9110 section 7.6.1), plus the
/// ones the client pool sets itself.
const HOP_BY_HOP: &[HeaderName] = &[
    header::CONNECTION,
    header::PROXY_AUTHENTICATE,
    header::PROXY_AUTHORIZATION,
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
];

/// Legacy hop-by-hop headers without a constant in `http`.
const LEGACY_HOP_BY_HOP: &[&str] = &["keep-alive", "proxy-connection"];

/// Copies end-to-end headers: drops hop-by-hop ones, those the `Connection` header names,
/// and `Host`/`Content-Length` (set anew for the upstream request).
pub fn end_to_end_headers(headers: &HeaderMap) -> HeaderMap {
    let named_by_connection: Vec<String> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|value| value.to_str().ok())
        .flat_map(|value| value.split(','))
        .map(|name| name.trim().to_ascii_lowercase())
        .filter(|name| !name.is_empty())
        .collect();
    let mut forwarded = HeaderMap::with_capacity(headers.len());
    for (name, value) in headers {
        let hop_by_hop = HOP_BY_HOP.contains(name)
            || LEGACY_HOP_BY_HOP.contains(&name.as_str())
            || named_by_connection
                .iter()
                .any(|named| named == name.as_str())
            || name == header::HOST
            || name == header::CONTENT_LENGTH;
        if !hop_by_hop {
            forwarded.append(name.clone(), value.clone());
        }
    }
    forwarded
}

/// A request ready to be sent to any backend (the body is already read and validated).
#[derive(Debug, Clone)]
pub struct UpstreamRequest {
    pub method: Method,
    pub path_and_query: String,
    pub headers: HeaderMap,
    pub body: Bytes,
}

/// What one attempt produced.
pub enum Attempt {
    /// The engine answered; pass it on (any status but a retryable one).
    Answered(Response<Incoming>),
    /// Nothing usable reached us: another backend may take the request.
    Failed(FailedAttempt),
}

/// A failed attempt, before any byte went to the client.
pub enum FailedAttempt {
    /// The engine answered 502 or 503.
    Status(Response<Incoming>),
    /// No response head arrived (connect error, reset).
    Error(ClientError),
    /// No response head arrived within this deadline (the attempt was dropped, which closes
    /// its connection: the engine aborts the request).
    Timeout(std::time::Duration),
}

impl FailedAttempt {
    /// The `reason` label of the retry metric.
    pub fn retry_reason(&self) -> &'static str {
        match self {
            FailedAttempt::Status(response) if response.status() == StatusCode::BAD_GATEWAY => {
                "status_502"
            }
            FailedAttempt::Status(_) => "status_503",
            FailedAttempt::Error(error) if error.is_connect() => "connect",
            FailedAttempt::Error(_) => "no_response",
            FailedAttempt::Timeout(_) => "header_timeout",
        }
    }
}

/// Sends `upstream` to the backend at `base_url` (`http://host:port`).
pub async fn attempt(pool: &Pool, base_url: &str, upstream: &UpstreamRequest) -> Attempt {
    let uri = format!("{base_url}{}", upstream.path_and_query);
    let mut builder = Request::builder().method(upstream.method.clone()).uri(uri);
    if let Some(headers) = builder.headers_mut() {
        headers.clone_from(&upstream.headers);
        if !upstream.body.is_empty() || upstream.method == Method::POST {
            headers.insert(
                header::CONTENT_LENGTH,
                HeaderValue::from(upstream.body.len()),
            );
        }
    }
    let request = match builder.body(myelin_http::body::full(upstream.body.clone())) {
        Ok(request) => request,
        Err(error) => {
            return Attempt::Failed(FailedAttempt::Error(ClientError::BadUri(error.to_string())));
        }
    };
    match pool.send(request).await {
        Ok(response)
            if matches!(
                response.status(),
                StatusCode::BAD_GATEWAY | StatusCode::SERVICE_UNAVAILABLE
            ) =>
        {
            Attempt::Failed(FailedAttempt::Status(response))
        }
        Ok(response) => Attempt::Answered(response),
        Err(error) => Attempt::Failed(FailedAttempt::Error(error)),
    }
}

/// What went wrong with an attempt, in words a client may see: without the engine's address
/// or host name (those stay in the admin API).
pub fn describe_client_error(error: &ClientError) -> String {
    match error {
        ClientError::BadUri(_) => "its address is not a valid URI".into(),
        ClientError::Resolve { .. } => "its host name did not resolve".into(),
        ClientError::Connect { source, .. } => format!("cannot connect: {}", source.kind()),
        ClientError::ConnectTimeout(_) => "connect timed out".into(),
        ClientError::NoTls(_) => "its https:// address needs TLS, which this client lacks".into(),
        ClientError::Tls { source, .. } => format!("TLS handshake failed: {source}"),
        ClientError::Http(error) => format!("http: {error}"),
    }
}

/// Reads a body to its end, up to `limit` bytes: `None` past it or on an error (the rest is
/// dropped with the body, which closes its connection).
pub async fn collect_limited(mut body: Incoming, limit: usize) -> Option<Bytes> {
    use http_body_util::BodyExt;
    let mut collected = bytes::BytesMut::new();
    while let Some(frame) = body.frame().await {
        if let Ok(data) = frame.ok()?.into_data() {
            if collected.len() + data.len() > limit {
                return None;
            }
            collected.extend_from_slice(&data);
        }
    }
    Some(collected.freeze())
}

/// True when a response is an SSE stream.
pub fn is_event_stream(headers: &HeaderMap) -> bool {
    headers
        .get(header::CONTENT_TYPE)
        .and_then(|value| value.to_str().ok())
        .is_some_and(|value| value.trim_start().starts_with("text/event-stream"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strips_hop_by_hop_and_connection_named_headers() {
        let mut headers = HeaderMap::new();
        headers.insert(
            header::AUTHORIZATION,
            HeaderValue::from_static("Bearer sk-1"),
        );
        headers.insert(
            header::CONNECTION,
            HeaderValue::from_static("keep-alive, X-Private"),
        );
        headers.insert("x-private", HeaderValue::from_static("secret"));
        headers.insert("keep-alive", HeaderValue::from_static("timeout=5"));
        headers.insert(
            header::TRANSFER_ENCODING,
            HeaderValue::from_static("chunked"),
        );
        headers.insert(header::HOST, HeaderValue::from_static("router"));
        headers.insert(header::CONTENT_LENGTH, HeaderValue::from_static("10"));
        headers.insert("x-request-id", HeaderValue::from_static("abc"));
        headers.append("x-multi", HeaderValue::from_static("1"));
        headers.append("x-multi", HeaderValue::from_static("2"));
        let forwarded = end_to_end_headers(&headers);
        assert_eq!(forwarded[header::AUTHORIZATION], "Bearer sk-1");
        assert_eq!(forwarded["x-request-id"], "abc");
        assert_eq!(forwarded.get_all("x-multi").iter().count(), 2);
        for gone in [
            "connection",
            "x-private",
            "keep-alive",
            "transfer-encoding",
            "host",
            "content-length",
        ] {
            assert!(!forwarded.contains_key(gone), "{gone} forwarded");
        }
    }

    #[test]
    fn detects_event_streams() {
        let mut headers = HeaderMap::new();
        assert!(!is_event_stream(&headers));
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/event-stream; charset=utf-8"),
        );
        assert!(is_event_stream(&headers));
    }
}
