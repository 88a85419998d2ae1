//! Engine host names resolved off the executors. The system resolver blocks, so a data core
//! must never call it: engines' host names are resolved once at startup (before any core
//! serves), then again every [`RESOLVE_INTERVAL`] (and at once for a backend added at run
//! time) by one helper thread, `myelin-dns`. The control core forwards every address to the
//! data cores' connection pools (whose `with_provided_addresses` mode never resolves) and
//! re-sends the whole table every second, so a dropped message heals. A name that fails to
//! resolve keeps its last good address.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use crossbeam_channel::{Receiver, RecvTimeoutError, Sender};

/// How often every engine host name is resolved again.
pub const RESOLVE_INTERVAL: Duration = Duration::from_secs(30);

/// Whether `authority` (`host:port`) names its host by name (IP literals need no resolver).
pub fn needs_resolving(authority: &str) -> bool {
    let host = match authority.rsplit_once(':') {
        Some((host, port)) if port.bytes().all(|byte| byte.is_ascii_digit()) => host,
        _ => authority,
    };
    let host = host.trim_start_matches('[').trim_end_matches(']');
    host.parse::<std::net::IpAddr>().is_err()
}

/// Resolves every host name among `authorities` now, on the calling thread (startup).
pub fn resolve_now(authorities: &[String]) -> Vec<(String, SocketAddr)> {
    authorities
        .iter()
        .filter(|authority| needs_resolving(authority))
        .filter_map(
            |authority| match myelin_http::client::resolve_authority(authority) {
                Ok(addr) => Some((authority.clone(), addr)),
                Err(error) => {
                    eprintln!("myelin: cannot resolve {authority} yet: {error}");
                    None
                }
            },
        )
        .collect()
}

/// The resolver thread's answers: an authority and its address, or why it did not resolve.
pub type Resolution = (String, std::io::Result<SocketAddr>);

/// The `myelin-dns` thread; stops when dropped (within [`RESOLVE_INTERVAL`] at most, at once
/// when it is waiting).
pub struct Resolver {
    names: Option<Sender<Vec<String>>>,
    pub results: Receiver<Resolution>,
    stop: Arc<AtomicBool>,
    _thread: JoinHandle<()>,
}

impl Resolver {
    /// Starts the thread (pinned to `cpu` when given, like the KV-event subscribers).
    pub fn start(cpu: Option<usize>) -> std::io::Result<Resolver> {
        let (names, names_receiver) = crossbeam_channel::unbounded::<Vec<String>>();
        let (results_sender, results) = crossbeam_channel::unbounded();
        let stop = Arc::new(AtomicBool::new(false));
        let thread_stop = stop.clone();
        let thread = std::thread::Builder::new()
            .name("myelin-dns".into())
            .spawn(move || {
                if let Some(cpu) = cpu {
                    crate::kv_subscriber::pin_to(cpu);
                }
                let mut known: Vec<String> = Vec::new();
                loop {
                    let fresh = match names_receiver.recv_timeout(RESOLVE_INTERVAL) {
                        Ok(names) => {
                            let fresh: Vec<String> = names
                                .iter()
                                .filter(|name| !known.contains(name))
                                .cloned()
                                .collect();
                            known = names;
                            fresh
                        }
                        Err(RecvTimeoutError::Timeout) => known.clone(),
                        Err(RecvTimeoutError::Disconnected) => return,
                    };
                    for authority in fresh.iter().filter(|name| needs_resolving(name)) {
                        if thread_stop.load(Ordering::Acquire) {
                            return;
                        }
                        let resolved = myelin_http::client::resolve_authority(authority);
                        if results_sender.send((authority.clone(), resolved)).is_err() {
                            return;
                        }
                    }
                }
            })?;
        Ok(Resolver {
            names: Some(names),
            results,
            stop,
            _thread: thread,
        })
    }

    /// The engines' authorities now (names not seen before are resolved at once).
    pub fn follow(&self, authorities: Vec<String>) {
        if let Some(names) = &self.names {
            let _ = names.send(authorities);
        }
    }
}

impl Drop for Resolver {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        // Disconnects the thread's receive: it returns at once if it is waiting.
        self.names.take();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_host_names_need_resolving() {
        assert!(!needs_resolving("127.0.0.1:8000"));
        assert!(!needs_resolving("[::1]:8000"));
        assert!(needs_resolving("engine-1:8000"));
        assert!(needs_resolving("localhost:80"));
    }

    #[test]
    fn the_thread_resolves_new_names_at_once_and_skips_literals() {
        let resolver = Resolver::start(None).unwrap();
        resolver.follow(vec!["127.0.0.1:1".into(), "localhost:4321".into()]);
        let (authority, resolved) = resolver
            .results
            .recv_timeout(Duration::from_secs(10))
            .expect("an answer");
        assert_eq!(authority, "localhost:4321");
        assert_eq!(resolved.unwrap().port(), 4321);
        // No answer for the IP literal, nothing more until the interval.
        assert!(resolver.results.try_recv().is_err());
    }
}
