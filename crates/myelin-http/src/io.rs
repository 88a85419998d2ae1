//! `GlommioIo`: adapts a glommio stream (futures-lite `AsyncRead`/`AsyncWrite`) to hyper's
//! `rt::Read`/`rt::Write`, propagating every I/O error unchanged, plus `Rewind` for bytes read
//! ahead while sniffing the protocol.

use std::io;
use std::mem::MaybeUninit;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::{Buf, Bytes};
use futures_lite::{AsyncRead, AsyncWrite};
use hyper::rt::{Read, ReadBufCursor, Write};

/// A glommio stream seen through hyper's I/O traits.
pub struct GlommioIo<S> {
    inner: S,
}

impl<S> GlommioIo<S> {
    /// Wraps a stream.
    pub fn new(inner: S) -> Self {
        Self { inner }
    }

    /// The wrapped stream.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }
}

/// Most bytes one read asks the socket for (and zeroes first).
const READ_CHUNK: usize = 64 * 1024;

impl<S: AsyncRead + Unpin> Read for GlommioIo<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        mut buf: ReadBufCursor<'_>,
    ) -> Poll<io::Result<()>> {
        // SAFETY: the slice is zero-initialised before it is viewed as `[u8]`, and `advance` is
        // called with exactly the number of bytes the reader reported as written. At most
        // READ_CHUNK bytes are zeroed and read: hyper's buffer grows to hundreds of KiB for a
        // large body, and zeroing all of it on every read cost more than the read.
        let filled = unsafe {
            let uninit = buf.as_mut();
            let len = uninit.len().min(READ_CHUNK);
            let uninit = &mut uninit[..len];
            uninit.fill(MaybeUninit::new(0));
            let init = &mut *(uninit as *mut [MaybeUninit<u8>] as *mut [u8]);
            match Pin::new(&mut self.inner).poll_read(cx, init) {
                Poll::Ready(Ok(n)) => n,
                Poll::Ready(Err(error)) => return Poll::Ready(Err(error)),
                Poll::Pending => return Poll::Pending,
            }
        };
        unsafe { buf.advance(filled) };
        Poll::Ready(Ok(()))
    }
}

impl<S: AsyncWrite + Unpin> Write for GlommioIo<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_close(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }
}

/// A stream with some bytes already read from it put back in front.
pub struct Rewind<S> {
    prefix: Bytes,
    inner: S,
}

impl<S> Rewind<S> {
    /// Serves `prefix` first, then reads from `inner`.
    pub fn new(prefix: Bytes, inner: S) -> Self {
        Self { prefix, inner }
    }

    /// The wrapped stream.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Rewind<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut [u8],
    ) -> Poll<io::Result<usize>> {
        if self.prefix.has_remaining() {
            let n = self.prefix.len().min(buf.len());
            buf[..n].copy_from_slice(&self.prefix[..n]);
            self.prefix.advance(n);
            return Poll::Ready(Ok(n));
        }
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Rewind<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_close(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_close(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }
}

/// Renders the body of a response hyper writes on its own for a request it could not parse
/// (400, 414, 431): the status code in, `Some(JSON body)` to send one, `None` to leave it empty.
pub type ErrorBodyRenderer = fn(u16) -> Option<Bytes>;

/// An HTTP/1 server stream that gives hyper's automatic parse-error responses a body.
///
/// hyper answers a malformed request head (bad method, URI or header; a URI or head too large)
/// itself, with `connection: close`, `content-length: 0` and no hook to add a body. This
/// wrapper recognises exactly that response in what hyper writes (a 400/414/431 head carrying
/// both headers: the router's own responses always have a body) and writes it with a JSON body
/// and `content-type: application/json` instead. Everything else passes through unchanged.
pub struct ErrorBodies<S> {
    inner: S,
    render: ErrorBodyRenderer,
    /// The rewritten response still to write (hyper was told its own bytes were written).
    pending: Bytes,
}

impl<S> ErrorBodies<S> {
    /// Wraps a stream.
    pub fn new(inner: S, render: ErrorBodyRenderer) -> Self {
        Self {
            inner,
            render,
            pending: Bytes::new(),
        }
    }

    /// The wrapped stream.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The rewritten response for `head`, when it is one of hyper's automatic error responses.
    fn rewrite(&self, head: &[u8]) -> Option<Bytes> {
        const EMPTY: &[u8] = b"\r\nconnection: close\r\ncontent-length: 0\r\n";
        let status = head.strip_prefix(b"HTTP/1.1 ")?.get(..3)?;
        let status: u16 = std::str::from_utf8(status).ok()?.parse().ok()?;
        if !matches!(status, 400 | 414 | 431) || !head.ends_with(b"\r\n\r\n") {
            return None;
        }
        let at = head
            .windows(EMPTY.len())
            .position(|window| window == EMPTY)?;
        let body = (self.render)(status)?;
        let mut rewritten = Vec::with_capacity(head.len() + body.len() + 64);
        rewritten.extend_from_slice(&head[..at]);
        rewritten.extend_from_slice(b"\r\nconnection: close\r\ncontent-type: application/json");
        rewritten.extend_from_slice(format!("\r\ncontent-length: {}\r\n", body.len()).as_bytes());
        rewritten.extend_from_slice(&head[at + EMPTY.len()..]);
        rewritten.extend_from_slice(&body);
        Some(Bytes::from(rewritten))
    }
}

impl<S: AsyncWrite + Unpin> ErrorBodies<S> {
    /// Writes what is pending; ready once nothing is.
    fn poll_pending(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        while !self.pending.is_empty() {
            match Pin::new(&mut self.inner).poll_write(cx, &self.pending) {
                Poll::Ready(Ok(0)) => return Poll::Ready(Err(io::ErrorKind::WriteZero.into())),
                Poll::Ready(Ok(written)) => self.pending.advance(written),
                Poll::Ready(Err(error)) => return Poll::Ready(Err(error)),
                Poll::Pending => return Poll::Pending,
            }
        }
        Poll::Ready(Ok(()))
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for ErrorBodies<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut [u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for ErrorBodies<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        if self.poll_pending(cx)?.is_pending() {
            return Poll::Pending;
        }
        if let Some(rewritten) = self.rewrite(buf) {
            self.pending = rewritten;
            // hyper's bytes are accounted for: they are in `pending`, rewritten.
            let _ = self.poll_pending(cx)?;
            return Poll::Ready(Ok(buf.len()));
        }
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if self.poll_pending(cx)?.is_pending() {
            return Poll::Pending;
        }
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_close(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if self.poll_pending(cx)?.is_pending() {
            return Poll::Pending;
        }
        Pin::new(&mut self.inner).poll_close(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn render(status: u16) -> Option<Bytes> {
        (status != 414).then(|| Bytes::from(format!("{{\"status\":{status}}}")))
    }

    #[test]
    fn gives_hyper_parse_error_responses_a_body_and_nothing_else() {
        let bodies = ErrorBodies::new((), render);
        let head = b"HTTP/1.1 431 Request Header Fields Too Large\r\nconnection: close\r\n\
                     content-length: 0\r\ndate: Mon, 30 Nov 2026 18:35:41 GMT\r\n\r\n";
        let rewritten = bodies.rewrite(head).expect("rewritten");
        assert_eq!(
            &rewritten[..],
            &b"HTTP/1.1 431 Request Header Fields Too Large\r\nconnection: close\r\n\
               content-type: application/json\r\ncontent-length: 14\r\n\
               date: Mon, 30 Nov 2026 18:35:41 GMT\r\n\r\n{\"status\":431}"[..]
        );
        // The renderer may decline.
        let uri = b"HTTP/1.1 414 URI Too Long\r\nconnection: close\r\ncontent-length: 0\r\n\r\n";
        assert!(bodies.rewrite(uri).is_none());
        // Responses with a body, other statuses, body bytes: untouched.
        for other in [
            &b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"[..],
            &b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 0\r\n\r\n"[..],
            &b"data: HTTP/1.1 400 x\r\n\r\n"[..],
        ] {
            assert!(bodies.rewrite(other).is_none());
        }
    }
}
