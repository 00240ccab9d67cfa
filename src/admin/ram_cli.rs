//! `strata ram-tier`: the RAM tier files in the RAM directory (/dev/shm),
//! listed and removed on this machine, without the daemon. A daemon killed
//! without a clean shutdown leaves its pools' files there for its next
//! start to replay; one whose daemon does not come back pins its size in
//! RAM until it is removed.

use serde_json::{json, Value};

use super::cli::{pretty, table, Align, CliError, CliResult, ClientOptions};
use crate::pool::ram::{region_file, region_files, remove_region_file, RegionFile};
use crate::units::format_size;

#[derive(Debug, clap::Args)]
pub struct RamTierArgs {
    #[command(flatten)]
    pub client: ClientOptions,
    /// The RAM directory the daemons put their RAM tier files in.
    #[arg(
        long,
        global = true,
        env = "STRATA_RAM_DIR",
        default_value = "/dev/shm",
        value_name = "DIR"
    )]
    pub ram_dir: std::path::PathBuf,
    #[command(subcommand)]
    pub command: RamTierCommand,
}

#[derive(Debug, clap::Subcommand)]
pub enum RamTierCommand {
    /// List the RAM tier files: FILE POOL DATA_DIR SIZE STATE (in use by a
    /// daemon's PID, or stale; dirty when it holds writes not yet placed).
    #[command(visible_alias = "ls")]
    List,
    /// Remove RAM tier files no daemon uses: those named, or with --stale
    /// every one. A file holding writes not yet placed is kept unless
    /// --force (the next start of its data directory would replay them).
    Remove {
        /// Files to remove (paths, or names in the RAM directory).
        files: Vec<String>,
        /// Every file no daemon uses.
        #[arg(long)]
        stale: bool,
        /// Also remove files holding writes not yet placed (they are lost).
        #[arg(long)]
        force: bool,
    },
}

fn state(file: &RegionFile) -> String {
    let mut state = match file.held_by {
        Some(pid) => format!("in use (pid {pid})"),
        None => "stale".to_string(),
    };
    if file.dirty {
        state.push_str(", dirty");
    }
    state
}

fn as_json(file: &RegionFile) -> Value {
    json!({
        "file": file.path.display().to_string(),
        "pool": file.pool,
        "data_dir": file.data_dir.as_ref().map(|d| d.display().to_string()),
        "bytes": file.bytes,
        "pid": file.held_by,
        "dirty": file.dirty,
    })
}

pub(super) fn run(args: RamTierArgs) -> CliResult<String> {
    let json = args.client.json || args.client.options.iter().any(|o| o == "json");
    match args.command {
        RamTierCommand::List => {
            let files = region_files(&args.ram_dir)
                .map_err(|e| CliError::from(format!("cannot list {}: {e}", args.ram_dir.display())))?;
            if json {
                let listed: Vec<Value> = files.iter().map(as_json).collect();
                return Ok(pretty(&listed));
            }
            use Align::*;
            let headers = [
                ("FILE", Left),
                ("POOL", Left),
                ("DATA_DIR", Left),
                ("SIZE", Right),
                ("STATE", Left),
            ];
            let rows: Vec<Vec<String>> = files
                .iter()
                .map(|f| {
                    vec![
                        f.path.display().to_string(),
                        f.pool.clone(),
                        f.data_dir.as_ref().map_or("-".to_string(), |d| d.display().to_string()),
                        format_size(f.bytes),
                        state(f),
                    ]
                })
                .collect();
            Ok(table(&headers, &rows))
        }
        RamTierCommand::Remove { files, stale, force } => {
            if files.is_empty() != stale {
                return Err(CliError::from("name the files to remove, or --stale (not both)"));
            }
            let chosen: Vec<std::path::PathBuf> = if stale {
                region_files(&args.ram_dir)
                    .map_err(|e| CliError::from(format!("cannot list {}: {e}", args.ram_dir.display())))?
                    .into_iter()
                    .filter(|f| f.held_by.is_none() && (force || !f.dirty))
                    .map(|f| f.path)
                    .collect()
            } else {
                files
                    .iter()
                    .map(|f| {
                        let path = std::path::PathBuf::from(f);
                        if path.components().count() == 1 && region_file(&path).is_none() {
                            args.ram_dir.join(path)
                        } else {
                            path
                        }
                    })
                    .collect()
            };
            let mut out = String::new();
            for path in &chosen {
                remove_region_file(path, force).map_err(|e| CliError::from(e.to_string()))?;
                if !json {
                    out.push_str(&format!("removed {}\n", path.display()));
                }
            }
            if json {
                let removed: Vec<String> = chosen.iter().map(|p| p.display().to_string()).collect();
                return Ok(pretty(&json!({ "removed": removed })));
            }
            Ok(out)
        }
    }
}
