//! Starting glommio executors the way every myelin process does: a small `io_memory` (the
//! machine's memlock limit is small and each io_uring ring pins its buffers) and optional pinning.

use std::future::Future;
use std::io;

use glommio::{CpuSet, ExecutorJoinHandle, LocalExecutorBuilder, Placement};

/// io_uring registered-buffer memory per executor. glommio's default (10 MiB) exceeds common
/// memlock limits (8 MiB here); the router does no bulk file I/O, so 256 KiB is plenty.
pub const DEFAULT_IO_MEMORY_BYTES: usize = 256 * 1024;

/// How to start one executor thread.
#[derive(Clone, Debug)]
pub struct ExecutorSpec {
    /// Thread name (shows in `top -H`, `perf`).
    pub name: String,
    /// CPU to pin to, or `None` to let the kernel schedule it.
    pub cpu: Option<usize>,
    /// io_uring registered-buffer memory in bytes.
    pub io_memory_bytes: usize,
}

impl ExecutorSpec {
    /// An unpinned executor with the default io memory.
    pub fn unpinned(name: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            cpu: None,
            io_memory_bytes: DEFAULT_IO_MEMORY_BYTES,
        }
    }

    /// An executor pinned to `cpu`.
    pub fn pinned(name: impl Into<String>, cpu: usize) -> Self {
        Self {
            cpu: Some(cpu),
            ..Self::unpinned(name)
        }
    }
}

/// Starts a glommio executor on a new thread and runs the future made by `make_future` on it.
pub fn spawn_executor<G, F, T>(
    spec: ExecutorSpec,
    make_future: G,
) -> io::Result<ExecutorJoinHandle<T>>
where
    G: FnOnce() -> F + Send + 'static,
    F: Future<Output = T> + 'static,
    T: Send + 'static,
{
    let placement = match spec.cpu {
        Some(cpu) => {
            let cpus = CpuSet::online()?.filter(|location| location.cpu == cpu);
            Placement::Fenced(cpus)
        }
        None => Placement::Unbound,
    };
    LocalExecutorBuilder::new(placement)
        .name(&spec.name)
        .io_memory(spec.io_memory_bytes)
        .spawn(make_future)
        .map_err(io::Error::from)
}
