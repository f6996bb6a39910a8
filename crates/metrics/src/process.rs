//! The standard `process_*` series of Prometheus client libraries, read from `/proc`
//! at each scrape (a confined component may still read its own `/proc` entries).

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;

#[derive(Debug)]
pub(crate) struct ProcessCollector;

/// What `/proc/self/stat` says, in the units the series use.
struct Stat {
    cpu_seconds: f64,
    start_time_seconds: f64,
    virtual_memory_bytes: u64,
    resident_memory_bytes: u64,
}

fn read_stat() -> Option<Stat> {
    let text = std::fs::read_to_string("/proc/self/stat").ok()?;
    // The command name is in parentheses and may hold spaces; fields count from after it.
    let rest = text.get(text.rfind(')')? + 2..)?;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // Field n of proc(5) is fields[n - 3] here (pid and comm come before the state).
    let field = |n: usize| fields.get(n - 3)?.parse::<u64>().ok();
    let ticks = rustix::param::clock_ticks_per_second() as f64;
    let boot = boot_time_seconds()?;
    Some(Stat {
        cpu_seconds: (field(14)? + field(15)?) as f64 / ticks,
        start_time_seconds: boot + field(22)? as f64 / ticks,
        virtual_memory_bytes: field(23)?,
        resident_memory_bytes: field(24)? * rustix::param::page_size() as u64,
    })
}

fn boot_time_seconds() -> Option<f64> {
    let text = std::fs::read_to_string("/proc/stat").ok()?;
    text.lines()
        .find_map(|line| line.strip_prefix("btime "))
        .and_then(|v| v.trim().parse::<f64>().ok())
}

fn open_fds() -> Option<u64> {
    Some(std::fs::read_dir("/proc/self/fd").ok()?.count() as u64)
}

fn max_fds() -> Option<u64> {
    rustix::process::getrlimit(rustix::process::Resource::Nofile).current
}

fn gauge(
    encoder: &mut DescriptorEncoder<'_>,
    name: &str,
    help: &str,
    value: impl prometheus_client::encoding::EncodeGaugeValue + Send + Sync + std::fmt::Debug,
) -> Result<(), std::fmt::Error> {
    let gauge = ConstGauge::new(value);
    let metric = encoder.encode_descriptor(name, help, None, gauge.metric_type())?;
    gauge.encode(metric)
}

impl Collector for ProcessCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        if let Some(stat) = read_stat() {
            let cpu = ConstCounter::new(stat.cpu_seconds);
            let metric = encoder.encode_descriptor(
                "process_cpu_seconds",
                "Total user and system CPU time spent in seconds.",
                None,
                cpu.metric_type(),
            )?;
            cpu.encode(metric)?;
            gauge(
                &mut encoder,
                "process_start_time_seconds",
                "Start time of the process since unix epoch in seconds.",
                stat.start_time_seconds,
            )?;
            gauge(
                &mut encoder,
                "process_virtual_memory_bytes",
                "Virtual memory size in bytes.",
                stat.virtual_memory_bytes,
            )?;
            gauge(
                &mut encoder,
                "process_resident_memory_bytes",
                "Resident memory size in bytes.",
                stat.resident_memory_bytes,
            )?;
        }
        if let Some(fds) = open_fds() {
            gauge(
                &mut encoder,
                "process_open_fds",
                "Number of open file descriptors.",
                fds,
            )?;
        }
        if let Some(max) = max_fds() {
            gauge(
                &mut encoder,
                "process_max_fds",
                "Maximum number of open file descriptors.",
                max,
            )?;
        }
        Ok(())
    }
}
