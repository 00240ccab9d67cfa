//! `strata serve`: opens the data directory, starts the frontends and the
//! REST API, and shuts down cleanly on SIGTERM or SIGINT.

use std::io::Write;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use tokio::net::TcpListener;
use tokio::sync::watch;

use crate::checksum::Backend;
use crate::control::manager::VolumeManager;
use crate::device::{DeviceWraps, MappedIo};
use crate::frontend::{iscsi, nbd};
use crate::fs::Exports as _;

#[derive(Debug, Clone, clap::Args)]
pub struct ServeArgs {
    /// Directory holding the pool; created with a default pool and a 10 GiB
    /// volume `default/vol0` on first start, reused afterwards.
    #[arg(long, default_value = "./strata-data")]
    pub data_dir: PathBuf,
    /// Address for NBD clients (port 0 picks a free port).
    #[arg(long, default_value = "127.0.0.1:10809")]
    pub nbd: SocketAddr,
    /// Address for iSCSI initiators (port 0 picks a free port).
    #[arg(long, default_value = "127.0.0.1:3260")]
    pub iscsi: SocketAddr,
    /// Address for NFSv3 clients (MOUNT and a portmapper answer on the same
    /// port), or `off`. Port 0 picks a free port.
    #[arg(long, value_name = "ADDR|off", default_value = "127.0.0.1:2049", value_parser = parse_nfs_address)]
    pub nfs: NfsAddress,
    /// TCP address of the REST API and /metrics. Every request but `GET
    /// /metrics` needs the bearer token (DATA_DIR/api.token); an address
    /// other than loopback is served with TLS only.
    #[arg(long, default_value = "127.0.0.1:9860")]
    pub api: SocketAddr,
    #[command(flatten)]
    pub api_security: ApiSecurityArgs,
    /// Most connections each of the NBD, iSCSI and NFS listeners serves at once.
    #[arg(long, default_value_t = crate::frontend::limits::DEFAULT_MAX_CONNECTIONS, value_name = "N")]
    pub max_connections: usize,
    /// Most connections one client address may hold on each listener.
    #[arg(long, default_value_t = crate::frontend::limits::DEFAULT_MAX_PER_CLIENT, value_name = "N")]
    pub max_connections_per_client: usize,
    /// Memory for the request and reply data that clients have in flight,
    /// over every NBD, iSCSI and NFS connection together (e.g. 2G): past
    /// it, connections stop reading requests until replies go out; one
    /// client address holds at most a quarter of it. Default: an eighth of
    /// the machine's RAM.
    #[arg(long, value_name = "SIZE", value_parser = parse_client_memory)]
    pub client_memory: Option<u64>,
    /// Seconds an NBD client has for its handshake and an iSCSI initiator
    /// for its login (idle or slow clients are cut).
    #[arg(long, default_value_t = 30, value_name = "SECONDS", value_parser = clap::value_parser!(u64).range(1..))]
    pub handshake_timeout: u64,
    /// Microseconds an NBD connection with nothing in flight polls for its
    /// client's next request before it waits (polls run only while they
    /// catch requests); 0 never polls, saving that CPU at the cost of
    /// latency at queue depth 1.
    #[arg(long, default_value_t = nbd::server::DEFAULT_IDLE_POLL_US, value_name = "MICROSECONDS")]
    pub nbd_poll_us: u64,
    /// Send buffer each NBD connection asks of the kernel (Linux doubles
    /// it; net.core.wmem_max caps it); 0 leaves it to the kernel's
    /// autotuning.
    #[arg(long, value_name = "SIZE", default_value = "512K", value_parser = parse_send_buffer)]
    pub nbd_send_buffer: u64,
    /// Which requests of buffered file devices go through a mapping of the
    /// file: `on` (reads of cached pages, and small writes that would wait
    /// for another thread's pwrite), `reads`, or `off` (every request to
    /// the I/O engine).
    #[arg(long, value_name = "on|reads|off", default_value = "on", value_parser = MappedIo::parse)]
    pub mapped_io: MappedIo,
    /// CRC-32C implementation: `auto` (crc-fast where the CPU has AVX-512
    /// VPCLMULQDQ, else crc32c; sectors six at once where it has AVX2
    /// VPCLMULQDQ), or `crc-fast` or `crc32c` (sectors one by one with it).
    /// Every one gives the same checksums.
    #[arg(long, value_name = "auto|crc-fast|crc32c", default_value = "auto", value_parser = parse_crc)]
    pub crc: CrcChoice,
    /// Do not record requests for the latency heat maps, `strata iostat`
    /// and `/v1/analytics` (the per-volume Prometheus counters stay).
    #[arg(long)]
    pub no_analytics: bool,
    /// Stack device wrappers on a pool device for this run, for tests and
    /// benchmarks: PATH=STACK, e.g. `--wrap
    /// strata-data/pools/default/capacity.dev=delay:8ms+throttle:iops=150,bw=100M`
    /// (emulates an HDD) or `...=error:write,every=100`. PATH is the device's
    /// path as `strata pool status` shows it. Repeatable; not stored.
    #[arg(long = "wrap", value_name = "PATH=STACK")]
    pub wrap: Vec<String>,
    /// NBD over TLS: --tls, --tls-certificates, --tls-verify-peer, --tls-psk.
    #[command(flatten)]
    pub nbd_tls: nbd::tls::TlsArgs,
}

/// How the REST API is reached and protected (README's "Security").
#[derive(Debug, Clone, clap::Args)]
pub struct ApiSecurityArgs {
    /// The API's Unix socket, which the local CLI uses (default
    /// DATA_DIR/api.sock; mode 0660).
    #[arg(long, value_name = "PATH")]
    pub api_socket: Option<PathBuf>,
    /// Group (name or number) that may use the API socket, like docker's
    /// group; the data directory then lets that group through (mode 0710).
    #[arg(long, value_name = "GROUP")]
    pub api_socket_group: Option<String>,
    /// TLS on the API's TCP listener: `auto` (on unless the address is
    /// loopback), `on`, or `off` (refused for other than loopback).
    #[arg(long, value_name = "auto|on|off", default_value = "auto", value_parser = ["auto", "on", "off"])]
    pub api_tls: String,
    /// The API's certificate chain (PEM); default DATA_DIR/api.crt,
    /// self-signed at first use.
    #[arg(long, value_name = "FILE", requires = "api_key")]
    pub api_cert: Option<PathBuf>,
    /// The private key of --api-cert (PEM).
    #[arg(long, value_name = "FILE", requires = "api_cert")]
    pub api_key: Option<PathBuf>,
    /// Put GET /metrics behind the token too (default: open, like
    /// node_exporter, on whatever address --api gives).
    #[arg(long)]
    pub metrics_auth: bool,
}

pub fn run(args: ServeArgs) -> ExitCode {
    tune_allocator();
    raise_file_limit();
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    // tokio's own variable, for experiments, wins over the rule.
    if std::env::var_os("TOKIO_WORKER_THREADS").is_none() {
        builder.worker_threads(async_workers());
    }
    let runtime = match builder.enable_all().build() {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("strata: error: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(serve(args)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("strata: error: {message}");
            ExitCode::FAILURE
        }
    }
}

/// Async workers: half as many again as the cores (3 on 2). The clients of
/// a storage server often share its cores (VMs on the same host, a
/// benchmark's fio), and a client woken by its reply preempts a worker
/// whatever its nice value (a sleeper's credit): with one worker per core,
/// the tasks queued on a preempted worker wait for its next turn, and a
/// spare worker that is on a core steals them. On 2 cores, 16-256 NBD
/// connections reading 4K: p99 27-28 / 65-70 / 170-225 ms with 2 workers,
/// 13 / 31 / 95 with 3, 9-10 / 22-23 / 88-91 with 4; but one connection's
/// 1M reads lost 4-18 % with 4 and none with 3 (BENCHMARKS.md, "Many
/// clients").
fn async_workers() -> usize {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    cores + (cores / 2).max(1)
}

/// Each connection takes a descriptor (an NBD one three: the socket and two
/// clones for its sender and hang-up watch), and the connection caps
/// default to 1024 per listener: the usual soft limit of 1024 descriptors
/// would run out first. Raise it to the hard limit, as most daemons do.
fn raise_file_limit() {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit read and write the struct we pass.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) == 0 && limit.rlim_cur < limit.rlim_max {
            let old = limit.rlim_cur;
            limit.rlim_cur = limit.rlim_max;
            if libc::setrlimit(libc::RLIMIT_NOFILE, &limit) == 0 {
                tracing::info!("open files limit raised from {old} to {}", limit.rlim_max);
            }
        }
    }
}

/// Request payloads of up to 32 MiB are allocated and freed at line rate.
/// glibc would serve each large one with a fresh `mmap` (and page faults on
/// every touch) and give it back with `munmap`; keep them in the heap instead.
fn tune_allocator() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only adjusts allocator tunables; it is called before any
    // other thread exists.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 256 << 20);
    }
}

/// `--crc`: `auto` (`None`) or a backend.
#[derive(Debug, Clone, Copy)]
pub struct CrcChoice(pub Option<Backend>);

fn parse_crc(text: &str) -> Result<CrcChoice, String> {
    if text == "auto" {
        return Ok(CrcChoice(None));
    }
    Backend::from_name(text)
        .map(|backend| CrcChoice(Some(backend)))
        .ok_or_else(|| format!("{text:?} is not auto, crc-fast or crc32c"))
}

/// `--nbd-send-buffer SIZE`: what `SO_SNDBUF` takes (an `int`).
fn parse_send_buffer(text: &str) -> Result<u64, String> {
    let bytes = crate::units::parse_size(text)?;
    if bytes > i32::MAX as u64 {
        return Err(format!("at most {}", crate::units::format_size(i32::MAX as u64)));
    }
    Ok(bytes)
}

/// `--nfs`: an address or `off`.
#[derive(Debug, Clone, Copy)]
pub struct NfsAddress(pub Option<SocketAddr>);

fn parse_nfs_address(text: &str) -> Result<NfsAddress, String> {
    if text == "off" {
        return Ok(NfsAddress(None));
    }
    text.parse()
        .map(|a| NfsAddress(Some(a)))
        .map_err(|e| format!("{text:?} is not an address (HOST:PORT) or off: {e}"))
}

async fn bind(what: &str, address: SocketAddr) -> Result<TcpListener, String> {
    TcpListener::bind(address)
        .await
        .map_err(|e| format!("cannot listen for {what} on {address}: {e}"))
}

async fn serve(args: ServeArgs) -> Result<(), String> {
    let signals = Signals::catch()?;
    let wraps = DeviceWraps::parse(&args.wrap)?;
    let api_tls = api_tls(&args)?;
    let nbd_tls = Arc::new(nbd::tls::NbdTls::from_args(&args.nbd_tls)?);
    // Process-wide, so set before the pools open: their recovery
    // checksums, their devices' mappings.
    if let Some(backend) = args.crc.0 {
        crate::checksum::force_backend(backend).map_err(|chosen| {
            format!(
                "--crc {}: this process already checksums with {}",
                backend.name(),
                chosen.name()
            )
        })?;
    }
    tracing::info!(
        "crc32c: {}; sectors: {}",
        crate::checksum::backend().name(),
        crate::checksum::sector_method().name()
    );
    let mapped_io = crate::device::set_default_mapped_io(args.mapped_io);
    tracing::info!("file devices: mapped I/O {} (--mapped-io)", mapped_io.name());
    nbd::server::set_idle_poll_us(args.nbd_poll_us);
    nbd::server::set_send_buffer_bytes(args.nbd_send_buffer);
    let manager = Arc::new(
        VolumeManager::open_with_wraps(&args.data_dir, wraps)
            .await
            .map_err(|e| e.to_string())?,
    );
    manager.resume_removals();
    manager.resume_scrubs();
    let nbd_listener = bind("NBD", args.nbd).await?;
    let iscsi_listener = bind("iSCSI", args.iscsi).await?;
    let nfs_listener = match args.nfs.0 {
        Some(address) => Some(bind("NFS", address).await?),
        None => None,
    };
    let api_listener = bind("the REST API", args.api).await?;
    let api = open_api(&args, api_tls, &manager, api_listener)?;
    let iscsi_address = iscsi_listener.local_addr().map_err(|e| e.to_string())?;
    let nbd_address = nbd_listener.local_addr().map_err(|e| e.to_string())?;
    let api_address = api.tcp.listener.local_addr().map_err(|e| e.to_string())?;
    let api_scheme = if api.tcp.tls.is_some() { "https" } else { "http" };

    let volumes = manager.volumes();
    let names: Vec<&str> = volumes.iter().map(|v| v.full_name()).collect();
    {
        // Tests and scripts read these lines to find the ports; keep their shape.
        let mut out = std::io::stdout().lock();
        let _ = writeln!(
            out,
            "strata {}: data in {} ({} volume(s): {})",
            env!("CARGO_PKG_VERSION"),
            args.data_dir.display(),
            names.len(),
            names.join(", ")
        );
        let _ = writeln!(out, "strata: nbd listening on {nbd_address}");
        let _ = writeln!(out, "strata: api listening on {api_scheme}://{api_address}");
        let _ = writeln!(out, "strata: api socket {}", api.socket_path.display());
        if let Some(listener) = &nfs_listener {
            let address = listener.local_addr().map_err(|e| e.to_string())?;
            let exports: Vec<String> = manager.all().iter().map(|e| e.path.clone()).collect();
            let _ = writeln!(
                out,
                "strata: nfs listening on {address} (exports: {})",
                if exports.is_empty() {
                    "none".to_string()
                } else {
                    exports.join(", ")
                }
            );
        }
        let _ = writeln!(out, "strata: iscsi listening on {iscsi_address}");
        let _ = writeln!(
            out,
            "strata: dashboard at {api_scheme}://{api_address}/ui (sign in with the token in {})",
            args.data_dir.join(crate::admin::auth::TOKEN_FILE).display()
        );
        let _ = out.flush();
    }

    let (stop_sender, stop) = watch::channel(false);
    crate::frontend::set_handshake_timeout(std::time::Duration::from_secs(args.handshake_timeout));
    let memory = crate::frontend::memory::install(
        args.client_memory
            .unwrap_or_else(crate::frontend::memory::default_bytes),
    );
    tracing::info!(
        "client data in flight: at most {} (--client-memory), a quarter of it per client address",
        crate::units::format_size(memory.total())
    );
    let limits = |protocol| {
        crate::frontend::limits::ConnectionLimits::new(protocol, args.max_connections, args.max_connections_per_client)
    };
    let nbd_task = tokio::spawn(nbd::server::serve(
        nbd_listener,
        manager.clone(),
        limits("nbd"),
        nbd_tls,
        stop.clone(),
    ));
    let iscsi_task = tokio::spawn(iscsi::server::serve(
        iscsi_listener,
        manager.clone(),
        limits("iscsi"),
        stop.clone(),
    ));
    let nfs_task = nfs_listener.map(|listener| {
        let exports: Arc<dyn crate::fs::Exports> = manager.clone();
        tokio::spawn(crate::frontend::nfs::server::serve(
            listener,
            exports,
            limits("nfs"),
            stop.clone(),
        ))
    });
    let api_task = tokio::spawn(crate::admin::server::serve(
        api.router,
        api.socket,
        api.socket_path,
        api.tcp,
        stop.clone(),
    ));

    // Automatic snapshots (`snapshot.schedule`); stops between rounds.
    let retention_task = tokio::spawn(crate::control::retention::run(manager.clone(), stop.clone()));
    // Scheduled scrubs (`scrub.interval`).
    let scrubbing = manager.clone();
    let scrub_task = tokio::spawn(crate::control::manager::every(
        crate::control::manager::SCHEDULE_EVERY,
        stop.clone(),
        move || scrubbing.start_due_scrubs(crate::control::manager::now_unix()),
    ));
    // Devices a pool let go of (a replaced one) leave the catalog.
    let settling = manager.clone();
    let settle_task = tokio::spawn(crate::control::manager::every(
        crate::control::manager::SETTLE_EVERY,
        stop.clone(),
        move || settling.settle_devices(),
    ));
    // One analytics frame per second.
    manager.analytics().set_enabled(!args.no_analytics);
    let analytics_task = tokio::spawn(crate::analytics::record::run(manager.analytics().clone(), stop.clone()));

    let signal = signals.first().await;
    tracing::info!("{signal} received, shutting down");
    let _ = stop_sender.send(true);
    let _ = nbd_task.await;
    let _ = iscsi_task.await;
    if let Some(task) = nfs_task {
        let _ = task.await;
    }
    let _ = api_task.await;
    let _ = retention_task.await;
    let _ = settle_task.await;
    let _ = scrub_task.await;
    let _ = analytics_task.await;
    let mut untold = manager.flush_all().await;
    untold.extend(manager.close().await);
    // stdout may be closed by now (a supervisor that stopped reading); never panic on it.
    let _ = if untold.is_empty() {
        writeln!(
            std::io::stdout(),
            "strata: stopped ({signal}); all acknowledged writes flushed"
        )
    } else {
        writeln!(
            std::io::stdout(),
            "strata: stopped ({signal}); not everything reached its place:\n  {}",
            untold.join("\n  ")
        )
    };
    Ok(())
}

/// The REST API, ready to serve: its router behind authentication, its
/// Unix socket and its TCP side.
struct Api {
    router: axum::Router,
    socket: tokio::net::UnixListener,
    socket_path: PathBuf,
    tcp: crate::admin::server::TcpApi,
}

/// Whether the API's TCP listener uses TLS; decided (and refused) before
/// anything listens.
fn api_tls(args: &ServeArgs) -> Result<bool, String> {
    let loopback = crate::admin::server::is_loopback(&args.api);
    match args.api_security.api_tls.as_str() {
        "on" => Ok(true),
        "off" if !loopback => Err(format!(
            "refusing to serve the REST API on {} without TLS: the bearer token would cross the network in clear; \
             drop --api-tls off (a self-signed certificate is made) or give --api-cert/--api-key",
            args.api
        )),
        "off" => Ok(false),
        _ => Ok(!loopback),
    }
}

fn open_api(args: &ServeArgs, tls: bool, manager: &Arc<VolumeManager>, listener: TcpListener) -> Result<Api, String> {
    use crate::admin::{auth, server};
    let security = &args.api_security;
    let auth = Arc::new(auth::ApiAuth::load_or_create(&args.data_dir, !security.metrics_auth)?);
    let acceptor = if tls {
        let given = security.api_cert.clone().zip(security.api_key.clone());
        let (cert, key) = server::certificate(&args.data_dir, &args.api, given)?;
        Some(Arc::new(crate::tls::acceptor(&cert, &key)?))
    } else {
        None
    };
    let group = security.api_socket_group.as_deref().map(server::group_id).transpose()?;
    let socket_path = security
        .api_socket
        .clone()
        .unwrap_or_else(|| auth::default_socket(&args.data_dir));
    if let Some(gid) = group {
        if socket_path.parent() == Some(args.data_dir.as_path()) {
            // The group must pass through the data directory to reach the
            // socket, and no more: traverse, not list.
            std::os::unix::fs::chown(&args.data_dir, None, Some(gid))
                .and_then(|()| {
                    std::fs::set_permissions(&args.data_dir, std::os::unix::fs::PermissionsExt::from_mode(0o710))
                })
                .map_err(|e| format!("cannot open {} to group {gid}: {e}", args.data_dir.display()))?;
        }
    }
    let socket = server::bind_socket(&socket_path, group)?;
    Ok(Api {
        router: crate::admin::api::router(manager.clone(), auth),
        socket,
        socket_path,
        tcp: server::TcpApi {
            listener,
            tls: acceptor,
        },
    })
}

/// SIGTERM and SIGINT, caught from the moment this is created: created
/// before the daemon says where it listens, so a stop sent as soon as a
/// supervisor (or a test) reads that is a clean stop, not the default
/// action's kill.
struct Signals {
    terminate: tokio::signal::unix::Signal,
    interrupt: tokio::signal::unix::Signal,
}

impl Signals {
    fn catch() -> Result<Signals, String> {
        use tokio::signal::unix::{signal, SignalKind};
        Ok(Signals {
            terminate: signal(SignalKind::terminate()).map_err(|e| format!("cannot catch SIGTERM: {e}"))?,
            interrupt: signal(SignalKind::interrupt()).map_err(|e| format!("cannot catch SIGINT: {e}"))?,
        })
    }

    /// Waits for the first of them; its name.
    async fn first(mut self) -> &'static str {
        tokio::select! {
            _ = self.terminate.recv() => "SIGTERM",
            _ = self.interrupt.recv() => "SIGINT",
        }
    }
}

/// `--client-memory SIZE`: at least four of the largest requests.
fn parse_client_memory(text: &str) -> Result<u64, String> {
    let bytes = crate::units::parse_size(text)?;
    if bytes < crate::frontend::memory::MIN_BYTES {
        return Err(format!(
            "at least {} (four of the largest requests)",
            crate::units::format_size(crate::frontend::memory::MIN_BYTES)
        ));
    }
    Ok(bytes)
}
