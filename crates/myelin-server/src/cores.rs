//! Core layout: which CPUs run data-plane shards, which runs the control core, and pinning.

use std::collections::BTreeSet;

/// Where the executors run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CoreLayout {
    /// One entry per data shard: the CPU it is pinned to, or `None` when unpinned.
    pub data_cpus: Vec<Option<usize>>,
    /// CPU of the control core, or `None` when unpinned.
    pub control_cpu: Option<usize>,
}

impl CoreLayout {
    /// Number of data shards (data-plane executors).
    pub fn shard_count(&self) -> usize {
        self.data_cpus.len()
    }
}

/// Why a core layout was rejected.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum CoreLayoutError {
    #[error("bad CPU list `{list}`: {reason}")]
    BadCpuList { list: String, reason: String },
    #[error("--shards and --cores are mutually exclusive (--shards runs unpinned shards)")]
    ShardsAndCores,
    #[error("--shards must be at least 1")]
    ZeroShards,
    #[error("CPU {cpu} is not online (online: {online})")]
    CpuOffline { cpu: usize, online: String },
    #[error("the control core {cpu} is also listed as a data core")]
    ControlCoreIsDataCore { cpu: usize },
}

/// Parses a Linux-style CPU list: `0-7`, `1,3,5`, `0-3,8-11`.
pub fn parse_cpu_list(list: &str) -> Result<Vec<usize>, CoreLayoutError> {
    let bad = |reason: &str| CoreLayoutError::BadCpuList {
        list: list.into(),
        reason: reason.into(),
    };
    let mut cpus = BTreeSet::new();
    for item in list.split(',').map(str::trim) {
        if item.is_empty() {
            return Err(bad("empty item"));
        }
        match item.split_once('-') {
            Some((first, last)) => {
                let first: usize = first.trim().parse().map_err(|_| bad("not a number"))?;
                let last: usize = last.trim().parse().map_err(|_| bad("not a number"))?;
                if last < first {
                    return Err(bad("range end before start"));
                }
                if last - first > 4096 {
                    return Err(bad("range too large"));
                }
                cpus.extend(first..=last);
            }
            None => {
                cpus.insert(item.parse().map_err(|_| bad("not a number"))?);
            }
        }
    }
    Ok(cpus.into_iter().collect())
}

/// CPUs this process may run on (its affinity mask), ascending.
pub fn online_cpus() -> Vec<usize> {
    // SAFETY: cpu_set_t is plain data; sched_getaffinity writes at most size_of::<cpu_set_t>().
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    let status =
        unsafe { libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) };
    if status != 0 {
        let count = std::thread::available_parallelism().map_or(1, |n| n.get());
        return (0..count).collect();
    }
    (0..libc::CPU_SETSIZE as usize)
        // SAFETY: index is below CPU_SETSIZE.
        .filter(|&cpu| unsafe { libc::CPU_ISSET(cpu, &set) })
        .collect()
}

/// Decides the layout from the flags. `online` is the list of usable CPUs.
///
/// - `--shards N`: N unpinned data shards and an unpinned control core (tests, laptops).
/// - `--cores LIST`: one pinned shard per listed CPU; the control core is `--control-core` or
///   the first online CPU not in the list.
/// - neither: the control core is `--control-core` or the first online CPU, and every other
///   online CPU runs a data shard (one CPU only: it runs both).
/// - `--no-pin` keeps the shard count but pins nothing.
pub fn decide_layout(
    cores: Option<&str>,
    shards: Option<usize>,
    control_core: Option<usize>,
    no_pin: bool,
    online: &[usize],
) -> Result<CoreLayout, CoreLayoutError> {
    let online_text = || {
        online
            .iter()
            .map(usize::to_string)
            .collect::<Vec<_>>()
            .join(",")
    };
    if let Some(cpu) = control_core
        && !online.contains(&cpu)
    {
        return Err(CoreLayoutError::CpuOffline {
            cpu,
            online: online_text(),
        });
    }
    let layout = match (cores, shards) {
        (Some(_), Some(_)) => return Err(CoreLayoutError::ShardsAndCores),
        (None, Some(0)) => return Err(CoreLayoutError::ZeroShards),
        (None, Some(count)) => {
            return Ok(CoreLayout {
                data_cpus: vec![None; count],
                control_cpu: None,
            });
        }
        (Some(list), None) => {
            let data = parse_cpu_list(list)?;
            if let Some(&cpu) = data.iter().find(|cpu| !online.contains(cpu)) {
                return Err(CoreLayoutError::CpuOffline {
                    cpu,
                    online: online_text(),
                });
            }
            let control = match control_core {
                Some(cpu) if data.contains(&cpu) => {
                    return Err(CoreLayoutError::ControlCoreIsDataCore { cpu });
                }
                Some(cpu) => Some(cpu),
                // Every online CPU is a data core: the control core shares the first one.
                None => online
                    .iter()
                    .copied()
                    .find(|cpu| !data.contains(cpu))
                    .or(data.first().copied()),
            };
            CoreLayout {
                data_cpus: data.into_iter().map(Some).collect(),
                control_cpu: control,
            }
        }
        (None, None) => {
            let control = control_core.or(online.first().copied());
            let mut data: Vec<usize> = online
                .iter()
                .copied()
                .filter(|&cpu| Some(cpu) != control)
                .collect();
            if data.is_empty() {
                data = online.to_vec();
            }
            if data.is_empty() {
                data = vec![0];
            }
            CoreLayout {
                data_cpus: data.into_iter().map(Some).collect(),
                control_cpu: control,
            }
        }
    };
    if no_pin {
        return Ok(CoreLayout {
            data_cpus: vec![None; layout.data_cpus.len()],
            control_cpu: None,
        });
    }
    Ok(layout)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_lists() {
        assert_eq!(parse_cpu_list("0-3").unwrap(), vec![0, 1, 2, 3]);
        assert_eq!(parse_cpu_list("5,1,3-4").unwrap(), vec![1, 3, 4, 5]);
        assert_eq!(parse_cpu_list(" 2 ").unwrap(), vec![2]);
        assert!(parse_cpu_list("").is_err());
        assert!(parse_cpu_list("3-1").is_err());
        assert!(parse_cpu_list("a").is_err());
        assert!(parse_cpu_list("1,,2").is_err());
    }

    #[test]
    fn default_layout_leaves_first_cpu_for_control() {
        let layout = decide_layout(None, None, None, false, &[0, 1, 2, 3]).unwrap();
        assert_eq!(layout.control_cpu, Some(0));
        assert_eq!(layout.data_cpus, vec![Some(1), Some(2), Some(3)]);
    }

    #[test]
    fn single_cpu_shares_control_and_data() {
        let layout = decide_layout(None, None, None, false, &[0]).unwrap();
        assert_eq!(layout.control_cpu, Some(0));
        assert_eq!(layout.data_cpus, vec![Some(0)]);
    }

    #[test]
    fn explicit_cores_and_control() {
        let layout = decide_layout(Some("2-3"), None, Some(0), false, &[0, 1, 2, 3]).unwrap();
        assert_eq!(layout.control_cpu, Some(0));
        assert_eq!(layout.data_cpus, vec![Some(2), Some(3)]);
        let layout = decide_layout(Some("0-1"), None, None, false, &[0, 1, 2, 3]).unwrap();
        assert_eq!(layout.control_cpu, Some(2));
    }

    #[test]
    fn shards_are_unpinned() {
        let layout = decide_layout(None, Some(2), None, false, &[0]).unwrap();
        assert_eq!(layout.data_cpus, vec![None, None]);
        assert_eq!(layout.control_cpu, None);
    }

    #[test]
    fn no_pin_keeps_count() {
        let layout = decide_layout(Some("1-3"), None, None, true, &[0, 1, 2, 3]).unwrap();
        assert_eq!(layout.data_cpus, vec![None, None, None]);
        assert_eq!(layout.control_cpu, None);
    }

    #[test]
    fn rejects_conflicts() {
        let online = [0, 1, 2, 3];
        assert_eq!(
            decide_layout(Some("1"), Some(2), None, false, &online),
            Err(CoreLayoutError::ShardsAndCores)
        );
        assert_eq!(
            decide_layout(None, Some(0), None, false, &online),
            Err(CoreLayoutError::ZeroShards)
        );
        assert_eq!(
            decide_layout(Some("1-2"), None, Some(2), false, &online),
            Err(CoreLayoutError::ControlCoreIsDataCore { cpu: 2 })
        );
        assert!(matches!(
            decide_layout(Some("7"), None, None, false, &online),
            Err(CoreLayoutError::CpuOffline { cpu: 7, .. })
        ));
    }
}
