use clap::{Parser, Subcommand};
use std::process::ExitCode;

/// strata: thin block volumes over NBD and iSCSI, and file datasets over
/// NFSv3, on tiered pools.
#[derive(Parser)]
#[command(name = "strata", version, about, propagate_version = true)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the storage daemon (every other subcommand talks to it).
    Serve(strata::daemon::ServeArgs),
    #[command(flatten)]
    Admin(strata::admin::cli::AdminCommand),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Serve(args) => {
            tracing_subscriber::fmt()
                .with_env_filter(
                    tracing_subscriber::EnvFilter::try_from_env("STRATA_LOG")
                        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
                )
                .with_writer(std::io::stderr)
                .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
                .init();
            strata::daemon::run(args)
        }
        Command::Admin(command) => strata::admin::cli::run(command),
    }
}
