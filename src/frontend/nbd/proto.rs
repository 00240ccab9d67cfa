//! NBD wire format: constants, parsers and reply encoders.
//!
//! Everything here is a pure function over bytes so it can be unit tested and
//! fuzzed without a socket (`fuzz/fuzz_targets/nbd_option.rs`,
//! `nbd_request.rs`). The numbers follow the protocol's `doc/proto.md`.

use crate::block::{BlockError, Capabilities, ChangedRun, Extent};

/// `NBDMAGIC`, the first eight bytes the server sends.
pub const NBD_MAGIC: u64 = 0x4e42_444d_4147_4943;
/// `IHAVEOPT`: newstyle server greeting and the prefix of every option.
pub const IHAVEOPT: u64 = 0x4948_4156_454f_5054;
/// Prefix of every option reply.
pub const OPTION_REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;
pub const REQUEST_MAGIC: u32 = 0x2560_9513;
pub const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;
pub const STRUCTURED_REPLY_MAGIC: u32 = 0x668e_33ef;

/// Handshake flags (server) and client flags.
pub const FLAG_FIXED_NEWSTYLE: u16 = 1 << 0;
pub const FLAG_NO_ZEROES: u16 = 1 << 1;
pub const CLIENT_FLAG_FIXED_NEWSTYLE: u32 = 1 << 0;
pub const CLIENT_FLAG_NO_ZEROES: u32 = 1 << 1;

/// Option codes.
pub mod opt {
    pub const EXPORT_NAME: u32 = 1;
    pub const ABORT: u32 = 2;
    pub const LIST: u32 = 3;
    pub const STARTTLS: u32 = 5;
    pub const INFO: u32 = 6;
    pub const GO: u32 = 7;
    pub const STRUCTURED_REPLY: u32 = 8;
    pub const LIST_META_CONTEXT: u32 = 9;
    pub const SET_META_CONTEXT: u32 = 10;
}

/// Option reply types.
pub mod rep {
    pub const ACK: u32 = 1;
    pub const SERVER: u32 = 2;
    pub const INFO: u32 = 3;
    pub const META_CONTEXT: u32 = 4;
    const ERROR: u32 = 1 << 31;
    pub const ERR_UNSUP: u32 = ERROR + 1;
    pub const ERR_POLICY: u32 = ERROR + 2;
    pub const ERR_INVALID: u32 = ERROR + 3;
    pub const ERR_TLS_REQD: u32 = ERROR + 5;
    pub const ERR_UNKNOWN: u32 = ERROR + 6;
    pub const ERR_SHUTDOWN: u32 = ERROR + 7;
    pub const ERR_TOO_BIG: u32 = ERROR + 9;
}

/// `NBD_INFO_*` types inside an `NBD_REP_INFO` reply.
pub mod info {
    pub const EXPORT: u16 = 0;
    pub const NAME: u16 = 1;
    pub const DESCRIPTION: u16 = 2;
    pub const BLOCK_SIZE: u16 = 3;
}

/// Transmission flags.
pub mod tflag {
    pub const HAS_FLAGS: u16 = 1 << 0;
    pub const READ_ONLY: u16 = 1 << 1;
    pub const SEND_FLUSH: u16 = 1 << 2;
    pub const SEND_FUA: u16 = 1 << 3;
    pub const ROTATIONAL: u16 = 1 << 4;
    pub const SEND_TRIM: u16 = 1 << 5;
    pub const SEND_WRITE_ZEROES: u16 = 1 << 6;
    pub const SEND_DF: u16 = 1 << 7;
    pub const CAN_MULTI_CONN: u16 = 1 << 8;
    pub const SEND_CACHE: u16 = 1 << 10;
    pub const SEND_FAST_ZERO: u16 = 1 << 11;
}

/// Command types.
pub mod cmd {
    pub const READ: u16 = 0;
    pub const WRITE: u16 = 1;
    pub const DISC: u16 = 2;
    pub const FLUSH: u16 = 3;
    pub const TRIM: u16 = 4;
    pub const CACHE: u16 = 5;
    pub const WRITE_ZEROES: u16 = 6;
    pub const BLOCK_STATUS: u16 = 7;
}

/// Command flags.
pub mod cflag {
    pub const FUA: u16 = 1 << 0;
    pub const NO_HOLE: u16 = 1 << 1;
    pub const DF: u16 = 1 << 2;
    pub const REQ_ONE: u16 = 1 << 3;
    pub const FAST_ZERO: u16 = 1 << 4;
}

/// Structured reply chunk types and flags.
pub mod chunk {
    pub const FLAG_DONE: u16 = 1 << 0;
    pub const OFFSET_DATA: u16 = 1;
    pub const OFFSET_HOLE: u16 = 2;
    pub const BLOCK_STATUS: u16 = 5;
    pub const ERROR: u16 = (1 << 15) + 1;
}

/// NBD error numbers (the protocol's own, not the host's errno).
pub mod errno {
    pub const EPERM: u32 = 1;
    pub const EIO: u32 = 5;
    pub const EINVAL: u32 = 22;
    pub const ENOSPC: u32 = 28;
    pub const EOVERFLOW: u32 = 75;
    pub const ENOTSUP: u32 = 95;
    pub const ESHUTDOWN: u32 = 108;
}

/// `base:allocation` flags.
pub const STATE_HOLE: u32 = 1 << 0;
pub const STATE_ZERO: u32 = 1 << 1;

pub const BASE_ALLOCATION: &str = "base:allocation";
/// The id we give `base:allocation` when a client selects it.
pub const BASE_ALLOCATION_ID: u32 = 1;

/// The changed-block contexts of a snapshot export, one pair per older
/// snapshot `NAME` of the same volume: qemu's dirty-bitmap form (so qemu's
/// NBD client and backup tools built on it read it as a bitmap) and our
/// own. Both report [`STATE_CHANGED`] for blocks that changed between
/// `NAME` and the exported snapshot.
pub const QEMU_DIRTY_BITMAP: &str = "qemu:dirty-bitmap:";
pub const STRATA_CHANGED: &str = "strata:changed:";
/// Flag of a changed-block context: the extent changed (qemu's
/// `NBD_STATE_DIRTY`).
pub const STATE_CHANGED: u32 = 1 << 0;

/// A changed-block context selected with NBD_OPT_SET_META_CONTEXT.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChangedContext {
    /// The context id we gave it.
    pub id: u32,
    /// The engine id of the older snapshot.
    pub older: u32,
}

/// Longest option payload accepted. Larger options are refused with
/// `NBD_REP_ERR_TOO_BIG` and the connection is closed without reading them.
pub const MAX_OPTION_BYTES: u32 = 64 * 1024;
/// The protocol's upper bound for any string (export names, queries).
pub const MAX_STRING_BYTES: usize = 4096;
/// Most information requests or meta-context queries in one option.
pub const MAX_QUERIES: usize = 256;

pub const OPTION_HEADER_BYTES: usize = 16;
pub const REQUEST_BYTES: usize = 28;
pub const SIMPLE_REPLY_BYTES: usize = 16;
pub const CHUNK_HEADER_BYTES: usize = 20;

/// A malformed handshake message after which the connection must close.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HandshakeError {
    #[error("expected option magic IHAVEOPT, got {0:#018x} (a transmission request before the handshake ended?)")]
    BadOptionMagic(u64),
    #[error("unknown client flags {0:#x}")]
    BadClientFlags(u32),
}

/// One option header from the client.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OptionHeader {
    pub option: u32,
    pub length: u32,
}

pub fn parse_client_flags(bytes: [u8; 4]) -> Result<u32, HandshakeError> {
    let flags = u32::from_be_bytes(bytes);
    if flags & !(CLIENT_FLAG_FIXED_NEWSTYLE | CLIENT_FLAG_NO_ZEROES) != 0 {
        return Err(HandshakeError::BadClientFlags(flags));
    }
    Ok(flags)
}

pub fn parse_option_header(bytes: &[u8; OPTION_HEADER_BYTES]) -> Result<OptionHeader, HandshakeError> {
    let magic = be_u64(&bytes[0..8]);
    if magic != IHAVEOPT {
        return Err(HandshakeError::BadOptionMagic(magic));
    }
    Ok(OptionHeader {
        option: be_u32(&bytes[8..12]),
        length: be_u32(&bytes[12..16]),
    })
}

/// A decoded option.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClientOption {
    ExportName(String),
    Abort,
    List,
    StructuredReply,
    Info {
        export: String,
        requests: Vec<u16>,
    },
    Go {
        export: String,
        requests: Vec<u16>,
    },
    ListMetaContext {
        export: String,
        queries: Vec<String>,
    },
    SetMetaContext {
        export: String,
        queries: Vec<String>,
    },
    StartTls,
    /// An option we do not implement; answered with `NBD_REP_ERR_UNSUP`.
    Unsupported(u32),
}

/// Why an option's payload was refused; answered with the carried reply
/// type, the connection stays open.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OptionError {
    pub reply: u32,
    pub message: String,
}

fn invalid(message: impl Into<String>) -> OptionError {
    OptionError {
        reply: rep::ERR_INVALID,
        message: message.into(),
    }
}

/// A cursor over an option payload that never reads past its end.
struct Cursor<'a> {
    bytes: &'a [u8],
}

impl<'a> Cursor<'a> {
    fn take(&mut self, count: usize, what: &str) -> Result<&'a [u8], OptionError> {
        if self.bytes.len() < count {
            return Err(invalid(format!("option payload too short for {what}")));
        }
        let (head, rest) = self.bytes.split_at(count);
        self.bytes = rest;
        Ok(head)
    }

    fn u16(&mut self, what: &str) -> Result<u16, OptionError> {
        let bytes = self.take(2, what)?;
        Ok(u16::from_be_bytes([bytes[0], bytes[1]]))
    }

    fn u32(&mut self, what: &str) -> Result<u32, OptionError> {
        Ok(be_u32(self.take(4, what)?))
    }

    fn string(&mut self, what: &str) -> Result<String, OptionError> {
        let length = self.u32(what)? as usize;
        if length > MAX_STRING_BYTES {
            return Err(OptionError {
                reply: rep::ERR_TOO_BIG,
                message: format!("{what} is longer than {MAX_STRING_BYTES} bytes"),
            });
        }
        utf8(self.take(length, what)?, what)
    }

    fn finish(&self) -> Result<(), OptionError> {
        if self.bytes.is_empty() {
            Ok(())
        } else {
            Err(invalid(format!(
                "{} unexpected trailing bytes in option",
                self.bytes.len()
            )))
        }
    }
}

fn utf8(bytes: &[u8], what: &str) -> Result<String, OptionError> {
    let text = std::str::from_utf8(bytes).map_err(|_| invalid(format!("{what} is not valid UTF-8")))?;
    if text.contains('\0') {
        return Err(invalid(format!("{what} contains a NUL character")));
    }
    Ok(text.to_string())
}

/// Decodes an option's payload. `data` is at most [`MAX_OPTION_BYTES`] long
/// (the caller refuses longer options before reading them).
pub fn parse_option(option: u32, data: &[u8]) -> Result<ClientOption, OptionError> {
    let mut cursor = Cursor { bytes: data };
    let parsed = match option {
        opt::EXPORT_NAME => {
            if data.len() > MAX_STRING_BYTES {
                return Err(invalid("export name is too long"));
            }
            return Ok(ClientOption::ExportName(utf8(data, "export name")?));
        }
        // The protocol asks servers to ignore any data sent with ABORT.
        opt::ABORT => return Ok(ClientOption::Abort),
        opt::LIST if !data.is_empty() => return Err(invalid("NBD_OPT_LIST takes no data")),
        opt::LIST => ClientOption::List,
        opt::STRUCTURED_REPLY if !data.is_empty() => return Err(invalid("NBD_OPT_STRUCTURED_REPLY takes no data")),
        opt::STRUCTURED_REPLY => ClientOption::StructuredReply,
        opt::STARTTLS => ClientOption::StartTls,
        opt::INFO | opt::GO => {
            let export = cursor.string("export name")?;
            let count = cursor.u16("information request count")? as usize;
            if count > MAX_QUERIES {
                return Err(invalid("too many information requests"));
            }
            let mut requests = Vec::with_capacity(count);
            for _ in 0..count {
                requests.push(cursor.u16("information request")?);
            }
            if option == opt::INFO {
                ClientOption::Info { export, requests }
            } else {
                ClientOption::Go { export, requests }
            }
        }
        opt::LIST_META_CONTEXT | opt::SET_META_CONTEXT => {
            let export = cursor.string("export name")?;
            let count = cursor.u32("query count")? as usize;
            if count > MAX_QUERIES {
                return Err(OptionError {
                    reply: rep::ERR_TOO_BIG,
                    message: format!("more than {MAX_QUERIES} meta context queries"),
                });
            }
            let mut queries = Vec::with_capacity(count);
            for _ in 0..count {
                queries.push(cursor.string("meta context query")?);
            }
            if option == opt::LIST_META_CONTEXT {
                ClientOption::ListMetaContext { export, queries }
            } else {
                ClientOption::SetMetaContext { export, queries }
            }
        }
        other => return Ok(ClientOption::Unsupported(other)),
    };
    cursor.finish()?;
    Ok(parsed)
}

/// The meta contexts (id, name) a set of queries selects, among
/// `base:allocation` and the changed-block contexts of `older` (the older
/// snapshots' names, oldest first; empty unless the export is a snapshot).
/// Listing, no query selects every context, and a namespace (`base:`,
/// `qemu:`, `strata:`) or a context-type prefix (`qemu:dirty-bitmap:`,
/// `strata:changed:`) selects all of its contexts; setting, only full names
/// select. Unknown namespaces and names (an unknown snapshot) are ignored,
/// as the protocol requires. Ids: 1 for `base:allocation`, `2 + 2i` and
/// `3 + 2i` for the qemu and strata names of `older[i]`.
pub fn match_meta_contexts(queries: &[String], listing: bool, older: &[&str]) -> Vec<(u32, String)> {
    let mut all: Vec<(u32, String)> = vec![(BASE_ALLOCATION_ID, BASE_ALLOCATION.to_string())];
    for (i, name) in older.iter().enumerate() {
        let id = 2 + 2 * i as u32;
        all.push((id, format!("{QEMU_DIRTY_BITMAP}{name}")));
        all.push((id + 1, format!("{STRATA_CHANGED}{name}")));
    }
    if queries.is_empty() {
        return if listing { all } else { Vec::new() };
    }
    let prefixes: &[&str] = if listing {
        &["base:", "qemu:", "strata:", QEMU_DIRTY_BITMAP, STRATA_CHANGED]
    } else {
        &[]
    };
    all.into_iter()
        .filter(|(_, name)| {
            queries
                .iter()
                .any(|q| q == name || (prefixes.contains(&q.as_str()) && name.starts_with(q.as_str())))
        })
        .collect()
}

/// The changed-block context named `name` among those of `older` (names
/// and engine ids, oldest first), as [`match_meta_contexts`] numbers it.
pub fn changed_context(name: &str, older: &[(String, u32)]) -> Option<ChangedContext> {
    let (offset, snapshot) = if let Some(snapshot) = name.strip_prefix(QEMU_DIRTY_BITMAP) {
        (0, snapshot)
    } else {
        (1, name.strip_prefix(STRATA_CHANGED)?)
    };
    let at = older.iter().position(|(n, _)| n == snapshot)?;
    Some(ChangedContext {
        id: 2 + 2 * at as u32 + offset,
        older: older[at].1,
    })
}

/// One transmission request header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Request {
    pub flags: u16,
    pub kind: u16,
    pub cookie: u64,
    pub offset: u64,
    pub length: u32,
}

/// A request whose magic is wrong: the stream is out of step and must close.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("bad request magic {0:#010x}")]
pub struct BadRequestMagic(pub u32);

pub fn parse_request(bytes: &[u8; REQUEST_BYTES]) -> Result<Request, BadRequestMagic> {
    let magic = be_u32(&bytes[0..4]);
    if magic != REQUEST_MAGIC {
        return Err(BadRequestMagic(magic));
    }
    Ok(Request {
        flags: u16::from_be_bytes([bytes[4], bytes[5]]),
        kind: u16::from_be_bytes([bytes[6], bytes[7]]),
        cookie: be_u64(&bytes[8..16]),
        offset: be_u64(&bytes[16..24]),
        length: be_u32(&bytes[24..28]),
    })
}

/// What was agreed in the handshake that affects which requests are valid.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Negotiated {
    pub structured_replies: bool,
    pub base_allocation: bool,
    /// The changed-block context selected, if any (at most one).
    pub changed: Option<ChangedContext>,
}

/// Checks a request's type and flags against what was negotiated; range and
/// alignment are checked by the volume. Returns the NBD error to reply with.
pub fn check_request(request: &Request, negotiated: &Negotiated) -> Result<(), u32> {
    let allowed = cflag::FUA
        | match request.kind {
            cmd::READ if negotiated.structured_replies => cflag::DF,
            cmd::WRITE_ZEROES => cflag::NO_HOLE | cflag::FAST_ZERO,
            cmd::BLOCK_STATUS => cflag::REQ_ONE,
            cmd::READ | cmd::WRITE | cmd::DISC | cmd::FLUSH | cmd::TRIM | cmd::CACHE => 0,
            _ => return Err(errno::EINVAL),
        };
    if request.flags & !allowed != 0 {
        return Err(errno::EINVAL);
    }
    match request.kind {
        cmd::FLUSH if request.offset != 0 || request.length != 0 => Err(errno::EINVAL),
        cmd::BLOCK_STATUS if !negotiated.base_allocation && negotiated.changed.is_none() => Err(errno::EINVAL),
        cmd::READ | cmd::WRITE | cmd::TRIM | cmd::CACHE | cmd::WRITE_ZEROES | cmd::BLOCK_STATUS
            if request.length == 0 =>
        {
            Err(errno::EINVAL)
        }
        _ => Ok(()),
    }
}

/// The one mapping from engine errors to NBD error numbers.
pub fn errno_for(error: &BlockError, command: u16) -> u32 {
    let writes = matches!(command, cmd::WRITE | cmd::WRITE_ZEROES);
    match error {
        BlockError::OutOfRange { .. } if writes => errno::ENOSPC,
        BlockError::OutOfRange { .. } | BlockError::Misaligned { .. } | BlockError::TooLarge { .. } => errno::EINVAL,
        BlockError::NoSpace => errno::ENOSPC,
        BlockError::NotFast => errno::ENOTSUP,
        BlockError::NotSupported(_) => errno::EINVAL,
        BlockError::ReadOnly => errno::EPERM,
        BlockError::Gone => errno::ESHUTDOWN,
        BlockError::Checksum { .. } | BlockError::Io(_) => errno::EIO,
    }
}

/// Transmission flags, derived from the volume's one capability description.
pub fn transmission_flags(caps: &Capabilities, structured_replies: bool) -> u16 {
    let mut flags = tflag::HAS_FLAGS;
    let mut set = |condition: bool, flag: u16| {
        if condition {
            flags |= flag;
        }
    };
    set(caps.read_only, tflag::READ_ONLY);
    set(caps.can_flush, tflag::SEND_FLUSH);
    set(caps.can_fua, tflag::SEND_FUA);
    set(caps.rotational, tflag::ROTATIONAL);
    set(caps.can_trim, tflag::SEND_TRIM);
    set(caps.can_zero, tflag::SEND_WRITE_ZEROES);
    set(caps.can_zero && caps.can_fast_zero, tflag::SEND_FAST_ZERO);
    set(structured_replies, tflag::SEND_DF);
    set(caps.flush_covers_all_handles, tflag::CAN_MULTI_CONN);
    set(caps.can_cache, tflag::SEND_CACHE);
    flags
}

pub fn option_reply(option: u32, reply: u32, data: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(20 + data.len());
    out.extend_from_slice(&OPTION_REPLY_MAGIC.to_be_bytes());
    out.extend_from_slice(&option.to_be_bytes());
    out.extend_from_slice(&reply.to_be_bytes());
    out.extend_from_slice(&(data.len() as u32).to_be_bytes());
    out.extend_from_slice(data);
    out
}

/// `NBD_REP_INFO` / `NBD_INFO_EXPORT`: size and transmission flags.
pub fn info_export(size_bytes: u64, flags: u16) -> Vec<u8> {
    let mut data = Vec::with_capacity(12);
    data.extend_from_slice(&info::EXPORT.to_be_bytes());
    data.extend_from_slice(&size_bytes.to_be_bytes());
    data.extend_from_slice(&flags.to_be_bytes());
    data
}

pub fn info_string(kind: u16, text: &str) -> Vec<u8> {
    let mut data = kind.to_be_bytes().to_vec();
    data.extend_from_slice(text.as_bytes());
    data
}

pub fn info_block_size(caps: &Capabilities) -> Vec<u8> {
    let mut data = info::BLOCK_SIZE.to_be_bytes().to_vec();
    data.extend_from_slice(&caps.min_block_bytes.to_be_bytes());
    data.extend_from_slice(&caps.preferred_block_bytes.to_be_bytes());
    data.extend_from_slice(&caps.max_request_bytes.to_be_bytes());
    data
}

/// Writes a simple reply header into `out` (16 bytes).
pub fn put_simple_reply(out: &mut [u8], error: u32, cookie: u64) {
    out[0..4].copy_from_slice(&SIMPLE_REPLY_MAGIC.to_be_bytes());
    out[4..8].copy_from_slice(&error.to_be_bytes());
    out[8..16].copy_from_slice(&cookie.to_be_bytes());
}

pub fn simple_reply(error: u32, cookie: u64) -> Vec<u8> {
    let mut out = vec![0; SIMPLE_REPLY_BYTES];
    put_simple_reply(&mut out, error, cookie);
    out
}

/// Writes a structured reply chunk header into `out` (20 bytes).
pub fn put_chunk_header(out: &mut [u8], flags: u16, kind: u16, cookie: u64, length: u32) {
    out[0..4].copy_from_slice(&STRUCTURED_REPLY_MAGIC.to_be_bytes());
    out[4..6].copy_from_slice(&flags.to_be_bytes());
    out[6..8].copy_from_slice(&kind.to_be_bytes());
    out[8..16].copy_from_slice(&cookie.to_be_bytes());
    out[16..20].copy_from_slice(&length.to_be_bytes());
}

/// Appends a complete chunk to `out`.
pub fn push_chunk(out: &mut Vec<u8>, flags: u16, kind: u16, cookie: u64, payload: &[u8]) {
    let start = out.len();
    out.resize(start + CHUNK_HEADER_BYTES, 0);
    put_chunk_header(&mut out[start..], flags, kind, cookie, payload.len() as u32);
    out.extend_from_slice(payload);
}

/// A final `NBD_REPLY_TYPE_ERROR` chunk carrying `error` and a message.
pub fn error_chunk(cookie: u64, error: u32, message: &str) -> Vec<u8> {
    let message = &message.as_bytes()[..message.len().min(MAX_STRING_BYTES)];
    let mut payload = Vec::with_capacity(6 + message.len());
    payload.extend_from_slice(&error.to_be_bytes());
    payload.extend_from_slice(&(message.len() as u16).to_be_bytes());
    payload.extend_from_slice(message);
    let mut out = Vec::with_capacity(CHUNK_HEADER_BYTES + payload.len());
    push_chunk(&mut out, chunk::FLAG_DONE, chunk::ERROR, cookie, &payload);
    out
}

/// A final `NBD_REPLY_TYPE_BLOCK_STATUS` chunk for `base:allocation`.
/// Extents beyond `max_length` are clipped; with `req_one` only the first is sent.
pub fn block_status_chunk(cookie: u64, extents: &[Extent], max_length: u32, req_one: bool) -> Vec<u8> {
    let mut out = Vec::new();
    push_block_status(
        &mut out,
        cookie,
        BASE_ALLOCATION_ID,
        allocation_descriptors(extents),
        max_length,
        req_one,
        true,
    );
    out
}

/// `base:allocation` descriptors: (length, flags).
pub fn allocation_descriptors(extents: &[Extent]) -> impl Iterator<Item = (u64, u32)> + '_ {
    extents.iter().map(|extent| {
        let flags = if extent.hole { STATE_HOLE } else { 0 } | if extent.zero { STATE_ZERO } else { 0 };
        (extent.length, flags)
    })
}

/// Changed-block descriptors: (length, flags).
pub fn changed_descriptors(runs: &[ChangedRun]) -> impl Iterator<Item = (u64, u32)> + '_ {
    runs.iter()
        .map(|run| (run.length, if run.changed { STATE_CHANGED } else { 0 }))
}

/// Appends an `NBD_REPLY_TYPE_BLOCK_STATUS` chunk for context `id` (the
/// final one of the reply when `done`). Descriptors beyond `max_length`
/// are clipped, neighbours with the same flags merged (each is at most
/// 4 GiB - 1 bytes); with `req_one` only the first is sent.
pub fn push_block_status(
    out: &mut Vec<u8>,
    cookie: u64,
    id: u32,
    descriptors: impl Iterator<Item = (u64, u32)>,
    max_length: u32,
    req_one: bool,
    done: bool,
) {
    let mut merged: Vec<(u64, u32)> = Vec::new();
    let mut remaining = max_length as u64;
    for (length, flags) in descriptors {
        if remaining == 0 {
            break;
        }
        let length = length.min(remaining);
        remaining -= length;
        match merged.last_mut() {
            Some((last, last_flags)) if *last_flags == flags && *last + length <= u32::MAX as u64 => *last += length,
            _ => merged.push((length, flags)),
        }
    }
    if req_one {
        merged.truncate(1);
    }
    let mut payload = Vec::with_capacity(4 + 8 * merged.len());
    payload.extend_from_slice(&id.to_be_bytes());
    for (length, flags) in merged {
        payload.extend_from_slice(&(length as u32).to_be_bytes());
        payload.extend_from_slice(&flags.to_be_bytes());
    }
    let flags = if done { chunk::FLAG_DONE } else { 0 };
    push_chunk(out, flags, chunk::BLOCK_STATUS, cookie, &payload);
}

/// Granularity at which a structured read reply reports zero runs as holes.
pub const HOLE_GRANULE_BYTES: usize = 4096;

/// Splits read data into runs of (is_zero, start, end) at 4 KiB granules.
pub fn zero_runs(data: &[u8]) -> Vec<(bool, usize, usize)> {
    let mut runs: Vec<(bool, usize, usize)> = Vec::new();
    for (index, granule) in data.chunks(HOLE_GRANULE_BYTES).enumerate() {
        let start = index * HOLE_GRANULE_BYTES;
        let end = start + granule.len();
        let zero = is_zero(granule);
        match runs.last_mut() {
            Some(last) if last.0 == zero => last.2 = end,
            _ => runs.push((zero, start, end)),
        }
    }
    runs
}

pub fn is_zero(bytes: &[u8]) -> bool {
    let (prefix, words, suffix) = {
        // SAFETY: reinterpreting initialised bytes as u64 words is valid for
        // any bit pattern; align_to puts misaligned ends in prefix/suffix.
        unsafe { bytes.align_to::<u64>() }
    };
    prefix.iter().all(|&b| b == 0) && words.iter().all(|&w| w == 0) && suffix.iter().all(|&b| b == 0)
}

fn be_u32(bytes: &[u8]) -> u32 {
    u32::from_be_bytes([bytes[0], bytes[1], bytes[2], bytes[3]])
}

fn be_u64(bytes: &[u8]) -> u64 {
    let mut array = [0u8; 8];
    array.copy_from_slice(&bytes[..8]);
    u64::from_be_bytes(array)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn go_payload(name: &str, requests: &[u16]) -> Vec<u8> {
        let mut data = (name.len() as u32).to_be_bytes().to_vec();
        data.extend_from_slice(name.as_bytes());
        data.extend_from_slice(&(requests.len() as u16).to_be_bytes());
        for r in requests {
            data.extend_from_slice(&r.to_be_bytes());
        }
        data
    }

    #[test]
    fn parses_go() {
        let parsed = parse_option(opt::GO, &go_payload("default/vol0", &[info::BLOCK_SIZE])).unwrap();
        assert_eq!(
            parsed,
            ClientOption::Go {
                export: "default/vol0".into(),
                requests: vec![info::BLOCK_SIZE]
            }
        );
        let mut trailing = go_payload("x", &[]);
        trailing.push(0);
        assert_eq!(parse_option(opt::GO, &trailing).unwrap_err().reply, rep::ERR_INVALID);
        assert_eq!(
            parse_option(opt::GO, &[0, 0, 0, 9, b'a']).unwrap_err().reply,
            rep::ERR_INVALID
        );
    }

    #[test]
    fn refuses_long_names() {
        let long = "a".repeat(MAX_STRING_BYTES + 1);
        assert_eq!(
            parse_option(opt::GO, &go_payload(&long, &[])).unwrap_err().reply,
            rep::ERR_TOO_BIG
        );
        assert!(parse_option(opt::EXPORT_NAME, long.as_bytes()).is_err());
        assert!(parse_option(opt::EXPORT_NAME, &[0xff, 0xfe]).is_err());
    }

    #[test]
    fn meta_context_matching() {
        assert_eq!(match_meta_contexts(&[], true, &[]).len(), 1);
        assert_eq!(match_meta_contexts(&[], false, &[]).len(), 0);
        assert_eq!(match_meta_contexts(&["base:".into()], true, &[]).len(), 1);
        assert_eq!(match_meta_contexts(&["base:".into()], false, &[]).len(), 0);
        assert_eq!(
            match_meta_contexts(&["qemu:dirty-bitmap:x".into()], false, &[]).len(),
            0
        );
        assert_eq!(match_meta_contexts(&["base:allocation".into()], false, &[]).len(), 1);
        // A snapshot export with two older snapshots.
        let older = ["a", "b"];
        let names =
            |found: Vec<(u32, String)>| found.into_iter().map(|(id, n)| format!("{id}={n}")).collect::<Vec<_>>();
        assert_eq!(
            names(match_meta_contexts(&[], true, &older)),
            [
                "1=base:allocation",
                "2=qemu:dirty-bitmap:a",
                "3=strata:changed:a",
                "4=qemu:dirty-bitmap:b",
                "5=strata:changed:b"
            ]
        );
        assert_eq!(
            names(match_meta_contexts(&["qemu:".into()], true, &older)),
            ["2=qemu:dirty-bitmap:a", "4=qemu:dirty-bitmap:b"]
        );
        assert_eq!(
            names(match_meta_contexts(&["strata:changed:".into()], true, &older)),
            ["3=strata:changed:a", "5=strata:changed:b"]
        );
        assert!(match_meta_contexts(&["qemu:".into()], false, &older).is_empty());
        assert_eq!(
            names(match_meta_contexts(
                &["strata:changed:b".into(), "qemu:dirty-bitmap:c".into()],
                false,
                &older
            )),
            ["5=strata:changed:b"]
        );
        let ids = [("a".to_string(), 0x8000_0001), ("b".to_string(), 0x8000_0007)];
        assert_eq!(
            changed_context("qemu:dirty-bitmap:b", &ids),
            Some(ChangedContext {
                id: 4,
                older: 0x8000_0007
            })
        );
        assert_eq!(
            changed_context("strata:changed:a", &ids),
            Some(ChangedContext {
                id: 3,
                older: 0x8000_0001
            })
        );
        assert_eq!(changed_context("strata:changed:c", &ids), None);
        assert_eq!(changed_context("base:allocation", &ids), None);
    }

    #[test]
    fn changed_status_merges_clips_and_may_leave_the_reply_open() {
        let runs = [
            ChangedRun {
                length: 4096,
                changed: true,
            },
            ChangedRun {
                length: 4096,
                changed: true,
            },
            ChangedRun {
                length: 8192,
                changed: false,
            },
        ];
        let mut out = Vec::new();
        push_block_status(&mut out, 9, 3, changed_descriptors(&runs), 12288, false, false);
        assert_eq!(out.len(), CHUNK_HEADER_BYTES + 4 + 16);
        assert_eq!(u16::from_be_bytes([out[4], out[5]]) & chunk::FLAG_DONE, 0);
        assert_eq!(be_u32(&out[20..24]), 3);
        assert_eq!((be_u32(&out[24..28]), be_u32(&out[28..32])), (8192, STATE_CHANGED));
        assert_eq!((be_u32(&out[32..36]), be_u32(&out[36..40])), (4096, 0));
    }

    #[test]
    fn request_checks() {
        let negotiated = Negotiated {
            structured_replies: true,
            base_allocation: false,
            changed: None,
        };
        let request = |kind, flags, length| Request {
            flags,
            kind,
            cookie: 1,
            offset: 0,
            length,
        };
        assert_eq!(check_request(&request(cmd::READ, cflag::DF, 4096), &negotiated), Ok(()));
        assert_eq!(
            check_request(&request(cmd::READ, cflag::NO_HOLE, 4096), &negotiated),
            Err(errno::EINVAL)
        );
        assert_eq!(
            check_request(&request(cmd::WRITE, cflag::FUA, 4096), &negotiated),
            Ok(())
        );
        assert_eq!(
            check_request(&request(cmd::BLOCK_STATUS, 0, 4096), &negotiated),
            Err(errno::EINVAL)
        );
        assert_eq!(check_request(&request(99, 0, 4096), &negotiated), Err(errno::EINVAL));
        assert_eq!(
            check_request(&request(cmd::FLUSH, 0, 1), &negotiated),
            Err(errno::EINVAL)
        );
        assert_eq!(
            check_request(&request(cmd::READ, 0, 0), &negotiated),
            Err(errno::EINVAL)
        );
    }

    #[test]
    fn zero_runs_split() {
        let mut data = vec![0u8; 4 * HOLE_GRANULE_BYTES];
        data[HOLE_GRANULE_BYTES + 7] = 1;
        assert_eq!(
            zero_runs(&data),
            vec![(true, 0, 4096), (false, 4096, 8192), (true, 8192, 16384)]
        );
        assert_eq!(zero_runs(&[0u8; 512]), vec![(true, 0, 512)]);
    }

    #[test]
    fn block_status_clips() {
        let extents = [
            Extent {
                length: 8192,
                hole: true,
                zero: true,
            },
            Extent {
                length: 8192,
                hole: false,
                zero: false,
            },
        ];
        let out = block_status_chunk(7, &extents, 10000, false);
        // header + id + 2 descriptors
        assert_eq!(out.len(), CHUNK_HEADER_BYTES + 4 + 16);
        assert_eq!(be_u32(&out[24..28]), 8192);
        assert_eq!(be_u32(&out[28..32]), STATE_HOLE | STATE_ZERO);
        assert_eq!(be_u32(&out[32..36]), 10000 - 8192);
        let one = block_status_chunk(7, &extents, 10000, true);
        assert_eq!(one.len(), CHUNK_HEADER_BYTES + 4 + 8);
    }

    proptest! {
        #[test]
        fn option_parser_never_panics(option in 0u32..16, data in proptest::collection::vec(any::<u8>(), 0..512)) {
            let _ = parse_option(option, &data);
        }

        #[test]
        fn request_round_trip(flags: u16, kind: u16, cookie: u64, offset: u64, length: u32) {
            let mut bytes = [0u8; REQUEST_BYTES];
            bytes[0..4].copy_from_slice(&REQUEST_MAGIC.to_be_bytes());
            bytes[4..6].copy_from_slice(&flags.to_be_bytes());
            bytes[6..8].copy_from_slice(&kind.to_be_bytes());
            bytes[8..16].copy_from_slice(&cookie.to_be_bytes());
            bytes[16..24].copy_from_slice(&offset.to_be_bytes());
            bytes[24..28].copy_from_slice(&length.to_be_bytes());
            let parsed = parse_request(&bytes).unwrap();
            prop_assert_eq!(parsed, Request { flags, kind, cookie, offset, length });
            let _ = check_request(&parsed, &Negotiated { structured_replies: true, base_allocation: true, changed: None });
        }
    }
}
