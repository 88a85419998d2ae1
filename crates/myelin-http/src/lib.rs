//! hyper 1.x on glommio: the I/O adapter, executor and timer glue, an HTTP server loop with
//! graceful shutdown, a per-core HTTP/1.1 keep-alive client pool, TLS (rustls) for both, streaming
//! bodies and an SSE parser. Shared by the router, the simulated engine and the harness; holds no routing logic.
//!
//! Everything here is `!Send` by design: each glommio executor owns its listeners, connections
//! and pools, and nothing crosses threads.

pub mod backend_spec;
pub mod body;
pub mod client;
pub mod executor;
pub mod io;
pub mod rt;
pub mod server;
pub mod sse;
pub mod tls;

pub use body::{Body, BoxError};
