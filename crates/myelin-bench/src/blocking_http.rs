//! A minimal blocking HTTP/1.1 client for the control side of the harness (health polls,
//! /metrics scrapes and external engines' cache resets, from the main thread, and tests), where an
//! executor would be overkill. Not used on the measured request path.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::time::Duration;

/// Why a control-side request failed.
#[derive(Debug, thiserror::Error)]
pub enum GetError {
    #[error("{method} {url}: {source}")]
    Io {
        method: &'static str,
        url: String,
        source: std::io::Error,
    },
    #[error("{method} {url}: malformed response: {problem}")]
    Malformed {
        method: &'static str,
        url: String,
        problem: String,
    },
    #[error("{url}: only http://host:port/path URLs are supported")]
    BadUrl { url: String },
}

/// A response: status and body text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GetResponse {
    pub status: u16,
    pub body: String,
}

/// Splits `http://host:port/path` into (host:port, /path).
fn split_url(url: &str) -> Option<(&str, &str)> {
    let rest = url.strip_prefix("http://")?;
    Some(match rest.find('/') {
        Some(slash) => (&rest[..slash], &rest[slash..]),
        None => (rest, "/"),
    })
}

/// GETs `url` with `Connection: close`, waiting at most `timeout` for each step.
pub fn get(url: &str, timeout: Duration) -> Result<GetResponse, GetError> {
    request("GET", url, "", timeout)
}

/// POSTs an empty body to `url` with `Connection: close`, waiting at most `timeout` for each
/// step.
pub fn post_empty(url: &str, timeout: Duration) -> Result<GetResponse, GetError> {
    request("POST", url, "", timeout)
}

/// POSTs the JSON `body` to `url` with `Connection: close`, waiting at most `timeout` for each
/// step.
pub fn post_json(url: &str, body: &str, timeout: Duration) -> Result<GetResponse, GetError> {
    request("POST", url, body, timeout)
}

fn request(
    method: &'static str,
    url: &str,
    body: &str,
    timeout: Duration,
) -> Result<GetResponse, GetError> {
    let (authority, path) = split_url(url).ok_or_else(|| GetError::BadUrl { url: url.into() })?;
    let io_error = |source| GetError::Io {
        method,
        url: url.into(),
        source,
    };
    let address: SocketAddr = authority
        .to_socket_addrs()
        .map_err(io_error)?
        .next()
        .ok_or_else(|| GetError::BadUrl { url: url.into() })?;
    let mut stream = TcpStream::connect_timeout(&address, timeout).map_err(io_error)?;
    stream.set_read_timeout(Some(timeout)).map_err(io_error)?;
    stream.set_write_timeout(Some(timeout)).map_err(io_error)?;
    // One write of the whole request: a peer reading the head in one go sees all of it.
    let length = if method == "POST" {
        let kind = if body.is_empty() {
            ""
        } else {
            "Content-Type: application/json\r\n"
        };
        format!("{kind}Content-Length: {}\r\n", body.len())
    } else {
        String::new()
    };
    let request = format!(
        "{method} {path} HTTP/1.1\r\nHost: {authority}\r\nAccept: */*\r\n{length}Connection: close\r\n\r\n{body}"
    );
    stream.write_all(request.as_bytes()).map_err(io_error)?;
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw).map_err(io_error)?;
    parse_response(&raw).map_err(|problem| GetError::Malformed {
        method,
        url: url.into(),
        problem,
    })
}

/// Parses a whole HTTP/1.1 response (identity or chunked body).
pub fn parse_response(raw: &[u8]) -> Result<GetResponse, String> {
    let head_end = raw
        .windows(4)
        .position(|window| window == b"\r\n\r\n")
        .ok_or("no end of headers")?;
    let head = std::str::from_utf8(&raw[..head_end]).map_err(|_| "headers are not UTF-8")?;
    let mut lines = head.split("\r\n");
    let status_line = lines.next().ok_or("empty response")?;
    let status: u16 = status_line
        .split_whitespace()
        .nth(1)
        .and_then(|code| code.parse().ok())
        .ok_or_else(|| format!("bad status line {status_line:?}"))?;
    let chunked = lines.any(|line| {
        let lower = line.to_ascii_lowercase();
        lower.starts_with("transfer-encoding:") && lower.contains("chunked")
    });
    let body = &raw[head_end + 4..];
    let body = if chunked {
        dechunk(body)?
    } else {
        body.to_vec()
    };
    Ok(GetResponse {
        status,
        body: String::from_utf8_lossy(&body).into_owned(),
    })
}

fn dechunk(mut body: &[u8]) -> Result<Vec<u8>, String> {
    let mut out = Vec::with_capacity(body.len());
    loop {
        let line_end = body
            .windows(2)
            .position(|window| window == b"\r\n")
            .ok_or("truncated chunk size")?;
        let size_text = std::str::from_utf8(&body[..line_end]).map_err(|_| "bad chunk size")?;
        let size_text = size_text.split(';').next().unwrap_or("").trim();
        let size = usize::from_str_radix(size_text, 16)
            .map_err(|_| format!("bad chunk size {size_text:?}"))?;
        body = &body[line_end + 2..];
        if size == 0 {
            return Ok(out);
        }
        if body.len() < size {
            return Err("truncated chunk".into());
        }
        out.extend_from_slice(&body[..size]);
        body = body.get(size + 2..).ok_or("truncated chunk end")?;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_identity_and_chunked_bodies() {
        let identity =
            parse_response(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello").unwrap();
        assert_eq!((identity.status, identity.body.as_str()), (200, "hello"));
        let chunked =
            parse_response(b"HTTP/1.1 503 Busy\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n6;x=y\r\n world\r\n0\r\n\r\n")
                .unwrap();
        assert_eq!(
            (chunked.status, chunked.body.as_str()),
            (503, "hello world")
        );
        assert!(parse_response(b"HTTP/1.1 200 OK\r\n").is_err());
    }

    #[test]
    fn talks_to_a_real_socket() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let address = listener.local_addr().unwrap();
        let server = std::thread::spawn(move || {
            let (mut socket, _) = listener.accept().unwrap();
            let mut request = Vec::new();
            let mut buffer = [0u8; 1024];
            while !request.ends_with(b"\r\n\r\n") {
                let read = socket.read(&mut buffer).unwrap();
                assert!(read > 0, "request head cut short");
                request.extend_from_slice(&buffer[..read]);
            }
            assert!(String::from_utf8_lossy(&request).starts_with("GET /metrics HTTP/1.1\r\n"));
            socket
                .write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
                .unwrap();
        });
        let response = get(&format!("http://{address}/metrics"), Duration::from_secs(5)).unwrap();
        assert_eq!(response.body, "ok");
        server.join().unwrap();
        assert!(matches!(
            get("https://x/", Duration::from_secs(1)),
            Err(GetError::BadUrl { .. })
        ));
    }
}
