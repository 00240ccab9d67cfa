//! ONC RPC version 2 (RFC 5531) over TCP: record marking, the call header,
//! AUTH_SYS and AUTH_NONE credentials, and the reply headers.
//!
//! A record is one call; it arrives as fragments, each behind a 4-byte
//! mark (the top bit says "last fragment", the rest is the length). A
//! record is assembled up to [`MAX_RECORD`] bytes, which holds the largest
//! WRITE we accept (1 MiB) and its headers; a larger one closes the
//! connection, because what follows it cannot be found again. Replies are
//! built with a placeholder mark in front ([`MARK_BYTES`]) that
//! [`finish`] fills in, so each reply goes out as one fragment, in one
//! buffer (a READ's in two: the data is sent from where the engine read
//! it, see `server::Reply`).

use tokio::io::{AsyncRead, AsyncReadExt};

use super::xdr::{Decoder, Encode, XdrError};

/// Largest record accepted: a 1 MiB WRITE and room for its headers.
pub const MAX_RECORD: usize = (1 << 20) + (64 << 10);
/// The record mark's "last fragment" bit.
pub const LAST_FRAGMENT: u32 = 1 << 31;
/// Bytes of the record mark in front of every reply buffer.
pub const MARK_BYTES: usize = 4;
/// Largest opaque_auth body (RFC 5531).
pub const MAX_AUTH_BYTES: usize = 400;
/// AUTH_SYS limits (RFC 5531 appendix A).
pub const MAX_MACHINE_NAME: usize = 255;
pub const MAX_AUTH_GIDS: usize = 16;

pub const RPC_VERSION: u32 = 2;
const CALL: u32 = 0;
const REPLY: u32 = 1;
const MSG_ACCEPTED: u32 = 0;
const MSG_DENIED: u32 = 1;

/// Credential flavors.
pub const AUTH_NONE: u32 = 0;
pub const AUTH_SYS: u32 = 1;

/// `auth_stat` values of an AUTH_ERROR rejection.
pub mod auth_stat {
    /// A credential we cannot use: an unknown flavor or a malformed body.
    pub const BADCRED: u32 = 1;
    /// A verifier other than AUTH_NONE's with AUTH_SYS or AUTH_NONE.
    pub const BADVERF: u32 = 3;
    pub const TOOWEAK: u32 = 5;
}

/// Why a record could not be read. Every one of these closes the
/// connection: the stream has no record boundary to resynchronise on.
#[derive(Debug, thiserror::Error)]
pub enum RecordError {
    #[error("record of more than {MAX_RECORD} bytes ({0} claimed so far) refused")]
    TooLarge(usize),
    #[error("{0}")]
    Io(#[from] std::io::Error),
}

/// Follows the fragments of one record and enforces [`MAX_RECORD`] on
/// their sum, before any of a fragment's bytes are read.
#[derive(Debug, Default)]
pub struct Assembler {
    bytes: usize,
}

impl Assembler {
    /// Takes a fragment's mark: its length and whether it ends the record.
    pub fn fragment(&mut self, mark: u32) -> Result<(usize, bool), RecordError> {
        let len = (mark & !LAST_FRAGMENT) as usize;
        let total = self.bytes + len;
        if total > MAX_RECORD {
            return Err(RecordError::TooLarge(total));
        }
        self.bytes = total;
        Ok((len, mark & LAST_FRAGMENT != 0))
    }
}

/// Reads one record into `record` (cleared first). `Ok(false)` when the
/// peer closed the connection between records.
pub async fn read_record<R: AsyncRead + Unpin>(reader: &mut R, record: &mut Vec<u8>) -> Result<bool, RecordError> {
    record.clear();
    let mut assembler = Assembler::default();
    let mut first = true;
    loop {
        let mut mark = [0u8; 4];
        if first {
            // End of stream before a mark is a clean close.
            let n = reader.read(&mut mark).await?;
            if n == 0 {
                return Ok(false);
            }
            reader.read_exact(&mut mark[n..]).await?;
            first = false;
        } else {
            reader.read_exact(&mut mark).await?;
        }
        let (len, last) = assembler.fragment(u32::from_be_bytes(mark))?;
        // Within MAX_RECORD, so reserving it is bounded; read_to_end then
        // appends without zeroing first.
        record.reserve(len);
        let got = (&mut *reader).take(len as u64).read_to_end(record).await?;
        if got < len {
            return Err(std::io::Error::from(std::io::ErrorKind::UnexpectedEof).into());
        }
        if last {
            return Ok(true);
        }
    }
}

/// The first whole record in `data` and the bytes it took with its marks;
/// `Ok(None)` if `data` ends before the record does. The synchronous twin
/// of [`read_record`], for the fuzz target and tests.
pub fn split_record(data: &[u8]) -> Result<Option<(Vec<u8>, usize)>, RecordError> {
    let mut assembler = Assembler::default();
    let mut record = Vec::new();
    let mut pos = 0;
    loop {
        let Some(mark) = data.get(pos..pos + 4) else {
            return Ok(None);
        };
        let (len, last) = assembler.fragment(u32::from_be_bytes([mark[0], mark[1], mark[2], mark[3]]))?;
        pos += 4;
        let Some(bytes) = data.get(pos..pos + len) else {
            return Ok(None);
        };
        record.extend_from_slice(bytes);
        pos += len;
        if last {
            return Ok(Some((record, pos)));
        }
    }
}

/// Who sent a call, as its credential says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Auth {
    None,
    Sys(AuthSys),
}

/// An AUTH_SYS credential (the machine name is checked and dropped).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AuthSys {
    pub stamp: u32,
    pub uid: u32,
    pub gid: u32,
    pub gids: Vec<u32>,
}

impl AuthSys {
    /// Decodes the body of an AUTH_SYS credential, which must be exactly
    /// one `authsys_parms`.
    pub fn decode(body: &[u8]) -> Result<AuthSys, XdrError> {
        let mut d = Decoder::new(body);
        let stamp = d.u32()?;
        d.string(MAX_MACHINE_NAME)?;
        let uid = d.u32()?;
        let gid = d.u32()?;
        let count = d.u32()?;
        if count as usize > MAX_AUTH_GIDS {
            return Err(XdrError::TooLong {
                len: count,
                max: MAX_AUTH_GIDS,
            });
        }
        let gids = (0..count).map(|_| d.u32()).collect::<Result<Vec<_>, _>>()?;
        if d.remaining() != 0 {
            return Err(XdrError::TooLong {
                len: body.len() as u32,
                max: d.position(),
            });
        }
        Ok(AuthSys { stamp, uid, gid, gids })
    }
}

/// A parsed call header; `args` are the procedure's argument bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Call<'a> {
    pub xid: u32,
    pub prog: u32,
    pub vers: u32,
    pub procedure: u32,
    pub auth: Auth,
    pub args: &'a [u8],
}

/// A record that is not a call we can run.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CallError {
    /// Not even the header decodes: no reply, the connection closes.
    #[error("garbled call header: {0}")]
    Garbled(XdrError),
    /// A REPLY (or another message type) sent to a server: ignored.
    #[error("message type {kind} is not a call")]
    NotACall { xid: u32, kind: u32 },
    /// An RPC version other than 2: MSG_DENIED / RPC_MISMATCH.
    #[error("RPC version {vers}, not 2")]
    RpcMismatch { xid: u32, vers: u32 },
    /// A credential or verifier we do not take: MSG_DENIED / AUTH_ERROR.
    #[error("credential refused (auth_stat {stat})")]
    Auth { xid: u32, stat: u32 },
}

impl CallError {
    /// The reply this error gets, if any.
    pub fn reply(&self) -> Option<Vec<u8>> {
        match *self {
            CallError::Garbled(_) | CallError::NotACall { .. } => None,
            CallError::RpcMismatch { xid, .. } => Some(finish(rpc_mismatch(xid))),
            CallError::Auth { xid, stat } => Some(finish(auth_error(xid, stat))),
        }
    }
}

/// Parses a call's header: xid, message type, RPC version, program,
/// version, procedure, credential and verifier.
pub fn parse_call(record: &[u8]) -> Result<Call<'_>, CallError> {
    let mut d = Decoder::new(record);
    let xid = d.u32().map_err(CallError::Garbled)?;
    let kind = d.u32().map_err(CallError::Garbled)?;
    if kind != CALL {
        return Err(CallError::NotACall { xid, kind });
    }
    let rpcvers = d.u32().map_err(CallError::Garbled)?;
    if rpcvers != RPC_VERSION {
        return Err(CallError::RpcMismatch { xid, vers: rpcvers });
    }
    let mut header = || -> Result<_, XdrError> {
        let prog = d.u32()?;
        let vers = d.u32()?;
        let procedure = d.u32()?;
        let cred_flavor = d.u32()?;
        let cred = d.opaque(MAX_AUTH_BYTES)?;
        let verf_flavor = d.u32()?;
        d.opaque(MAX_AUTH_BYTES)?;
        Ok((prog, vers, procedure, cred_flavor, cred, verf_flavor))
    };
    let (prog, vers, procedure, cred_flavor, cred, verf_flavor) = header().map_err(CallError::Garbled)?;
    let auth = match cred_flavor {
        AUTH_NONE => Auth::None,
        AUTH_SYS => Auth::Sys(AuthSys::decode(cred).map_err(|_| CallError::Auth {
            xid,
            stat: auth_stat::BADCRED,
        })?),
        // RPCSEC_GSS, AUTH_DH, AUTH_SHORT...: not offered by this server.
        _ => {
            return Err(CallError::Auth {
                xid,
                stat: auth_stat::BADCRED,
            })
        }
    };
    // With AUTH_SYS and AUTH_NONE the verifier is AUTH_NONE's (as knfsd
    // checks).
    if verf_flavor != AUTH_NONE {
        return Err(CallError::Auth {
            xid,
            stat: auth_stat::BADVERF,
        });
    }
    Ok(Call {
        xid,
        prog,
        vers,
        procedure,
        auth,
        args: d.rest(),
    })
}

/// How an accepted call ended (`accept_stat`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Accept {
    Success,
    ProgUnavail,
    ProgMismatch { low: u32, high: u32 },
    ProcUnavail,
    GarbageArgs,
    SystemErr,
}

/// A reply buffer: the mark placeholder, xid, REPLY, MSG_ACCEPTED, an
/// AUTH_NONE verifier and `accept`. A `Success` reply's results are
/// appended by the caller; then [`finish`].
pub fn accepted(xid: u32, accept: Accept) -> Vec<u8> {
    accepted_with_capacity(xid, accept, 128)
}

/// [`accepted`] with room for `capacity` bytes (a READ's data).
pub fn accepted_with_capacity(xid: u32, accept: Accept, capacity: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(capacity.max(64));
    out.put_u32(0);
    out.put_u32(xid);
    out.put_u32(REPLY);
    out.put_u32(MSG_ACCEPTED);
    out.put_u32(AUTH_NONE);
    out.put_u32(0);
    let (stat, range) = match accept {
        Accept::Success => (0, None),
        Accept::ProgUnavail => (1, None),
        Accept::ProgMismatch { low, high } => (2, Some((low, high))),
        Accept::ProcUnavail => (3, None),
        Accept::GarbageArgs => (4, None),
        Accept::SystemErr => (5, None),
    };
    out.put_u32(stat);
    if let Some((low, high)) = range {
        out.put_u32(low);
        out.put_u32(high);
    }
    out
}

/// MSG_DENIED / RPC_MISMATCH: we speak version 2 only.
pub fn rpc_mismatch(xid: u32) -> Vec<u8> {
    let mut out = Vec::with_capacity(28);
    out.put_u32(0);
    out.put_u32(xid);
    out.put_u32(REPLY);
    out.put_u32(MSG_DENIED);
    out.put_u32(0);
    out.put_u32(RPC_VERSION);
    out.put_u32(RPC_VERSION);
    out
}

/// MSG_DENIED / AUTH_ERROR with `stat`.
pub fn auth_error(xid: u32, stat: u32) -> Vec<u8> {
    let mut out = Vec::with_capacity(24);
    out.put_u32(0);
    out.put_u32(xid);
    out.put_u32(REPLY);
    out.put_u32(MSG_DENIED);
    out.put_u32(1);
    out.put_u32(stat);
    out
}

/// Fills in the record mark of a reply built by the functions above: one
/// fragment, the last.
pub fn finish(reply: Vec<u8>) -> Vec<u8> {
    finish_before(reply, 0)
}

/// [`finish`] for a record whose last `trailing` bytes are sent after
/// `reply` from elsewhere (a READ's data).
pub fn finish_before(mut reply: Vec<u8>, trailing: usize) -> Vec<u8> {
    let len = (reply.len() - MARK_BYTES + trailing) as u32;
    reply[..MARK_BYTES].copy_from_slice(&(LAST_FRAGMENT | len).to_be_bytes());
    reply
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A call record (no mark) with an AUTH_SYS credential.
    pub fn call(xid: u32, prog: u32, vers: u32, procedure: u32, args: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        out.put_u32(xid);
        out.put_u32(CALL);
        out.put_u32(2);
        out.put_u32(prog);
        out.put_u32(vers);
        out.put_u32(procedure);
        out.put_u32(AUTH_SYS);
        out.put_opaque(&auth_sys_body(1000, 100, &[4, 27]));
        out.put_u32(AUTH_NONE);
        out.put_opaque(&[]);
        out.extend_from_slice(args);
        out
    }

    pub fn auth_sys_body(uid: u32, gid: u32, gids: &[u32]) -> Vec<u8> {
        let mut body = Vec::new();
        body.put_u32(12345);
        body.put_string(b"client");
        body.put_u32(uid);
        body.put_u32(gid);
        body.put_u32(gids.len() as u32);
        for gid in gids {
            body.put_u32(*gid);
        }
        body
    }

    fn fragments(record: &[u8], cuts: &[usize]) -> Vec<u8> {
        let mut out = Vec::new();
        let mut start = 0;
        for (i, &end) in cuts.iter().chain([record.len()].iter()).enumerate() {
            let last = if i == cuts.len() { LAST_FRAGMENT } else { 0 };
            out.put_u32(last | (end - start) as u32);
            out.extend_from_slice(&record[start..end]);
            start = end;
        }
        out
    }

    #[tokio::test]
    async fn records_are_assembled_from_fragments() {
        let record = call(9, 100003, 3, 0, &[]);
        let mut stream = fragments(&record, &[5, 30]);
        // A second record behind the first, in one fragment.
        stream.extend(fragments(&call(10, 100003, 3, 0, &[]), &[]));
        let mut reader = &stream[..];
        let mut got = Vec::new();
        assert!(read_record(&mut reader, &mut got).await.unwrap());
        assert_eq!(got, record);
        assert!(read_record(&mut reader, &mut got).await.unwrap());
        assert_eq!(parse_call(&got).unwrap().xid, 10);
        assert!(!read_record(&mut reader, &mut got).await.unwrap());

        let (sync, used) = split_record(&stream).unwrap().unwrap();
        assert_eq!(sync, record);
        assert_eq!(used, record.len() + 12);
        assert!(split_record(&stream[..used - 1]).unwrap().is_none());

        // Ending inside a record is an error, not a clean close.
        let mut reader = &stream[..10];
        assert!(read_record(&mut reader, &mut got).await.is_err());
    }

    #[tokio::test]
    async fn oversized_records_are_refused_before_their_bytes_arrive() {
        // One fragment claiming 2 GiB, nothing behind it.
        let mut reader = &[0xff, 0xff, 0xff, 0xff][..];
        let mut got = Vec::new();
        assert!(matches!(
            read_record(&mut reader, &mut got).await,
            Err(RecordError::TooLarge(_))
        ));
        assert!(got.capacity() < 1024);
        // Fragments each under the limit, their sum over it.
        let mut stream = Vec::new();
        stream.put_u32(MAX_RECORD as u32);
        stream.extend(vec![0u8; MAX_RECORD]);
        stream.put_u32(LAST_FRAGMENT | 1);
        stream.push(0);
        let mut reader = &stream[..];
        assert!(matches!(
            read_record(&mut reader, &mut got).await,
            Err(RecordError::TooLarge(n)) if n == MAX_RECORD + 1
        ));
        assert!(matches!(split_record(&stream), Err(RecordError::TooLarge(_))));
    }

    #[test]
    fn call_headers_and_credentials() {
        let record = call(77, 100005, 3, 1, &[1, 2, 3, 4]);
        let parsed = parse_call(&record).unwrap();
        assert_eq!(
            parsed,
            Call {
                xid: 77,
                prog: 100005,
                vers: 3,
                procedure: 1,
                auth: Auth::Sys(AuthSys {
                    stamp: 12345,
                    uid: 1000,
                    gid: 100,
                    gids: vec![4, 27]
                }),
                args: &[1, 2, 3, 4],
            }
        );

        // 17 supplementary groups: AUTH_ERROR / AUTH_BADCRED.
        let mut record = Vec::new();
        for word in [5, CALL, 2, 100003, 3, 1, AUTH_SYS] {
            record.put_u32(word);
        }
        record.put_opaque(&auth_sys_body(0, 0, &[1; 17]));
        record.put_u32(AUTH_NONE);
        record.put_opaque(&[]);
        let error = parse_call(&record).unwrap_err();
        assert_eq!(
            error,
            CallError::Auth {
                xid: 5,
                stat: auth_stat::BADCRED
            }
        );
        assert_eq!(
            error.reply().unwrap(),
            [0x80, 0, 0, 20, 0, 0, 0, 5, 0, 0, 0, 1, 0, 0, 0, 1, 0, 0, 0, 1, 0, 0, 0, 1]
        );
        // 16 are fine.
        let mut record = Vec::new();
        for word in [5, CALL, 2, 100003, 3, 1, AUTH_SYS] {
            record.put_u32(word);
        }
        record.put_opaque(&auth_sys_body(0, 0, &[1; 16]));
        record.put_u32(AUTH_NONE);
        record.put_opaque(&[]);
        assert!(parse_call(&record).is_ok());

        // An unknown flavor (RPCSEC_GSS).
        let mut record = Vec::new();
        for word in [6, CALL, 2, 100003, 3, 1, 6] {
            record.put_u32(word);
        }
        record.put_opaque(&[0; 8]);
        record.put_u32(AUTH_NONE);
        record.put_opaque(&[]);
        assert_eq!(
            parse_call(&record),
            Err(CallError::Auth {
                xid: 6,
                stat: auth_stat::BADCRED
            })
        );

        // RPC version 3: RPC_MISMATCH(2, 2).
        let mut record = call(8, 100003, 3, 0, &[]);
        record[8..12].copy_from_slice(&3u32.to_be_bytes());
        let error = parse_call(&record).unwrap_err();
        assert_eq!(error, CallError::RpcMismatch { xid: 8, vers: 3 });
        assert_eq!(
            error.reply().unwrap(),
            [0x80, 0, 0, 24, 0, 0, 0, 8, 0, 0, 0, 1, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 2, 0, 0, 0, 2]
        );

        // A truncated header gets no reply; a reply message is ignored.
        let record = call(8, 100003, 3, 0, &[]);
        assert!(matches!(parse_call(&record[..30]), Err(CallError::Garbled(_))));
        assert!(CallError::Garbled(XdrError::BadBool(3)).reply().is_none());
        let mut reply = record.clone();
        reply[4..8].copy_from_slice(&REPLY.to_be_bytes());
        assert!(matches!(parse_call(&reply), Err(CallError::NotACall { .. })));
    }

    #[test]
    fn accepted_replies() {
        assert_eq!(
            finish(accepted(3, Accept::ProgMismatch { low: 3, high: 3 })),
            [
                0x80, 0, 0, 32, 0, 0, 0, 3, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2, 0, 0, 0, 3, 0,
                0, 0, 3
            ]
        );
        let garbage = finish(accepted(3, Accept::GarbageArgs));
        assert_eq!(&garbage[20..], [0, 0, 0, 0, 0, 0, 0, 4]);
    }
}
