//! A criterion measurement of the benchmark thread's CPU time (`CLOCK_THREAD_CPUTIME_ID`)
//! instead of wall time: on a small shared machine other processes take the core away for
//! milliseconds at a time, which wall time counts and CPU time does not. "Block events per
//! second of one core" is then block events per second of CPU the thread actually got (cache
//! interference from neighbours and hypervisor steal still count).

use criterion::Throughput;
use criterion::measurement::{Measurement, ValueFormatter};

/// Thread CPU time, in nanoseconds.
pub struct ThreadCpuTime;

/// This thread's CPU time so far, in nanoseconds.
pub fn thread_cpu_nanos() -> u64 {
    let mut now = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime(2) writes one timespec we own.
    unsafe {
        libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut now);
    }
    now.tv_sec as u64 * 1_000_000_000 + now.tv_nsec as u64
}

impl Measurement for ThreadCpuTime {
    type Intermediate = u64;
    type Value = u64;

    fn start(&self) -> u64 {
        thread_cpu_nanos()
    }
    fn end(&self, start: u64) -> u64 {
        thread_cpu_nanos().saturating_sub(start)
    }
    fn add(&self, first: &u64, second: &u64) -> u64 {
        first + second
    }
    fn zero(&self) -> u64 {
        0
    }
    fn to_f64(&self, value: &u64) -> f64 {
        *value as f64
    }
    fn formatter(&self) -> &dyn ValueFormatter {
        &CpuFormatter
    }
}

struct CpuFormatter;

impl ValueFormatter for CpuFormatter {
    fn scale_values(&self, typical_ns: f64, values: &mut [f64]) -> &'static str {
        let (factor, unit) = if typical_ns < 1e3 {
            (1.0, "ns cpu")
        } else if typical_ns < 1e6 {
            (1e-3, "µs cpu")
        } else if typical_ns < 1e9 {
            (1e-6, "ms cpu")
        } else {
            (1e-9, "s cpu")
        };
        values.iter_mut().for_each(|value| *value *= factor);
        unit
    }

    fn scale_throughputs(
        &self,
        _typical_ns: f64,
        throughput: &Throughput,
        values: &mut [f64],
    ) -> &'static str {
        let (count, unit) = match *throughput {
            Throughput::Elements(elements) | Throughput::ElementsAndBytes { elements, .. } => {
                (elements, "Melem/cpu-s")
            }
            Throughput::Bytes(bytes) | Throughput::BytesDecimal(bytes) => (bytes, "MB/cpu-s"),
            Throughput::Bits(bits) => (bits, "Mb/cpu-s"),
        };
        values
            .iter_mut()
            .for_each(|value| *value = count as f64 * 1e3 / *value);
        unit
    }

    fn scale_for_machines(&self, _values: &mut [f64]) -> &'static str {
        "ns"
    }
}
