//! The CLI client (placeholder until the admin API lands).

use std::process::ExitCode;

#[derive(Debug, clap::Subcommand)]
pub enum AdminCommand {
    /// Show pools.
    Pool,
}

pub fn run(_command: AdminCommand) -> ExitCode {
    eprintln!("strata: error: not implemented yet");
    ExitCode::FAILURE
}
