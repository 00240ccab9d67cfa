//! `strata serve`: opens the data directory, starts the frontends and the
//! REST API, and shuts down cleanly on SIGTERM or SIGINT.

use std::io::Write;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use tokio::net::TcpListener;
use tokio::sync::watch;

use crate::device::DeviceWraps;
use crate::frontend::{iscsi, nbd};
use crate::volume::manager::VolumeManager;

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
    /// Address of the REST API and /metrics.
    #[arg(long, default_value = "127.0.0.1:9860")]
    pub api: SocketAddr,
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

/// Sender side of the shutdown signal every listener watches.
pub type Shutdown = watch::Receiver<bool>;

pub fn run(args: ServeArgs) -> ExitCode {
    tune_allocator();
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
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

async fn bind(what: &str, address: SocketAddr) -> Result<TcpListener, String> {
    TcpListener::bind(address)
        .await
        .map_err(|e| format!("cannot listen for {what} on {address}: {e}"))
}

async fn serve(args: ServeArgs) -> Result<(), String> {
    let signals = Signals::catch()?;
    let wraps = DeviceWraps::parse(&args.wrap)?;
    let nbd_tls = Arc::new(nbd::tls::NbdTls::from_args(&args.nbd_tls)?);
    // Measured before the pools open (their recovery checksums), and said.
    tracing::info!(
        "crc32c: {}; sectors: {}",
        crate::checksum::backend().name(),
        crate::checksum::sector_method().name()
    );
    let manager = Arc::new(
        VolumeManager::open_with_wraps(&args.data_dir, wraps)
            .await
            .map_err(|e| e.to_string())?,
    );
    let nbd_listener = bind("NBD", args.nbd).await?;
    let iscsi_listener = bind("iSCSI", args.iscsi).await?;
    let api_listener = bind("the REST API", args.api).await?;
    let iscsi_address = iscsi_listener.local_addr().map_err(|e| e.to_string())?;
    let nbd_address = nbd_listener.local_addr().map_err(|e| e.to_string())?;
    let api_address = api_listener.local_addr().map_err(|e| e.to_string())?;

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
        let _ = writeln!(out, "strata: api listening on http://{api_address}");
        let _ = writeln!(out, "strata: iscsi listening on {iscsi_address}");
        let _ = out.flush();
    }

    let (stop_sender, stop) = watch::channel(false);
    let nbd_task = tokio::spawn(nbd::server::serve(nbd_listener, manager.clone(), nbd_tls, stop.clone()));
    let iscsi_task = tokio::spawn(iscsi::server::serve(iscsi_listener, manager.clone(), stop.clone()));
    let router = crate::admin::api::router(manager.clone());
    let mut api_stop = stop.clone();
    let api_task = tokio::spawn(async move {
        let result = axum::serve(api_listener, router)
            .with_graceful_shutdown(async move {
                let _ = api_stop.wait_for(|stopped| *stopped).await;
            })
            .await;
        if let Err(e) = result {
            tracing::error!("REST API stopped: {e}");
        }
    });

    let signal = signals.first().await;
    tracing::info!("{signal} received, shutting down");
    let _ = stop_sender.send(true);
    let _ = nbd_task.await;
    let _ = iscsi_task.await;
    let _ = api_task.await;
    manager.flush_all().await;
    manager.close().await;
    // stdout may be closed by now (a supervisor that stopped reading); never panic on it.
    let _ = writeln!(
        std::io::stdout(),
        "strata: stopped ({signal}); all acknowledged writes flushed"
    );
    Ok(())
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
