//! `strata send` and `strata receive`: the CLI streams between
//! stdout/stdin and the daemon's REST API (`admin::send`), with a progress
//! bar on stderr when it is a terminal (bytes, rate, ETA).

use std::io::{IsTerminal, Read, Write};

use hyper::body::Bytes;
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::Value;
use tokio::sync::mpsc;

use super::cli::ClientOptions;
use crate::control::manager::{split_snapshot_name, split_volume_name, ReceiveOutcome, ReceiveStatus};
use crate::control::stream::Header;

/// What the CLI reads from stdin at a time.
const READ_BYTES: usize = 1 << 20;

#[derive(Debug, clap::Args)]
#[command(override_usage = "strata send POOL/VOLUME@SNAPSHOT [-i SNAPSHOT] > FILE\n       strata send -t TOKEN > FILE")]
pub struct SendArgs {
    #[command(flatten)]
    pub client: ClientOptions,
    /// The snapshot to send: POOL/VOLUME@SNAPSHOT.
    #[arg(required_unless_present = "resume_token")]
    pub snapshot: Option<String>,
    /// Send only what changed since this older snapshot of the same
    /// volume (@SNAP, SNAP or POOL/VOLUME@SNAP): an incremental stream.
    #[arg(short = 'i', value_name = "SNAPSHOT")]
    pub from: Option<String>,
    /// Send the rest of an interrupted stream (the token `strata receive`
    /// printed, or `strata receive --status` shows).
    #[arg(short = 't', long = "resume", value_name = "TOKEN", conflicts_with_all = ["snapshot", "from"])]
    pub resume_token: Option<String>,
}

#[derive(Debug, clap::Args)]
#[command(
    override_usage = "strata receive POOL/VOLUME < FILE\n       strata receive --resume TOKEN < REST\n       strata receive --status POOL/VOLUME\n       strata receive --abort POOL/VOLUME"
)]
pub struct ReceiveArgs {
    #[command(flatten)]
    pub client: ClientOptions,
    /// The volume to receive into: a new one for a full stream, the one
    /// holding the base snapshot for an incremental stream.
    #[arg(required_unless_present = "resume_token")]
    pub volume: Option<String>,
    /// Continue an interrupted receive with the stream `strata send -t
    /// TOKEN` produces.
    #[arg(long = "resume", value_name = "TOKEN")]
    pub resume_token: Option<String>,
    /// Show the pending (interrupted) receive into the volume and its token.
    #[arg(long, conflicts_with_all = ["resume_token", "abort"])]
    pub status: bool,
    /// Discard the pending receive into the volume: a volume being made is
    /// destroyed, an existing one rolled back to the base snapshot.
    #[arg(long, conflicts_with_all = ["resume_token", "status"])]
    pub abort: bool,
}

fn progress_bar(total: Option<u64>, message: &str) -> ProgressBar {
    if !std::io::stderr().is_terminal() {
        return ProgressBar::hidden();
    }
    let bar = match total {
        Some(total) => ProgressBar::new(total),
        None => ProgressBar::no_length(),
    };
    bar.set_style(
        ProgressStyle::with_template(
            "{msg} [{elapsed_precise}] [{wide_bar}] {bytes}/{total_bytes} {binary_bytes_per_sec} ETA {eta}",
        )
        .unwrap_or_else(|_| ProgressStyle::default_bar())
        .progress_chars("=> "),
    );
    bar.set_message(message.to_string());
    bar
}

/// The daemon's one-line error from a JSON answer.
fn error_of(status: u16, body: &str, client: &super::client::Client) -> (String, Option<String>) {
    let value: Option<Value> = serde_json::from_str(body).ok();
    let message = value
        .as_ref()
        .and_then(|v| v.get("error").and_then(Value::as_str).map(str::to_string))
        .unwrap_or_else(|| format!("{} answered HTTP {status}", client.describe()));
    let token = value
        .as_ref()
        .and_then(|v| v.get("resume_token").and_then(Value::as_str).map(str::to_string));
    if status == 401 {
        return (
            format!(
                "not authorized by the strata daemon at {} ({message}); give --token or STRATA_TOKEN (the daemon's DATA_DIR/api.token), or use the Unix socket (--data-dir DIR)",
                client.describe()
            ),
            None,
        );
    }
    (message, token)
}

fn client(options: &ClientOptions) -> Result<super::client::Client, String> {
    super::client::Client::new(&super::client::Settings {
        api: options.api.clone(),
        data_dir: options.data_dir.clone(),
        token: options.token.clone(),
        cacert: options.cacert.clone(),
    })
}

/// Percent-encodes a query value.
fn query_value(text: &str) -> String {
    text.bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() || b"-_.~".contains(&b) {
                (b as char).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect()
}

/// `strata send`: the stream on stdout. Errors are one line.
pub fn run_send(args: SendArgs) -> Result<(), String> {
    let mut stdout = std::io::stdout().lock();
    if stdout.is_terminal() {
        return Err("refusing to write a send stream to a terminal: redirect stdout to a file or a pipe".into());
    }
    let path = match (&args.resume_token, &args.snapshot) {
        (Some(token), _) => {
            // The snapshot's name is in the token; the path only routes.
            let decoded = crate::control::manager::ResumeToken::decode(token).map_err(|e| e.to_string())?;
            let name = format!("{}@{}", decoded.source, decoded.snapshot);
            split_snapshot_name(&name).map_err(|e| e.to_string())?;
            format!("/v1/snapshots/{name}/send?resume={}", query_value(token.trim()))
        }
        (None, Some(name)) => {
            split_snapshot_name(name).map_err(|e| e.to_string())?;
            match &args.from {
                Some(from) => format!("/v1/snapshots/{name}/send?from={}", query_value(from)),
                None => format!("/v1/snapshots/{name}/send"),
            }
        }
        (None, None) => return Err("name the snapshot to send: strata send POOL/VOLUME@SNAPSHOT".into()),
    };
    let client = client(&args.client)?;
    let bar = progress_bar(None, "send");
    let mut started = |headers: &hyper::HeaderMap| {
        let total = headers
            .get(super::send::STREAM_LENGTH_HEADER)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok());
        if let Some(total) = total {
            bar.set_length(total);
        }
    };
    let mut sent = 0u64;
    let mut sink = |data: &[u8]| {
        stdout
            .write_all(data)
            .map_err(|e| format!("cannot write the stream to stdout: {e}"))?;
        sent += data.len() as u64;
        bar.set_position(sent);
        Ok(())
    };
    let answer = client.stream("GET", &path, None, true, &mut started, &mut sink);
    bar.finish_and_clear();
    let answer = answer?;
    if !(200..300).contains(&answer.status) {
        return Err(error_of(answer.status, &answer.body, &client).0);
    }
    stdout
        .flush()
        .map_err(|e| format!("cannot write the stream to stdout: {e}"))?;
    Ok(())
}

/// How `strata receive` failed: one line, and the resume token when the
/// receive can be resumed.
pub struct ReceiveError {
    pub message: String,
    pub token: Option<String>,
}

impl From<String> for ReceiveError {
    fn from(message: String) -> Self {
        ReceiveError { message, token: None }
    }
}

/// `strata receive`: the stream from stdin. Returns what to print.
pub fn run_receive(args: ReceiveArgs) -> Result<String, ReceiveError> {
    let token = args
        .resume_token
        .as_deref()
        .map(crate::control::manager::ResumeToken::decode)
        .transpose()
        .map_err(|e| e.to_string())?;
    let target = match (&args.volume, &token) {
        (Some(volume), _) => volume.clone(),
        (None, Some(token)) => token.target.clone(),
        (None, None) => {
            return Err("name the volume to receive into: strata receive POOL/VOLUME"
                .to_string()
                .into())
        }
    };
    split_volume_name(&target).map_err(|e| e.to_string())?;
    let client = client(&args.client)?;
    let path = format!("/v1/volumes/{target}/receive");
    let mut nothing = |_: &hyper::HeaderMap| {};
    let mut ignore = |_: &[u8]| Ok(());
    if args.status || args.abort {
        let method = if args.abort { "DELETE" } else { "GET" };
        let answer = client.stream(method, &path, None, false, &mut nothing, &mut ignore)?;
        if !(200..300).contains(&answer.status) {
            return Err(error_of(answer.status, &answer.body, &client).0.into());
        }
        if args.abort {
            return Ok(String::new());
        }
        let status: ReceiveStatus = serde_json::from_str(&answer.body)
            .map_err(|e| format!("unexpected answer from {}: {e}", client.describe()))?;
        return Ok(format!(
            "receiving {}@{} into {}: {} of {} bytes\nresume with: strata send -t {} | strata receive --resume {}\n",
            status.source,
            status.snapshot,
            status.name,
            status.received_bytes,
            status.stream_bytes,
            status.token,
            status.token
        ));
    }
    if std::io::stdin().is_terminal() {
        return Err(
            "refusing to read a send stream from a terminal: redirect stdin from a file or a pipe"
                .to_string()
                .into(),
        );
    }
    let bar = progress_bar(None, "receive");
    let (sender, receiver) = mpsc::channel::<Result<Bytes, String>>(8);
    let reading_bar = bar.clone();
    // stdin is read on its own thread (blocking reads), chunk by chunk.
    let reader = std::thread::spawn(move || {
        let mut stdin = std::io::stdin().lock();
        let mut read = 0u64;
        let mut first = true;
        loop {
            let mut chunk = vec![0u8; READ_BYTES];
            let mut filled = 0;
            while filled < chunk.len() {
                match stdin.read(&mut chunk[filled..]) {
                    Ok(0) => break,
                    Ok(n) => filled += n,
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                    Err(e) => {
                        let _ = sender.blocking_send(Err(format!("cannot read stdin: {e}")));
                        return;
                    }
                }
            }
            if filled == 0 {
                return;
            }
            chunk.truncate(filled);
            if first {
                first = false;
                // The header says how long the stream is: the bar's length.
                if let Ok(header) = Header::decode(&chunk) {
                    let total = header.stream_bytes.saturating_sub(header.resume_offset.unwrap_or(0))
                        + header.encode().len() as u64;
                    reading_bar.set_length(total);
                }
            }
            read += filled as u64;
            reading_bar.set_position(read);
            if sender.blocking_send(Ok(Bytes::from(chunk))).is_err() {
                return;
            }
        }
    });
    let path = if token.is_some() {
        format!("{path}?resume=true")
    } else {
        path
    };
    let answer = client.stream("POST", &path, Some(receiver), false, &mut nothing, &mut ignore);
    bar.finish_and_clear();
    drop(reader);
    let answer = answer?;
    if !(200..300).contains(&answer.status) {
        let (message, token) = error_of(answer.status, &answer.body, &client);
        return Err(ReceiveError { message, token });
    }
    let outcome: ReceiveOutcome =
        serde_json::from_str(&answer.body).map_err(|e| format!("unexpected answer from {}: {e}", client.describe()))?;
    let json = args.client.json || args.client.options.iter().any(|o| o == "json");
    Ok(if json {
        serde_json::to_string_pretty(&outcome).unwrap_or_default() + "\n"
    } else {
        String::new()
    })
}
