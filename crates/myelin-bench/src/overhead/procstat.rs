//! CPU time of a router from `/proc/PID/stat`: utime + stime of every process in the router's
//! process group (the router runs in its own group, so for an external router started by a
//! shell this covers the shell's children too), plus the cutime + cstime its members have
//! collected from children they already reaped.

use std::path::Path;

/// The fields of `/proc/PID/stat` the benchmark reads (times in clock ticks).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProcStat {
    pub pid: u32,
    /// Process group id (field 5).
    pub pgrp: u32,
    /// User and system time of the process itself (fields 14 and 15).
    pub utime: u64,
    pub stime: u64,
    /// User and system time of its reaped children (fields 16 and 17).
    pub cutime: u64,
    pub cstime: u64,
}

impl ProcStat {
    /// Everything this entry accounts for, own and reaped children's, in ticks.
    pub fn total_ticks(&self) -> u64 {
        self.utime + self.stime + self.cutime + self.cstime
    }
}

/// Parses one `/proc/PID/stat` line. The command name (field 2) is in parentheses and may
/// itself hold spaces and parentheses, so fields are counted from the last `)`.
pub fn parse_stat(text: &str) -> Option<ProcStat> {
    let open = text.find('(')?;
    let close = text.rfind(')')?;
    if close < open {
        return None;
    }
    let pid = text[..open].trim().parse().ok()?;
    // After the name: field 3 (state) onwards.
    let rest: Vec<&str> = text[close + 1..].split_whitespace().collect();
    // Field n is rest[n - 3].
    let field = |n: usize| rest.get(n - 3).and_then(|value| value.parse::<u64>().ok());
    Some(ProcStat {
        pid,
        pgrp: u32::try_from(field(5)?).ok()?,
        utime: field(14)?,
        stime: field(15)?,
        cutime: field(16)?,
        cstime: field(17)?,
    })
}

/// Clock ticks per second (`sysconf(_SC_CLK_TCK)`, 100 on Linux almost everywhere).
pub fn ticks_per_second() -> u64 {
    // SAFETY: sysconf has no preconditions.
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if ticks > 0 { ticks as u64 } else { 100 }
}

/// Ticks to microseconds.
pub fn ticks_to_us(ticks: u64) -> u64 {
    ticks.saturating_mul(1_000_000) / ticks_per_second()
}

/// CPU ticks used so far by process group `pgrp`, read from every `/proc/*/stat` under
/// `proc_root`. `None` when no process of that group is there.
pub fn group_ticks_in(proc_root: &Path, pgrp: u32) -> Option<u64> {
    let entries = std::fs::read_dir(proc_root).ok()?;
    let mut total = None;
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        if !name.bytes().all(|byte| byte.is_ascii_digit()) {
            continue;
        }
        // Processes come and go while we read: a vanished one is simply skipped.
        let Ok(text) = std::fs::read_to_string(entry.path().join("stat")) else {
            continue;
        };
        if let Some(stat) = parse_stat(&text)
            && stat.pgrp == pgrp
        {
            *total.get_or_insert(0) += stat.total_ticks();
        }
    }
    total
}

/// [`group_ticks_in`] on `/proc`, in microseconds.
pub fn group_cpu_us(pgrp: u32) -> Option<u64> {
    group_ticks_in(Path::new("/proc"), pgrp).map(ticks_to_us)
}

#[cfg(test)]
mod tests {
    use super::*;

    const STAT: &str = "4242 (my (odd) name) S 1 4242 4242 0 -1 4194560 2211 0 0 0 \
                        1234 567 89 10 20 0 9 0 1000 123456789 1000 18446744073709551615 \
                        1 1 0 0 0 0 0 0 0 0 0 0 17 3 0 0 0 0 0";

    #[test]
    fn parses_times_and_group_past_a_name_with_spaces_and_parentheses() {
        let stat = parse_stat(STAT).unwrap();
        assert_eq!(
            stat,
            ProcStat {
                pid: 4242,
                pgrp: 4242,
                utime: 1234,
                stime: 567,
                cutime: 89,
                cstime: 10,
            }
        );
        assert_eq!(stat.total_ticks(), 1900);
    }

    #[test]
    fn rejects_truncated_or_garbled_lines() {
        assert_eq!(parse_stat(""), None);
        assert_eq!(parse_stat("12 (x) S 1 2 3"), None);
        assert_eq!(
            parse_stat("x (y) S 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15"),
            None
        );
    }

    #[test]
    fn reads_this_process_from_proc() {
        let pid = std::process::id();
        let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
        let stat = parse_stat(&text).unwrap();
        assert_eq!(stat.pid, pid);
        // SAFETY: getpgrp has no preconditions.
        let pgrp = unsafe { libc::getpgrp() } as u32;
        assert_eq!(stat.pgrp, pgrp);
        assert!(group_ticks_in(Path::new("/proc"), pgrp).is_some());
        assert_eq!(group_ticks_in(Path::new("/proc"), u32::MAX), None);
    }

    #[test]
    fn sums_the_members_of_one_group_only() {
        let root = std::env::temp_dir().join(format!("myelin-procstat-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        for (pid, pgrp, utime) in [(10, 10, 100), (11, 10, 5), (12, 99, 1000)] {
            let directory = root.join(pid.to_string());
            std::fs::create_dir_all(&directory).unwrap();
            std::fs::write(
                directory.join("stat"),
                format!("{pid} (sh) S 1 {pgrp} {pgrp} 0 -1 0 0 0 0 0 {utime} 1 2 3 0"),
            )
            .unwrap();
        }
        std::fs::create_dir_all(root.join("self")).unwrap();
        // 100+1+2+3 and 5+1+2+3.
        assert_eq!(group_ticks_in(&root, 10), Some(106 + 11));
        assert_eq!(group_ticks_in(&root, 99), Some(1006));
        let _ = std::fs::remove_dir_all(root);
    }
}
