//! The CLI client: every `strata` subcommand except `serve` talks to the
//! daemon's REST API (`admin::api`). The contract is in docs/CLI.md.
//!
//! Output is an aligned table for people, or the API's JSON (pretty printed)
//! with `--json` / `-o json`. Any failure is one line on stderr,
//! `strata: error: <message>`, and exit status 1.

use std::io::Write;
use std::process::ExitCode;

use serde::de::DeserializeOwned;
use serde_json::{json, Value};

use super::api::split_dataset_name;
use crate::control::manager::{
    role_for_add, split_snapshot_name, split_volume_name, validate_component, DatasetInfo, DatasetSnapshotInfo,
    PoolStatus, SnapshotView, VolumeInfo, DATASET_PROPERTIES, POOL_PROPERTY_NAMES,
};
use crate::pool::migrate::{MigrationStatus, PassSummary};
use crate::pool::{ScrubState, ScrubStatus};
use crate::units::{format_size, parse_size};
use crate::volume::props::{split_assignment, PropError, PropertyRow};

/// Options every admin subcommand accepts (anywhere after `volume`/`pool`).
#[derive(Debug, Clone, clap::Args)]
pub struct ClientOptions {
    /// Where the daemon's REST API is: HOST:PORT, http://HOST:PORT,
    /// https://HOST:PORT or unix:PATH (default: the Unix socket in
    /// --data-dir).
    #[arg(long, global = true, env = "STRATA_API", value_name = "ADDR")]
    pub api: Option<String>,
    /// The daemon's data directory: its socket (api.sock), and the token
    /// (api.token) and certificate (api.crt) used over TCP when readable.
    #[arg(
        long,
        global = true,
        env = "STRATA_DATA_DIR",
        default_value = "./strata-data",
        value_name = "DIR"
    )]
    pub data_dir: std::path::PathBuf,
    /// Bearer token for the API over TCP (prefer STRATA_TOKEN: a command
    /// line is visible to other users in ps).
    #[arg(
        long,
        global = true,
        env = "STRATA_TOKEN",
        value_name = "TOKEN",
        hide_env_values = true
    )]
    pub token: Option<String>,
    /// CA or pinned certificate (PEM) to trust for an https:// API
    /// (default: DATA_DIR/api.crt).
    #[arg(long, global = true, env = "STRATA_CACERT", value_name = "FILE")]
    pub cacert: Option<std::path::PathBuf>,
    /// Print the API's JSON instead of a table (same as `-o json`).
    #[arg(long, global = true)]
    pub json: bool,
    /// `json` for JSON output; with `volume create`, `volume clone`, `fs
    /// create` and `fs clone`, PROPERTY=VALUE sets a property (repeatable).
    #[arg(short = 'o', global = true, value_name = "json|PROPERTY=VALUE")]
    pub options: Vec<String>,
}

#[derive(Debug, clap::Subcommand)]
pub enum AdminCommand {
    /// Create, list, inspect, change, resize and delete volumes.
    Volume(VolumeArgs),
    /// Create pools, add devices to them, show capacity, usage and errors.
    Pool(PoolArgs),
    /// Create, list, inspect, change and destroy file datasets (exported
    /// over NFS as /POOL/NAME).
    Fs(FsArgs),
    /// Daemon-wide iSCSI settings: CHAP for discovery sessions.
    Iscsi(IscsiArgs),
    /// Take, list and delete snapshots (read-only images of volumes,
    /// exported over NBD as POOL/VOLUME@SNAPSHOT).
    Snapshot(SnapshotArgs),
    /// Write a snapshot as a stream on stdout (all of it, or with -i what
    /// changed since an older snapshot), for `strata receive`.
    Send(super::send_cli::SendArgs),
    /// Make a volume and its snapshot from a stream on stdin (a full
    /// stream), or apply an incremental stream to the volume holding its
    /// base snapshot.
    Receive(super::send_cli::ReceiveArgs),
    /// Operations, bandwidth and latency percentiles per volume, every
    /// INTERVAL seconds (like `zpool iostat -l`).
    Iostat(super::iostat::IostatArgs),
    /// List and remove the RAM tier files in /dev/shm (on this machine,
    /// without the daemon): a killed daemon's stay until it starts again.
    #[command(name = "ram-tier")]
    RamTier(super::ram_cli::RamTierArgs),
}

#[derive(Debug, clap::Args)]
pub struct SnapshotArgs {
    #[command(flatten)]
    pub client: ClientOptions,
    #[command(subcommand)]
    pub command: SnapshotCommand,
}

#[derive(Debug, clap::Subcommand)]
pub enum SnapshotCommand {
    /// Take snapshots, all at one consistency point (volumes of one pool).
    Create {
        /// POOL/VOLUME@SNAPSHOT names.
        #[arg(required = true)]
        names: Vec<String>,
    },
    /// List snapshots (all, or those of one volume).
    #[command(visible_alias = "ls")]
    List {
        /// POOL/VOLUME whose snapshots to show.
        volume: Option<String>,
    },
    /// Delete a snapshot (refused while its export has clients).
    #[command(visible_alias = "destroy")]
    Delete {
        /// POOL/VOLUME@SNAPSHOT
        name: String,
    },
    /// Roll a volume back to a snapshot: writes since are undone (refused
    /// while the volume has clients, unless --force).
    Rollback {
        /// POOL/VOLUME@SNAPSHOT
        name: String,
        /// Delete the snapshots newer than this one first.
        #[arg(short = 'r')]
        destroy_newer: bool,
        /// Drop the volume's clients first (NBD connections and iSCSI
        /// sessions are closed after answering what they had in flight).
        #[arg(long)]
        force: bool,
    },
}

#[derive(Debug, clap::Args)]
pub struct IscsiArgs {
    #[command(flatten)]
    pub client: ClientOptions,
    #[command(subcommand)]
    pub command: IscsiCommand,
}

#[derive(Debug, clap::Subcommand)]
pub enum IscsiCommand {
    /// Show the settings: NAME PROPERTY VALUE SOURCE (secrets masked).
    Get,
    /// Change settings (discovery_auth=none|chap|mutual, discovery_chap_user,
    /// discovery_chap_secret, discovery_mutual_user, discovery_mutual_secret);
    /// an empty value clears one. They apply to the next login.
    Set {
        /// SETTING=VALUE assignments.
        #[arg(required = true, value_name = "SETTING=VALUE")]
        assignments: Vec<String>,
    },
}

#[derive(Debug, clap::Args)]
pub struct VolumeArgs {
    #[command(flatten)]
    pub client: ClientOptions,
    #[command(subcommand)]
    pub command: VolumeCommand,
}

#[derive(Debug, clap::Subcommand)]
pub enum VolumeCommand {
    /// Create a thin volume (`-o PROPERTY=VALUE` sets properties).
    Create {
        /// POOL/NAME of the new volume.
        name: String,
        /// Size, e.g. 10G (binary suffixes K, M, G, T, P).
        #[arg(long, short = 's')]
        size: String,
    },
    /// List volumes (all, or those of the given pools and volumes).
    #[command(visible_alias = "ls")]
    List {
        /// POOL or POOL/NAME to show.
        names: Vec<String>,
    },
    /// Show a volume's properties: NAME PROPERTY VALUE SOURCE.
    Get {
        /// POOL/NAME of the volume.
        name: String,
        /// Properties to show (default: all).
        properties: Vec<String>,
    },
    /// Set properties; they take effect at once.
    Set {
        /// POOL/NAME of the volume.
        name: String,
        /// PROPERTY=VALUE assignments.
        #[arg(required = true, value_name = "PROPERTY=VALUE")]
        assignments: Vec<String>,
    },
    /// Grow a volume (shrinking is refused).
    Resize {
        /// POOL/NAME of the volume.
        name: String,
        /// New size, e.g. 20G (or use --size).
        #[arg(value_name = "SIZE", required_unless_present = "size", conflicts_with = "size")]
        new_size: Option<String>,
        /// New size, e.g. 20G.
        #[arg(long, short = 's')]
        size: Option<String>,
    },
    /// Destroy a volume and its data (refused while clients are connected).
    #[command(visible_alias = "destroy")]
    Delete {
        /// POOL/NAME of the volume.
        name: String,
    },
    /// Create a writable clone of a snapshot, instantly: it shares the
    /// snapshot's blocks until it changes them (`-o PROPERTY=VALUE` sets
    /// properties; it takes the origin volume's otherwise).
    Clone {
        /// POOL/VOLUME@SNAPSHOT to clone.
        origin: String,
        /// POOL/NAME of the new volume (same pool).
        name: String,
    },
    /// Make a clone independent of its origin snapshot: the snapshot (and
    /// the older ones of its volume) move to the clone, and the origin's
    /// volume becomes a clone of it, so that it can be deleted.
    Promote {
        /// POOL/NAME of the clone.
        name: String,
    },
}

#[derive(Debug, clap::Args)]
pub struct FsArgs {
    #[command(flatten)]
    pub client: ClientOptions,
    #[command(subcommand)]
    pub command: FsCommand,
}

#[derive(Debug, clap::Subcommand)]
pub enum FsCommand {
    /// Create a file dataset, exported over NFS at once as /POOL/NAME
    /// (`-o PROPERTY=VALUE` sets properties).
    #[command(after_help = dataset_properties_help())]
    Create {
        /// POOL/NAME of the new dataset (volumes and datasets share names).
        name: String,
    },
    /// List file datasets.
    #[command(visible_alias = "ls")]
    List,
    /// Show a dataset's properties: NAME PROPERTY VALUE.
    Get {
        /// POOL/NAME of the dataset.
        name: String,
        /// Properties to show (default: all).
        #[arg(value_name = "PROPERTY")]
        properties: Vec<String>,
    },
    /// Set properties; they take effect at once (recordsize is fixed at
    /// creation).
    #[command(after_help = dataset_properties_help())]
    Set {
        /// POOL/NAME of the dataset.
        name: String,
        /// PROPERTY=VALUE assignments.
        #[arg(required = true, value_name = "PROPERTY=VALUE")]
        assignments: Vec<String>,
    },
    /// Destroy a dataset with its files and directories (refused while it
    /// has snapshots), or one snapshot of it (POOL/NAME@SNAPSHOT). NFS
    /// clients still using it get stale file handles.
    #[command(visible_alias = "delete")]
    Destroy {
        /// POOL/NAME of the dataset, or POOL/NAME@SNAPSHOT.
        name: String,
    },
    /// Take a snapshot of a dataset: read-only, every write acknowledged
    /// before it included, seen by NFS clients under
    /// /POOL/NAME/.snapshot/SNAPSHOT.
    Snapshot {
        /// POOL/NAME@SNAPSHOT.
        name: String,
    },
    /// List the snapshots of one dataset or of all.
    Snapshots {
        /// POOL/NAME of the dataset (default: all).
        name: Option<String>,
    },
    /// Roll a dataset back to a snapshot: its files become the snapshot's
    /// again and everything written since is discarded. NFS clients stay
    /// mounted (files made since get stale file handles).
    Rollback {
        /// POOL/NAME@SNAPSHOT
        name: String,
        /// Destroy the snapshots newer than this one first.
        #[arg(short = 'r')]
        destroy_newer: bool,
    },
    /// Create a writable dataset from a snapshot, instantly: its files are
    /// the snapshot's and share their data until they change (`-o
    /// PROPERTY=VALUE` sets properties; it takes the origin's otherwise).
    /// Exported over NFS at once as /POOL/NEW.
    Clone {
        /// POOL/NAME@SNAPSHOT to clone.
        origin: String,
        /// POOL/NEW: the new dataset (same pool).
        name: String,
    },
    /// Make a clone independent of its origin snapshot: the snapshot (and
    /// the older ones of its dataset) move to the clone, names kept, and
    /// the origin's dataset becomes a clone of it, so that it can be
    /// destroyed. NFS clients of both stay mounted.
    Promote {
        /// POOL/NAME of the clone.
        name: String,
    },
}

/// The dataset properties with their defaults, under `fs create --help`
/// and `fs set --help`.
fn dataset_properties_help() -> String {
    let name_width = DATASET_PROPERTIES.iter().map(|p| p.0.len()).max().unwrap_or(0);
    let default_width = DATASET_PROPERTIES.iter().map(|p| p.1.len()).max().unwrap_or(0);
    let mut help = String::from("Properties and their defaults:\n");
    for (name, default, meaning) in DATASET_PROPERTIES {
        help.push_str(&format!(
            "  {name:<name_width$}  {default:<default_width$}  {meaning}\n"
        ));
    }
    help
}

#[derive(Debug, clap::Args)]
pub struct PoolArgs {
    #[command(flatten)]
    pub client: ClientOptions,
    #[command(subcommand)]
    pub command: PoolCommand,
}

#[derive(Debug, clap::Subcommand)]
pub enum PoolCommand {
    /// Show capacity, usage and errors of all pools or one.
    Status {
        /// Pool to show (default: all).
        pool: Option<String>,
    },
    /// Create a pool on devices (files or block devices; files must exist,
    /// e.g. `truncate -s 100G fast.img`). Devices already in a pool are refused.
    Create {
        /// Pool name.
        name: String,
        /// Fast tier device (SSD/NVMe), or `mirror:A,B[,...]` for one member
        /// kept on each of those devices; repeatable.
        #[arg(long = "fast", value_name = "FILE|DEV|mirror:A,B")]
        fast: Vec<String>,
        /// Capacity tier device (HDD), or `mirror:A,B[,...]`; repeatable.
        #[arg(long = "capacity", value_name = "FILE|DEV|mirror:A,B")]
        capacity: Vec<String>,
        /// Dedicated intent-log device, or `mirror:A,B`.
        #[arg(long = "log", value_name = "FILE|DEV|mirror:A,B")]
        log: Vec<String>,
        /// A mirror's device that takes reads only when no other copy can
        /// (an HDD copy of an SSD); repeatable.
        #[arg(long = "write-mostly", value_name = "FILE|DEV")]
        write_mostly: Vec<String>,
        /// Placement unit, a power of two from 64K to 64M (fixed at creation).
        #[arg(long = "chunk-size", default_value = "1M")]
        chunk_size: String,
        /// RAM for caching (default 512M): half holds dirty data (the
        /// write-back bound, in the RAM tier), half caches reads.
        #[arg(long = "ram", value_name = "SIZE")]
        ram: Option<String>,
        /// Write over devices that are not empty (a file system, partition
        /// table or other signature, or any data in their first or last
        /// MiB), which are refused otherwise. Another pool's devices are
        /// refused even so.
        #[arg(long)]
        force: bool,
    },
    /// Destage all of a pool's cached writes to their place on the devices
    /// and checkpoint its metadata, so the device files alone hold every
    /// write (e.g. before copying them). Writes keep being served.
    Sync {
        /// Pool name.
        pool: String,
    },
    /// Add a fast or capacity device, or a mirror of devices, to a pool
    /// while it runs; its space is usable at once. The devices must not
    /// already be in a pool.
    #[command(
        name = "add-device",
        override_usage = "strata pool add-device POOL (--fast|--capacity) FILE|DEV|mirror:A,B [--force]",
        group(clap::ArgGroup::new("role").required(true))
    )]
    AddDevice {
        /// Pool name.
        pool: String,
        /// Add as a fast tier device (SSD/NVMe), or `mirror:A,B[,...]` for
        /// a mirror of them.
        #[arg(long = "fast", value_name = "FILE|DEV|mirror:A,B", group = "role")]
        fast: Option<String>,
        /// Add as a capacity tier device (HDD), or `mirror:A,B[,...]`.
        #[arg(long = "capacity", value_name = "FILE|DEV|mirror:A,B", group = "role")]
        capacity: Option<String>,
        /// Refused: a log device is fixed when the pool is created.
        #[arg(long = "log", value_name = "FILE|DEV", group = "role", hide = true)]
        log: Option<String>,
        /// Refused: a RAM tier is not a pool device.
        #[arg(long = "ram", value_name = "SIZE", group = "role", hide = true)]
        ram: Option<String>,
        /// Write over a device that is not empty (refused otherwise).
        #[arg(long)]
        force: bool,
    },
    /// Attach NEW to the pool as a mirror copy of EXISTING while the pool
    /// runs: a single device becomes a two-way mirror, a mirror gets one
    /// more copy. NEW takes writes at once and reads once resilvered
    /// (`pool status` shows the progress).
    #[command(override_usage = "strata pool attach POOL EXISTING NEW [--force]")]
    Attach {
        /// Pool name.
        pool: String,
        /// A device of the pool (its path, or the uuid `pool status` shows
        /// for a missing one).
        existing: String,
        /// The device to attach (FILE|DEV, at least EXISTING's size).
        new: String,
        /// Write over a device that is not empty (refused otherwise).
        #[arg(long)]
        force: bool,
    },
    /// Detach DEVICE from its mirror; refused when it is the mirror's last
    /// up-to-date copy, or a single-device member. Its superblocks are
    /// cleared, so it can be used again.
    #[command(override_usage = "strata pool detach POOL DEVICE")]
    Detach {
        /// Pool name.
        pool: String,
        /// The device (its path, or the uuid `pool status` shows for a
        /// missing one).
        device: String,
    },
    /// Replace OLD with NEW while the pool runs: NEW is attached beside
    /// OLD, resilvered (from OLD, or from the mirror's other copies when
    /// OLD is missing or faulted), and OLD is then detached.
    #[command(override_usage = "strata pool replace POOL OLD NEW [--force]")]
    Replace {
        /// Pool name.
        pool: String,
        /// The device to replace (its path, or the uuid `pool status`
        /// shows for a missing one).
        old: String,
        /// The device taking its place (FILE|DEV, at least OLD's size).
        new: String,
        /// Write over a device that is not empty (refused otherwise).
        #[arg(long)]
        force: bool,
    },
    /// Remove a device, or a whole mirror, from a pool while it runs: it
    /// takes no new data at once, its blocks move to the other devices of
    /// its tier (or to the other tier when it is the only one), then it
    /// leaves the pool. Without --wait the move runs in the background
    /// (`pool status` shows it).
    #[command(override_usage = "strata pool remove POOL FILE|DEV|mirror-N [--wait]")]
    Remove {
        /// Pool name.
        pool: String,
        /// The device's path, or `mirror-N` (or the path of any of its
        /// devices) for a whole mirror.
        #[arg(value_name = "FILE|DEV|mirror-N")]
        device: String,
        /// Wait until the device is out of the pool (progress on a
        /// terminal), then print one line.
        #[arg(long)]
        wait: bool,
    },
    /// Scrub a pool: read back every block the pool's volumes, datasets
    /// and snapshots hold, on every copy, and check it against its
    /// checksum. A bad copy on a mirror is rewritten from a good one; a
    /// block no copy holds intact is listed by volume and offset (and by
    /// file for a dataset). Runs in the background, yielding to clients;
    /// `pool status` shows its progress. With --wait, exits 1 if any block
    /// could not be repaired.
    #[command(override_usage = "strata pool scrub POOL [--pause | --stop] [--wait]")]
    Scrub {
        /// Pool name.
        pool: String,
        /// Pause the scrub under way; `pool scrub POOL` goes on from where
        /// it paused, also after a restart.
        #[arg(long, conflicts_with_all = ["stop", "wait"])]
        pause: bool,
        /// Stop the scrub under way (or a paused one) for good.
        #[arg(long, conflicts_with = "wait")]
        stop: bool,
        /// Wait until the scrub ends (progress on a terminal), then print
        /// what it found.
        #[arg(long)]
        wait: bool,
    },
    /// Show a pool's properties: NAME PROPERTY VALUE SOURCE.
    Get {
        /// Pool name.
        pool: String,
        /// Properties to show (default: all).
        properties: Vec<String>,
    },
    /// Set pool properties; they take effect at once: migration=on|off,
    /// migration.high=PERCENT, migration.low=PERCENT,
    /// migration.window=HH:MM-HH:MM (UTC; none clears it).
    Set {
        /// Pool name.
        pool: String,
        /// PROPERTY=VALUE assignments.
        #[arg(required = true, value_name = "PROPERTY=VALUE")]
        assignments: Vec<String>,
    },
    /// Run a migration pass now (cold chunks down to the capacity tier,
    /// hot ones up, pinned volumes where they belong), whatever `migration`
    /// says. Without --wait it is started in the background.
    Migrate {
        /// Pool name.
        pool: String,
        /// Wait for the pass to end (a progress bar on a terminal), then
        /// print what it moved.
        #[arg(long)]
        wait: bool,
    },
}

/// A failure, reported as one line.
#[derive(Debug)]
pub(super) struct CliError(String);

impl<T: std::fmt::Display> From<T> for CliError {
    fn from(message: T) -> Self {
        CliError(message.to_string())
    }
}

pub(super) type CliResult<T> = Result<T, CliError>;

pub fn run(command: AdminCommand) -> ExitCode {
    let result = match command {
        AdminCommand::Volume(args) => run_volume(args),
        AdminCommand::Pool(args) => run_pool(args),
        AdminCommand::Fs(args) => run_fs(args),
        AdminCommand::Iscsi(args) => run_iscsi(args),
        AdminCommand::Snapshot(args) => run_snapshot(args),
        AdminCommand::Iostat(args) => super::iostat::run(args),
        AdminCommand::RamTier(args) => super::ram_cli::run(args),
        AdminCommand::Send(args) => super::send_cli::run_send(args)
            .map(|()| String::new())
            .map_err(CliError),
        AdminCommand::Receive(args) => match super::send_cli::run_receive(args) {
            Ok(output) => Ok(output),
            Err(failure) => {
                eprintln!(
                    "strata: error: {}",
                    failure
                        .message
                        .trim()
                        .lines()
                        .map(str::trim)
                        .collect::<Vec<_>>()
                        .join("; ")
                );
                if let Some(token) = failure.token {
                    eprintln!("resume with: strata send -t {token} | strata receive --resume {token}");
                }
                return ExitCode::FAILURE;
            }
        },
    };
    match result {
        Ok(output) => {
            // A closed stdout (`| head`) is not worth a panic or an error.
            let mut stdout = std::io::stdout().lock();
            let _ = stdout.write_all(output.as_bytes());
            let _ = stdout.flush();
            ExitCode::SUCCESS
        }
        Err(CliError(message)) => {
            let line: Vec<&str> = message.trim().lines().map(str::trim).collect();
            eprintln!("strata: error: {}", line.join("; "));
            ExitCode::FAILURE
        }
    }
}

/// The parsed `--json` / `-o` options.
struct Output {
    json: bool,
    properties: Vec<(String, String)>,
}

fn parse_options(client: &ClientOptions, properties_allowed: bool) -> CliResult<Output> {
    parse_options_for("volume", client, properties_allowed)
}

/// [`parse_options`] for `KIND create` (`volume`, `fs`): what a misplaced
/// `-o PROPERTY=VALUE` is told to use instead.
fn parse_options_for(kind: &str, client: &ClientOptions, properties_allowed: bool) -> CliResult<Output> {
    let mut output = Output {
        json: client.json,
        properties: Vec::new(),
    };
    for option in &client.options {
        if option == "json" {
            output.json = true;
        } else if option.contains('=') {
            if !properties_allowed {
                return Err(CliError(format!(
                    "-o {option}: setting properties with -o is only valid with '{kind} create'; use 'strata {kind} set POOL/NAME {option}'"
                )));
            }
            output.properties.push(split_assignment(option)?);
        } else {
            return Err(CliError(format!(
                "invalid -o value '{option}': expected 'json' or PROPERTY=VALUE"
            )));
        }
    }
    Ok(output)
}

/// The `-o PROPERTY=VALUE` options as the API takes them (a `volsize`
/// checked here first).
fn properties_json(output: &Output) -> CliResult<serde_json::Map<String, Value>> {
    if let Some((_, volsize)) = output.properties.iter().find(|(k, _)| k == "volsize") {
        parse_size(volsize)?;
    }
    Ok(output
        .properties
        .iter()
        .map(|(k, v)| (k.clone(), Value::String(v.clone())))
        .collect())
}

fn run_volume(args: VolumeArgs) -> CliResult<String> {
    let creating = matches!(args.command, VolumeCommand::Create { .. } | VolumeCommand::Clone { .. });
    let output = parse_options(&args.client, creating)?;
    // Everything that can be checked here is checked before the daemon is asked.
    match args.command {
        VolumeCommand::Create { name, size } => {
            split_volume_name(&name)?;
            let size = parse_size(&size)?;
            let properties = properties_json(&output)?;
            let client = Client::new(&args.client)?;
            let body = json!({ "name": name, "size": size, "properties": properties });
            let info: VolumeInfo = client.send("POST", "/v1/volumes", Some(body))?;
            Ok(if output.json { pretty(&info) } else { String::new() })
        }
        VolumeCommand::List { names } => {
            for name in &names {
                if name.contains('/') {
                    split_volume_name(name)?;
                } else {
                    validate_component("pool", name)?;
                }
            }
            let client = Client::new(&args.client)?;
            let volumes: Vec<VolumeInfo> = if names.is_empty() {
                client.get("/v1/volumes")?
            } else {
                let mut all: Vec<VolumeInfo> = Vec::new();
                for name in &names {
                    let found: Vec<VolumeInfo> = if name.contains('/') {
                        vec![client.get(&volume_path(name))?]
                    } else {
                        client.get(&format!("/v1/volumes?pool={name}"))?
                    };
                    for info in found {
                        if !all.iter().any(|v| v.name == info.name) {
                            all.push(info);
                        }
                    }
                }
                all
            };
            Ok(if output.json {
                pretty(&volumes)
            } else {
                volume_table(&volumes)
            })
        }
        VolumeCommand::Get { name, properties } => {
            split_volume_name(&name)?;
            let client = Client::new(&args.client)?;
            let mut info: VolumeInfo = client.get(&volume_path(&name))?;
            let all = properties.is_empty() || properties.iter().any(|p| p == "all");
            if !all {
                let mut rows = Vec::new();
                for wanted in &properties {
                    let row = info
                        .properties
                        .iter()
                        .find(|r| &r.property == wanted)
                        .ok_or_else(|| PropError::Unknown(wanted.clone()))?;
                    rows.push(row.clone());
                }
                info.properties = rows;
            }
            Ok(if output.json {
                pretty(&info)
            } else {
                property_table(&info.name, &info.properties)
            })
        }
        VolumeCommand::Set { name, assignments } => {
            split_volume_name(&name)?;
            let mut properties = serde_json::Map::new();
            for assignment in &assignments {
                let (key, value) = split_assignment(assignment)?;
                if key == "volsize" {
                    parse_size(&value)?;
                }
                properties.insert(key, Value::String(value));
            }
            let client = Client::new(&args.client)?;
            let info: VolumeInfo =
                client.send("PATCH", &volume_path(&name), Some(json!({ "properties": properties })))?;
            Ok(if output.json { pretty(&info) } else { String::new() })
        }
        VolumeCommand::Resize { name, new_size, size } => {
            split_volume_name(&name)?;
            let size = new_size
                .or(size)
                .ok_or_else(|| CliError("missing size: strata volume resize POOL/NAME --size 20G".into()))?;
            let size = parse_size(&size)?;
            let client = Client::new(&args.client)?;
            let path = format!("{}/resize", volume_path(&name));
            let info: VolumeInfo = client.send("POST", &path, Some(json!({ "size": size })))?;
            Ok(if output.json { pretty(&info) } else { String::new() })
        }
        VolumeCommand::Delete { name } => {
            split_volume_name(&name)?;
            let client = Client::new(&args.client)?;
            client.send_empty("DELETE", &volume_path(&name))?;
            Ok(String::new())
        }
        VolumeCommand::Clone { origin, name } => {
            split_snapshot_name(&origin)?;
            split_volume_name(&name)?;
            let properties = properties_json(&output)?;
            let client = Client::new(&args.client)?;
            let body = json!({ "name": name, "properties": properties });
            let info: VolumeInfo = client.send("POST", &format!("/v1/snapshots/{origin}/clone"), Some(body))?;
            Ok(if output.json { pretty(&info) } else { String::new() })
        }
        VolumeCommand::Promote { name } => {
            split_volume_name(&name)?;
            let client = Client::new(&args.client)?;
            let info: VolumeInfo = client.send("POST", &format!("{}/promote", volume_path(&name)), None)?;
            Ok(if output.json { pretty(&info) } else { String::new() })
        }
    }
}

fn run_pool(args: PoolArgs) -> CliResult<String> {
    let output = parse_options(&args.client, false)?;
    match args.command {
        PoolCommand::Create {
            name,
            fast,
            capacity,
            log,
            write_mostly,
            chunk_size,
            ram,
            force,
        } => {
            validate_component("pool", &name)?;
            let write_mostly: Vec<std::path::PathBuf> = write_mostly
                .iter()
                .map(|p| std::path::absolute(p).map_err(|e| format!("{p}: {e}")))
                .collect::<Result<_, _>>()?;
            let chunk_bytes = parse_size(&chunk_size)?;
            let ram_bytes = ram.as_deref().map(parse_size).transpose()?;
            let mut devices = Vec::new();
            let mut mirrors = 0u8;
            for (role, paths) in [("fast", &fast), ("capacity", &capacity), ("log", &log)] {
                for spec in paths {
                    // `mirror:A,B[,...]`: one member, a copy on each device.
                    let (group, paths) = match spec.strip_prefix("mirror:") {
                        Some(list) => {
                            let paths: Vec<&str> = list.split(',').filter(|p| !p.is_empty()).collect();
                            if paths.len() < 2 {
                                return Err(CliError(format!(
                                    "'{spec}': a mirror needs at least two devices (mirror:A,B)"
                                )));
                            }
                            mirrors += 1;
                            (Some(mirrors - 1), paths)
                        }
                        None => (None, vec![spec.as_str()]),
                    };
                    for path in paths {
                        // Absolute paths: the daemon may run in another directory.
                        let absolute = std::path::absolute(path).map_err(|e| format!("{path}: {e}"))?;
                        let mut device = json!({ "path": absolute.display().to_string(), "role": role });
                        if let Some(group) = group {
                            device["mirror"] = json!(group);
                        }
                        if write_mostly.contains(&absolute) {
                            device["write_mostly"] = json!(true);
                        }
                        devices.push(device);
                    }
                }
            }
            if fast.is_empty() && capacity.is_empty() {
                return Err(CliError("a pool needs at least one --fast or --capacity device".into()));
            }
            let named: Vec<&str> = devices.iter().filter_map(|d| d["path"].as_str()).collect();
            if let Some(path) = write_mostly
                .iter()
                .find(|p| !named.contains(&p.display().to_string().as_str()))
            {
                return Err(CliError(format!(
                    "--write-mostly {}: not one of the pool's devices",
                    path.display()
                )));
            }
            let client = Client::new(&args.client)?;
            let body = json!({ "name": name, "devices": devices, "chunk_bytes": chunk_bytes, "ram_bytes": ram_bytes, "force": force });
            let status: PoolStatus = client.send("POST", "/v1/pools", Some(body))?;
            // Sparse device files that promise more than their file system
            // holds: said now, not when a write fails.
            for warning in status.devices.iter().filter_map(|d| d.backing_warning()) {
                eprintln!("strata: warning: {warning}");
            }
            Ok(if output.json { pretty(&status) } else { String::new() })
        }
        PoolCommand::AddDevice {
            pool,
            fast,
            capacity,
            log,
            ram,
            force,
        } => {
            validate_component("pool", &pool)?;
            let (role, path) = match (fast, capacity, log, ram) {
                (Some(path), _, _, _) => ("fast", path),
                (_, Some(path), _, _) => ("capacity", path),
                (_, _, Some(_), _) => return Err(role_for_add("log").unwrap_err().into()),
                _ => return Err(role_for_add("ram").unwrap_err().into()),
            };
            // `mirror:A,B[,...]`: A is added, and the others attached to it.
            let paths: Vec<&str> = match path.strip_prefix("mirror:") {
                Some(list) => {
                    let paths: Vec<&str> = list.split(',').collect();
                    if paths.len() < 2 || paths.iter().any(|p| p.is_empty()) {
                        return Err(format!("'{path}': a mirror needs at least two devices (mirror:A,B)").into());
                    }
                    paths
                }
                None => vec![path.as_str()],
            };
            // Absolute paths: the daemon may run in another directory.
            let mut absolute = Vec::with_capacity(paths.len());
            for path in paths {
                let path = std::path::absolute(path).map_err(|e| format!("{path}: {e}"))?;
                absolute.push(path.display().to_string());
            }
            let client = Client::new(&args.client)?;
            let body = json!({ "path": absolute[0], "copies": absolute[1..], "role": role, "force": force });
            let status: PoolStatus = client.send("POST", &format!("/v1/pools/{pool}/devices"), Some(body))?;
            Ok(if output.json { pretty(&status) } else { String::new() })
        }
        PoolCommand::Attach {
            pool,
            existing,
            new,
            force,
        } => {
            validate_component("pool", &pool)?;
            let body = json!({ "device": device_argument(&existing)?, "new": absolute(&new)?, "force": force });
            let client = Client::new(&args.client)?;
            let status: PoolStatus = client.send("POST", &format!("/v1/pools/{pool}/attach"), Some(body))?;
            Ok(if output.json { pretty(&status) } else { String::new() })
        }
        PoolCommand::Detach { pool, device } => {
            validate_component("pool", &pool)?;
            let body = json!({ "device": device_argument(&device)? });
            let client = Client::new(&args.client)?;
            let status: PoolStatus = client.send("POST", &format!("/v1/pools/{pool}/detach"), Some(body))?;
            Ok(if output.json { pretty(&status) } else { String::new() })
        }
        PoolCommand::Replace { pool, old, new, force } => {
            validate_component("pool", &pool)?;
            let body = json!({ "old": device_argument(&old)?, "new": absolute(&new)?, "force": force });
            let client = Client::new(&args.client)?;
            let status: PoolStatus = client.send("POST", &format!("/v1/pools/{pool}/replace"), Some(body))?;
            Ok(if output.json { pretty(&status) } else { String::new() })
        }
        PoolCommand::Remove { pool, device, wait } => {
            validate_component("pool", &pool)?;
            // Absolute paths: the daemon may run in another directory.
            let device = if device.starts_with("mirror-") {
                device
            } else {
                absolute(&device)?
            };
            let client = Client::new(&args.client)?;
            let body = json!({ "device": device });
            let status: PoolStatus = client.send("POST", &format!("/v1/pools/{pool}/remove"), Some(body))?;
            if !wait {
                return Ok(if output.json { pretty(&status) } else { String::new() });
            }
            let line = remove_and_wait(&client, &pool, &device, &status)?;
            Ok(if output.json {
                let status: PoolStatus = client.get(&format!("/v1/pools/{pool}"))?;
                pretty(&status)
            } else {
                format!("{line}\n")
            })
        }
        PoolCommand::Scrub {
            pool,
            pause,
            stop,
            wait,
        } => {
            validate_component("pool", &pool)?;
            let action = match (pause, stop) {
                (true, _) => "pause",
                (_, true) => "stop",
                _ => "start",
            };
            let client = Client::new(&args.client)?;
            let body = json!({ "action": action });
            let mut status: ScrubStatus = client.send("POST", &format!("/v1/pools/{pool}/scrub"), Some(body))?;
            if wait {
                status = scrub_and_wait(&client, &pool)?;
            }
            let text = if output.json {
                pretty(&status)
            } else {
                scrub_lines(&pool, &status)
            };
            if wait && status.errors > 0 {
                // The summary goes out, and the exit status says it.
                print!("{text}");
                return Err(CliError(format!(
                    "pool {pool}: {} block{} could not be repaired",
                    status.errors,
                    if status.errors == 1 { "" } else { "s" }
                )));
            }
            Ok(text)
        }
        PoolCommand::Sync { pool } => {
            validate_component("pool", &pool)?;
            let client = Client::new(&args.client)?;
            let status: PoolStatus = client.send("POST", &format!("/v1/pools/{pool}/sync"), None)?;
            Ok(if output.json { pretty(&status) } else { String::new() })
        }
        PoolCommand::Get { pool, properties } => {
            validate_component("pool", &pool)?;
            let client = Client::new(&args.client)?;
            let answer: Value = client.get(&format!("/v1/pools/{pool}/properties"))?;
            let mut rows: Vec<PropertyRow> = serde_json::from_value(answer["properties"].clone())
                .map_err(|e| CliError(format!("unexpected answer from the daemon: {e}")))?;
            if !(properties.is_empty() || properties.iter().any(|p| p == "all")) {
                let mut wanted = Vec::new();
                for name in &properties {
                    let row = rows.iter().find(|r| &r.property == name).ok_or_else(|| {
                        CliError(format!(
                            "unknown pool property '{name}' (known: {})",
                            POOL_PROPERTY_NAMES.join(", ")
                        ))
                    })?;
                    wanted.push(row.clone());
                }
                rows = wanted;
            }
            Ok(if output.json {
                pretty(&json!({ "properties": rows }))
            } else {
                property_table(&pool, &rows)
            })
        }
        PoolCommand::Set { pool, assignments } => {
            validate_component("pool", &pool)?;
            let mut properties = serde_json::Map::new();
            for assignment in &assignments {
                let (key, value) = split_assignment(assignment)?;
                properties.insert(key, Value::String(value));
            }
            let client = Client::new(&args.client)?;
            let answer: Value = client.send(
                "PATCH",
                &format!("/v1/pools/{pool}/properties"),
                Some(Value::Object(properties)),
            )?;
            Ok(if output.json { pretty(&answer) } else { String::new() })
        }
        PoolCommand::Migrate { pool, wait } => {
            validate_component("pool", &pool)?;
            if !wait {
                let client = Client::new(&args.client)?;
                let status: MigrationStatus =
                    client.send("POST", &format!("/v1/pools/{pool}/migrate?wait=false"), None)?;
                return Ok(if output.json { pretty(&status) } else { String::new() });
            }
            let summary = migrate_and_wait(&args.client, &pool)?;
            Ok(if output.json {
                pretty(&summary)
            } else {
                format!("{}\n", summary_line(&pool, &summary))
            })
        }
        PoolCommand::Status { pool } => {
            if let Some(pool) = &pool {
                validate_component("pool", pool)?;
            }
            let client = Client::new(&args.client)?;
            let pools: Vec<PoolStatus> = match &pool {
                Some(pool) => vec![client.get(&format!("/v1/pools/{pool}"))?],
                None => client.get("/v1/pools")?,
            };
            Ok(match (output.json, pool.is_some()) {
                // One pool asked for: that pool's object, as the API answers.
                (true, true) => pretty(&pools[0]),
                (true, false) => pretty(&pools),
                (false, _) => pool_table(&pools),
            })
        }
    }
}

/// `-o PROPERTY=VALUE` options as the API takes them, values as given.
fn string_properties(output: &Output) -> serde_json::Map<String, Value> {
    output
        .properties
        .iter()
        .map(|(k, v)| (k.clone(), Value::String(v.clone())))
        .collect()
}

/// Splits and checks `POOL/NAME@SNAPSHOT` (a dataset's snapshot).
fn split_dataset_snapshot_name(name: &str) -> CliResult<(&str, &str)> {
    let (dataset, snapshot) = name
        .split_once('@')
        .ok_or_else(|| CliError(format!("invalid snapshot name '{name}': expected POOL/NAME@SNAPSHOT")))?;
    split_dataset_name(dataset)?;
    check_snapshot_part(name, snapshot)?;
    Ok((dataset, snapshot))
}

fn run_fs(args: FsArgs) -> CliResult<String> {
    let creating = matches!(args.command, FsCommand::Create { .. } | FsCommand::Clone { .. });
    let output = parse_options_for("fs", &args.client, creating)?;
    // Names and assignments are checked here; values by the daemon.
    match args.command {
        FsCommand::Create { name } => {
            split_dataset_name(&name)?;
            let client = Client::new(&args.client)?;
            let body = json!({ "name": name, "properties": string_properties(&output) });
            let info: DatasetInfo = client.send("POST", "/v1/filesystems", Some(body))?;
            Ok(if output.json { pretty(&info) } else { String::new() })
        }
        FsCommand::Clone { origin, name } => {
            let (dataset, snapshot) = split_dataset_snapshot_name(&origin)?;
            split_dataset_name(&name)?;
            let client = Client::new(&args.client)?;
            let body = json!({ "name": name, "properties": string_properties(&output) });
            let info: DatasetInfo = client.send(
                "POST",
                &format!("{}/snapshots/{snapshot}/clone", dataset_path(dataset)),
                Some(body),
            )?;
            Ok(if output.json { pretty(&info) } else { String::new() })
        }
        FsCommand::Promote { name } => {
            split_dataset_name(&name)?;
            let client = Client::new(&args.client)?;
            let info: DatasetInfo = client.send("POST", &format!("{}/promote", dataset_path(&name)), None)?;
            Ok(if output.json { pretty(&info) } else { String::new() })
        }
        FsCommand::Rollback { name, destroy_newer } => {
            let (dataset, snapshot) = split_dataset_snapshot_name(&name)?;
            Client::new(&args.client)?.call(
                "POST",
                &format!("{}/snapshots/{snapshot}/rollback", dataset_path(dataset)),
                Some(json!({ "destroy_newer": destroy_newer })),
            )?;
            Ok(String::new())
        }
        FsCommand::List => {
            let datasets: Vec<DatasetInfo> = Client::new(&args.client)?.get("/v1/filesystems")?;
            Ok(if output.json {
                pretty(&datasets)
            } else {
                dataset_table(&datasets)
            })
        }
        FsCommand::Get { name, properties } => {
            split_dataset_name(&name)?;
            let mut info: DatasetInfo = Client::new(&args.client)?.get(&dataset_path(&name))?;
            // In the order the properties are documented (or asked for).
            let mut wanted: Vec<String> = DATASET_PROPERTIES.iter().map(|p| p.0.to_string()).collect();
            wanted.extend(
                info.properties
                    .keys()
                    .filter(|k| !wanted.contains(k))
                    .cloned()
                    .collect::<Vec<_>>(),
            );
            let all = properties.is_empty() || properties.iter().any(|p| p == "all");
            if !all {
                for property in &properties {
                    if !info.properties.contains_key(property) {
                        return Err(CliError(format!(
                            "unknown dataset property '{property}' (known: {})",
                            DATASET_PROPERTIES.iter().map(|p| p.0).collect::<Vec<_>>().join(", ")
                        )));
                    }
                }
                wanted = properties;
                info.properties.retain(|k, _| wanted.contains(k));
            }
            if output.json {
                return Ok(pretty(&info));
            }
            let mut rows: Vec<Vec<String>> = wanted
                .iter()
                .filter_map(|property| {
                    let value = info.properties.get(property)?;
                    Some(vec![
                        info.name.clone(),
                        property.clone(),
                        dataset_value(property, value),
                    ])
                })
                .collect();
            if let (Some(origin), true) = (&info.origin, all) {
                rows.push(vec![info.name.clone(), "origin".into(), origin.clone()]);
            }
            use Align::*;
            Ok(table(&[("NAME", Left), ("PROPERTY", Left), ("VALUE", Left)], &rows))
        }
        FsCommand::Set { name, assignments } => {
            split_dataset_name(&name)?;
            let mut properties = serde_json::Map::new();
            for assignment in &assignments {
                let (key, value) = split_assignment(assignment)?;
                properties.insert(key, Value::String(value));
            }
            let client = Client::new(&args.client)?;
            let info: DatasetInfo =
                client.send("PATCH", &dataset_path(&name), Some(json!({ "properties": properties })))?;
            Ok(if output.json { pretty(&info) } else { String::new() })
        }
        FsCommand::Destroy { name } => {
            let path = match name.split_once('@') {
                Some((dataset, snapshot)) => {
                    split_dataset_name(dataset)?;
                    check_snapshot_part(&name, snapshot)?;
                    format!("{}/snapshots/{snapshot}", dataset_path(dataset))
                }
                None => {
                    split_dataset_name(&name)?;
                    dataset_path(&name)
                }
            };
            Client::new(&args.client)?.send_empty("DELETE", &path)?;
            Ok(String::new())
        }
        FsCommand::Snapshot { name } => {
            let (dataset, snapshot) = split_dataset_snapshot_name(&name)?;
            let client = Client::new(&args.client)?;
            let info: DatasetSnapshotInfo = client.send(
                "POST",
                &format!("{}/snapshots", dataset_path(dataset)),
                Some(json!({ "name": snapshot })),
            )?;
            Ok(if output.json { pretty(&info) } else { String::new() })
        }
        FsCommand::Snapshots { name } => {
            let path = match &name {
                Some(dataset) => {
                    split_dataset_name(dataset)?;
                    format!("{}/snapshots", dataset_path(dataset))
                }
                None => "/v1/filesystem-snapshots".to_string(),
            };
            let snapshots: Vec<DatasetSnapshotInfo> = Client::new(&args.client)?.get(&path)?;
            if output.json {
                return Ok(pretty(&snapshots));
            }
            use Align::*;
            let rows: Vec<Vec<String>> = snapshots
                .iter()
                .map(|s| {
                    vec![
                        s.name.clone(),
                        s.path.clone(),
                        s.files.to_string(),
                        format_size(s.used_bytes),
                        format_size(s.referenced_bytes),
                        crate::utc::UtcTime::of_unix(s.created_unix).to_string(),
                    ]
                })
                .collect();
            Ok(table(
                &[
                    ("NAME", Left),
                    ("PATH", Left),
                    ("FILES", Right),
                    ("USED", Right),
                    ("REFER", Right),
                    ("CREATED", Left),
                ],
                &rows,
            ))
        }
    }
}

/// The SNAPSHOT of POOL/NAME@SNAPSHOT: a name NFS clients can look up.
fn check_snapshot_part(name: &str, snapshot: &str) -> CliResult<()> {
    if snapshot.is_empty() || snapshot.len() > 255 || snapshot.contains(['/', '@']) || snapshot.starts_with('.') {
        return Err(CliError(format!(
            "invalid snapshot name '{name}': SNAPSHOT is 1 to 255 bytes, no '/' or '@', not starting with '.'"
        )));
    }
    Ok(())
}

/// A dataset property's value as tables show it: byte counts as sizes
/// (`quota` 1073741824 is 1G).
fn dataset_value(property: &str, value: &str) -> String {
    match (property, value.parse::<u64>()) {
        ("recordsize" | "quota", Ok(bytes)) => format_size(bytes),
        _ => value.to_string(),
    }
}

fn dataset_table(datasets: &[DatasetInfo]) -> String {
    use Align::*;
    let headers = [
        ("NAME", Left),
        ("EXPORT", Left),
        ("FILES", Right),
        ("USED", Right),
        ("QUOTA", Right),
    ];
    let rows: Vec<Vec<String>> = datasets
        .iter()
        .map(|d| {
            let quota = d.properties.get("quota").map(String::as_str).unwrap_or("none");
            vec![
                d.name.clone(),
                d.export.clone(),
                d.files.to_string(),
                format_size(d.used_bytes),
                dataset_value("quota", quota),
            ]
        })
        .collect();
    table(&headers, &rows)
}

/// `/v1/filesystems/POOL/NAME` for an already validated `POOL/NAME`.
fn dataset_path(name: &str) -> String {
    format!("/v1/filesystems/{name}")
}

/// `pool migrate --wait`: runs the pass (a request that lasts as long as
/// it does) while a progress bar on a terminal follows the pool's
/// `migration` status.
fn migrate_and_wait(options: &ClientOptions, pool: &str) -> CliResult<PassSummary> {
    use std::io::IsTerminal;
    let path = format!("/v1/pools/{pool}/migrate");
    let runner = Client::new(options)?;
    let (done, finished) = std::sync::mpsc::channel();
    let pass = std::thread::spawn(move || {
        let answer = runner.call_long("POST", &path);
        let _ = done.send(());
        answer
    });
    if std::io::stderr().is_terminal() {
        let poller = Client::new(options)?;
        let bar = indicatif::ProgressBar::new(0);
        bar.set_style(
            indicatif::ProgressStyle::with_template(
                "{msg} [{elapsed_precise}] [{wide_bar}] {bytes}/{total_bytes} {binary_bytes_per_sec}",
            )
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar())
            .progress_chars("=> "),
        );
        bar.set_message(format!("migrate {pool}"));
        while let Err(std::sync::mpsc::RecvTimeoutError::Timeout) =
            finished.recv_timeout(std::time::Duration::from_millis(300))
        {
            // A status that cannot be had now is no reason to stop the pass.
            if let Ok(status) = poller.get::<PoolStatus>(&format!("/v1/pools/{pool}")) {
                bar.set_length(status.migration.pass_total_bytes);
                bar.set_position(status.migration.pass_done_bytes);
            }
        }
        bar.finish_and_clear();
    }
    let text = pass
        .join()
        .map_err(|_| CliError("the migration request failed (its thread panicked)".into()))??;
    serde_json::from_str(&text).map_err(|e| CliError(format!("unexpected answer from the daemon: {e}")))
}

/// The line `pool migrate --wait` ends with.
fn summary_line(pool: &str, summary: &PassSummary) -> String {
    let mut line = format!(
        "pool {pool}: moved {} down ({} chunks) and {} up ({} chunks), {} blocks skipped, {} errors, in {:.1} s",
        format_size(summary.moved_down_bytes),
        summary.chunks_down,
        format_size(summary.moved_up_bytes),
        summary.chunks_up,
        summary.skipped_blocks,
        summary.errors,
        summary.seconds
    );
    if let Some(reason) = &summary.idle_reason {
        line.push_str(&format!(" ({reason})"));
    }
    line
}

/// `/v1/volumes/POOL/NAME` for an already validated `POOL/NAME` (the name
/// characters need no escaping).
fn volume_path(name: &str) -> String {
    format!("/v1/volumes/{name}")
}

/// JSON output: the API's objects, pretty printed, fields in API order.
pub(super) fn pretty<T: serde::Serialize>(value: &T) -> String {
    let mut text = serde_json::to_string_pretty(value).unwrap_or_else(|e| format!("{{\"error\": \"{e}\"}}"));
    text.push('\n');
    text
}

// ---------------------------------------------------------------------------
// Tables

#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Align {
    Left,
    Right,
}

/// Columns separated by two spaces, padded to the widest cell; the last
/// column is not padded, so lines carry no trailing blanks.
pub(super) fn table(headers: &[(&str, Align)], rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = headers.iter().map(|(h, _)| h.len()).collect();
    for row in rows {
        for (width, cell) in widths.iter_mut().zip(row) {
            *width = (*width).max(cell.chars().count());
        }
    }
    let mut out = String::new();
    let header_row: Vec<String> = headers.iter().map(|(h, _)| h.to_string()).collect();
    for row in std::iter::once(&header_row).chain(rows) {
        let last = row.len().saturating_sub(1);
        let mut line = String::new();
        for (index, cell) in row.iter().enumerate() {
            if index > 0 {
                line.push_str("  ");
            }
            let pad = widths[index].saturating_sub(cell.chars().count());
            match headers[index].1 {
                Align::Right => {
                    line.push_str(&" ".repeat(pad));
                    line.push_str(cell);
                }
                Align::Left => {
                    line.push_str(cell);
                    if index != last {
                        line.push_str(&" ".repeat(pad));
                    }
                }
            }
        }
        out.push_str(&line);
        out.push('\n');
    }
    out
}

fn property_value(info: &VolumeInfo, property: &str) -> String {
    info.properties
        .iter()
        .find(|r| r.property == property)
        .map(|r| r.value.clone())
        .unwrap_or_else(|| "-".to_string())
}

fn volume_table(volumes: &[VolumeInfo]) -> String {
    use Align::*;
    let headers = [
        ("NAME", Left),
        ("VOLSIZE", Right),
        ("USED", Right),
        ("VOLBLOCKSIZE", Right),
        ("SYNC", Left),
        ("LOGBIAS", Left),
        ("WCE", Left),
        ("CONNECTIONS", Right),
    ];
    let rows: Vec<Vec<String>> = volumes
        .iter()
        .map(|v| {
            vec![
                v.name.clone(),
                format_size(v.volsize),
                format_size(v.used_bytes),
                format_size(v.volblocksize as u64),
                property_value(v, "sync"),
                property_value(v, "logbias"),
                property_value(v, "wce"),
                v.connections.to_string(),
            ]
        })
        .collect();
    table(&headers, &rows)
}

fn run_snapshot(args: SnapshotArgs) -> CliResult<String> {
    let output = parse_options(&args.client, false)?;
    let client = Client::new(&args.client)?;
    match args.command {
        SnapshotCommand::Create { names } => {
            for name in &names {
                split_snapshot_name(name)?;
            }
            let taken: Vec<SnapshotView> = client.send("POST", "/v1/snapshots", Some(json!({ "names": names })))?;
            Ok(if output.json { pretty(&taken) } else { String::new() })
        }
        SnapshotCommand::List { volume } => {
            let path = match &volume {
                Some(name) => {
                    split_volume_name(name)?;
                    format!("/v1/snapshots?volume={name}")
                }
                None => "/v1/snapshots".to_string(),
            };
            let snapshots: Vec<SnapshotView> = client.get(&path)?;
            Ok(if output.json {
                pretty(&snapshots)
            } else {
                snapshot_table(&snapshots)
            })
        }
        SnapshotCommand::Delete { name } => {
            split_snapshot_name(&name)?;
            client.send_empty("DELETE", &format!("/v1/snapshots/{name}"))?;
            Ok(String::new())
        }
        SnapshotCommand::Rollback {
            name,
            destroy_newer,
            force,
        } => {
            split_snapshot_name(&name)?;
            let body = json!({ "destroy_newer": destroy_newer, "force": force });
            client.call("POST", &format!("/v1/snapshots/{name}/rollback"), Some(body))?;
            Ok(String::new())
        }
    }
}

fn snapshot_table(snapshots: &[SnapshotView]) -> String {
    use Align::*;
    let headers = [
        ("NAME", Left),
        ("CREATED", Left),
        ("VOLSIZE", Right),
        ("USED", Right),
        ("REFERENCED", Right),
        ("WRITTEN", Right),
        ("CONNECTIONS", Right),
    ];
    let rows: Vec<Vec<String>> = snapshots
        .iter()
        .map(|s| {
            vec![
                s.name.clone(),
                crate::utc::UtcTime::of_unix(s.created_unix).to_string(),
                format_size(s.size_bytes),
                format_size(s.used_bytes),
                format_size(s.referenced_bytes),
                format_size(s.written_bytes),
                s.connections.to_string(),
            ]
        })
        .collect();
    table(&headers, &rows)
}

fn run_iscsi(args: IscsiArgs) -> CliResult<String> {
    let output = parse_options(&args.client, false)?;
    let answer: Value = match args.command {
        IscsiCommand::Get => Client::new(&args.client)?.get("/v1/iscsi")?,
        IscsiCommand::Set { assignments } => {
            let mut properties = serde_json::Map::new();
            for assignment in &assignments {
                let (key, value) = split_assignment(assignment)?;
                properties.insert(key, Value::String(value));
            }
            let answer: Value =
                Client::new(&args.client)?.send("PATCH", "/v1/iscsi", Some(json!({ "properties": properties })))?;
            if !output.json {
                return Ok(String::new());
            }
            answer
        }
    };
    if output.json {
        return Ok(pretty(&answer));
    }
    let rows: Vec<PropertyRow> = serde_json::from_value(answer["properties"].clone())
        .map_err(|e| CliError(format!("unexpected answer from the daemon: {e}")))?;
    Ok(property_table("iscsi", &rows))
}

fn property_table(name: &str, properties: &[PropertyRow]) -> String {
    use Align::*;
    let headers = [("NAME", Left), ("PROPERTY", Left), ("VALUE", Left), ("SOURCE", Left)];
    let rows: Vec<Vec<String>> = properties
        .iter()
        .map(|r| vec![name.to_string(), r.property.clone(), r.value.clone(), r.source.clone()])
        .collect();
    table(&headers, &rows)
}

/// `pool status`'s line on migration.
fn migration_line(pool: &PoolStatus) -> String {
    let m = &pool.migration;
    let settings = m.settings.unwrap_or_default();
    let mut line = format!(
        "{}: migration {} (high {}%, low {}%, window {})",
        pool.name,
        if settings.enabled { "on" } else { "off" },
        settings.high_percent,
        settings.low_percent,
        match settings.window {
            None => "any time".to_string(),
            Some(_) => format!("{} UTC", crate::control::manager::format_window(settings.window)),
        }
    );
    if m.running {
        line.push_str(&format!(
            ", running{}: {} of {} at {}/s, queued {} down and {} up chunks",
            if m.throttled { " (throttled)" } else { "" },
            format_size(m.pass_done_bytes),
            format_size(m.pass_total_bytes),
            format_size(m.rate_bytes_per_sec),
            m.queued_down_chunks,
            m.queued_up_chunks
        ));
    } else {
        line.push_str(", idle");
    }
    line.push_str(&format!(
        "; moved {} down and {} up in {} passes since start, {} errors",
        format_size(m.moved_down_bytes),
        format_size(m.moved_up_bytes),
        m.passes,
        m.errors
    ));
    line
}

fn pool_table(pools: &[PoolStatus]) -> String {
    use Align::*;
    let headers = [
        ("NAME", Left),
        ("STATE", Left),
        ("SIZE", Right),
        ("USED", Right),
        ("AVAIL", Right),
        ("FREEING", Right),
        ("DIRTY", Right),
        ("PROVISIONED", Right),
        ("VOLUMES", Right),
        ("READ_ERRORS", Right),
        ("WRITE_ERRORS", Right),
        ("CKSUM_ERRORS", Right),
        ("SUSPECT", Right),
    ];
    let rows: Vec<Vec<String>> = pools
        .iter()
        .map(|p| {
            vec![
                p.name.clone(),
                p.state.clone(),
                format_size(p.size_bytes),
                format_size(p.used_bytes),
                format_size(p.available_bytes),
                format_size(p.freeing_bytes),
                format_size(p.cache.dirty_bytes),
                format_size(p.provisioned_bytes),
                p.volumes.to_string(),
                p.read_errors.to_string(),
                p.write_errors.to_string(),
                p.checksum_errors.to_string(),
                p.suspect_chunks.to_string(),
            ]
        })
        .collect();
    let mut out = table(&headers, &rows);
    // Per device, like `zpool status`.
    let device_headers = [
        ("POOL", Left),
        ("DEVICE", Left),
        ("STATE", Left),
        ("ROLE", Left),
        ("SIZE", Right),
        ("DATA", Right),
        ("USED", Right),
        ("READ", Right),
        ("WRITE", Right),
        ("CKSUM", Right),
        ("REPAIRED", Right),
        ("ENGINE", Left),
        ("FS_FREE", Right),
        ("UNBACKED", Right),
    ];
    let fs_free =
        |backing: Option<crate::device::BackingSpace>| backing.map_or("-".into(), |b| format_size(b.fs_free_bytes));
    let device_rows: Vec<Vec<String>> = pools
        .iter()
        .flat_map(|p| {
            p.devices.iter().flat_map(move |d| {
                let member = vec![
                    p.name.clone(),
                    d.name.clone(),
                    d.state.clone(),
                    d.role.as_str().to_string(),
                    format_size(d.size_bytes),
                    format_size(d.data_bytes),
                    format_size(d.used_bytes),
                    d.read_errors.to_string(),
                    d.write_errors.to_string(),
                    d.checksum_errors.to_string(),
                    "-".into(),
                    d.engine.clone(),
                    fs_free(d.backing),
                    d.backing
                        .map_or("-".into(), |b| format_size(d.size_bytes.saturating_sub(b.backed_bytes))),
                ];
                // A mirror's devices under it, indented as in `zpool status`.
                let children = d.children.iter().map(move |c| {
                    vec![
                        p.name.clone(),
                        format!(
                            "  {}{}{}",
                            c.name,
                            if c.write_mostly { " (write-mostly)" } else { "" },
                            match (c.replaced, c.replacement) {
                                (true, _) => " (being replaced)",
                                (_, true) => " (replacement)",
                                _ => "",
                            }
                        ),
                        c.state.as_str().to_string(),
                        String::new(),
                        String::new(),
                        String::new(),
                        String::new(),
                        c.read_errors.to_string(),
                        c.write_errors.to_string(),
                        c.checksum_errors.to_string(),
                        c.repaired_sectors.to_string(),
                        String::new(),
                        fs_free(c.backing),
                        String::new(),
                    ]
                });
                std::iter::once(member).chain(children)
            })
        })
        .collect();
    if !device_rows.is_empty() {
        if !out.ends_with('\n') {
            out.push('\n');
        }
        out.push('\n');
        out.push_str(&table(&device_headers, &device_rows));
    }
    // Per tier, and what the migrator does between them.
    let tier_headers = [
        ("POOL", Left),
        ("TIER", Left),
        ("SIZE", Right),
        ("USED", Right),
        ("FREE", Right),
    ];
    let tier_rows: Vec<Vec<String>> = pools
        .iter()
        .flat_map(|p| {
            [("fast", p.tiers.fast), ("capacity", p.tiers.capacity)]
                .into_iter()
                .filter(|(_, space)| space.size_bytes > 0)
                .map(move |(tier, space)| {
                    vec![
                        p.name.clone(),
                        tier.to_string(),
                        format_size(space.size_bytes),
                        format_size(space.used_bytes),
                        format_size(space.free_bytes),
                    ]
                })
        })
        .collect();
    if !tier_rows.is_empty() {
        out.push('\n');
        out.push_str(&table(&tier_headers, &tier_rows));
    }
    if !pools.is_empty() {
        out.push('\n');
    }
    for pool in pools {
        out.push_str(&migration_line(pool));
        out.push('\n');
        if let Some(action) = &pool.action {
            out.push_str(&format!("pool {} is {}: {action}\n", pool.name, pool.state));
        }
        for member in &pool.devices {
            if let Some(r) = &member.removal {
                let what = match &r.error {
                    Some(error) if r.phase == "failed" => {
                        format!("stopped: {error}; it takes no new data, run `strata pool remove` again to retry")
                    }
                    _ => format!(
                        "{} moved to the {} tier, {} left",
                        format_size(r.moved_bytes),
                        r.destination.as_str(),
                        format_size(r.left_bytes)
                    ),
                };
                out.push_str(&format!("pool {}: removing {}: {what}\n", pool.name, member.name));
            }
            if let Some(r) = member.resilver {
                let left = r.total_bytes.saturating_sub(r.done_bytes);
                let eta = left
                    .checked_div(r.bytes_per_second)
                    .map_or_else(String::new, |seconds| format!(", about {seconds} s left"));
                out.push_str(&format!(
                    "pool {}: resilvering {}: {} of {} ({}%) at {}/s{eta}\n",
                    pool.name,
                    member.name,
                    format_size(r.done_bytes),
                    format_size(r.total_bytes),
                    r.done_bytes * 100 / r.total_bytes.max(1),
                    format_size(r.bytes_per_second)
                ));
            }
            // A device away or faulted: what its return will copy.
            for child in member.children.iter().filter(|c| {
                !matches!(
                    c.state,
                    crate::pool::vdev::Health::Online | crate::pool::vdev::Health::Resilvering
                )
            }) {
                let resync = match child.changed_bytes {
                    Some(bytes) => format!(
                        "at most {} written since it fell behind is copied to it when it is back",
                        format_size(bytes)
                    ),
                    None => "it is copied whole when it is back".into(),
                };
                out.push_str(&format!(
                    "pool {}: {} of {} is {}: {resync}\n",
                    pool.name,
                    child.name,
                    member.name,
                    child.state.as_str()
                ));
            }
        }
    }
    for pool in pools {
        if let Some(scrub) = &pool.scrub {
            out.push_str(&scrub_lines(&pool.name, scrub));
        }
        if let Some(due) = pool.next_scrub_unix {
            out.push_str(&format!(
                "pool {}: next scrub due {} UTC (`strata pool set {} scrub.interval=...`)\n",
                pool.name,
                crate::utc::UtcTime::of_unix(due),
                pool.name
            ));
        }
    }
    // The file system under a sparse device cannot hold what the device
    // may still ask of it, or is nearly full.
    for warning in pools
        .iter()
        .flat_map(|p| p.devices.iter().filter_map(|d| d.backing_warning()))
    {
        if !out.ends_with('\n') {
            out.push('\n');
        }
        out.push_str(&format!("warning: {warning}\n"));
    }
    out
}

/// A device path made absolute (the daemon may run in another directory).
fn absolute(path: &str) -> CliResult<String> {
    let absolute = std::path::absolute(path).map_err(|e| format!("{path}: {e}"))?;
    Ok(absolute.display().to_string())
}

/// A device of a pool as given: a uuid (`device UUID`, as `pool status`
/// names a missing device) as it is, a path made absolute.
fn device_argument(text: &str) -> CliResult<String> {
    match crate::pool::DeviceSpec::parse(text) {
        crate::pool::DeviceSpec::Uuid(_) => Ok(text.to_string()),
        crate::pool::DeviceSpec::Path(path) => absolute(&path),
    }
}

/// Follows a removal `started` (the pool's status as the request to
/// remove answered) until its device leaves the pool: a progress line on a
/// terminal, then the final line; the reason if it stopped.
fn remove_and_wait(client: &Client, pool: &str, device: &str, started: &PoolStatus) -> CliResult<String> {
    use std::io::IsTerminal;
    let Some(removal) = started.devices.iter().find_map(|d| d.removal.clone()) else {
        // Out before the request answered (it held little or nothing).
        return Ok(format!("pool {pool}: removed {device}"));
    };
    let terminal = std::io::stderr().is_terminal();
    let mut moved = 0;
    loop {
        let status: PoolStatus = client.get(&format!("/v1/pools/{pool}"))?;
        let Some(now) = status.devices.iter().find(|d| d.index == removal.index) else {
            if terminal {
                eprint!("\r\x1b[K");
            }
            return Ok(format!(
                "pool {pool}: removed {}; moved {}",
                removal.name,
                format_size(moved.max(removal.total_bytes))
            ));
        };
        if let Some(r) = &now.removal {
            moved = r.moved_bytes;
            if let Some(error) = r.error.as_ref().filter(|_| r.phase == "failed") {
                if terminal {
                    eprint!("\r\x1b[K");
                }
                return Err(CliError(format!(
                    "removing {} from pool {pool} stopped: {error} (it stays in the pool, taking no new data; \
                     run `strata pool remove` again to retry)",
                    removal.name
                )));
            }
            if terminal {
                eprint!(
                    "\r\x1b[Kremoving {}: {} moved, {} left",
                    removal.name,
                    format_size(r.moved_bytes),
                    format_size(r.left_bytes)
                );
            }
        }
        std::thread::sleep(std::time::Duration::from_millis(250));
    }
}

/// At most this many unrepaired blocks are listed in text output (`--json`
/// has all the scrub kept).
const SCRUB_FAULT_LINES: usize = 10;

/// A scrub's status as lines of text: what it is doing or did, then the
/// blocks it could not repair.
fn scrub_lines(pool: &str, s: &ScrubStatus) -> String {
    let percent = (s.issued_bytes * 100 / s.total_bytes.max(1)).min(100);
    let found = format!(
        "{} repaired, {} error{}",
        format_size(s.repaired_bytes),
        s.errors,
        if s.errors == 1 { "" } else { "s" }
    );
    let mut out = match s.state {
        ScrubState::Scanning => {
            let eta = s
                .eta_seconds()
                .map_or_else(String::new, |seconds| format!(", about {seconds} s left"));
            format!(
                "pool {pool}: scrubbing: {} of {} ({percent}%) at {}/s, {found}{eta}\n",
                format_size(s.issued_bytes),
                format_size(s.total_bytes),
                format_size(s.bytes_per_second)
            )
        }
        ScrubState::Paused => format!(
            "pool {pool}: scrub paused at {} of {} ({percent}%), {found}; `strata pool scrub {pool}` goes on\n",
            format_size(s.issued_bytes),
            format_size(s.total_bytes)
        ),
        ScrubState::Finished => format!(
            "pool {pool}: scrubbed {} in {} s, {found}\n",
            format_size(s.issued_bytes),
            s.seconds
        ),
        ScrubState::Stopped => format!(
            "pool {pool}: scrub stopped at {} of {} ({percent}%), {found}\n",
            format_size(s.issued_bytes),
            format_size(s.total_bytes)
        ),
        ScrubState::Failed => format!(
            "pool {pool}: scrub failed after {}: {}, {found}\n",
            format_size(s.issued_bytes),
            s.error.as_deref().unwrap_or("unknown error")
        ),
    };
    for fault in s.faults.iter().take(SCRUB_FAULT_LINES) {
        let what = fault
            .name
            .clone()
            .unwrap_or_else(|| format!("{pool}/volume-{}", fault.volume));
        let file = fault
            .path
            .as_ref()
            .map_or_else(String::new, |path| format!(" (file {path})"));
        out.push_str(&format!(
            "pool {pool}: unrepaired: {what}{file} at offset {}, {} bytes, on {}\n",
            fault.offset, fault.length, fault.device
        ));
    }
    let unlisted = (s.errors as usize).saturating_sub(s.faults.len().min(SCRUB_FAULT_LINES));
    if unlisted > 0 {
        out.push_str(&format!(
            "pool {pool}: {unlisted} more unrepaired block{} (`--json` lists up to {})\n",
            if unlisted == 1 { "" } else { "s" },
            crate::pool::SCRUB_MAX_FAULTS
        ));
    }
    out
}

/// Follows the pool's scrub until it is no longer scanning: a progress
/// line on a terminal meanwhile. Returns its last status.
fn scrub_and_wait(client: &Client, pool: &str) -> CliResult<ScrubStatus> {
    use std::io::IsTerminal;
    let terminal = std::io::stderr().is_terminal();
    loop {
        let status: Option<ScrubStatus> = client.get(&format!("/v1/pools/{pool}/scrub"))?;
        let Some(status) = status else {
            return Err(CliError(format!("pool {pool}: no scrub to wait for")));
        };
        if status.state != ScrubState::Scanning {
            if terminal {
                eprint!("\r\x1b[K");
            }
            return Ok(status);
        }
        if terminal {
            eprint!(
                "\r\x1b[Kscrubbing {pool}: {} of {} at {}/s",
                format_size(status.issued_bytes),
                format_size(status.total_bytes),
                format_size(status.bytes_per_second)
            );
        }
        std::thread::sleep(std::time::Duration::from_millis(250));
    }
}

// ---------------------------------------------------------------------------
// HTTP

pub(super) struct Client {
    inner: super::client::Client,
}

impl Client {
    pub(super) fn new(options: &ClientOptions) -> CliResult<Self> {
        let settings = super::client::Settings {
            api: options.api.clone(),
            data_dir: options.data_dir.clone(),
            token: options.token.clone(),
            cacert: options.cacert.clone(),
        };
        Ok(Client {
            inner: super::client::Client::new(&settings)?,
        })
    }

    pub(super) fn get<T: DeserializeOwned>(&self, path: &str) -> CliResult<T> {
        self.send("GET", path, None)
    }

    fn send<T: DeserializeOwned>(&self, method: &str, path: &str, body: Option<Value>) -> CliResult<T> {
        let text = self.call(method, path, body)?;
        serde_json::from_str(&text).map_err(|e| {
            CliError(format!(
                "unexpected answer from {} ({method} {path}): not the JSON expected ({e}); is it a strata daemon?",
                self.inner.describe()
            ))
        })
    }

    fn send_empty(&self, method: &str, path: &str) -> CliResult<()> {
        self.call(method, path, None).map(drop)
    }

    /// One request; the body of a 2xx answer, or an error carrying the
    /// daemon's own message.
    fn call(&self, method: &str, path: &str, body: Option<Value>) -> CliResult<String> {
        let answer = self.inner.request(method, path, body.map(|b| b.to_string()))?;
        self.checked(answer, method, path)
    }

    /// [`Client::call`] without a body and without the overall timeout: for
    /// requests that last as long as their work (`pool migrate --wait`).
    fn call_long(&self, method: &str, path: &str) -> CliResult<String> {
        let answer = self
            .inner
            .stream(method, path, None, false, &mut |_| {}, &mut |_| Ok(()))?;
        self.checked(answer, method, path)
    }

    fn checked(&self, answer: super::client::Answer, method: &str, path: &str) -> CliResult<String> {
        if (200..300).contains(&answer.status) {
            return Ok(answer.body);
        }
        let message = serde_json::from_str::<Value>(&answer.body)
            .ok()
            .and_then(|v| v.get("error").and_then(Value::as_str).map(str::to_string));
        if answer.status == 401 {
            let (problem, hint) = if self.inner.has_token() {
                (
                    message.as_deref().unwrap_or("token refused"),
                    "check --token or STRATA_TOKEN against the daemon's DATA_DIR/api.token",
                )
            } else {
                (
                    "no token",
                    "give --token or STRATA_TOKEN (the daemon's DATA_DIR/api.token), or use the Unix socket (--data-dir DIR)",
                )
            };
            return Err(CliError(format!(
                "not authorized by the strata daemon at {} ({problem}); {hint}",
                self.inner.describe()
            )));
        }
        Err(CliError(message.unwrap_or_else(|| {
            let first = answer.body.lines().next().unwrap_or("").trim();
            format!(
                "{} answered HTTP {} to {method} {path}{}{first}; is it a strata daemon?",
                self.inner.describe(),
                answer.status,
                if first.is_empty() { "" } else { ": " }
            )
        })))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tables_align() {
        let text = table(
            &[("A", Align::Left), ("BB", Align::Right), ("C", Align::Left)],
            &[vec!["xyz".into(), "1".into(), "p".into()]],
        );
        assert_eq!(text, "A    BB  C\nxyz   1  p\n");
    }
}
