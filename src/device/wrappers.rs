//! Devices that stack on any other device, like nbdkit filters: each takes
//! an `Arc<dyn Device>`, is one itself, and its name shows the stack
//! (`error(delay(/var/lib/strata/hdd.img))`).
//!
//! - [`DelayDevice`]: fixed latency per read, write and flush (emulates an
//!   HDD's seek on any machine).
//! - [`ThrottleDevice`]: IOPS and bandwidth caps (token buckets).
//! - [`ErrorDevice`]: fails chosen I/Os with [`DeviceError::Injected`].
//!
//! [`WrapperSpec`] parses the one-line form the CLI uses (grammar in
//! docs/DEVICES.md): `delay:read=8ms,write=8ms`, `throttle:iops=150,bw=100M`,
//! `error:write,every=100`, stacked innermost first with `+`.
//!
//! The delay and throttle wrappers sleep on tokio's timer, so they need a
//! tokio runtime with time enabled (the daemon and `#[tokio::test]` have one).

use std::str::FromStr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;

use super::sim::SimRng;
use super::{check_request, BoxFuture, Device, DeviceError, DeviceInfo, DeviceResult, IoBuf, StickyError};

fn wrapped_info(inner: &dyn Device, kind: &str) -> DeviceInfo {
    let mut info = inner.info().clone();
    info.name = format!("{kind}({})", info.name);
    info
}

/// Fixed added latency per operation kind.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DelayConfig {
    pub read: Duration,
    pub write: Duration,
    pub flush: Duration,
}

/// Sleeps before passing each request on. A delay of 1 ms or more on reads
/// or writes marks the device rotational (it emulates a disk that seeks).
pub struct DelayDevice {
    inner: Arc<dyn Device>,
    info: DeviceInfo,
    config: DelayConfig,
}

impl DelayDevice {
    pub fn new(inner: Arc<dyn Device>, config: DelayConfig) -> Self {
        let mut info = wrapped_info(&*inner, "delay");
        info.rotational |= config.read >= Duration::from_millis(1) || config.write >= Duration::from_millis(1);
        DelayDevice { inner, info, config }
    }
}

async fn pause(delay: Duration) {
    if !delay.is_zero() {
        tokio::time::sleep(delay).await;
    }
}

impl Device for DelayDevice {
    fn info(&self) -> &DeviceInfo {
        &self.info
    }

    fn backing_space(&self) -> Option<super::BackingSpace> {
        self.inner.backing_space()
    }

    fn release_lock(&self) {
        self.inner.release_lock()
    }

    fn preallocate(&self, offset: u64, length: u64) -> super::DeviceResult<()> {
        self.inner.preallocate(offset, length)
    }

    fn read(&self, offset: u64, buf: IoBuf) -> BoxFuture<'_, (IoBuf, DeviceResult<()>)> {
        Box::pin(async move {
            if let Err(e) = check_request(&self.info, offset, buf.len() as u64) {
                return (buf, Err(e));
            }
            pause(self.config.read).await;
            self.inner.read(offset, buf).await
        })
    }

    fn write(&self, offset: u64, buf: IoBuf) -> BoxFuture<'_, (IoBuf, DeviceResult<()>)> {
        Box::pin(async move {
            if let Err(e) = check_request(&self.info, offset, buf.len() as u64) {
                return (buf, Err(e));
            }
            pause(self.config.write).await;
            self.inner.write(offset, buf).await
        })
    }

    fn flush(&self) -> BoxFuture<'_, DeviceResult<()>> {
        // The whole device: every range.
        self.flush_range(0, u64::MAX)
    }

    fn flush_range(&self, offset: u64, length: u64) -> BoxFuture<'_, DeviceResult<()>> {
        Box::pin(async move {
            pause(self.config.flush).await;
            self.inner.flush_range(offset, length).await
        })
    }

    fn discard(&self, offset: u64, length: u64) -> BoxFuture<'_, DeviceResult<()>> {
        self.inner.discard(offset, length)
    }
}

/// Caps; `None` is unlimited.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ThrottleConfig {
    /// Operations per second (reads, writes, flushes and discards each count one).
    pub iops: Option<u64>,
    /// Bytes per second read plus written.
    pub bytes_per_sec: Option<u64>,
}

/// A token bucket that may go into debt: a request takes its cost at once
/// and waits until the debt is paid back, so requests are served in arrival
/// order and a request larger than the burst is still admitted.
#[derive(Debug)]
struct Bucket {
    rate_per_sec: f64,
    burst: f64,
    tokens: f64,
    last: Instant,
}

impl Bucket {
    fn new(rate_per_sec: u64, burst: f64) -> Self {
        Bucket {
            rate_per_sec: rate_per_sec.max(1) as f64,
            burst,
            tokens: burst,
            last: Instant::now(),
        }
    }

    fn reserve(&mut self, cost: f64, now: Instant) -> Duration {
        let elapsed = now.saturating_duration_since(self.last).as_secs_f64();
        self.last = now;
        self.tokens = (self.tokens + elapsed * self.rate_per_sec).min(self.burst);
        self.tokens -= cost;
        if self.tokens >= 0.0 {
            Duration::ZERO
        } else {
            Duration::from_secs_f64(-self.tokens / self.rate_per_sec)
        }
    }
}

/// Limits IOPS and bandwidth. Bursts are 10 ms worth of the rate (at least
/// one operation), so an idle throttled disk does not answer a burst of
/// requests faster than the disk it emulates would.
pub struct ThrottleDevice {
    inner: Arc<dyn Device>,
    info: DeviceInfo,
    buckets: Mutex<(Option<Bucket>, Option<Bucket>)>,
}

impl ThrottleDevice {
    pub fn new(inner: Arc<dyn Device>, config: ThrottleConfig) -> Self {
        let info = wrapped_info(&*inner, "throttle");
        let ops = config
            .iops
            .map(|iops| Bucket::new(iops, (iops as f64 / 100.0).max(1.0)));
        let bytes = config
            .bytes_per_sec
            .map(|bw| Bucket::new(bw, (bw as f64 / 100.0).max(4096.0)));
        ThrottleDevice {
            inner,
            info,
            buckets: Mutex::new((ops, bytes)),
        }
    }

    async fn admit(&self, bytes: u64) {
        let wait = {
            let mut buckets = self.buckets.lock().unwrap_or_else(|e| e.into_inner());
            let now = Instant::now();
            let ops_wait = buckets.0.as_mut().map_or(Duration::ZERO, |b| b.reserve(1.0, now));
            let bytes_wait = match buckets.1.as_mut() {
                Some(b) if bytes > 0 => b.reserve(bytes as f64, now),
                _ => Duration::ZERO,
            };
            ops_wait.max(bytes_wait)
        };
        pause(wait).await;
    }
}

impl Device for ThrottleDevice {
    fn info(&self) -> &DeviceInfo {
        &self.info
    }

    fn backing_space(&self) -> Option<super::BackingSpace> {
        self.inner.backing_space()
    }

    fn release_lock(&self) {
        self.inner.release_lock()
    }

    fn preallocate(&self, offset: u64, length: u64) -> super::DeviceResult<()> {
        self.inner.preallocate(offset, length)
    }

    fn read(&self, offset: u64, buf: IoBuf) -> BoxFuture<'_, (IoBuf, DeviceResult<()>)> {
        Box::pin(async move {
            if let Err(e) = check_request(&self.info, offset, buf.len() as u64) {
                return (buf, Err(e));
            }
            self.admit(buf.len() as u64).await;
            self.inner.read(offset, buf).await
        })
    }

    fn write(&self, offset: u64, buf: IoBuf) -> BoxFuture<'_, (IoBuf, DeviceResult<()>)> {
        Box::pin(async move {
            if let Err(e) = check_request(&self.info, offset, buf.len() as u64) {
                return (buf, Err(e));
            }
            self.admit(buf.len() as u64).await;
            self.inner.write(offset, buf).await
        })
    }

    fn flush(&self) -> BoxFuture<'_, DeviceResult<()>> {
        // The whole device: every range.
        self.flush_range(0, u64::MAX)
    }

    fn flush_range(&self, offset: u64, length: u64) -> BoxFuture<'_, DeviceResult<()>> {
        Box::pin(async move {
            self.admit(0).await;
            self.inner.flush_range(offset, length).await
        })
    }

    fn discard(&self, offset: u64, length: u64) -> BoxFuture<'_, DeviceResult<()>> {
        Box::pin(async move {
            check_request(&self.info, offset, length)?;
            self.admit(0).await;
            self.inner.discard(offset, length).await
        })
    }
}

/// A device operation kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum IoOp {
    Read,
    Write,
    Flush,
    Discard,
}

impl IoOp {
    pub const ALL: [IoOp; 4] = [IoOp::Read, IoOp::Write, IoOp::Flush, IoOp::Discard];

    fn parse(word: &str) -> Option<IoOp> {
        match word {
            "read" => Some(IoOp::Read),
            "write" => Some(IoOp::Write),
            "flush" => Some(IoOp::Flush),
            "discard" | "trim" => Some(IoOp::Discard),
            _ => None,
        }
    }
}

/// Which I/Os an [`ErrorDevice`] fails. An I/O matches when its kind is in
/// `ops` and (for reads, writes and discards) it overlaps `range`; a
/// matching I/O fails when it is the `every`-th match (if set) and the coin
/// with `probability` (if set) comes up. With neither set, every match fails.
#[derive(Debug, Clone, PartialEq)]
pub struct ErrorRule {
    pub ops: Vec<IoOp>,
    /// Byte range `[start, end)`.
    pub range: Option<(u64, u64)>,
    pub every: Option<u64>,
    pub probability: Option<f64>,
}

impl ErrorRule {
    /// Fails every I/O of these kinds.
    pub fn always(ops: &[IoOp]) -> Self {
        ErrorRule {
            ops: ops.to_vec(),
            range: None,
            every: None,
            probability: None,
        }
    }

    fn matches(&self, op: IoOp, offset: u64, length: u64) -> bool {
        if !self.ops.contains(&op) {
            return false;
        }
        match (op, self.range) {
            (IoOp::Flush, _) | (_, None) => true,
            (_, Some((start, end))) => offset < end && offset.saturating_add(length.max(1)) > start,
        }
    }
}

struct ErrorState {
    rules: Vec<(ErrorRule, u64)>,
    rng: SimRng,
    enabled: bool,
    injected: u64,
}

/// Fails chosen I/Os with [`DeviceError::Injected`]. An injected write or
/// flush failure makes this device's error sticky, as a real one would.
pub struct ErrorDevice {
    inner: Arc<dyn Device>,
    info: DeviceInfo,
    state: Mutex<ErrorState>,
    sticky: StickyError,
}

impl ErrorDevice {
    /// `seed` drives the probabilistic rules, so a failing run replays.
    pub fn new(inner: Arc<dyn Device>, rules: Vec<ErrorRule>, seed: u64) -> Self {
        let info = wrapped_info(&*inner, "error");
        ErrorDevice {
            inner,
            info,
            state: Mutex::new(ErrorState {
                rules: rules.into_iter().map(|r| (r, 0)).collect(),
                rng: SimRng::new(seed),
                enabled: true,
                injected: 0,
            }),
            sticky: StickyError::new(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, ErrorState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Replaces the rules (and resets their counters).
    pub fn set_rules(&self, rules: Vec<ErrorRule>) {
        self.lock().rules = rules.into_iter().map(|r| (r, 0)).collect();
    }

    /// Turns injection on or off (the rules stay).
    pub fn set_enabled(&self, enabled: bool) {
        self.lock().enabled = enabled;
    }

    /// How many errors were injected so far.
    pub fn injected(&self) -> u64 {
        self.lock().injected
    }

    fn should_fail(&self, op: IoOp, offset: u64, length: u64) -> bool {
        let mut guard = self.lock();
        let state = &mut *guard;
        if !state.enabled {
            return false;
        }
        let mut fail = false;
        for (rule, count) in state.rules.iter_mut() {
            if !rule.matches(op, offset, length) {
                continue;
            }
            *count += 1;
            let nth = rule.every.is_none_or(|n| n > 0 && *count % n == 0);
            if nth && rule.probability.is_none_or(|p| state.rng.chance(p)) {
                fail = true;
            }
        }
        if fail {
            state.injected += 1;
        }
        fail
    }

    fn injected_error(&self, offset: u64) -> DeviceError {
        DeviceError::Injected {
            device: self.info.name.clone(),
            offset,
        }
    }
}

impl Device for ErrorDevice {
    fn info(&self) -> &DeviceInfo {
        &self.info
    }

    fn backing_space(&self) -> Option<super::BackingSpace> {
        self.inner.backing_space()
    }

    fn release_lock(&self) {
        self.inner.release_lock()
    }

    fn preallocate(&self, offset: u64, length: u64) -> super::DeviceResult<()> {
        self.inner.preallocate(offset, length)
    }

    fn read(&self, offset: u64, buf: IoBuf) -> BoxFuture<'_, (IoBuf, DeviceResult<()>)> {
        Box::pin(async move {
            if let Err(e) = check_request(&self.info, offset, buf.len() as u64) {
                return (buf, Err(e));
            }
            if self.should_fail(IoOp::Read, offset, buf.len() as u64) {
                return (buf, Err(self.injected_error(offset)));
            }
            self.inner.read(offset, buf).await
        })
    }

    fn write(&self, offset: u64, buf: IoBuf) -> BoxFuture<'_, (IoBuf, DeviceResult<()>)> {
        Box::pin(async move {
            if let Err(e) =
                check_request(&self.info, offset, buf.len() as u64).and_then(|()| self.sticky.check(&self.info.name))
            {
                return (buf, Err(e));
            }
            if self.should_fail(IoOp::Write, offset, buf.len() as u64) {
                self.sticky.set(format!("injected write error at offset {offset}"));
                return (buf, Err(self.injected_error(offset)));
            }
            self.inner.write(offset, buf).await
        })
    }

    fn flush(&self) -> BoxFuture<'_, DeviceResult<()>> {
        // The whole device: every range.
        self.flush_range(0, u64::MAX)
    }

    fn flush_range(&self, offset: u64, length: u64) -> BoxFuture<'_, DeviceResult<()>> {
        Box::pin(async move {
            self.sticky.check(&self.info.name)?;
            if self.should_fail(IoOp::Flush, 0, 0) {
                self.sticky.set("injected flush error");
                return Err(self.injected_error(0));
            }
            self.inner.flush_range(offset, length).await
        })
    }

    fn discard(&self, offset: u64, length: u64) -> BoxFuture<'_, DeviceResult<()>> {
        Box::pin(async move {
            check_request(&self.info, offset, length)?;
            self.sticky.check(&self.info.name)?;
            if self.should_fail(IoOp::Discard, offset, length) {
                return Err(self.injected_error(offset));
            }
            self.inner.discard(offset, length).await
        })
    }
}

/// One wrapper layer, parsed from its one-line form (see docs/DEVICES.md).
#[derive(Debug, Clone, PartialEq)]
pub enum WrapperSpec {
    Delay(DelayConfig),
    Throttle(ThrottleConfig),
    Error { rules: Vec<ErrorRule>, seed: u64 },
}

impl WrapperSpec {
    /// Stacks this layer on `inner`.
    pub fn wrap(&self, inner: Arc<dyn Device>) -> Arc<dyn Device> {
        match self {
            WrapperSpec::Delay(config) => Arc::new(DelayDevice::new(inner, *config)),
            WrapperSpec::Throttle(config) => Arc::new(ThrottleDevice::new(inner, *config)),
            WrapperSpec::Error { rules, seed } => Arc::new(ErrorDevice::new(inner, rules.clone(), *seed)),
        }
    }

    /// Parses `layer+layer+...`, innermost first.
    pub fn parse_stack(text: &str) -> Result<Vec<WrapperSpec>, String> {
        text.split('+')
            .filter(|part| !part.trim().is_empty())
            .map(WrapperSpec::from_str)
            .collect()
    }

    /// Applies layers innermost first.
    pub fn wrap_all(specs: &[WrapperSpec], device: Arc<dyn Device>) -> Arc<dyn Device> {
        specs.iter().fold(device, |dev, spec| spec.wrap(dev))
    }
}

/// Wrapper stacks to put on chosen devices as they are opened, keyed by the
/// device's path (`strata serve --wrap PATH=STACK`): emulate an HDD under a
/// benchmark, fail writes under a test. Nothing of it is stored; a restart
/// without `--wrap` opens the bare devices.
#[derive(Debug, Clone, Default)]
pub struct DeviceWraps {
    entries: Vec<(std::path::PathBuf, Vec<WrapperSpec>)>,
}

impl DeviceWraps {
    /// Parses `PATH=STACK` arguments (the stack in the one-line form).
    pub fn parse(arguments: &[String]) -> Result<Self, String> {
        let mut entries: Vec<(std::path::PathBuf, Vec<WrapperSpec>)> = Vec::new();
        for argument in arguments {
            let (path, stack) = argument
                .split_once('=')
                .filter(|(path, stack)| !path.is_empty() && !stack.trim().is_empty())
                .ok_or_else(|| {
                    format!("invalid --wrap '{argument}': expected PATH=STACK, e.g. pool/fast.dev=delay:1ms")
                })?;
            let specs = WrapperSpec::parse_stack(stack).map_err(|e| format!("invalid --wrap '{argument}': {e}"))?;
            let path = std::path::PathBuf::from(path);
            if entries.iter().any(|(known, _)| same_path(known, path.as_path())) {
                return Err(format!("--wrap names {} twice", path.display()));
            }
            entries.push((path, specs));
        }
        Ok(DeviceWraps { entries })
    }

    /// The stack for the device at `path`, if one was asked for.
    fn stack_for(&self, path: &std::path::Path) -> Option<&[WrapperSpec]> {
        self.entries
            .iter()
            .find(|(known, _)| same_path(known, path))
            .map(|(_, specs)| specs.as_slice())
    }

    /// Stacks the wrappers asked for `path` (if any) on `device`.
    pub fn apply(&self, path: &std::path::Path, device: Arc<dyn Device>) -> Arc<dyn Device> {
        match self.stack_for(path) {
            Some(specs) => {
                let wrapped = WrapperSpec::wrap_all(specs, device);
                tracing::warn!("device {} runs wrapped: {}", path.display(), wrapped.info().name);
                wrapped
            }
            None => device,
        }
    }

    /// The paths of `--wrap` arguments that name none of `devices`.
    pub fn unmatched<'a>(&'a self, devices: &[&std::path::Path]) -> Vec<&'a std::path::Path> {
        self.entries
            .iter()
            .map(|(path, _)| path.as_path())
            .filter(|path| !devices.iter().any(|device| same_path(path, device)))
            .collect()
    }
}

/// Whether two paths name the same file: equal as written, or equal once
/// resolved (relative to the working directory, through links).
fn same_path(a: &std::path::Path, b: &std::path::Path) -> bool {
    a == b
        || matches!(
            (std::fs::canonicalize(a), std::fs::canonicalize(b)),
            (Ok(a), Ok(b)) if a == b
        )
}

/// Parses `8ms`, `250us`, `1s`, `1500ns`, `0`.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    let err = || format!("invalid duration '{text}': expected a whole number with ns, us, ms or s (e.g. 8ms)");
    let split = text.find(|c: char| !c.is_ascii_digit()).unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let value: u64 = number.parse().map_err(|_| err())?;
    match unit {
        "ns" => Ok(Duration::from_nanos(value)),
        "us" | "µs" => Ok(Duration::from_micros(value)),
        "ms" => Ok(Duration::from_millis(value)),
        "s" => Ok(Duration::from_secs(value)),
        "" if value == 0 => Ok(Duration::ZERO),
        _ => Err(err()),
    }
}

/// `START-END` with sizes (`1M-2M`), or `START:LENGTH` (`1M:64K`).
fn parse_range(text: &str) -> Result<(u64, u64), String> {
    let size = |s: &str| crate::units::parse_size(s);
    if let Some((start, end)) = text.split_once('-') {
        let (start, end) = (size(start)?, size(end)?);
        if end <= start {
            return Err(format!("empty range '{text}'"));
        }
        Ok((start, end))
    } else if let Some((start, len)) = text.split_once(':') {
        let start = size(start)?;
        Ok((start, start.saturating_add(size(len)?)))
    } else {
        Err(format!("invalid range '{text}': expected START-END, e.g. 1M-2M"))
    }
}

impl FromStr for WrapperSpec {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        let text = text.trim();
        let (kind, args) = text.split_once(':').unwrap_or((text, ""));
        let mut pairs = Vec::new();
        let mut words = Vec::new();
        for item in args.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            match item.split_once('=') {
                Some((k, v)) => pairs.push((k.trim(), v.trim())),
                None => words.push(item),
            }
        }
        let unknown = |key: &str| format!("{kind}: unknown setting '{key}'");
        match kind {
            "delay" => {
                let mut config = DelayConfig::default();
                if let Some(word) = words.first() {
                    // `delay:8ms` = reads and writes.
                    let d = parse_duration(word)?;
                    config.read = d;
                    config.write = d;
                }
                for (key, value) in pairs {
                    let d = parse_duration(value)?;
                    match key {
                        "read" => config.read = d,
                        "write" => config.write = d,
                        "flush" => config.flush = d,
                        "all" => (config.read, config.write) = (d, d),
                        _ => return Err(unknown(key)),
                    }
                }
                Ok(WrapperSpec::Delay(config))
            }
            "throttle" => {
                if let Some(word) = words.first() {
                    return Err(unknown(word));
                }
                let mut config = ThrottleConfig::default();
                for (key, value) in pairs {
                    match key {
                        "iops" => {
                            config.iops = Some(value.parse().map_err(|_| format!("throttle: bad iops '{value}'"))?)
                        }
                        "bw" | "bandwidth" => config.bytes_per_sec = Some(crate::units::parse_size(value)?),
                        _ => return Err(unknown(key)),
                    }
                }
                if config.iops == Some(0) || config.bytes_per_sec == Some(0) {
                    return Err("throttle: a limit of 0 would stop all I/O".into());
                }
                Ok(WrapperSpec::Throttle(config))
            }
            "error" => {
                let mut rule = ErrorRule::always(&[]);
                let mut seed = 0;
                for word in words {
                    if word == "all" {
                        rule.ops.extend(IoOp::ALL);
                    } else {
                        rule.ops.push(IoOp::parse(word).ok_or_else(|| unknown(word))?);
                    }
                }
                for (key, value) in pairs {
                    match key {
                        "every" => {
                            let n: u64 = value.parse().map_err(|_| format!("error: bad every '{value}'"))?;
                            if n == 0 {
                                return Err("error: every must be at least 1".into());
                            }
                            rule.every = Some(n);
                        }
                        "prob" | "probability" => {
                            let p: f64 = value.parse().map_err(|_| format!("error: bad probability '{value}'"))?;
                            if !(0.0..=1.0).contains(&p) {
                                return Err(format!("error: probability {p} is not in [0, 1]"));
                            }
                            rule.probability = Some(p);
                        }
                        "offset" | "range" => rule.range = Some(parse_range(value)?),
                        "seed" => seed = value.parse().map_err(|_| format!("error: bad seed '{value}'"))?,
                        _ => return Err(unknown(key)),
                    }
                }
                if rule.ops.is_empty() {
                    rule.ops.extend(IoOp::ALL);
                }
                Ok(WrapperSpec::Error {
                    rules: vec![rule],
                    seed,
                })
            }
            _ => Err(format!(
                "unknown device wrapper '{kind}': expected delay, throttle or error"
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::SimDevice;

    fn sim() -> Arc<dyn Device> {
        SimDevice::new(1 << 20, 1).as_device()
    }

    #[test]
    fn parse_specs() {
        assert_eq!(
            "delay:read=8ms,write=8ms".parse::<WrapperSpec>().unwrap(),
            WrapperSpec::Delay(DelayConfig {
                read: Duration::from_millis(8),
                write: Duration::from_millis(8),
                flush: Duration::ZERO,
            })
        );
        assert_eq!(
            "throttle:iops=150,bw=100M".parse::<WrapperSpec>().unwrap(),
            WrapperSpec::Throttle(ThrottleConfig {
                iops: Some(150),
                bytes_per_sec: Some(100 << 20),
            })
        );
        assert_eq!(
            "error:write,every=100".parse::<WrapperSpec>().unwrap(),
            WrapperSpec::Error {
                rules: vec![ErrorRule {
                    ops: vec![IoOp::Write],
                    range: None,
                    every: Some(100),
                    probability: None,
                }],
                seed: 0,
            }
        );
        let WrapperSpec::Error { rules, seed } = "error:read,discard,offset=1M-2M,prob=0.25,seed=9".parse().unwrap()
        else {
            panic!()
        };
        assert_eq!(seed, 9);
        assert_eq!(rules[0].ops, vec![IoOp::Read, IoOp::Discard]);
        assert_eq!(rules[0].range, Some((1 << 20, 2 << 20)));
        assert_eq!(rules[0].probability, Some(0.25));
        for bad in [
            "slow:1ms",
            "delay:read=8",
            "delay:seek=1ms",
            "throttle:iops=0",
            "throttle:iops=x",
            "error:explode",
            "error:every=0",
            "error:prob=2",
            "error:offset=5M-1M",
        ] {
            assert!(bad.parse::<WrapperSpec>().is_err(), "{bad} should be refused");
        }
        let stack = WrapperSpec::parse_stack("delay:1ms+error:flush").unwrap();
        assert_eq!(stack.len(), 2);
        let dev = WrapperSpec::wrap_all(&stack, sim());
        assert_eq!(dev.info().name, "error(delay(sim))");
        assert!(dev.info().rotational);
    }

    #[tokio::test]
    async fn error_every_nth_write_then_sticky() {
        let dev = ErrorDevice::new(
            sim(),
            vec![ErrorRule {
                every: Some(3),
                ..ErrorRule::always(&[IoOp::Write])
            }],
            0,
        );
        for i in 0..2u64 {
            let (_, res) = dev.write(i * 512, IoBuf::new(512)).await;
            res.unwrap();
        }
        let (buf, res) = dev.write(1024, IoBuf::copy_from(&[1; 512])).await;
        assert!(matches!(res, Err(DeviceError::Injected { offset: 1024, .. })));
        assert_eq!(buf.payload(), &[1; 512], "the buffer comes back");
        let (_, res) = dev.write(0, IoBuf::new(512)).await;
        assert!(matches!(res, Err(DeviceError::Failed { .. })));
        assert!(matches!(dev.flush().await, Err(DeviceError::Failed { .. })));
        let (_, res) = dev.read(0, IoBuf::new(512)).await;
        res.unwrap();
        assert_eq!(dev.injected(), 1);
    }

    #[tokio::test]
    async fn error_by_range_and_probability_replays_from_seed() {
        let rule = ErrorRule {
            range: Some((4096, 8192)),
            ..ErrorRule::always(&[IoOp::Read])
        };
        let dev = ErrorDevice::new(sim(), vec![rule], 0);
        assert!(dev.read(0, IoBuf::new(4096)).await.1.is_ok());
        assert!(dev.read(8192, IoBuf::new(512)).await.1.is_ok());
        assert!(
            dev.read(7680, IoBuf::new(1024)).await.1.is_err(),
            "overlapping the range fails"
        );
        dev.set_enabled(false);
        assert!(dev.read(4096, IoBuf::new(512)).await.1.is_ok());

        let pattern = |seed| async move {
            let dev = ErrorDevice::new(
                sim(),
                vec![ErrorRule {
                    probability: Some(0.3),
                    ..ErrorRule::always(&[IoOp::Read])
                }],
                seed,
            );
            let mut out = Vec::new();
            for _ in 0..200 {
                out.push(dev.read(0, IoBuf::new(512)).await.1.is_err());
            }
            out
        };
        let a = pattern(5).await;
        assert_eq!(a, pattern(5).await);
        let failures = a.iter().filter(|&&f| f).count();
        assert!((30..90).contains(&failures), "{failures} of 200 at p=0.3");
    }

    #[tokio::test]
    async fn delay_adds_latency() {
        let dev = DelayDevice::new(
            sim(),
            DelayConfig {
                read: Duration::from_millis(20),
                write: Duration::from_millis(10),
                flush: Duration::ZERO,
            },
        );
        let start = std::time::Instant::now();
        dev.read(0, IoBuf::new(512)).await.1.unwrap();
        dev.write(0, IoBuf::new(512)).await.1.unwrap();
        let elapsed = start.elapsed();
        assert!(elapsed >= Duration::from_millis(30), "{elapsed:?}");
        assert!(elapsed < Duration::from_secs(2), "{elapsed:?}");
        assert_eq!(dev.info().name, "delay(sim)");
    }

    #[tokio::test]
    async fn throttle_caps_iops_and_bandwidth() {
        let dev = ThrottleDevice::new(
            sim(),
            ThrottleConfig {
                iops: Some(200),
                bytes_per_sec: None,
            },
        );
        let start = std::time::Instant::now();
        for _ in 0..62 {
            dev.read(0, IoBuf::new(512)).await.1.unwrap();
        }
        // Burst of 2, then 60 at 200/s = 0.3 s.
        let elapsed = start.elapsed();
        assert!(elapsed >= Duration::from_millis(270), "{elapsed:?}");
        assert!(elapsed < Duration::from_secs(2), "{elapsed:?}");

        let dev = ThrottleDevice::new(
            sim(),
            ThrottleConfig {
                iops: None,
                bytes_per_sec: Some(4 << 20),
            },
        );
        let start = std::time::Instant::now();
        for i in 0..16u64 {
            dev.write(i * 65536, IoBuf::new(65536)).await.1.unwrap();
        }
        // 1 MiB at 4 MiB/s, less a ~42 KiB burst: ~0.24 s.
        let elapsed = start.elapsed();
        assert!(elapsed >= Duration::from_millis(220), "{elapsed:?}");
        assert!(elapsed < Duration::from_secs(2), "{elapsed:?}");
    }

    #[test]
    fn durations() {
        assert_eq!(parse_duration("8ms"), Ok(Duration::from_millis(8)));
        assert_eq!(parse_duration("250us"), Ok(Duration::from_micros(250)));
        assert_eq!(parse_duration("0"), Ok(Duration::ZERO));
        assert!(parse_duration("8").is_err());
        assert!(parse_duration("ms").is_err());
    }
}
