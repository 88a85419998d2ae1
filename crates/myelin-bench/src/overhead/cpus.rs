//! CPU lists (`0-3,8,10-11`), the CPUs this process may run on, and the pinning plan of a run:
//! which CPUs the router, the instant engines and the load generator get.

use std::fmt;

/// Fewer online CPUs than this and every part of the run shares all of them by default.
pub const SPLIT_MIN_CPUS: usize = 8;

/// Longest range a CPU list may hold (a typo like `0-99999999` must not allocate).
const MAX_RANGE: usize = 4096;

/// Why a CPU list is malformed or a pinning plan cannot work.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CpuError {
    #[error("empty CPU list")]
    Empty,
    #[error("bad CPU list {list:?}: {problem}")]
    Syntax { list: String, problem: String },
    #[error("CPU {cpu} is listed twice in {list:?}")]
    Duplicate { cpu: usize, list: String },
    #[error("{what}: CPU {cpu} is not available to this process (available: {available})")]
    Unavailable {
        what: &'static str,
        cpu: usize,
        available: String,
    },
    #[error(
        "--router-cores asks for {cores} router cores but --router-cpus has only {cpus} CPUs ({list})"
    )]
    TooFewRouterCpus {
        cores: usize,
        cpus: usize,
        list: String,
    },
    #[error("router core counts must be at least 1")]
    ZeroCores,
}

/// Parses a CPU list: comma-separated CPUs and inclusive ranges (`0-3,8,10-11`), in the
/// order given. Rejects duplicates, reversed ranges and anything else.
pub fn parse_cpu_list(list: &str) -> Result<Vec<usize>, CpuError> {
    let syntax = |problem: &str| CpuError::Syntax {
        list: list.to_string(),
        problem: problem.to_string(),
    };
    let trimmed = list.trim();
    if trimmed.is_empty() {
        return Err(CpuError::Empty);
    }
    let number = |text: &str| {
        text.trim()
            .parse::<usize>()
            .map_err(|_| syntax(&format!("{:?} is not a CPU number", text.trim())))
    };
    let mut cpus = Vec::new();
    for part in trimmed.split(',') {
        let part = part.trim();
        if part.is_empty() {
            return Err(syntax("empty element"));
        }
        match part.split_once('-') {
            Some((low, high)) => {
                let (low, high) = (number(low)?, number(high)?);
                if low > high {
                    return Err(syntax(&format!("range {low}-{high} runs backwards")));
                }
                if high - low > MAX_RANGE {
                    return Err(syntax(&format!("range {low}-{high} is too large")));
                }
                cpus.extend(low..=high);
            }
            None => cpus.push(number(part)?),
        }
    }
    for (index, cpu) in cpus.iter().enumerate() {
        if cpus[..index].contains(cpu) {
            return Err(CpuError::Duplicate {
                cpu: *cpu,
                list: list.to_string(),
            });
        }
    }
    Ok(cpus)
}

/// Writes CPUs compactly, runs of consecutive CPUs as ranges: `[0,1,2,3,8]` -> `0-3,8`.
pub fn format_cpu_list(cpus: &[usize]) -> String {
    let mut parts: Vec<String> = Vec::new();
    let mut index = 0;
    while index < cpus.len() {
        let start = cpus[index];
        let mut end = index;
        while end + 1 < cpus.len() && cpus[end + 1] == cpus[end] + 1 {
            end += 1;
        }
        if end > index {
            parts.push(format!("{start}-{}", cpus[end]));
        } else {
            parts.push(start.to_string());
        }
        index = end + 1;
    }
    parts.join(",")
}

/// The CPUs this process may run on (its affinity mask), ascending.
pub fn available_cpus() -> Vec<usize> {
    // SAFETY: cpu_set_t is plain data; sched_getaffinity writes at most its size into it.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    let status =
        unsafe { libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) };
    if status != 0 {
        let count = std::thread::available_parallelism().map_or(1, |count| count.get());
        return (0..count).collect();
    }
    (0..libc::CPU_SETSIZE as usize)
        // SAFETY: `cpu` is below CPU_SETSIZE, the size of the set.
        .filter(|&cpu| unsafe { libc::CPU_ISSET(cpu, &set) })
        .collect()
}

/// Where everything runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pinning {
    pub router: Vec<usize>,
    pub engines: Vec<usize>,
    pub loadgen: Vec<usize>,
}

impl Pinning {
    /// The default plan: below [`SPLIT_MIN_CPUS`] every part shares every CPU; from there the
    /// router gets the first half, the engines the next quarter and the load generator the
    /// rest.
    pub fn default_for(available: &[usize]) -> Pinning {
        let count = available.len();
        if count < SPLIT_MIN_CPUS {
            return Pinning {
                router: available.to_vec(),
                engines: available.to_vec(),
                loadgen: available.to_vec(),
            };
        }
        let router_end = count / 2;
        let engines_end = router_end + count / 4;
        Pinning {
            router: available[..router_end].to_vec(),
            engines: available[router_end..engines_end].to_vec(),
            loadgen: available[engines_end..].to_vec(),
        }
    }

    /// The default plan with any of the three lists replaced by a flag.
    pub fn resolve(
        available: &[usize],
        router: Option<&str>,
        engines: Option<&str>,
        loadgen: Option<&str>,
    ) -> Result<Pinning, CpuError> {
        let defaults = Pinning::default_for(available);
        let pick = |what: &'static str, flag: Option<&str>, default: Vec<usize>| {
            let cpus = match flag {
                Some(list) => parse_cpu_list(list)?,
                None => default,
            };
            if let Some(&cpu) = cpus.iter().find(|cpu| !available.contains(cpu)) {
                return Err(CpuError::Unavailable {
                    what,
                    cpu,
                    available: format_cpu_list(available),
                });
            }
            if cpus.is_empty() {
                return Err(CpuError::Empty);
            }
            Ok(cpus)
        };
        Ok(Pinning {
            router: pick("--router-cpus", router, defaults.router)?,
            engines: pick("--engine-cpus", engines, defaults.engines)?,
            loadgen: pick("--loadgen-cpus", loadgen, defaults.loadgen)?,
        })
    }

    /// Whether any CPU serves two parts of the run (then the figures are not isolated).
    pub fn shared(&self) -> bool {
        let overlaps = |a: &[usize], b: &[usize]| a.iter().any(|cpu| b.contains(cpu));
        overlaps(&self.router, &self.engines)
            || overlaps(&self.router, &self.loadgen)
            || overlaps(&self.engines, &self.loadgen)
    }

    /// The router's CPUs at `cores` router cores.
    pub fn router_layout(&self, cores: usize) -> Result<RouterLayout, CpuError> {
        if cores == 0 {
            return Err(CpuError::ZeroCores);
        }
        if cores > self.router.len() {
            return Err(CpuError::TooFewRouterCpus {
                cores,
                cpus: self.router.len(),
                list: format_cpu_list(&self.router),
            });
        }
        Ok(RouterLayout {
            data: self.router[..cores].to_vec(),
            control: self.router.get(cores).copied(),
        })
    }
}

/// A router's CPUs at one core count.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RouterLayout {
    /// One per data core.
    pub data: Vec<usize>,
    /// The next router CPU after the data cores; `None` when the list has none left, and then
    /// `myelin serve` is given no `--control-core` (its control core shares a data core's CPU:
    /// it refuses an explicit control core that is also a data core).
    pub control: Option<usize>,
}

impl RouterLayout {
    /// Every CPU the router may use: the data cores and the control core. External routers
    /// are pinned (`taskset -c`) to exactly these.
    pub fn all(&self) -> Vec<usize> {
        let mut all = self.data.clone();
        all.extend(self.control);
        all
    }

    /// `myelin serve`'s pinning flags.
    pub fn serve_flags(&self) -> Vec<String> {
        let mut flags = vec!["--cores".to_string(), format_cpu_list(&self.data)];
        if let Some(control) = self.control {
            flags.push("--control-core".into());
            flags.push(control.to_string());
        }
        flags
    }
}

impl fmt::Display for RouterLayout {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(formatter, "data cores {}", format_cpu_list(&self.data))?;
        match self.control {
            Some(control) => write!(formatter, ", control core {control}"),
            None => write!(
                formatter,
                ", control core shared (no CPU left in --router-cpus)"
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_lists_parse_in_order_with_ranges() {
        assert_eq!(
            parse_cpu_list("0-3,8,10-11").unwrap(),
            [0, 1, 2, 3, 8, 10, 11]
        );
        assert_eq!(parse_cpu_list(" 5 , 2 ").unwrap(), [5, 2]);
        assert_eq!(parse_cpu_list("7").unwrap(), [7]);
        assert_eq!(parse_cpu_list("4-4").unwrap(), [4]);
    }

    #[test]
    fn malformed_cpu_lists_are_rejected() {
        assert_eq!(parse_cpu_list(""), Err(CpuError::Empty));
        assert_eq!(parse_cpu_list("  "), Err(CpuError::Empty));
        for bad in ["1,,2", "a", "3-1", "1-", "-2", "1;2", "1-2-3", "0-99999999"] {
            assert!(
                matches!(parse_cpu_list(bad), Err(CpuError::Syntax { .. })),
                "{bad} parsed"
            );
        }
        assert!(matches!(
            parse_cpu_list("0-3,2"),
            Err(CpuError::Duplicate { cpu: 2, .. })
        ));
    }

    #[test]
    fn cpu_lists_format_compactly_and_round_trip() {
        assert_eq!(format_cpu_list(&[0, 1, 2, 3, 8, 10, 11]), "0-3,8,10-11");
        assert_eq!(format_cpu_list(&[5, 2]), "5,2");
        assert_eq!(format_cpu_list(&[]), "");
        let cpus = [0, 2, 3, 4, 9];
        assert_eq!(parse_cpu_list(&format_cpu_list(&cpus)).unwrap(), cpus);
    }

    #[test]
    fn small_machines_share_every_cpu_and_large_ones_split() {
        let two = Pinning::default_for(&[0, 1]);
        assert_eq!(
            (two.router.as_slice(), two.loadgen.as_slice()),
            (&[0, 1][..], &[0, 1][..])
        );
        assert!(two.shared());
        let sixteen: Vec<usize> = (0..16).collect();
        let split = Pinning::default_for(&sixteen);
        assert_eq!(split.router, (0..8).collect::<Vec<_>>());
        assert_eq!(split.engines, (8..12).collect::<Vec<_>>());
        assert_eq!(split.loadgen, (12..16).collect::<Vec<_>>());
        assert!(!split.shared());
    }

    #[test]
    fn flags_replace_defaults_and_must_name_available_cpus() {
        let available: Vec<usize> = (0..4).collect();
        let pinning = Pinning::resolve(&available, Some("1-2"), None, Some("3")).unwrap();
        assert_eq!(pinning.router, [1, 2]);
        assert_eq!(pinning.engines, [0, 1, 2, 3]);
        assert_eq!(pinning.loadgen, [3]);
        assert!(matches!(
            Pinning::resolve(&available, Some("0-4"), None, None),
            Err(CpuError::Unavailable { cpu: 4, .. })
        ));
    }

    #[test]
    fn router_layout_takes_the_first_n_and_the_next_as_control() {
        let pinning = Pinning {
            router: vec![2, 3, 4, 6],
            engines: vec![0],
            loadgen: vec![1],
        };
        let one = pinning.router_layout(1).unwrap();
        assert_eq!((one.data.as_slice(), one.control), (&[2][..], Some(3)));
        assert_eq!(one.serve_flags(), ["--cores", "2", "--control-core", "3"]);
        let three = pinning.router_layout(3).unwrap();
        assert_eq!(
            three.serve_flags(),
            ["--cores", "2-4", "--control-core", "6"]
        );
        assert_eq!(three.all(), [2, 3, 4, 6]);
        // Every router CPU is a data core: no --control-core (serve shares one itself).
        let four = pinning.router_layout(4).unwrap();
        assert_eq!(four.control, None);
        assert_eq!(four.serve_flags(), ["--cores", "2-4,6"]);
        assert_eq!(four.all(), [2, 3, 4, 6]);
        assert!(matches!(
            pinning.router_layout(5),
            Err(CpuError::TooFewRouterCpus { cores: 5, .. })
        ));
        assert_eq!(pinning.router_layout(0), Err(CpuError::ZeroCores));
    }
}
