//! Just enough of the portmapper (RFC 1833, version 2) on the NFS port for
//! clients that ask it where NFS and MOUNT are (`rpcinfo -p`, a mount
//! helper pointed at this port): both are here, over TCP. Nothing can be
//! registered.

use super::xdr::{Decoder, Encode};
use super::{ArgsError, MOUNT_PROGRAM, MOUNT_VERSION, NFS_PROGRAM, NFS_VERSION, PORTMAP_PROGRAM, PORTMAP_VERSION};

pub mod procedure {
    pub const NULL: u32 = 0;
    pub const GETPORT: u32 = 3;
    pub const DUMP: u32 = 4;
}

const IPPROTO_TCP: u32 = 6;

/// A decoded portmapper call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PortmapCall {
    Null,
    GetPort { prog: u32, vers: u32, prot: u32 },
    Dump,
}

/// Decodes the arguments of portmapper procedure `procedure` (SET, UNSET
/// and CALLIT are not served).
pub fn decode(procedure: u32, args: &[u8]) -> Result<PortmapCall, ArgsError> {
    let mut d = Decoder::new(args);
    Ok(match procedure {
        procedure::NULL => PortmapCall::Null,
        procedure::GETPORT => {
            let prog = d.u32()?;
            let vers = d.u32()?;
            let prot = d.u32()?;
            // The mapping's port field, unused in a query.
            d.u32()?;
            PortmapCall::GetPort { prog, vers, prot }
        }
        procedure::DUMP => PortmapCall::Dump,
        _ => return Err(ArgsError::ProcUnavail),
    })
}

/// The programs served here: (program, version).
const SERVED: [(u32, u32); 3] = [
    (PORTMAP_PROGRAM, PORTMAP_VERSION),
    (NFS_PROGRAM, NFS_VERSION),
    (MOUNT_PROGRAM, MOUNT_VERSION),
];

/// Runs a portmapper call; `port` is the port this connection came in on.
pub fn execute(call: PortmapCall, port: u16, out: &mut Vec<u8>) {
    match call {
        PortmapCall::Null => {}
        PortmapCall::GetPort { prog, vers, prot } => {
            let here = prot == IPPROTO_TCP && SERVED.contains(&(prog, vers));
            out.put_u32(if here { port as u32 } else { 0 });
        }
        PortmapCall::Dump => {
            for (prog, vers) in SERVED {
                out.put_bool(true);
                out.put_u32(prog);
                out.put_u32(vers);
                out.put_u32(IPPROTO_TCP);
                out.put_u32(port as u32);
            }
            out.put_bool(false);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn getport_answers_this_port_for_nfs_and_mount_over_tcp() {
        let mut args = Vec::new();
        for word in [NFS_PROGRAM, 3, IPPROTO_TCP, 0] {
            args.put_u32(word);
        }
        let call = decode(procedure::GETPORT, &args).unwrap();
        let mut out = Vec::new();
        execute(call, 2049, &mut out);
        assert_eq!(out, [0, 0, 8, 1]);
        out.clear();
        // UDP is not served.
        execute(
            PortmapCall::GetPort {
                prog: MOUNT_PROGRAM,
                vers: 3,
                prot: 17,
            },
            2049,
            &mut out,
        );
        assert_eq!(out, [0, 0, 0, 0]);
        assert!(matches!(
            decode(procedure::GETPORT, &args[..12]),
            Err(ArgsError::Garbage(_))
        ));
        assert_eq!(decode(1, &[]), Err(ArgsError::ProcUnavail));
        out.clear();
        execute(PortmapCall::Dump, 2049, &mut out);
        assert_eq!(out.len(), 3 * 20 + 4);
    }
}
